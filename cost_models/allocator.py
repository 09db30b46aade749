"""The CUDA caching allocator's reserved bytes for a sequence of large allocations.

PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp) serves a request from the smallest cached
free block that fits (best fit), splitting it, and otherwise reserves a new segment (cudaMalloc) of the
request's size; freed blocks stay cached, merge only with free neighbours inside their own segment, and
segments are never merged nor returned before `empty_cache()`. So a tensor freed before a larger one is
requested leaves its segment reserved and unusable for it: reserved exceeds allocated by that segment.

The loss over the vocabulary is where this matters: tensors of V elements per token, gigabytes each, whose
sizes alternate between the compute dtype and fp32 (cost_models/activations.py, loss_events). Everything
else in a step is small against them. Sizes here are in any unit (bytes per logit element): the sequence
scales with tokens x vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Segment:
    size: float
    used: dict = field(default_factory=dict)   # tensor name -> its size

    @property
    def free(self) -> float:  # one free run: the requests here are freed whole, so segments never hold holes
        return self.size - sum(self.used.values())


def reserved_peak(events) -> tuple[float, float]:
    """(peak allocated, peak reserved) over events ("alloc" | "free", tensor name, size), best fit.

    A free block is reused only by a request it holds whole; segments are kept to the end (reserved never
    falls). Simplification: a segment serves a request only from its single free tail, which is exact for
    sequences where each segment's tensors are freed in the reverse of their allocation or all together
    (the loss sequences here allocate at most two tensors into one segment).
    """
    segments: list[_Segment] = []
    where: dict[str, _Segment] = {}
    allocated = peak_allocated = 0.0
    for kind, name, size in events:
        if kind == "alloc":
            fits = [s for s in segments if s.free >= size]
            segment = min(fits, key=lambda s: s.free) if fits else None
            if segment is None:
                segment = _Segment(size)
                segments.append(segment)
            segment.used[name] = size
            where[name] = segment
            allocated += size
            peak_allocated = max(peak_allocated, allocated)
        elif kind == "free":
            allocated -= where.pop(name).used.pop(name)
        else:
            raise ValueError(f"event kind {kind!r}; choose alloc or free")
    return peak_allocated, sum(s.size for s in segments)
