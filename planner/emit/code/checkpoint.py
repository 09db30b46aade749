"""The code snippets' loading and checkpoint functions, written the way the plan prices them for their trainer
(planner/trainers/table.py load_way / save_way, cost_models/outside_step.py):
- FSDP2 (--emit fsdp2): rank 0 reads the pretrained weights and broadcasts them, each rank keeping its slice
  (load_pretrained); each rank saves and resumes its own shard with DCP.
- FSDP1 (--emit fsdp1): every rank builds the model with its weights before apply_fsdp (the every-rank way, no
  loading function); each rank saves and resumes its own shard with DCP too: torch.distributed.checkpoint.state_dict's
  get_state_dict gives an FSDP1 model's SHARDED_STATE_DICT, as it gives FSDP2's DTensors. The save and the resume
  ask for cpu_offload=True: FSDP1's state dict hooks clone the rank's chunk of every param and optimizer state, on
  the GPU by default (a second copy of the sharded state beside the live one: 99.5 GiB per GPU for llama2-70b on 8;
  24.3 GB of resume transient for llama3.1-8b on 8 x RTX 4090); with it each chunk moves to host as it is made, the
  resume's dcp.load fills the host copy and set_state_dict gathers it onto the GPU unit by unit
  (cost_models/outside_step.py _fsdp1_resume prices both so).
Both run for real in tests/distributed/test_outside_step_torchrun.py.
"""

from __future__ import annotations

DCP_IMPORT = "import torch.distributed.checkpoint as dcp"
CHECKPOINT_IMPORTS = [  # FSDP2: the broadcast load, the DCP save and resume
    DCP_IMPORT,
    "from torch.distributed.checkpoint.state_dict import (",
    "    StateDictOptions, get_state_dict, set_model_state_dict, set_state_dict)",
]
FSDP1_CHECKPOINT_IMPORTS = [DCP_IMPORT, "from torch.distributed.checkpoint.state_dict import (",
                            "    StateDictOptions, get_state_dict, set_state_dict)"]

LOAD_PRETRAINED = [
    "def load_pretrained(model, full_state_dict=None):",
    "    \"\"\"After apply_fsdp (other ranks may build on meta, then model.to_empty(device=...)): rank 0",
    "    passes the full state dict it read (torch.load / safetensors), the others None; each tensor is",
    "    broadcast and each rank keeps its slice: one copy of the model in host RAM per node.\"\"\"",
    "    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)",
    "    set_model_state_dict(model, full_state_dict or {}, options=options)",
    "",
    "",
]
SAVE_AND_RESUME = [
    "def save_checkpoint(model, optimizer, path):",
    "    \"\"\"Each rank writes its shard of the params and optimizer state (DCP): no gather on rank 0.\"\"\"",
    "    model_state, optimizer_state = get_state_dict(model, optimizer)",
    "    dcp.save({\"model\": model_state, \"optimizer\": optimizer_state}, checkpoint_id=path)",
    "",
    "",
    "def load_checkpoint(model, optimizer, path):",
    "    \"\"\"Resume: each rank reads its shard back in place, one tensor at a time.\"\"\"",
    "    model_state, optimizer_state = get_state_dict(model, optimizer)",
    "    state = {\"model\": model_state, \"optimizer\": optimizer_state}",
    "    dcp.load(state, checkpoint_id=path)",
    "    set_state_dict(model, optimizer, model_state_dict=state[\"model\"],",
    "                   optim_state_dict=state[\"optimizer\"])",
]


FSDP1_SAVE_LINES = ["    options = StateDictOptions(cpu_offload=True)  # FSDP1 clones each chunk: to host, not the GPU",
                    "    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)"]
FSDP1_RESUME_DOC = ["    \"\"\"Resume: each rank reads its shard into a host copy (FSDP1's state dict is a copy, not",
                    "    the live tensors); set_state_dict copies it back to the GPU unit by unit.\"\"\""]


def checkpoint_code(load_pretrained: bool = True, fsdp1: bool = False) -> str:
    """The functions as text, to follow the snippet's make_optimizer (FSDP1: without load_pretrained, every rank
    loads, and the save's and the resume's copies go to host)."""
    save = list(SAVE_AND_RESUME)
    if fsdp1:
        resume = save.index("def load_checkpoint(model, optimizer, path):")
        save[resume + 1:resume + 3] = FSDP1_RESUME_DOC + FSDP1_SAVE_LINES
        save[2:3] = FSDP1_SAVE_LINES
    return "\n\n" + "\n".join((LOAD_PRETRAINED if load_pretrained else []) + save) + "\n"
