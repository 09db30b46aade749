"""How a Python snippet loads its weights and saves its checkpoints, for check's host RAM
(planner/doctor/host_ways.py): rank 0's state dict broadcast (StateDictOptions(broadcast_from_rank0=True), as
--emit fsdp2 writes it) or every rank loading; DCP saves (torch.distributed.checkpoint's save / async_save: each
rank its shard), a full state dict gathered (StateDictOptions(full_state_dict=True) without the broadcast) or Hugging
Face's save (`model.save_pretrained(...)`, `trainer.save_model()`: rank 0 gathers the params, outside_step's
save-pretrained way); and whether FSDP1's sharded state dicts are made on host (every get_state_dict with
StateDictOptions(cpu_offload=True), as --emit fsdp1 writes it) or on the GPU (one without: the save's or the
resume's copy of the shard on the device)."""

from __future__ import annotations

import ast

from planner.doctor.readers.python_ast import Snippet, dotted

DCP_MODULE = "torch.distributed.checkpoint"
# torch.distributed.checkpoint.state_dict's getters: under FSDP1 each makes a copy of the rank's shard, on the GPU
# unless StateDictOptions(cpu_offload=True) (cost_models/outside_step.py _fsdp1_dcp); a resume gets one to load into
SHARDED_GETS = ("get_state_dict", "get_model_state_dict", "get_optimizer_state_dict")
RESUME_CALLS = {"load", "set_state_dict", "set_model_state_dict", "set_optimizer_state_dict"}


def checkpoint_fields(snippet: Snippet) -> dict:
    """UserSetup's init, sync_module_states and state_dict_type as the code has them (state_dict_type None: no save
    in the code). The broadcast is FSDP2's sync_module_states: every rank receives rank 0's weights."""
    options = [{key: snippet.value(node, "StateDictOptions") for key, node in c.kwargs.items()}
               for c in snippet.named("StateDictOptions")]
    broadcast = any(o.get("broadcast_from_rank0") is True for o in options)
    full_save = any(o.get("full_state_dict") is True and o.get("broadcast_from_rank0") is not True for o in options)
    dcp = any(c.short in ("save", "async_save") and _bound(snippet, c.name).startswith(DCP_MODULE)
              for c in snippet.calls)
    # transformers' save_pretrained of an FSDP model gathers a full state dict of the params (Trainer.save_model
    # calls it); DCP is priced only where nothing is gathered: a gather, even once at the end, needs more host RAM
    pretrained = any(c.short in ("save_pretrained", "save_model") for c in snippet.calls)
    state = ("FULL_STATE_DICT" if full_save else "SAVE_PRETRAINED" if pretrained else "SHARDED_STATE_DICT" if dcp
             else None)
    gets = {role: [_offloaded(snippet, c) for c in calls] for role, calls in _gets_by_role(snippet).items()}
    return {"init": "rank0" if broadcast else "all", "sync_module_states": broadcast, "state_dict_type": state,
            "save_state_dict_on_host": all(gets["save"]), "resume_state_dict_on_host": all(gets["resume"])}


def _gets_by_role(snippet: Snippet) -> dict[str, list]:
    """The get_state_dict calls of the save and of the resume: a function that loads (dcp.load, set_state_dict)
    gets a state dict to load into, one that saves gets one to write; a get elsewhere counts for both."""
    roles: dict[str, list] = {"save": [], "resume": []}
    scopes = [{id(n) for n in ast.walk(f)} for f in snippet.functions.values()]
    for call in snippet.named(*SHARDED_GETS):
        scope = next((s for s in scopes if id(call.node) in s), None)
        shorts = {c.short for c in snippet.calls if scope is not None and id(c.node) in scope}
        loads, saves = bool(shorts & RESUME_CALLS), bool(shorts & {"save", "async_save"})
        for role, yes in (("resume", loads or not saves), ("save", saves or not loads)):
            if yes:
                roles[role].append(call)
    return roles


def _offloaded(snippet: Snippet, call) -> bool:
    """Whether a get_state_dict call makes its state dict on host: options=StateDictOptions(cpu_offload=True),
    written in the call or bound to a name before it (a full state dict's get: a gather, not FSDP1's copy)."""
    node = call.kwargs.get("options")
    if not (isinstance(node, ast.Call) and (dotted(node.func) or "").endswith("StateDictOptions")):
        return False
    options = {kw.arg: snippet.value(kw.value, "StateDictOptions") for kw in node.keywords if kw.arg}
    return options.get("cpu_offload") is True or options.get("full_state_dict") is True


def _bound(snippet: Snippet, name: str) -> str:
    """The module a call's name resolves to: dcp.save with `import torch.distributed.checkpoint as dcp` is
    torch.distributed.checkpoint.save."""
    head, _, rest = name.partition(".")
    bound = snippet.imports.get(head, head)
    return f"{bound}.{rest}" if rest else bound
