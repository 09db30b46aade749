"""The optimizer a trace steps (foreach=False, see calibration/trace.py) and the foreach step's temporaries put
back in its optimizer-step window."""

from __future__ import annotations

import torch

from cost_models.specs import Optimizer

from .memtrack import MemorySnapshot


def make_optimizer(params, optimizer: Optimizer | str = Optimizer.ADAMW) -> torch.optim.Optimizer:
    """The optimizer the trace steps: the configured one with foreach=False (see the module docstring)."""
    optimizer = Optimizer(optimizer)
    params = [p for p in params if p.requires_grad]
    if optimizer is Optimizer.SGD:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False)
    if optimizer is Optimizer.ADAM:
        return torch.optim.Adam(params, lr=1e-4, foreach=False)
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def foreach_temporary_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the multi-tensor (foreach) step allocates on top of the state: Adam/AdamW's
    torch._foreach_sqrt(exp_avg_sqs), one tensor per local parameter shard (then divided and added to
    in place); SGD with momentum updates in place (0)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 0
    from torch.distributed.tensor import DTensor

    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                local = p.to_local() if isinstance(p, DTensor) else p
                total += local.numel() * local.element_size()
    return total


def _replace_temporaries(snap: MemorySnapshot, temporaries: int) -> MemorySnapshot:
    """The optimizer-step window with the for-loop step's temporaries swapped for the foreach step's."""
    b = dict(snap.breakdown)
    peak = snap.peak_allocated_bytes - b["optimizer_temporaries"] + temporaries
    b["optimizer_temporaries"] = temporaries
    return MemorySnapshot(peak_allocated_bytes=peak, breakdown=b, peak_phase="optimizer_step")
