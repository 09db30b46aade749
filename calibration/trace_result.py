"""What the trace tier returns (TraceResult: a rank's memory of the second training step) and raises
(TraceError, TraceUnsupported, UntraceableModel), for calibration/trace.py and trace_pipeline.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.caching_allocator import AllocatorSettings, ReplayResult, replay

from .memtrack import MemorySnapshot


class TraceError(RuntimeError):
    """The trace tier cannot produce a figure for this request."""


class TraceUnsupported(TraceError):
    """A configuration the trace tier does not model (offload, 8-bit optimizers; LoRA without peft)."""


class UntraceableModel(TraceError):
    """The model's code does not run under FakeTensorMode (data-dependent ops, custom code)."""


@dataclass(frozen=True)
class TraceResult:
    """Per-rank memory of the second training step, as MemoryBreakdown categories (bytes)."""

    peak_allocated_bytes: int
    breakdown: dict[str, int]
    peak_phase: str                           # "forward", "backward" or "optimizer_step"
    phases: dict[str, MemorySnapshot]         # "forward_backward" and "optimizer_step" windows
    world_size: int
    shard_group_size: int
    builder: str                              # "transformers" or "reference"
    seconds: float
    notes: tuple[str, ...] = ()
    attention: str = ""                       # the implementation traced (eager where a family refuses sdpa)
    experts: str | None = None                # mixture-of-experts kernel ("grouped_mm"); None: no experts
    allocator: ReplayResult | None = None     # both steps' allocations replayed (cost_models/caching_allocator.py)
    allocation_events: tuple = field(default=(), repr=False, compare=False)  # what was replayed (alloc_sequence.py)

    def replay(self, settings: AllocatorSettings | None = None) -> ReplayResult | None:
        """The step's allocations replayed under other allocator settings (None: torch's defaults, `allocator`)."""
        if settings is None or settings == AllocatorSettings() or not self.allocation_events:
            return self.allocator
        return replay(self.allocation_events, settings)

    def to_dict(self) -> dict:
        return {
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_phase": self.peak_phase,
            "breakdown": dict(self.breakdown),
            "phases": {name: snap.to_dict() for name, snap in self.phases.items()},
            "world_size": self.world_size,
            "shard_group_size": self.shard_group_size,
            "builder": self.builder,
            "attention": self.attention,
            "experts": self.experts,
            "seconds": round(self.seconds, 2),
            "notes": list(self.notes),
            "allocator": None if self.allocator is None else {
                "peak_allocated_bytes": self.allocator.peak_allocated_bytes,
                "peak_reserved_bytes": self.allocator.peak_reserved_bytes,
                "segments": len(self.allocator.segments_at_peak)},
        }


def _untraceable(what: str, exc: BaseException) -> UntraceableModel:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return UntraceableModel(f"{what} failed under FakeTensorMode: {type(exc).__name__}: {text[:300]} "
                            "(data-dependent ops or custom code cannot be traced; use the analytic estimate "
                            "or `fsdp-plan calibrate` on real hardware)")
