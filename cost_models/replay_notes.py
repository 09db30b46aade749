"""The estimate's notes on a reserved figure replayed through the caching allocator model (the pipeline ranks'
replay, pipeline_allocations.replayed_reserved, and the pp = 1 step's, step_allocations.py)."""

from __future__ import annotations

from .caching_allocator import AllocatorSettings
from .memory_types import MemoryEstimate
from .units import GiB


def replay_notes(memory: MemoryEstimate, reserved_bytes: int, what: str, settings: AllocatorSettings, profile,
                 capacity_bytes: int) -> tuple[str, ...]:
    """The estimate's notes on a replayed reserved figure (what: whose allocations), and the warning where it passes
    the GPU's memory while the flat rule (memory.peak_reserved_bytes) decides that it fits."""
    conf = (f"PYTORCH_CUDA_ALLOC_CONF={settings.conf()}" if settings != AllocatorSettings()
            else "PyTorch's default allocator settings")
    flat = f"allocated x {1 + profile.fragmentation:.2f} + outside, {memory.peak_reserved_bytes / GiB:.1f} GiB"
    notes = (f"reserved {reserved_bytes / GiB:.1f} GiB{what} replayed through the caching allocator model under "
             f"{conf}, + {memory.outside_allocator_bytes / GiB:.2f} GiB outside the allocator; the flat rule "
             f"({flat}) decides whether it fits, as the allocator frees its cached segments and retries before an "
             "out-of-memory error",)
    if reserved_bytes > capacity_bytes:
        notes += (f"warning: the replay's reserved {reserved_bytes / GiB:.1f} GiB > the GPU's "
                  f"{capacity_bytes / GiB:.1f} GiB: expect the allocator to free cached segments and retry "
                  "(slower steps)",)
    return notes
