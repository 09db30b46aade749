"""One calibration step under torch.profiler (`fsdp-plan calibrate --torch-profile`): its Chrome trace saved beside
the run's result (planner/calibrating/step_profile.py reads its phases back for the report).

The runner marks the step's phases with `phase(name)`: a record_function range ("calibration.forward", ...) while
a profiler runs, nothing otherwise, so the timed steps carry no marks.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PREFIX = "calibration."  # planner/calibrating/step_profile.py reads the ranges by it


def phase(name: str):
    """A named range of the step in the profiler's trace (no cost while no profiler runs)."""
    return record_function(PREFIX + name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def profile_step(run_step, path: str, device: torch.device, record: bool) -> None:
    """Run one step; with record (one rank does), under torch.profiler, its Chrome trace written to `path`. Other
    ranks run the step plain: their collectives pair with the recording rank's."""
    if not record:
        run_step()
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(path)
