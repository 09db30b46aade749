"""A pipeline candidate in words and JSON: its schedule, how the local batch becomes microbatches, which blocks each
stage runs on which pipeline rank (cost_models/pipeline.py), and each rank's memory (MemoryEstimate.pipeline_ranks:
the estimate's headline is the largest rank, as torchtitan reports the maximum across ranks)."""

from __future__ import annotations

from cost_models.pipeline import stages
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec
from cost_models.units import GiB


def pipeline_ranks(memory) -> tuple:
    """The per-rank memory of a pipeline estimate (empty without PP, or before the estimate prices ranks)."""
    return tuple(getattr(memory, "pipeline_ranks", ()) or ())


def largest_rank(memory):
    """The rank whose reserved peak is the estimate's headline (None without per-rank memory)."""
    ranks = pipeline_ranks(memory)
    return max(ranks, key=lambda r: r.peak_reserved_bytes) if ranks else None


def batch_words(config: FsdpConfig, cluster: ClusterSpec) -> str:
    """How the local batch is cut: 'micro-batch 1 is the pipeline microbatch: the local batch of 16 sequences
    (16 data-parallel ranks) runs as 16 microbatches in one schedule step'."""
    dp = config.data_parallel_size(cluster)
    local = config.micro_batch * config.pp_microbatches
    return (f"micro-batch {config.micro_batch} is the pipeline microbatch: the local batch of {local} sequences "
            f"(global batch {local * dp} / {dp} data-parallel ranks) runs as {config.pp_microbatches} microbatches "
            "in one schedule step")


def schedule_words(config: FsdpConfig) -> str:
    """'pp 8 x 2 stages per rank = 16 stages, interleaved-1f1b (torch's ScheduleInterleaved1F1B)'."""
    v = config.pp_stages_per_rank
    per_rank = f" x {v} stages per rank = {config.pp_stages} stages" if v > 1 else f" ({config.pp} stages)"
    return (f"pp {config.pp}{per_rank}, {config.pp_schedule.value} (torch's {config.pp_schedule.torch_class}; "
            f"torchtitan's {config.pp_schedule.torchtitan_name})")


def stage_lines(model: ModelSpec, config: FsdpConfig) -> list[str]:
    """One line per pipeline rank: the stages it runs and their blocks."""
    by_rank: dict[int, list] = {}
    for s in stages(model, config):
        by_rank.setdefault(s.rank, []).append(s)
    return [f"  rank {rank}: " + ", ".join(f"stage {s.index} ({s.describe()})" for s in held)
            for rank, held in sorted(by_rank.items())]


def rank_memory_lines(memory) -> list[str]:
    """Each pipeline rank's peak, the largest marked (none before the estimate prices ranks)."""
    ranks = pipeline_ranks(memory)
    if not ranks:
        return []
    top = largest_rank(memory)
    lines = ["Memory per pipeline rank (GiB; the breakdown above is the largest rank's, as torchtitan reports the "
             "maximum across ranks):"]
    for r in ranks:
        mark = "  <- largest" if r is top else ""
        lines.append(f"  rank {r.rank} (stage{'s' if len(r.stages) > 1 else ''} {', '.join(map(str, r.stages))}): "
                     f"peak allocated {r.peak_allocated_bytes / GiB:.1f}, reserved {r.peak_reserved_bytes / GiB:.1f} "
                     f"at {r.peak_moment}{mark}")
    return lines


def pipeline_lines(model: ModelSpec, config: FsdpConfig, cluster: ClusterSpec, memory=None) -> list[str]:
    """The pipeline in words (empty without PP): schedule, microbatches, the stage split, each rank's memory."""
    if config.pp == 1:
        return []
    lines = [f"pipeline: {schedule_words(config)}; {batch_words(config, cluster)}",
             "stages (whole blocks as even as they go; the embedding on the first, norm + head + loss on the last):",
             *stage_lines(model, config)]
    return lines + (rank_memory_lines(memory) if memory is not None else [])


def pipeline_dict(model: ModelSpec, config: FsdpConfig, cluster: ClusterSpec) -> dict:
    """Candidate JSON's "pipeline" (planner.schemas.fsdp_arguments.Pipeline)."""
    return {
        "schedule": config.pp_schedule.value,
        "torchtitan_schedule": config.pp_schedule.torchtitan_name,
        "stages_per_rank": config.pp_stages_per_rank,
        "microbatches": config.pp_microbatches,
        "microbatch_size": config.micro_batch,
        "local_batch": config.micro_batch * config.pp_microbatches,
        "stages": [{"index": s.index, "rank": s.rank, "first_block": s.first_block, "n_blocks": s.n_blocks,
                    "embedding": s.embedding, "head": s.head, "description": s.describe()}
                   for s in stages(model, config)],
    }


def rank_memory_dicts(memory) -> list[dict]:
    """Memory JSON's "pipeline_ranks" (planner.schemas.budget.PipelineRank)."""
    return [{"rank": r.rank, "stages": list(r.stages), "description": r.description,
             "peak_allocated_bytes": r.peak_allocated_bytes, "peak_reserved_bytes": r.peak_reserved_bytes,
             "peak_moment": r.peak_moment, "breakdown": r.breakdown.to_dict()} for r in pipeline_ranks(memory)]
