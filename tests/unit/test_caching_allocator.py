"""Hand-worked sequences through the caching allocator model (cost_models/caching_allocator.py): each expected
figure follows from the c10/cuda/CUDACachingAllocator.cpp rules cited there, arithmetic in the comments.
Exact: the rules are integer arithmetic, so the tolerance is zero bytes.

No CPU truth exists beside these: torch's CPU allocator does not cache, and torch ships no simulation of the CUDA
one (torch/cuda/_memory_viz.py renders recorded snapshots; its _profile_to_snapshot files a profile's
allocations into one segment per device; MemoryViz.js replays the segment_alloc events a GPU recorded).
Where a GPU is lent, torch.cuda.memory._snapshot() of a real step is the check (issue 27)."""

import pytest

from cost_models import allocator
from cost_models.caching_allocator import AllocatorSettings, pool_totals, replay
from cost_models.units import KiB, MiB


def _peaks(events, **settings):
    r = replay(events, AllocatorSettings(**settings))
    return r.peak_allocated_bytes, r.peak_reserved_bytes


def test_rounding_to_512_bytes_in_a_2_mib_small_segment():
    # round_size: 1 B -> 512 B, 1000 B -> 1024 B; both small (<= 1 MiB): one kSmallBuffer segment of 2 MiB
    assert _peaks([("alloc", "a", 1), ("alloc", "b", 1000)]) == (512 + 1024, 2 * MiB)
    r = replay([("alloc", "a", 1), ("alloc", "b", 1000)])
    assert r.peak_requested_bytes == 1001


def test_small_and_large_pools_split_at_1_mib():
    # 1 MiB exactly is small (<= kSmallSize): a 2 MiB segment. 1 MiB + 1 B rounds to 1 MiB + 512 B, large,
    # below kMinLargeAlloc: a 20 MiB segment of its own (the small segment's 1 MiB free block is another pool)
    assert _peaks([("alloc", "a", MiB), ("alloc", "b", MiB + 1)]) == (2 * MiB + 512, 22 * MiB)


def test_20_mib_segment_is_shared_by_large_requests_below_10_mib():
    # 6 MiB: a 20 MiB segment, split (14 MiB remainder > 1 MiB); the next 6 MiB takes the 14 MiB block (best
    # fit), leaving 8; the third leaves 2 MiB (> 1 MiB: split). The fourth finds only 2 MiB: a new 20 MiB segment.
    six = [("alloc", i, 6 * MiB) for i in range(4)]
    assert _peaks(six[:3]) == (18 * MiB, 20 * MiB)
    assert _peaks(six) == (24 * MiB, 40 * MiB)


def test_large_requests_round_to_2_mib_segments_and_small_remainders_stay_unsplit():
    # 11 MiB >= kMinLargeAlloc: a segment of 12 MiB (kRoundLarge); the 1 MiB remainder is not > kSmallSize,
    # so the block is allocated whole: torch's allocated_bytes counts 12 MiB
    assert _peaks([("alloc", "a", 11 * MiB)]) == (12 * MiB, 12 * MiB)
    # 9.5 MiB: 20 MiB segment, 10.5 MiB remainder split off; 10 MiB then takes that block and its 0.5 MiB
    # remainder stays in it: allocated 9.5 + 10.5 = 20 MiB, reserved 20 MiB
    assert _peaks([("alloc", "a", 9 * MiB + 512 * KiB), ("alloc", "b", 10 * MiB)]) == (20 * MiB, 20 * MiB)


def test_free_blocks_merge_inside_a_segment_but_never_across_segments():
    # two 12 MiB segments, both freed: two free 12 MiB blocks in different segments. 20 MiB fits neither: a new
    # 20 MiB segment, reserved 12 + 12 + 20 = 44 MiB
    across = [("alloc", "a", 12 * MiB), ("alloc", "b", 12 * MiB), ("free", "a"), ("free", "b"),
              ("alloc", "c", 20 * MiB)]
    assert _peaks(across) == (24 * MiB, 44 * MiB)
    # 4 + 4 MiB inside one 20 MiB segment (remainder 12 MiB): freed, the three blocks merge back to 20 MiB,
    # which holds 18 MiB (split, 2 MiB > 1 MiB left): reserved stays 20 MiB
    inside = [("alloc", "a", 4 * MiB), ("alloc", "b", 4 * MiB), ("free", "a"), ("free", "b"),
              ("alloc", "c", 18 * MiB)]
    assert _peaks(inside) == (18 * MiB, 20 * MiB)


def test_max_split_size_keeps_oversize_blocks_for_oversize_requests():
    cached_40 = [("alloc", "a", 40 * MiB), ("free", "a")]
    # default (no limit): 12 MiB takes the cached 40 MiB block, split: reserved 40 MiB
    assert _peaks(cached_40 + [("alloc", "b", 12 * MiB)]) == (40 * MiB, 40 * MiB)
    # max_split_size_mb:32: 12 < 32 may not take a block >= 32 MiB: a new 12 MiB segment, 40 + 12 = 52 MiB
    limit = {"max_split_size_bytes": 32 * MiB}
    assert _peaks(cached_40 + [("alloc", "b", 12 * MiB)], **limit) == (40 * MiB, 52 * MiB)
    # 36 MiB (>= 32) takes the 40 MiB block (40 < 36 + kLargeBuffer 20), unsplit: allocated 40 MiB
    assert _peaks(cached_40 + [("alloc", "b", 36 * MiB)], **limit) == (40 * MiB, 40 * MiB)
    # a cached 64 MiB block is too big for 40 MiB (64 >= 40 + 20): a new 40 MiB segment, 64 + 40 = 104 MiB
    cached_64 = [("alloc", "a", 64 * MiB), ("free", "a"), ("alloc", "b", 40 * MiB)]
    assert _peaks(cached_64, **limit) == (64 * MiB, 104 * MiB)


