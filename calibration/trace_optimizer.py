"""The optimizer a trace steps (foreach=False, see calibration/trace.py) and the step window of the implementation
priced (TrainingSpec.optimizer_impl, cost_models/optimizer_step.py): what the for-loop step allocated swapped for
what the foreach or fused step allocates. Real runs (tests/distributed) can step the implementation itself.

What each allocates, from torch 2.13's torch/optim/adam.py (cost_models/optimizer_step.py cites the lines): the
for-loop step two copies of one parameter at a time (measured, not replaced); foreach Adam/AdamW the list
torch._foreach_sqrt(exp_avg_sqs), one tensor per local parameter shard; fused nothing (torch._fused_adamw_ updates in
place, on CUDA and on CPU alike); SGD with momentum nothing, whichever implementation.
"""

from __future__ import annotations

import torch

from cost_models.specs import Optimizer, OptimizerImpl

from .memtrack import MemorySnapshot


def make_optimizer(params, optimizer: Optimizer | str = Optimizer.ADAMW,
                   impl: OptimizerImpl | str | None = None) -> torch.optim.Optimizer:
    """The optimizer the trace steps: the configured one with foreach=False (impl None, see the module docstring);
    with `impl`, that implementation itself (foreach=True, fused=True or foreach=False), as a real run steps it."""
    optimizer = Optimizer(optimizer)
    impl = OptimizerImpl(impl) if impl is not None else OptimizerImpl.FOR_LOOP
    params = [p for p in params if p.requires_grad]
    how = {"fused": True} if impl is OptimizerImpl.FUSED else {"foreach": impl is OptimizerImpl.FOREACH}
    if optimizer is Optimizer.SGD:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **how)
    if optimizer is Optimizer.ADAM:
        return torch.optim.Adam(params, lr=1e-4, **how)
    return torch.optim.AdamW(params, lr=1e-4, **how)


def runs(optimizer: torch.optim.Optimizer) -> OptimizerImpl:
    """The implementation a torch optimizer steps with, as its param groups say (fused / foreach; None is torch's
    default: foreach when every parameter is on CUDA, torch/optim/optimizer.py _default_to_fused_or_foreach)."""
    group = optimizer.param_groups[0]
    if group.get("fused"):
        return OptimizerImpl.FUSED
    foreach = group.get("foreach")
    if foreach is None:
        foreach = all(p.device.type == "cuda" for g in optimizer.param_groups for p in g["params"])
    return OptimizerImpl.FOREACH if foreach else OptimizerImpl.FOR_LOOP


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


def step_window(snap: MemorySnapshot, optimizer: torch.optim.Optimizer,
                impl: OptimizerImpl | str = OptimizerImpl.FOREACH) -> MemorySnapshot:
    """The optimizer-step window of `impl`: the measured one when `optimizer` runs it; from a for-loop step, its
    temporaries replaced by the foreach step's list or the fused step's none."""
    impl = OptimizerImpl(impl)
    ran = runs(optimizer)
    if ran is impl:
        return snap
    if ran is not OptimizerImpl.FOR_LOOP:
        raise ValueError(f"a {ran.value} step measures {ran.value}, not {impl.value}: step a for-loop one "
                         "(make_optimizer without impl) to price another")
    return _replace_temporaries(snap, foreach_temporary_bytes(optimizer) if impl is OptimizerImpl.FOREACH else 0)


def _replace_temporaries(snap: MemorySnapshot, temporaries: int) -> MemorySnapshot:
    """The optimizer-step window with the for-loop step's temporaries swapped for `temporaries`."""
    b = dict(snap.breakdown)
    peak = snap.peak_allocated_bytes - b["optimizer_temporaries"] + temporaries
    b["optimizer_temporaries"] = temporaries
    return MemorySnapshot(peak_allocated_bytes=peak, breakdown=b, peak_phase="optimizer_step")
