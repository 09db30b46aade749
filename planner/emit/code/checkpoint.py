"""The FSDP2 snippet's loading and checkpoint functions, written the way the plan prices them
(cost_models/host_ram.py): rank 0 reads the pretrained weights and broadcasts them, each rank keeping its slice;
each rank saves and resumes its own shard with DCP. Run for real in tests/distributed/test_outside_step_torchrun.py.
"""

from __future__ import annotations

CHECKPOINT_IMPORTS = [
    "import torch.distributed.checkpoint as dcp",
    "from torch.distributed.checkpoint.state_dict import (",
    "    StateDictOptions, get_state_dict, set_model_state_dict, set_state_dict)",
]

CHECKPOINT_FUNCTIONS = [
    "def load_pretrained(model, full_state_dict=None):",
    "    \"\"\"After apply_fsdp (other ranks may build on meta, then model.to_empty(device=...)): rank 0",
    "    passes the full state dict it read (torch.load / safetensors), the others None; each tensor is",
    "    broadcast and each rank keeps its slice: one copy of the model in host RAM per node.\"\"\"",
    "    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)",
    "    set_model_state_dict(model, full_state_dict or {}, options=options)",
    "",
    "",
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


def checkpoint_code() -> str:
    """The functions as text, to follow the snippet's make_optimizer."""
    return "\n\n" + "\n".join(CHECKPOINT_FUNCTIONS) + "\n"
