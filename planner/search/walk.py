"""How the search walks pipeline degrees (planner/search/): the scout knobs a degree is first costed on, the
ceiling no pipeline of a mesh can beat, and when the walk goes on to the next degree."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.schedules import Schedule

from planner.search.pipeline import Pipeline


def scout_space(space, cluster):
    """The few knobs a pipeline degree is first judged by (the walk compares degrees on them): the first
    precision, compile, Float8 and async TP where they run, no reshard group, HYBRID over the node; every
    micro-batch and every activation checkpointing choice. Checkpointing stays whole because it is what a pipeline
    trades: fewer blocks per rank free the memory that lets a stage run without recompute, so judging degrees under
    full checkpointing alone ranks them by the wrong step (llama3.1-70b on 1,024 A100, global batch 512: FSDP 128 x
    TP 8 at 321 tokens/s/GPU instead of FSDP 64 x TP 4 x PP 4 interleaved without checkpointing at 333). `space`: a
    planner.search.SearchSpace."""
    return replace(space, precisions=space.precisions_for(cluster)[:1],
                   compile=(max(space.compile_for(cluster)),), float8=(max(space.float8),),
                   reshard_to_node=(False,), async_tp=(max(space.async_tp),),
                   # a pipeline's HYBRID shards over the node (SearchSpace.shard_groups_for): like with like
                   shard_group_gpus=(0,) if space.shard_group_gpus is None else space.shard_group_gpus)


def per_token_compute_s(evaluations) -> float | None:
    """The least compute (recompute left out) a token costs a GPU, over these costed candidates."""
    rates = [(e.time.compute_s - e.time.recompute_s) / (e.time.tokens_per_s_per_gpu * e.time.step_s)
             for e in evaluations if e.time.tokens_per_s_per_gpu > 0]
    return min(rates, default=None)


def pipeline_ceiling(per_token_s: float | None, pipe: Pipeline, plans: list[tuple[int, int]]) -> float | None:
    """tokens/s/GPU no candidate of this pipeline beats: the mesh's cheapest compute per token with nothing but
    the textbook bubble on top, at the most microbatches its plans give (None: no bound). The same tokens on
    fewer blocks per rank cost a GPU the same compute; communication, imbalance and sends only slow it further."""
    if per_token_s is None or not plans or pipe.schedule not in (Schedule.GPIPE, Schedule.ONE_F_ONE_B,
                                                                  Schedule.INTERLEAVED_1F1B):
        return None
    from cost_models.pipeline_time import textbook_bubble_fraction

    m = max(accum for _, accum in plans)
    return (1 - textbook_bubble_fraction(pipe.schedule, pipe.pp, pipe.stages_per_rank, m)) / per_token_s


@dataclass(frozen=True)
class Walk:
    """Where a schedule's walk over pipeline degrees stands: the best tokens/s/GPU so far (the mesh without PP
    included) and the last degree's least overshoot when nothing fit there."""
    best: float | None = None
    overshoot: float | None = None


def walk_on(best: float | None, least_overshoot: float | None, costed: bool, walk: Walk) -> tuple[bool, Walk]:
    """(whether the walk goes past this degree, where it then stands), from the degree's fastest fitting
    candidate (`best`) or, where nothing fits, its nearest miss's overshoot; costed False: no micro-batch plan.
    Stopped at a degree that fits no faster than the best so far: a larger pp halves the data-parallel ranks and
    grows the bubble. Where nothing fits, on while the nearest miss comes closer: a larger pp leaves fewer blocks
    per rank (under PP a stage keeps its blocks gathered from forward to backward), so memory falls with the
    degree until it does not."""
    if best is None:
        closer = least_overshoot is not None and (walk.overshoot is None or least_overshoot < walk.overshoot)
        return closer or (not costed and walk.overshoot is None), replace(walk, overshoot=least_overshoot)
    if walk.best is None or best > walk.best:
        return True, Walk(best)
    return False, walk
