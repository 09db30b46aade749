"""Activation checkpointing as calibration.apply applies it: every K-th block in a non-reentrant checkpoint
wrapper, or every block under torchtitan's selective op-level policy (selective_op_context)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from cost_models.specs import FsdpConfig

from .model_blocks import _block_slots


def apply_checkpointing(model: nn.Module, block_classes: set[type], config: FsdpConfig) -> int:
    """The config's activation checkpointing: every K-th block, or every block with the selective-op
    policy; returns how many blocks were wrapped (0 without checkpointing)."""
    if config.selective_op_ac:
        return apply_activation_checkpointing(model, block_classes, 1, context_fn=selective_op_context)
    return apply_activation_checkpointing(model, block_classes, config.ac_every) if config.ac_every else 0


# torchtitan's selective op-level checkpointing (shared/reference/published.md): the outputs of these ops
# are saved, except every second matmul; every other op (norms, activations, elementwise) is recomputed.
# aten.mm is what nn.Linear dispatches to (2-D weights, bias-free); a biased linear dispatches to addmm,
# counted as a matmul here too (torchtitan's models have no biases) so a q/k/v bias (Qwen2) changes nothing.
_aten = torch.ops.aten
SELECTIVE_OP_MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})
SELECTIVE_OP_SAVE = SELECTIVE_OP_MATMULS | {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,  # SDPA's fused kernel on CPU
    _aten.max.default,  # Float8's absmax: saved so the recompute need not scale again
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def selective_op_context():
    """context_fn of a non-reentrant checkpoint: torchtitan's policy, with the matmul count kept apart for
    the forward and the recompute so both make the same choices (odd matmuls saved, even recomputed)."""
    matmuls: defaultdict = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in SELECTIVE_OP_MATMULS:
            matmuls[mode] += 1
        save = func in SELECTIVE_OP_SAVE and not (func in SELECTIVE_OP_MATMULS and matmuls[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, block_classes: set[type], every: int, context_fn=None) -> int:
    """Wrap blocks 0, K, 2K, ... in a non-reentrant checkpoint_wrapper; returns how many were wrapped.
    context_fn: a selective checkpoint policy (selective_op_context), else the whole block is recomputed.

    Non-reentrant: works with FSDP, frozen params and kwargs. Works before or after FSDP1 wrapping
    (after, the wrapper sits inside the block's FSDP unit). Already-wrapped blocks are left alone.
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    count = 0
    for index, (parent, name) in enumerate(_block_slots(model, block_classes)):
        if index % every:
            continue
        holder, attr = parent, name
        # Under FSDP1 put the wrapper inside the unit: FSDP(CheckpointWrapper(block)).
        while isinstance(getattr(holder, attr), FullyShardedDataParallel):
            holder, attr = getattr(holder, attr), "_fsdp_wrapped_module"
        if isinstance(getattr(holder, attr), CheckpointWrapper):
            continue
        setattr(holder, attr, checkpoint_wrapper(getattr(holder, attr), checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                 **extra))
        count += 1
    return count

