"""`fsdp-plan calibrate --format json`: the measured runs, the profile fit and the re-ranking."""

from __future__ import annotations


from pydantic import Field

from calibration.store import RunRecord
from planner.schemas.common import Config, _Out


class CalibrationRun(RunRecord):
    """A results.jsonl record (calibration.store.RunRecord) with the fitted prediction beside it."""

    fitted_step_s: float | None = Field(description="s, predicted with the fitted profile; null without a fit")
    extrapolated_step_s: float | None = Field(description="s, --layers: at the full depth")
    extrapolated_peak_bytes: int | None = Field(description="bytes per rank, --layers: at the full depth")


class FitSummary(_Out):
    fitted: list[str] = Field(description="the profile coefficients fitted")
    step_error_before: float = Field(description="RMS relative step-time error with the starting profile")
    step_error_after: float = Field(description="RMS relative step-time error with the fitted profile")
    notes: list[str]
    identified: dict[str, float] = Field(description="coefficient -> relative standard error")
    not_identified: list[str] = Field(description="fitted, but the runs barely moved them")


class CalibrateOutput(_Out):
    """`fsdp-plan calibrate --format json`: the runs, the fit and the re-ranking. Multi-node without --launch
    runs nothing: `runs` is empty and `commands` holds what to run on each node."""

    model: str
    runs: list[CalibrationRun] = Field(description="every run in results.jsonl of this model and cluster")
    new_runs: list[str] = Field(description="run_id of the runs made by this invocation")
    skipped_runs: list[str] = Field(description="run_id of the runs --resume found in results.jsonl")
    fit: FitSummary | None
    profile_path: str | None
    ranked: list[str] = Field(description="run_id of the measured runs, by measured tokens/s per GPU")
    best: Config | None = Field(description="the fastest measured configuration")
    notes: list[str]
    commands: list[str] = Field(description="multi-node without --launch: the commands to run")
