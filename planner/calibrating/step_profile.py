"""`fsdp-plan calibrate --torch-profile`: where each run's torch.profiler trace lies (beside its result.json) and
the seconds of the step's phases read back from it (no torch needed: the trace is JSON).

calibration/profile_step.py marks the phases with record_function ranges "calibration.forward", ".backward" and
".optimizer"; the profiler writes them as X events (cat "user_annotation" on the host; "gpu_user_annotation" for
the GPU's view of the same range, which is what a CUDA step's time is). A phase's seconds are its ranges' sum over
the step's micro-steps.
"""

from __future__ import annotations

import json
from pathlib import Path

TORCH_PROFILE_FILE = "torch_profile.json"
PHASES = ("forward", "backward", "optimizer")
_PREFIX = "calibration."


def trace_path(run_dir: Path) -> Path:
    return run_dir / TORCH_PROFILE_FILE


def phase_seconds(trace: dict) -> dict[str, float]:
    """{"forward": s, "backward": s, "optimizer": s} of a torch.profiler Chrome trace; the GPU's ranges when the
    trace has them, else the host's. Empty when the trace holds no marked phase."""
    sums: dict[str, dict[str, float]] = {"gpu_user_annotation": {}, "user_annotation": {}}
    for e in trace.get("traceEvents", []):
        name, cat = e.get("name", ""), e.get("cat")
        if e.get("ph") == "X" and cat in sums and name.startswith(_PREFIX) and name[len(_PREFIX):] in PHASES:
            key = name[len(_PREFIX):]
            sums[cat][key] = sums[cat].get(key, 0.0) + e["dur"] / 1e6  # trace times: microseconds
    return sums["gpu_user_annotation"] or sums["user_annotation"]


def read_phase_seconds(path: Path) -> dict[str, float]:
    """phase_seconds of the trace at `path`; empty when there is none or it does not parse."""
    try:
        return phase_seconds(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return {}
