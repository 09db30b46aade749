"""What a user pinned (a degree of the mesh, a schedule, an attention kernel) that the model, cluster or trainer
does not allow: one line (PlannerError) before the search, as estimate says it, not an empty plan."""

from __future__ import annotations

from cost_models.feasibility import refusals
from cost_models.mesh_rules import mesh_refusals
from cost_models.schedules import Schedule
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec

from .errors import PlannerError
from .search import SearchSpace
from .trainers import trainer_kernel_refusal


def check_attention_kernel(trainer, kernel: str, cluster: ClusterSpec) -> None:
    """A pinned attention kernel the trainer cannot express or the GPU does not have is one line (PlannerError), as
    estimate says it, not an empty plan."""
    error = trainer_kernel_refusal(trainer, "attention_kernel", kernel)
    if error is not None:
        raise error
    refused = [r for r in refusals(cluster, FsdpConfig(attention_kernel=kernel)) if r.field == "attention_kernel"]
    if refused:
        raise PlannerError("attention_kernel", f"{refused[0].reason}; {refused[0].fix}")


def check_mesh(spec: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, space: SearchSpace) -> None:
    """A pinned degree the model or cluster does not allow is one line (PlannerError), not an empty plan. The
    microbatch count is the search's to choose (from the micro-batch), so its rules are not checked here."""
    pipelined = space.pp is not None and space.pp > 1
    if not pipelined and (space.pp_schedule is not None or space.pp_stages_per_rank is not None):
        given = "pp_schedule" if space.pp_schedule is not None else "pp_stages_per_rank"
        raise PlannerError(given, "pins the pipeline's schedule: give pp >= 2 (--pp N) with it, or leave it out "
                                  "(the search tries 1f1b and interleaved-1f1b with 2 stages per rank)")
    config = FsdpConfig(tp=space.tp or 1, cp=space.cp or 1, pp=space.pp or 1, ep=space.ep or 1,
                        attention=space.attention, sequence_parallel=space.sequence_parallel,
                        pp_schedule=space.pp_schedule or Schedule.ONE_F_ONE_B,
                        pp_stages_per_rank=space.pp_stages_per_rank or 0)
    refused = [r for r in mesh_refusals(spec, cluster, training, config)
               if (r.code != "ep-does-not-divide" or spec.moe is None or spec.moe.n_experts % config.ep)
               and r.field != "micro_batch" and r.code != "qlora-storage-not-compute-dtype"]  # the search's
    if refused:                                                            # precisions follow the storage
        raise PlannerError(refused[0].field, f"{refused[0].reason}; {refused[0].fix}")
