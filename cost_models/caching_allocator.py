"""Reserved bytes from a replay of PyTorch's CUDA caching allocator over an ordered allocation sequence.

    result = replay([("alloc", "a", 3_000_000), ("alloc", "b", 700, "side"), ("free", "a")])
    result.peak_allocated_bytes, result.peak_reserved_bytes, result.segments_at_peak

The rules are those of c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.13; the constants live in
c10/core/AllocatorConfig.h, shipped with torch under torch/include):
- round_size: every request is rounded up to a multiple of kMinBlockSize (512 B);
- get_pool: requests <= kSmallSize (1 MiB) come from the small pool, others from the large pool; each pool
  is per stream (blocks carry the stream they were made on and get_free_block only looks at that stream's);
- get_free_block: best fit, the smallest cached free block that holds the request, ties by address
  (BlockComparatorSize orders by stream, size, address). With max_split_size set, a request below it never
  takes a block at or above it, and a request at or above it takes only a block smaller than request +
  kLargeBuffer;
- get_allocation_size / alloc_block: without a fitting block, a new segment (cudaMalloc) of kSmallBuffer
  (2 MiB) for a small request, kLargeBuffer (20 MiB) for a large one below kMinLargeAlloc (10 MiB), else the
  request rounded up to kRoundLarge (2 MiB);
- should_split: the block is split and the remainder cached when it is >= kMinBlockSize (small pool) or
  > kSmallSize and the request is below max_split_size (large pool); an unsplit block is allocated whole
  (torch's allocated_bytes counts block sizes);
- free_block / try_merge_blocks: a freed block merges with its free neighbours, which are only ever blocks
  of the same segment; segments are never merged, and never released before empty_cache() (not modelled),
  so reserved never falls.
- expandable_segments (ExpandableSegment): one segment per stream and pool, a virtual range mapped page by
  page, the page kSmallBuffer (2 MiB) in the small pool and kLargeBuffer (20 MiB) in the large one
  (find_expandable_block's segment_size). A request no cached block holds maps just enough pages behind the
  free block at the segment's end; splits keep any remainder >= kMinBlockSize. Reserved = mapped pages.

Not modelled: garbage_collection_threshold (it acts only under set_per_process_memory_fraction, releasing
whole cached segments, oldest first, once reserved passes threshold x the allowed memory:
garbage_collect_cached_blocks), the release of cached segments on an OOM (release_cached_blocks),
roundup_power2_divisions, record_stream delays and CUDA graph pools. New segments take increasing addresses
(cudaMalloc's are arbitrary): the address only breaks ties between free blocks of one size.
"""

from __future__ import annotations

import re
from bisect import bisect_left, insort
from dataclasses import dataclass
from itertools import islice

from .units import MiB

K_MIN_BLOCK_BYTES = 512                   # kMinBlockSize
K_SMALL_SIZE_BYTES = 1 * MiB              # kSmallSize: largest small-pool request
K_SMALL_BUFFER_BYTES = 2 * MiB            # kSmallBuffer: small-pool segment (and expandable page)
K_MIN_LARGE_ALLOC_BYTES = 10 * MiB        # kMinLargeAlloc: large requests below it share 20 MiB segments
K_ROUND_LARGE_BYTES = 2 * MiB             # kRoundLarge
K_LARGE_BUFFER_BYTES = 20 * MiB           # kLargeBuffer


