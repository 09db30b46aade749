"""The memory tracker's categories (the private trackers' own, plus logits) and the custom ops whose inner
allocations it counts (calibration/memtrack.py)."""

from __future__ import annotations

import sys
from enum import Enum

import torch

# Extra category for logits-shaped tensors. The private trackers key their per-device dicts by their own
# str-Enum members; ours repeats their values (equal as str, so their members find our keys) plus one.
_LOGITS = "Logits and loss"


def category_enum(base):
    members = {m.name: m.value for m in base}
    members["LOGITS"] = _LOGITS
    return Enum(f"{base.__name__}WithLogits", members, type=str)


TO_BREAKDOWN = {
    "Sharded Param": "sharded_params", "Parameter": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "Sharded Grad": "sharded_grads", "Gradient": "sharded_grads",
    "Unsharded Grad": "unsharded_grads",
    "OptState": "optimizer_state", "Optstate": "optimizer_state",
    "Activation": "activations", "Temp": "activations",
    _LOGITS: "logits_and_loss",
    "All Gather": "collective_buffers", "Reduce Scatter": "collective_buffers",
    "Buffer": "other", "Inputs": "other", "Other": "other",
}


_DECOMPOSED: list = []


def decomposed_ops() -> list:
    """Custom ops whose inner allocations the tracker counts: bitsandbytes' gemm_4bit (MatMul4Bit's forward), once
    bitsandbytes is imported (it registers the op)."""
    if not _DECOMPOSED and "bitsandbytes" in sys.modules:
        _DECOMPOSED.append(torch.ops.bitsandbytes.gemm_4bit.default)
    return _DECOMPOSED
