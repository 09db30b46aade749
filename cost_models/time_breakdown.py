"""TimeBreakdown: a step's seconds by kind (compute classes, exposed and total communication, the mesh's and the
pipeline's shares, offload, optimizer) and its throughput, as cost_models/step_time.py prices them."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .quick_init import quick_init


@quick_init
@dataclass(frozen=True)
class TimeBreakdown:
    compute_s: float             # all micro-steps, recompute included: matmul + attention + memory-bound
    recompute_s: float           # the part of compute_s spent re-running checkpointed forwards
    matmul_s: float              # of compute_s without recompute: the matmuls (block linears, experts, head)
    attention_s: float           # ... the attention kernels (eager: the score products)
    memory_bound_s: float        # ... norms, activations, rotary, residuals, loss, casts, FSDP's copies
    exposed_comm_s: float        # communication not hidden behind compute
    overlap_slowdown_s: float    # compute slowed by the NCCL kernels running beside it
    total_comm_s: float          # all collective time, hidden or not (for information)
    offload_copy_s: float        # CPU offload host<->device copies
    optimizer_s: float           # the optimizer step (GPU, or CPU with offload)
    overhead_s: float            # fixed per micro-step cost
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float                   # model FLOPs (torchtitan's count, no recompute) / (step time * peak)
    hfu: float                   # executed FLOPs (recompute included) / (step time * peak)
    # the mesh's collectives, of total_comm_s and exposed_comm_s (FSDP's are the rest): tensor parallel's
    # all-gathers / reduce-scatters (all-reduces without sequence parallel), context parallel's ring exchanges
    tp_comm_s: float = 0.0
    tp_exposed_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    cp_exposed_comm_s: float = 0.0
    # expert parallelism's dispatch and combine all-to-alls (forward, backward, recompute), on the critical path
    ep_comm_s: float = 0.0
    # pipeline parallelism (cost_models/pipeline_time.py; 0 without): with pp > 1 compute_s and the mesh's exposed
    # collectives are the mean pipeline rank's, and the step adds the schedule's warm-up and cool-down (bubble),
    # the slowest rank's excess over the mean (imbalance: the first and last stages' embedding, head and loss) and
    # the exposed stage-to-stage sends of activations and gradients (pp_comm_s, of exposed_comm_s)
    pp_bubble_s: float = 0.0
    pp_imbalance_s: float = 0.0
    pp_comm_s: float = 0.0

    def to_dict(self) -> dict:
        """Every field; the pipeline's only with a pipeline (the output schemas leave them out without one)."""
        pipeline = ("pp_bubble_s", "pp_imbalance_s", "pp_comm_s")
        piped = any(getattr(self, name) for name in pipeline)
        return {f.name: getattr(self, f.name) for f in fields(self) if piped or f.name not in pipeline}
