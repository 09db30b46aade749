"""Which pipelines the search tries (planner/search/ walks them): the degrees, schedules and microbatch counts.

- pp: powers of two from 2 that divide the GPUs left by tp x cp and that the model's blocks can be split over
  (pp x V stages: cost_models/pipeline.stage_refusals), or the pinned degree;
- the schedule: 1F1B (one stage per rank) and interleaved 1F1B with V = 2 stages per rank (torchtitan's default
  looped schedule, Narayanan et al. SC21: the bubble / V), or the pinned schedule and V;
- the microbatches m: with a global batch, local batch / micro-batch (the micro-batch is the pipeline microbatch,
  the local batch = global batch / data-parallel ranks); without one, PP_MICROBATCHES_PER_STAGE x the stages
  (a global batch chooses m exactly). A count the schedule refuses (cost_models/pipeline.microbatch_refusal:
  1F1B needs m >= stages, the interleaved ones whole rounds) is not costed.
Under PP torchtitan keeps the blocks gathered from forward to backward whatever fsdp_reshard_after_forward's
"default" says (models/llama3/parallelize.py: reshard_after_forward = not pp_enabled), so FULL_SHARD and
SHARD_GRAD_OP (HYBRID_SHARD and its ZeRO-2 form) run alike there: the search tries the first of each pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.pipeline import microbatch_refusal, stage_refusals
from cost_models.schedules import Schedule
from cost_models.specs import FsdpConfig, ModelSpec, Sharding, TrainingSpec

# (schedule, stages per rank) the search tries
PP_SCHEDULES = ((Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED_1F1B, 2))
PP_MICROBATCHES_PER_STAGE = 2  # without a global batch: m = 2 x stages (1F1B's bubble (p - 1) / (m + p - 1) ~ 1/3)
PP_SHARDINGS = (Sharding.FULL_SHARD, Sharding.NO_SHARD, Sharding.HYBRID_SHARD)  # the others run alike under PP


@dataclass(frozen=True)
class Pipeline:
    pp: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    stages_per_rank: int = 1

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_rank


NO_PIPELINE = Pipeline()


def splits(model: ModelSpec, pp: int, schedule: Schedule = Schedule.ONE_F_ONE_B, stages_per_rank: int = 1) -> bool:
    """Whether the model's blocks split over pp x V stages (the stage rules of cost_models/pipeline.py)."""
    return not stage_refusals(model, FsdpConfig(pp=pp, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank))


def pp_degrees(model: ModelSpec, free_gpus: int, pinned: int | None = None) -> list[int]:
    """Pipeline degrees >= 2 over `free_gpus` (the GPUs over tp x cp): powers of two dividing them that split the
    blocks; the pinned degree alone when given (its rules are mesh_rules' to refuse)."""
    if pinned is not None:
        return [pinned] if pinned > 1 else []
    out, p = [], 2
    while p <= free_gpus and splits(model, p):
        if free_gpus % p == 0:
            out.append(p)
        p *= 2
    return out


def pipelines(model: ModelSpec, pp: int, schedule: Schedule | None = None,
              stages_per_rank: int | None = None) -> list[Pipeline]:
    """The schedules tried at degree pp: PP_SCHEDULES (or the pinned one, V its own default unless pinned), each
    where the blocks split over its stages."""
    if schedule is not None:
        choices = [(schedule, stages_per_rank or schedule.default_stages_per_rank)]
    else:
        choices = [(s, v) for s, v in PP_SCHEDULES if stages_per_rank in (None, v)]
    return [Pipeline(pp, s, v) for s, v in choices if splits(model, pp, s, v)]


def microbatch_plans(training: TrainingSpec, data_parallel: int, micro_batches: tuple[int, ...],
                     pipeline: Pipeline, pinned_schedule: bool = False) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) pairs to cost: without a pipeline the accumulation that reaches the global batch;
    with one, grad_accum is the microbatch count m of one schedule step, kept where the schedule takes it
    (microbatch_refusal) and, unless the schedule is pinned, m >= the stages (torchtitan warns of the bubble
    below that, and interleaving gains nothing)."""
    out = []
    for mb in micro_batches:
        accum = training.grad_accum_for(mb, data_parallel)
        if accum is None:
            continue
        if pipeline.pp > 1:
            if training.global_batch is None:
                accum = PP_MICROBATCHES_PER_STAGE * pipeline.stages
            config = FsdpConfig(micro_batch=mb, grad_accum=accum, pp=pipeline.pp, pp_schedule=pipeline.schedule,
                                pp_stages_per_rank=pipeline.stages_per_rank)
            if (not pinned_schedule and accum < pipeline.stages) or microbatch_refusal(config) is not None:
                continue
        out.append((mb, accum))
    return out
