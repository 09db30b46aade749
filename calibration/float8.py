"""Float8 (torchao) as calibration.apply applies it, GPU only: the blocks' linears converted to Float8 and, with
the FP8 all-gather, the weight scales precomputed after each optimizer step."""

from __future__ import annotations

import torch
from torch import nn

from cost_models.specs import FsdpConfig

from .model_blocks import _block_slots

FLOAT8_DIM_MULTIPLE = 16  # FP8 matmuls (torch._scaled_mm) need both dims of the weight divisible by 16


def convert_to_float8(model: nn.Module, block_classes: set[type], config: FsdpConfig, device_type: str) -> int:
    """torchao Float8 linears (tensorwise dynamic scaling) for the blocks' nn.Linear layers whose dims are
    multiples of 16, as torchtitan converts them (its filter leaves the output head in high precision; here
    everything outside the blocks stays). With fp8_all_gather FSDP2 all-gathers those weights in FP8.
    Returns how many linears were converted. Raises on CPU and without torchao: a CUDA GPU with FP8
    tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell) is needed."""
    if device_type != "cuda":
        raise ValueError(f"float8: torchao Float8 linears run on CUDA GPUs with FP8 tensor cores; this run is on "
                         f"{device_type} (drop float8, or run on an H100-class GPU)")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        raise ValueError(f"float8: {torch.cuda.get_device_name()} has no FP8 tensor cores (needs compute "
                         "capability 8.9+: Ada, Hopper, Blackwell)")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ValueError("float8: needs torchao (pip install torchao) for its Float8 linears") from None
    inside = {id(m) for parent, name in _block_slots(model, block_classes) for m in getattr(parent, name).modules()}
    converted = []

    def wanted(module: nn.Module, fqn: str) -> bool:
        ok = (isinstance(module, nn.Linear) and id(module) in inside
              and module.in_features % FLOAT8_DIM_MULTIPLE == 0 and module.out_features % FLOAT8_DIM_MULTIPLE == 0)
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=config.fp8_all_gather),
                               module_filter_fn=wanted)
    return len(converted)


def precompute_float8_scales(model: nn.Module, config: FsdpConfig) -> None:
    """After each optimizer step with the FP8 all-gather: compute every Float8 weight's scale in one
    all-reduce for all of them (torchao's precompute_float8_dynamic_scale_for_fsdp) instead of one per
    weight inside each all-gather. No-op otherwise."""
    if config.fp8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)