@dataclass(frozen=True)
class AllocatorSettings:
    """PYTORCH_CUDA_ALLOC_CONF's knobs that change reserved bytes (None: unset, torch's default SIZE_MAX)."""

    max_split_size_bytes: int | None = None
    expandable_segments: bool = False

    @classmethod
    def parse(cls, conf: str) -> "AllocatorSettings":
        """From a PYTORCH_CUDA_ALLOC_CONF string, e.g. "max_split_size_mb:128,expandable_segments:True"."""
        known = ("max_split_size_mb", "expandable_segments", "garbage_collection_threshold", "roundup_power2_divisions",
                 "max_non_split_rounding_mb", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                 "pinned_num_register_threads", "pinned_use_background_threads")
        # key:value pairs; roundup_power2_divisions' [64:8,...] list yields no key (its keys are numbers)
        items = dict(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*:\s*([^,\]]*)", conf))
        for key in items:
            if key not in known:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF key {key!r}; choose one of {', '.join(known)}")
        values = {}
        if "max_split_size_mb" in items:
            mb = items["max_split_size_mb"].strip()
            # torch's parser (parseMaxSplitSize) refuses sizes up to kLargeBuffer
            if not mb.isdigit() or int(mb) * MiB <= K_LARGE_BUFFER_BYTES:
                raise ValueError(f"max_split_size_mb {mb!r}; choose a whole number of MiB more than "
                                 f"{K_LARGE_BUFFER_BYTES // MiB} (kLargeBuffer)")
            values["max_split_size_bytes"] = int(mb) * MiB
        if "expandable_segments" in items:
            values["expandable_segments"] = items["expandable_segments"].strip().lower() == "true"
        return cls(**values)

    def conf(self) -> str:
        """As PYTORCH_CUDA_ALLOC_CONF writes it ("" for the defaults): the knobs the replay follows."""
        items = ([f"max_split_size_mb:{self.max_split_size_bytes // MiB}"] if self.max_split_size_bytes else []) + (
            ["expandable_segments:True"] if self.expandable_segments else [])
        return ",".join(items)


def allocation_size(size_bytes: int) -> int:
    """get_allocation_size: the segment cudaMalloc'd for a rounded request no cached block holds."""
    if size_bytes <= K_SMALL_SIZE_BYTES:
        return K_SMALL_BUFFER_BYTES
    if size_bytes < K_MIN_LARGE_ALLOC_BYTES:
        return K_LARGE_BUFFER_BYTES
    return -(-size_bytes // K_ROUND_LARGE_BYTES) * K_ROUND_LARGE_BYTES


_ADDRESS_BITS = 100   # a free block's key: size << _ADDRESS_BITS | address, ordered as (size, address) while
#                       addresses (segment index << 50, + offset) stay below 2**100


class _Block:
    """A block of a segment, linked to its neighbours in address order (c10's Block prev / next)."""

    __slots__ = ("segment", "offset", "size", "free", "key", "prev", "next")

    def __init__(self, segment: "_Segment", offset: int, size: int, prev: "_Block | None" = None,
                 next: "_Block | None" = None):
        self.segment, self.offset, self.size, self.free, self.prev, self.next = segment, offset, size, True, prev, next
        self.key = 0   # size << _ADDRESS_BITS | address, set while listed among its pool's free blocks

    def split(self, size: int) -> "_Block":
        """Keep `size` bytes; the rest becomes a new free block behind it (returned)."""
        rest = _Block(self.segment, self.offset + size, self.size - size, self, self.next)
        if self.next is None:
            self.segment.last = rest
        else:
            self.next.prev = rest
        self.next, self.size = rest, size
        return rest

    def absorb_next(self) -> None:
        """Merge the next block into this one (try_merge_blocks)."""
        gone = self.next
        self.size += gone.size
        self.next = gone.next
        if gone.next is None:
            self.segment.last = self
        else:
            gone.next.prev = self


class _Pool:
    """One stream's small or large pool: its free blocks' keys sorted (BlockComparatorSize's order, so best fit is a
    bisection; a linear scan took 60% of a 405B pipeline rank's replay), and each key's block."""

    __slots__ = ("keys", "blocks")

    def __init__(self):
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}

    def add(self, block: _Block) -> None:
        block.key = key = block.size << _ADDRESS_BITS | (block.segment.address + block.offset)
        insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        del self.keys[bisect_left(self.keys, block.key)]
        del self.blocks[block.key]


class _Segment:
    def __init__(self, stream, small: bool, address: int, size: int, pool: _Pool):   # address: creation order << 50
        self.stream, self.small, self.address, self.size, self.pool = stream, small, address, size, pool
        self.first = self.last = _Block(self, 0, size) if size else None   # its blocks cover [0, size)

    def blocks(self):
        block = self.first
        while block is not None:
            yield block
            block = block.next


@dataclass(frozen=True)
class SegmentState:
    """One segment when reserved reached its peak: its stream, pool, size and the bytes allocated in it."""

    stream: object
    pool: str                 # "small" or "large"
    size_bytes: int
    allocated_bytes: int
    largest_free_bytes: int


