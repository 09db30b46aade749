"""Whether a configuration can run at all on the cluster and batch it was asked for: a PlannerError naming the field
(the API raises it; `fsdp-plan check` and estimate report it)."""

from __future__ import annotations

from cost_models.feasibility import refusals
from cost_models.specs import ClusterSpec, FsdpConfig, TrainingSpec

from .errors import PlannerError


def grad_accum_for(micro_batch: int, cluster: ClusterSpec, training: TrainingSpec, model_parallel: int = 1) -> int:
    """Accumulation steps that reach the global batch (1 without one) on the data-parallel ranks (the GPUs over
    tp x cp x pp = model_parallel); PlannerError when it cannot."""
    data_parallel = max(1, cluster.n_gpus // model_parallel)
    accum = training.grad_accum_for(micro_batch, data_parallel)
    if accum is None:
        ranks = "gpus" if model_parallel == 1 else f"data-parallel ranks ({cluster.n_gpus} GPUs / tp x cp x pp)"
        raise PlannerError("global_batch", f"{training.global_batch} is not a multiple of micro_batch x {ranks} "
                                           f"= {micro_batch * data_parallel}")
    return accum


def cluster_rejects(cluster: ClusterSpec, config: FsdpConfig) -> PlannerError | None:
    """Why `config` cannot run on `cluster` at all (cost_models.feasibility: its field, the reason and what is
    valid), or None; of several, one the cost model cannot price first."""
    if not (refused := refusals(cluster, config)):
        return None
    first = next((r for r in refused if not r.priced), refused[0])
    return PlannerError(first.field, f"{first.reason}; {first.fix}")
