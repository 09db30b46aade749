"""The EP view's parameter counts (expert_parallel.ExpertParallelView.param_counts), which the memory ledger and the
step time read for every configuration of a search: once per the view's model, its groups and what they read of
training (ParamCounts.of: the fine-tuning and the LoRA rank)."""

from __future__ import annotations

from dataclasses import replace

from . import moe
from .identity_memo import IdentityMemo
from .memory_types import ParamCounts

_COUNTS = IdentityMemo(limit=256)  # (the view's model, efsdp, d, what ParamCounts.of reads) -> (gathered, shard)


def param_counts(view, training) -> tuple[ParamCounts, ParamCounts]:
    """(gathered, shard) ParamCounts of the per-rank model (view: an ExpertParallelView): gathered counts the block's
    all-gather outputs (the rest padded at d, the experts at efsdp); shard counts are those whose / d is a rank's
    shard (the experts' efsdp shard scaled by d), which the ledger's model states divide by d."""
    return _COUNTS.get(view.model, (view.efsdp, view.d, training.finetune, training.lora_rank),
                       lambda: _param_counts(view, training))


def _param_counts(view, training) -> tuple[ParamCounts, ParamCounts]:
    gathered = ParamCounts.of(view.model, training, view.d)
    g_experts = moe.experts_gathered_elements(view.model, view.d)
    experts_d = view.experts_gathered_elements()
    block = gathered.trainable_block - g_experts + experts_d
    shard_block = block - experts_d + view.experts_shard_elements() * view.d
    nd = view.model.n_dense_layers

    def counts(b: int) -> ParamCounts:  # (the dense blocks' own dim-0 padding kept: gathered's delta)
        delta = gathered.trainable_dense_delta + nd * (gathered.trainable_block - b) if nd else 0
        return replace(gathered, trainable_block=b, trainable_dense_delta=delta)

    return counts(block), counts(shard_block)
