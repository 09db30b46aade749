"""A pipeline rank's step time (pp > 1): cost_models/pipeline_time.py's schedule walk over the per-microbatch
costs cost_models/step_time.py priced, assembled into a TimeBreakdown."""

from __future__ import annotations

from . import pipeline_time
from .compute import mfu_flops_per_token
from .step_parts import _optimizer_times
from .time_breakdown import TimeBreakdown


def _pipeline_step(model, full_model, cluster, training, config, profile, blocks, root, per_mb: dict, tp_mb, cp_mb,
                   ep_mb: float, fsdp_copy_s: float, counts, shard_counts, d: int, tokens: int, c: int, peak: float,
                   flops_mb: float, terms: dict | None = None) -> TimeBreakdown:
    """A pipeline rank's step (cost_models/pipeline_time.py): the compute classes and the mesh's collectives are
    the mean rank's (the whole model's per microbatch x m / pp), the step the schedule's critical path. per_mb,
    tp_mb, cp_mb ((all, exposed) s), ep_mb: the whole model's seconds for one microbatch."""
    pp, m = config.pp, config.pp_microbatches
    passes = pipeline_time.stage_passes(model, config, blocks, root)
    p2p_s = pipeline_time.p2p_seconds(model, config, cluster, profile, tokens, c)
    pipe = pipeline_time.pipeline_time(model, config, passes, p2p_s, record=terms is not None)
    if terms is not None:  # what explain shows of the walk
        terms.update(pipeline_passes=passes, pipeline_p2p_s=p2p_s, pipeline=pipe, fsdp_copy_s=fsdp_copy_s)
    share = m / pp
    compute = share * per_mb["compute_s"] + fsdp_copy_s / pp  # FSDP2's copies once per step (gathered all step)
    mesh_exposed = share * (tp_mb[1] + cp_mb[1] + ep_mb)
    fsdp_total = sum(s.gather_s + s.reduce_s for s in passes) / pp
    total_comm = share * (tp_mb[0] + cp_mb[0] + ep_mb) + fsdp_total + pipe.p2p_total_s
    exposed = mesh_exposed + pipe.fsdp_exposed_s + pipe.p2p_exposed_s
    trainable, frozen = pipeline_time.largest_rank_params(model, config, counts)
    shard_trainable, _ = pipeline_time.largest_rank_params(model, config, shard_counts)
    offload_copy_s, optimizer_s = _optimizer_times(shard_trainable / d, trainable, frozen, d, 1, 1, cluster,
                                                   training, config, profile)
    overhead_s = m * profile.microstep_overhead_s
    overlap_slowdown_s = profile.overlap_slowdown * max(0.0, min(total_comm - exposed, compute))
    step_s = compute + exposed + pipe.bubble_s + pipe.imbalance_s + overlap_slowdown_s + offload_copy_s \
        + optimizer_s + overhead_s
    full_tokens = m * config.micro_batch * training.seq_len / config.model_parallel
    return TimeBreakdown(
        compute_s=compute, recompute_s=share * per_mb["recompute_s"], matmul_s=share * per_mb["matmul_s"],
        attention_s=share * per_mb["attention_s"], memory_bound_s=share * per_mb["memory_bound_s"] + fsdp_copy_s / pp,
        exposed_comm_s=exposed, overlap_slowdown_s=overlap_slowdown_s, total_comm_s=total_comm,
        offload_copy_s=offload_copy_s, optimizer_s=optimizer_s, overhead_s=overhead_s, step_s=step_s,
        tokens_per_s_per_gpu=m * tokens / config.tp / pp / step_s,
        mfu=full_tokens * mfu_flops_per_token(full_model, training) / (step_s * peak),
        hfu=share * flops_mb / (step_s * peak),
        tp_comm_s=share * tp_mb[0], tp_exposed_comm_s=share * tp_mb[1], cp_comm_s=share * cp_mb[0],
        cp_exposed_comm_s=share * cp_mb[1], ep_comm_s=share * ep_mb,
        pp_bubble_s=pipe.bubble_s, pp_imbalance_s=pipe.imbalance_s, pp_comm_s=pipe.p2p_exposed_s)
