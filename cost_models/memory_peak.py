"""The memory ledger's moments (memory.py) to its estimate: the moment that peaks, against the optimizer step's
states, the largest forward moment, and the reserved peak (the profile's fragmentation over the larger of the peak
and the loss's segments, plus the memory outside the allocator)."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

from .memory_types import MemoryBreakdown, MemoryEstimate

# A moment's MemoryBreakdown, cheaper to make (a ledger weighs ~7 moments to keep one): its fields in its order, so a
# moment's sum() is the breakdown's total_bytes and MemoryBreakdown(*moment) the breakdown
Moment = namedtuple("Moment", [f.name for f in dataclasses.fields(MemoryBreakdown)],
                    defaults=(0,) * len(dataclasses.fields(MemoryBreakdown)))


def peak_estimate(moments: dict, step: MemoryBreakdown, loss_reserved_extra: int, outside: tuple, profile, cluster,
                  cpu_per_rank: int, notes: tuple) -> MemoryEstimate:
    """moments: the ledger's, by label ("loss backward" among them); step: the optimizer step's breakdown;
    loss_reserved_extra: what the allocator strands above the loss's peak; outside: the memory outside the allocator;
    cpu_per_rank: the model states offloaded to the CPU."""
    totals = {k: sum(m) for k, m in moments.items()}  # each moment's total_bytes
    peak_moment = max(totals, key=totals.__getitem__)  # the first largest
    backward = MemoryBreakdown(*moments[peak_moment])
    step_total = step.total_bytes
    if step_total > totals[peak_moment]:
        breakdown, phase, peak_moment, peak_allocated = step, "optimizer_step", "optimizer step", step_total
    else:
        breakdown, phase = backward, "forward" if peak_moment.startswith("forward") else "backward"
        peak_allocated = totals[peak_moment]
    # The loss's segments stay reserved once made (allocator.py): with its allocator-stranded bytes the loss
    # backward can set the reserved peak even where another moment allocates more.
    loss_reserved = totals["loss backward"] + loss_reserved_extra
    peak_reserved = profile.reserved_bytes(max(peak_allocated, loss_reserved), sum(t.bytes for t in outside))
    forwards = [m for k, m in moments.items() if k.startswith("forward")]
    return MemoryEstimate(breakdown=breakdown, peak_phase=phase,
        phases={"backward": backward, "optimizer_step": step,
                **({"forward": MemoryBreakdown(*max(forwards, key=sum))} if forwards else {})},  # the largest
        peak_allocated_bytes=peak_allocated, peak_reserved_bytes=peak_reserved,
        cpu_bytes_per_node=cpu_per_rank * cluster.gpus_per_node, cpu_ram_capacity_bytes=cluster.cpu_ram_bytes_per_node,
        notes=notes, peak_moment=peak_moment, outside_allocator=outside)
