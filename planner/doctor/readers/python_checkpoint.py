"""How a Python snippet loads its weights and saves its checkpoints, for check's host RAM
(planner/doctor/host_ways.py): rank 0's state dict broadcast (StateDictOptions(broadcast_from_rank0=True), as
--emit fsdp2 writes it) or every rank loading; DCP saves (torch.distributed.checkpoint's save / async_save: each
rank its shard), a full state dict gathered (StateDictOptions(full_state_dict=True) without the broadcast) or Hugging
Face's save (`model.save_pretrained(...)`, `trainer.save_model()`: rank 0 gathers the params, outside_step's
save-pretrained way)."""

from __future__ import annotations

from planner.doctor.readers.python_ast import Snippet

DCP_MODULE = "torch.distributed.checkpoint"


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
    return {"init": "rank0" if broadcast else "all", "sync_module_states": broadcast, "state_dict_type": state}


def _bound(snippet: Snippet, name: str) -> str:
    """The module a call's name resolves to: dcp.save with `import torch.distributed.checkpoint as dcp` is
    torch.distributed.checkpoint.save."""
    head, _, rest = name.partition(".")
    bound = snippet.imports.get(head, head)
    return f"{bound}.{rest}" if rest else bound
