"""GPU memory under pipeline parallelism (pp > 1): what one pipeline rank runs (a TP rank's slice of the model on
s / cp tokens), the memory outside the allocator, and the estimate - the largest rank's figures as the headline,
every rank's beside them (cost_models/pipeline_rank_memory.py replays each rank's schedule)."""

from __future__ import annotations

import dataclasses

from . import activation_notes, pipeline_techniques, tensor_parallel
from .memory_types import MemoryEstimate
from .outside_allocator import outside_allocator_terms
from .pipeline_rank_memory import PipelineRankMemory, pipeline_ranks
from .quick_init import replaced
from .specs import FsdpConfig, ModelSpec, TrainingSpec


def _cp_rank_training(training: TrainingSpec, config: FsdpConfig) -> TrainingSpec:
    """A CP rank's training: its s / cp tokens of each sequence."""
    if config.cp > 1:
        return dataclasses.replace(training, seq_len=training.seq_len // config.cp)
    return training


def rank_inputs(model: ModelSpec, training: TrainingSpec, config: FsdpConfig) -> tuple[ModelSpec, TrainingSpec]:
    """What one pipeline rank runs: a TP rank's slice of the model on s / cp tokens."""
    return tensor_parallel.local_model(model, config), _cp_rank_training(training, config)


def pipeline_outside_terms(model: ModelSpec, cluster, training: TrainingSpec, config: FsdpConfig, profile) -> tuple:
    """The memory outside the allocator of a pipeline configuration (outside_allocator.py; async TP's workspace on
    a CP rank's s / cp tokens)."""
    return outside_allocator_terms(cluster, config, profile, model, _cp_rank_training(training, config))


def with_outside_terms(memory: MemoryEstimate, terms: tuple) -> MemoryEstimate:
    """`memory` with these outside-the-allocator terms in place of its own: every reserved figure shifted by the
    difference (the search's memo reuses a pipeline's rank replays across Float8 and async TP, which change only
    these terms)."""
    delta = sum(t.bytes for t in terms) - memory.outside_allocator_bytes
    ranks = tuple(replaced(r, peak_reserved_bytes=r.peak_reserved_bytes + delta)
                  for r in memory.pipeline_ranks)
    return replaced(memory, peak_reserved_bytes=memory.peak_reserved_bytes + delta, pipeline_ranks=ranks,
                    outside_allocator=tuple(terms))


def _notes(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, top: PipelineRankMemory) -> tuple:
    """The estimate's notes: the formulas' quirks, the rank that leads, and what pp > 1 prices roughly or not yet."""
    notes = list(activation_notes.quirks(model, config.attention, training.seq_len))
    notes.append(f"pipeline rank {top.rank} ({top.description}) has the largest peak, at its {top.peak_moment}")
    if config.pp_schedule.split_backward:
        recomputes = ""
        if config.ac_every:
            recomputes = ("; W's recomputes of each checkpointed block, one per parameter group, are not: up to 1.9x "
                          "in the trace")
        notes.append(f"{config.pp_schedule.value}: the split backward priced as torch runs it (the input pass keeps "
                     "the graph and the output gradients of the linears and norms until the weight pass; checked on "
                     f"pp 2 without checkpointing{recomputes}, docs/accuracy.md)")
    for what, on in (("CPU offload", config.offload), ("LoRA", training.finetune.value == "lora")):
        if on:
            notes.append(f"pp > 1 does not price {what} yet: priced as without it")
    notes += pipeline_techniques.moe_notes(model)
    if config.cp > 1 or config.tp > 1 and config.sequence_parallel:
        notes.append("TP with sequence parallel / CP inside a stage: a TP rank's slice of the model on s / cp tokens, "
                     "the residual stream on s / tp, ring attention's saved and working bytes (the rules traced at "
                     "pp = 1), the embedding's gradient the whole table under sequence parallel; traced under PP and "
                     "run for real on 4 gloo ranks at pp 2 x tp 2 and pp 2 x cp 2, not together (docs/accuracy.md)")
    return tuple(notes)


def pipeline_estimate(model: ModelSpec, cluster, training: TrainingSpec, config: FsdpConfig, profile,
                      outside: tuple | None = None):
    """estimate_memory under pp > 1: the largest rank's figures as the headline (torchtitan reports the maximum
    across ranks), every rank in pipeline_ranks. outside: the terms where the caller has them (a search's memo)."""
    if outside is None:
        outside = pipeline_outside_terms(model, cluster, training, config, profile)
    model, training = rank_inputs(model, training, config)
    d = config.shard_group_size(cluster)
    ranks = pipeline_ranks(model, training, config, d, profile, sum(t.bytes for t in outside))
    top = max(ranks, key=lambda x: x.peak_allocated_bytes)
    phase = "optimizer_step" if top.peak_moment == "optimizer step" else "backward"
    return MemoryEstimate(breakdown=top.breakdown, peak_phase=phase, phases=dict(top.phases),
                          peak_allocated_bytes=top.peak_allocated_bytes, peak_reserved_bytes=top.peak_reserved_bytes,
                          cpu_bytes_per_node=0, cpu_ram_capacity_bytes=cluster.cpu_ram_bytes_per_node,
                          notes=_notes(model, training, config, top),
                          peak_moment=f"{top.peak_moment} (pipeline rank {top.rank})", pipeline_ranks=ranks,
                          outside_allocator=outside)
