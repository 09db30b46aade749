"""`fsdp-plan trace --format json`: the memory the real FSDP2 step allocated on fake tensors, beside the
estimate, and where they differ."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from planner.schemas.common import Bytes, Config, ModelSummary, Seconds, _Out
from planner.schemas.budget import Memory, MemoryBreakdown, Time
from planner.schemas.fsdp_arguments import FsdpKwargs, FullyShardKwargs


class TracedBreakdown(MemoryBreakdown):
    """calibration.memtrack.BREAKDOWN_KEYS: the estimate's categories and what the tracker files under none."""

    other: Bytes


class Snapshot(_Out):
    peak_allocated_bytes: Bytes
    peak_phase: str
    breakdown: TracedBreakdown


class AllocatorReplay(_Out):
    """Both traced steps' allocations replayed through cost_models/caching_allocator.py (no CUDA context)."""

    peak_allocated_bytes: Bytes = Field(description="torch.cuda.max_memory_allocated: allocated block sizes")
    peak_reserved_bytes: Bytes = Field(description="torch.cuda.max_memory_reserved: the segments cudaMalloc'd")
    segments: int = Field(description="segments at the reserved peak")


class TraceDetails(_Out):
    """calibration.trace.TraceResult.to_dict() less what `memory` holds."""

    phases: dict[str, Snapshot] = Field(description='"forward_backward" and "optimizer_step" windows')
    world_size: int
    shard_group_size: int
    builder: Literal["transformers", "reference"]
    attention: str = Field(description="the attention implementation traced")
    experts: str | None = Field(description='mixture-of-experts kernel ("grouped_mm"); null: no experts')
    seconds: Seconds = Field(description="s the trace took")
    allocator: AllocatorReplay | None = Field(description="null: no allocation sequence recorded")


class TracedMemory(_Out):
    peak_allocated_bytes: Bytes
    peak_reserved_bytes: Bytes = Field(description="bytes per rank: the allocator replay's peak reserved + "
                                                   "outside_allocator_bytes (reserved_from replay), else "
                                                   "peak_reserved_flat_bytes")
    peak_reserved_flat_bytes: Bytes = Field(description="bytes per rank: traced peak + the estimate's fragmentation "
                                                        "+ outside_allocator_bytes")
    outside_allocator_bytes: Bytes = Field(description="bytes per rank outside PyTorch's caching allocator, the "
                                                       "estimate's (a trace records the allocator's tensors only)")
    reserved_from: Literal["replay", "flat"]
    peak_phase: str = Field(description='"forward", "backward" or "optimizer_step"')
    breakdown: TracedBreakdown
    cpu_bytes_per_node: Literal[0] = Field(description="the trace tier runs no offload")
    notes: list[str]


class Analytic(_Out):
    source: Literal["analytic"]
    fits: bool
    reasons: list[str]
    memory: Memory


class PeakPhases(_Out):
    analytic: str
    trace: str


class Difference(_Out):
    """analytic - trace."""

    peak_allocated_bytes: int = Field(description="bytes per rank, analytic - trace")
    peak_allocated_relative: float = Field(description="(analytic - trace) / trace, rounded to 4 places")
    peak_phase: PeakPhases
    breakdown: TracedBreakdown = Field(description="bytes per rank by category, analytic - trace (the "
                                                   "estimate has no 'other': 0 - trace)")


class TraceOutput(_Out):
    """`fsdp-plan trace --format json`: estimate's shape with the traced memory, the analytic memory beside it
    and the difference. Step time is the analytic model's: the trace measures memory."""

    model: ModelSummary
    source: Literal["trace"]
    config: Config
    fits: bool = Field(description="the traced peak reserved fits the GPU")
    reasons: list[str]
    memory: TracedMemory
    time: Time
    fsdp_kwargs: FsdpKwargs
    fully_shard_kwargs: FullyShardKwargs
    trace: TraceDetails
    analytic: Analytic
    difference: Difference
