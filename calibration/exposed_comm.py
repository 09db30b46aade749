"""Exposed communication of one calibration step (calibration/runner.py step 4, GPU): the time the CUDA kernel
timeline covers with NCCL kernels and no other kernel."""

from __future__ import annotations

import math
import sys

import torch


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def exposed_time(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Length of the time covered by communication and by no compute kernel: |C| - |C ∩ K|."""
    both = union_length(comm) + union_length(compute) - union_length(comm + compute)
    return union_length(comm) - both


def _is_comm_kernel(name: str) -> bool:
    return name.lower().startswith("nccl")


def profiled_exposed_comm_s(run_step) -> float | None:
    """Exposed communication of one step from the CUDA kernel timeline (rank's own view)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_step()
            torch.cuda.synchronize()
        comm, compute = [], []
        for event in prof.events():
            if getattr(event, "device_type", None) is None or "CUDA" not in str(event.device_type):
                continue
            interval = (event.time_range.start, event.time_range.end)
            (comm if _is_comm_kernel(event.name) else compute).append(interval)
        if not comm:
            return 0.0
        return exposed_time(comm, compute) / 1e6  # profiler times are microseconds
    except Exception as exc:  # the profiler is best effort: never fail a run over it
        print(f"calibration: exposed communication not measured ({exc})", file=sys.stderr)
        return None