@dataclass(frozen=True)
class ReplayResult:
    peak_allocated_bytes: int         # torch.cuda.max_memory_allocated: allocated block sizes
    peak_requested_bytes: int         # the requests themselves (the tensors' bytes)
    peak_reserved_bytes: int          # torch.cuda.max_memory_reserved: segments (mapped pages)
    segments_at_peak: tuple[SegmentState, ...]
    reserved_at_cuts: tuple[int, ...] = ()  # reserved after the first n events, for each n of replay's `cuts`


def pool_totals(segments) -> dict[tuple, tuple[int, int, int]]:
    """(stream, pool) -> (segments, reserved bytes, allocated bytes) over SegmentStates."""
    totals: dict[tuple, tuple[int, int, int]] = {}
    for s in segments:
        n, size, used = totals.get((s.stream, s.pool), (0, 0, 0))
        totals[(s.stream, s.pool)] = (n + 1, size + s.size_bytes, used + s.allocated_bytes)
    return totals


def pool_words(segments) -> list[str]:
    """Each (stream, pool)'s segments in words: count, reserved / allocated MiB, the largest free block (the
    largest request it could take without a new segment)."""
    largest: dict[tuple, int] = {}
    for s in segments:
        largest[(s.stream, s.pool)] = max(largest.get((s.stream, s.pool), 0), s.largest_free_bytes)
    return [f"{'default' if stream == 0 else stream} stream {pool} pool: {n} segment{'s' * (n != 1)}, "
            f"{size / MiB:,.0f} MiB reserved / {used / MiB:,.0f} allocated, largest free block "
            f"{largest[(stream, pool)] / MiB:,.1f} MiB" for (stream, pool), (n, size, used) in pool_totals(segments).items()]


