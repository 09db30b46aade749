"""Calibration runs of pipelines (issue 18): which sequences a pipeline rank feeds, the per-pipeline-rank peaks a
result holds (calibration.store, validated on read), and the pipelines the runner refuses in one line."""

from __future__ import annotations

import pytest

from cost_models.specs import FsdpConfig


def test_a_models_pipeline_ranks_feed_the_same_sequences():
    from calibration.runner import data_parallel_rank

    # 8 ranks, torchtitan's [pp, dp_replicate, dp_shard, cp, tp]: pp outermost, so ranks r and r + 4 are one
    # data-parallel rank's two stages; with tp 2 inside, ranks (0, 1) and (4, 5) share one copy's sequences
    assert [data_parallel_rank(r, FsdpConfig(pp=2, grad_accum=2), 8) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [data_parallel_rank(r, FsdpConfig(pp=2, tp=2, grad_accum=2), 8) for r in range(8)] == \
        [0, 0, 1, 1, 0, 0, 1, 1]
    assert [data_parallel_rank(r, FsdpConfig(pp=4, grad_accum=4), 4) for r in range(4)] == [0, 0, 0, 0]


def _measured(**extra) -> dict:
    return {"step_s": 1.0, "step_s_all": [1.0], "tokens_per_s_per_gpu": 10.0, "memory_source": "memtrack", **extra}


def test_per_pipeline_rank_peaks_are_validated_on_read():
    from pydantic import ValidationError

    from calibration.store import Measured

    ranks = [{"pp_rank": 0, "stages": [0, 2], "peak_allocated_bytes": 300},
             {"pp_rank": 1, "stages": [1, 3], "peak_allocated_bytes": 500}]
    m = Measured.model_validate(_measured(peak_allocated_bytes=500, pipeline_ranks=ranks))
    assert [r.stages for r in m.pipeline_ranks] == [[0, 2], [1, 3]]
    assert Measured.model_validate(_measured(peak_allocated_bytes=7)).pipeline_ranks == []  # pp 1: none
    with pytest.raises(ValidationError, match="largest pipeline rank"):
        Measured.model_validate(_measured(peak_allocated_bytes=300, pipeline_ranks=ranks))
    with pytest.raises(ValidationError, match="in order"):
        Measured.model_validate(_measured(peak_allocated_bytes=500, pipeline_ranks=ranks[::-1]))


@pytest.mark.parametrize("config, source, emulate, field, words", [
    (FsdpConfig(pp=2, grad_accum=4), "reference", None, "pp", "base_model_pp_plan"),
    (FsdpConfig(pp=2, grad_accum=4), "factory", None, "pp", "base_model_pp_plan"),
    (FsdpConfig(pp=2, tp=2, grad_accum=4), "hf", None, "pp", "tp = cp = ep = 1"),
    (FsdpConfig(pp=2, grad_accum=4, precision="fp16"), "hf", None, "precision", "loss scaling"),
    (FsdpConfig(pp=2, grad_accum=4), "hf", 4, "emulate_world_size", "fake group"),
])
def test_pipelines_the_runner_cannot_run_are_one_line(config, source, emulate, field, words):
    from planner.calibrating.pipelines import pipeline_refusal
    from planner.calibrating.request import CalibrationRequest, Target
    from planner.models import load_preset

    spec = load_preset("llama3.2-1b")
    target = Target(name="llama3.2-1b", spec=spec, run_spec=spec, source=source)
    request = CalibrationRequest(out_dir="x", gpus=1 if emulate else 4, model="llama3.2-1b", emulate_world_size=emulate)
    got_field, reason = pipeline_refusal(request, target, config)
    assert got_field == field and words in reason and "\n" not in reason
    assert pipeline_refusal(request, target, FsdpConfig()) is None
    assert pipeline_refusal(CalibrationRequest(out_dir="x", gpus=4, model="m"), Target("m", spec, spec, "hf"),
                            FsdpConfig(pp=2, grad_accum=4)) is None
