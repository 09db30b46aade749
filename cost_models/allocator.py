"""The loss's reserved bytes: its vocabulary-sized tensors replayed through the caching allocator model.

The loss over the vocabulary is where the allocator's stranding matters inside the estimate: tensors of V
elements per token, gigabytes each, whose sizes alternate between the compute dtype and fp32
(cost_models/loss_memory.py, loss_events). A tensor freed before a larger one is requested leaves its segment
reserved and unusable for it (caching_allocator.py: best fit, no merging across segments, no release).
The events' sizes are bytes per logit element (any unit): they are replayed at GiB_PER_UNIT, where each
tensor is a large-pool request of whole 2 MiB units (kRoundLarge), its own segment exactly, as the
gigabyte-sized tensors of a real step are, so the result scales back to per-element figures exactly.
"""

from __future__ import annotations

from . import caching_allocator
from .units import GiB

GiB_PER_UNIT = GiB


def reserved_peak(events) -> tuple[float, float]:
    """(peak allocated, peak reserved) per unit of size over events ("alloc" | "free", tensor name, size)."""
    scaled = [(kind, name, round(size * GiB_PER_UNIT)) for kind, name, size in events]
    result = caching_allocator.replay(scaled)
    return result.peak_allocated_bytes / GiB_PER_UNIT, result.peak_reserved_bytes / GiB_PER_UNIT