class CachingAllocator:
    """The allocator's state: malloc(key, size, stream) and free(key); statistics in bytes."""

    def __init__(self, settings: AllocatorSettings = AllocatorSettings(), snapshots: bool = True):
        self.settings, self.snapshots = settings, snapshots   # snapshots: keep segments_at_peak
        self._max_split, self._expandable_segments = settings.max_split_size_bytes, settings.expandable_segments
        self.segments: list[_Segment] = []
        self._pools: dict[object, tuple[_Pool, _Pool]] = {}   # stream -> its (large, small): get_pool's pools
        self._expandable: dict[tuple, _Segment] = {}   # (stream, small) -> its one segment
        self._live: dict[object, tuple[_Block, int]] = {}
        self.allocated_bytes = self.requested_bytes = self.reserved_bytes = 0
        self.peak_allocated_bytes = self.peak_requested_bytes = 0
        self.segments_at_peak: tuple[SegmentState, ...] = ()

    def malloc(self, key, size_bytes: int, stream=0) -> None:
        live = self._live
        if key in live:
            raise ValueError(f"allocation {key!r} is already live; free it first")
        if size_bytes <= 0:   # torch allocates nothing for an empty tensor
            return
        size = (size_bytes + K_MIN_BLOCK_BYTES - 1) & -K_MIN_BLOCK_BYTES   # round_size (size_bytes >= 1)
        small = size <= K_SMALL_SIZE_BYTES
        pools = self._pools.get(stream) or self._pools.setdefault(stream, (_Pool(), _Pool()))
        pool, limit, reserved_before = pools[small], self._max_split, self.reserved_bytes
        # best fit: the smallest free block that holds `size`, ties by address. max_split_size's rules bound the
        # block's size from above, so if the smallest such block breaks them every larger one does
        keys = pool.keys
        i = bisect_left(keys, size << _ADDRESS_BITS)
        if i < len(keys) and (limit is None or keys[i] >> _ADDRESS_BITS < (
                limit if size < limit else size + K_LARGE_BUFFER_BYTES)):
            block = pool.blocks.pop(keys.pop(i))
        else:
            block = self._new_block(stream, small, size, pool)
        remaining = block.size - size
        if (remaining >= K_MIN_BLOCK_BYTES if small or self._expandable_segments   # should_split
                else remaining > K_SMALL_SIZE_BYTES and (limit is None or size < limit)):
            pool.add(block.split(size))
        block.free = False
        live[key] = (block, size_bytes)
        allocated = self.allocated_bytes = self.allocated_bytes + block.size
        requested = self.requested_bytes = self.requested_bytes + size_bytes
        if allocated > self.peak_allocated_bytes:
            self.peak_allocated_bytes = allocated
        if requested > self.peak_requested_bytes:
            self.peak_requested_bytes = requested
        if self.snapshots and self.reserved_bytes > reserved_before:   # reserved only grows: its peak so far
            self.segments_at_peak = self._states()

    def free(self, key) -> None:
        entry = self._live.pop(key, None)
        if entry is None:
            return   # an empty tensor's free, or a storage made before recording began
        block, size_bytes = entry
        self.allocated_bytes -= block.size
        self.requested_bytes -= size_bytes
        block.free = True
        pool = block.segment.pool
        after, before = block.next, block.prev
        if after is not None and after.free:          # try_merge_blocks with the next block
            pool.remove(after)
            block.absorb_next()
        if before is not None and before.free:        # and with the previous one
            pool.remove(before)
            before.absorb_next()
            block = before
        pool.add(block)

    def _new_block(self, stream, small: bool, size: int, pool: _Pool) -> _Block:
        if self._expandable_segments:
            return self._expand(stream, small, size, pool)
        seg = self._add_segment(stream, small, allocation_size(size), pool)
        self.reserved_bytes += seg.size
        return seg.first

    def _add_segment(self, stream, small: bool, size: int, pool: _Pool) -> _Segment:
        seg = _Segment(stream, small, len(self.segments) << 50, size, pool)
        self.segments.append(seg)
        return seg

    def _expand(self, stream, small: bool, size: int, pool: _Pool) -> _Block:
        """Map pages behind the segment's free tail until it holds `size` (find_expandable_block, map_block). A tail
        that holds it already (best fit refused it under max_split_size) is taken as it is, nothing mapped:
        find_expandable_block returns the free block before the unmapped range, and try_allocate_expandable_block
        maps only while the candidate is short of the request."""
        page = K_SMALL_BUFFER_BYTES if small else K_LARGE_BUFFER_BYTES
        seg = self._expandable.get((stream, small))
        if seg is None:
            seg = self._expandable[(stream, small)] = self._add_segment(stream, small, 0, pool)
        tail = seg.last if seg.last is not None and seg.last.free else None
        if tail is not None:
            pool.remove(tail)
        have = tail.size if tail else 0
        grow = max(0, -(-(size - have) // page) * page)
        seg.size += grow
        self.reserved_bytes += grow
        if tail is None:
            tail = _Block(seg, seg.size - grow, 0, seg.last)
            if seg.last is None:
                seg.first = tail
            else:
                seg.last.next = tail
            seg.last = tail
        tail.size += grow
        return tail

    def _states(self) -> tuple[SegmentState, ...]:
        return tuple(SegmentState(s.stream, "small" if s.small else "large", s.size,
                                  sum(b.size for b in s.blocks() if not b.free),
                                  max((b.size for b in s.blocks() if b.free), default=0)) for s in self.segments)


def replay(events, settings: AllocatorSettings = AllocatorSettings(), snapshots: bool = True,
           cuts: tuple[int, ...] = ()) -> ReplayResult:
    """Replay ordered events: ("alloc", key, size_bytes[, stream]) and ("free", key, ...) (extra fields of a
    free are ignored). The stream defaults to 0, the default stream. snapshots False: segments_at_peak left
    empty (its copies at each new segment took half of a 405B pipeline rank's replay). cuts: ascending event
    counts after which to read the reserved bytes (what a replay of that prefix alone ends with: the first of two
    steps, say)."""
    allocator = CachingAllocator(settings, snapshots)
    at_cuts, done, remaining = [], 0, iter(events)
    for n in cuts:
        _feed(allocator, islice(remaining, n - done))
        at_cuts.append(allocator.reserved_bytes)
        done = n
    _feed(allocator, remaining)
    return ReplayResult(allocator.peak_allocated_bytes, allocator.peak_requested_bytes, allocator.reserved_bytes,
                        allocator.segments_at_peak, tuple(at_cuts))


def _feed(allocator: CachingAllocator, events) -> None:
    malloc, free = allocator.malloc, allocator.free
    for event in events:
        kind = event[0]
        if kind == "alloc":
            malloc(event[1], event[2], event[3] if len(event) > 3 else 0)
        elif kind == "free":
            free(event[1])
        else:
            raise ValueError(f"event kind {kind!r}; choose alloc or free")