def test_expandable_segments_grow_one_segment_by_pages():
    # growing requests, each freed before the next: separate segments hold 12 + 14 + 16 = 42 MiB
    growing = [("alloc", "a", 12 * MiB), ("free", "a"), ("alloc", "b", 14 * MiB), ("free", "b"),
               ("alloc", "c", 16 * MiB)]
    assert _peaks(growing) == (16 * MiB, 42 * MiB)
    # expandable: one large-pool segment mapped in 20 MiB pages (kLargeBuffer): 12 MiB maps one page; freed,
    # the page is one free 20 MiB block holding 14 and then 16 MiB: reserved 20 MiB
    assert _peaks(growing, expandable_segments=True) == (16 * MiB, 20 * MiB)
    # 12 + 12 MiB live: the second finds the 8 MiB free tail and maps one more page, 40 MiB; 14 MiB after freeing
    # the first: the 12 MiB hole is too small, the 16 MiB tail holds it (2 MiB split off): still 40 MiB
    holes = [("alloc", "a", 12 * MiB), ("alloc", "b", 12 * MiB), ("free", "a"), ("alloc", "c", 14 * MiB)]
    assert _peaks(holes, expandable_segments=True) == (26 * MiB, 40 * MiB)
    # small pool pages are 2 MiB (kSmallBuffer): four 600 KiB requests (2400 KiB) map two pages, 4 MiB
    small = [("alloc", i, 600 * KiB) for i in range(4)]
    assert _peaks(small, expandable_segments=True) == (2400 * KiB, 4 * MiB)


def test_an_expandable_tail_refused_by_max_split_is_taken_without_mapping():
    # expandable + max_split_size_mb:40: 100 MiB maps five 20 MiB pages; freed, the 100 MiB tail is oversize for a
    # 2 MiB request (get_free_block: a request below max_split never takes a block at or above it), so it reaches
    # try_allocate_expandable_block, whose find_expandable_block returns that free tail (before the unmapped
    # range) and maps nothing while it holds the request: reserved stays 100 MiB (the model once shrank it to 20)
    events = [("alloc", "a", 100 * MiB), ("free", "a"), ("alloc", "b", 2 * MiB)]
    r = replay(events, AllocatorSettings(expandable_segments=True, max_split_size_bytes=40 * MiB))
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes) == (100 * MiB, 100 * MiB)


def test_streams_have_their_own_pools():
    # a 12 MiB block freed on stream 0 is cached for stream 0 only: the same request on "side" makes a segment
    reuse = [("alloc", "a", 12 * MiB, 0), ("free", "a"), ("alloc", "b", 12 * MiB, 0)]
    other = [("alloc", "a", 12 * MiB, 0), ("free", "a"), ("alloc", "b", 12 * MiB, "side")]
    assert _peaks(reuse) == (12 * MiB, 12 * MiB)
    assert _peaks(other) == (12 * MiB, 24 * MiB)
    segments = replay(other).segments_at_peak
    assert [(s.stream, s.size_bytes, s.allocated_bytes) for s in segments] == [(0, 12 * MiB, 0),
                                                                               ("side", 12 * MiB, 12 * MiB)]
    assert pool_totals(segments) == {(0, "large"): (1, 12 * MiB, 0), ("side", "large"): (1, 12 * MiB, 12 * MiB)}


def test_the_loss_sequence_is_one_replay():
    # eager bf16 (cost_models/loss_memory.loss_events), bytes per logit element: logits 2, fp32 copy 4,
    # log_softmax 4 (three segments), copy and logits freed; backward: NLL grad 4 reuses the copy's segment,
    # log_softmax grad 4 finds only the logits' 2: a fourth segment; the cast back (2) reuses the logits'.
    # Allocated peak 4 + 4 + 4 = 12, reserved 2 + 4 + 4 + 4 = 14: the stranded 2 is loss_memory's 2*V.
    from cost_models.loss_memory import loss_events

    forward, backward = loss_events(2, compiled=False)
    assert allocator.reserved_peak(forward + backward) == (12, 14)


def test_settings_from_alloc_conf():
    s = AllocatorSettings.parse("max_split_size_mb:128, expandable_segments:True,roundup_power2_divisions:[64:8,>:1]")
    assert s == AllocatorSettings(max_split_size_bytes=128 * MiB, expandable_segments=True)
    with pytest.raises(ValueError, match="max_split_size_mb"):
        AllocatorSettings.parse("max_split_mb:128")
    with pytest.raises(ValueError, match="more than 20"):   # torch refuses max_split_size_mb <= kLargeBuffer
        AllocatorSettings.parse("max_split_size_mb:20")


def test_a_cut_reads_what_the_prefix_alone_reserves():
    """One replay, read after its first event: a 2 MiB request takes a 20 MiB segment (the large pool's below 10 MiB),
    then a 30 MiB one its own 30 MiB segment; the cut equals the prefix's own replay."""
    events = [("alloc", "a", 2 * MiB), ("alloc", "b", 30 * MiB), ("free", "a"), ("free", "b")]
    both = replay(events, cuts=(1,))
    assert both.reserved_at_cuts == (20 * MiB,) == (replay(events[:1]).peak_reserved_bytes,)
    assert both.peak_reserved_bytes == 50 * MiB and replay(events).reserved_at_cuts == ()
