"""The cyclic garbage collector paused while a search runs.

A search allocates some 10^5 container objects (configurations, estimates, the memo's keys and entries:
planner/search/memo.py) and keeps most of them until it returns, none in a reference cycle: around each of
benchmarks/search_speed.py's four searches CPython's collector (counted with gc.callbacks) found nothing
to free in any pass, and in the DeepSeek-V2-Lite one (64 GPUs) its passes - ~300 young, ~27 middle and 2 full ones,
each full one walking the live memo - took ~250 ms of ~1.6 s CPU at 7eede2d, ~150 ms of ~1.1 s after the memos of
c096ad2..37eba37. Reference counting frees everything else as before; anything cyclic made meanwhile is collected at
the first pass after the search."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    """gc disabled inside, and enabled again after where it was enabled before (a caller's gc.disable() stands)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
