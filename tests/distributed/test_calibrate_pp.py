"""A real CPU calibration of a pipeline candidate (issue 18 item 4): `calibrate` with pp 2 (1F1B, 4 microbatches)
runs the runner's pipeline under torchrun (2 gloo ranks, pp 2 x dp 1; calibration/runner_pipeline.py: the split and
schedule of calibration/pipeline.py, FSDP2 per stage) on a tiny transformers Llama (a config.json: the runner cuts
transformers models into stages) for one timed step, and records each pipeline rank's peak.

Checks on what it left: the record is the configuration asked for, per pipeline rank peaks (stages [0] and [1],
the headline the largest, validated on read by calibration.store.Measured), each against the pipeline trace of
the same configuration (calibration/trace_pipeline.py) within one sent activation plus the real runs' jitter
(test_torchrun_pp.py says why; the runner does not track the input ids the trace counts, 2,112 B), a finite loss
near ln(256) and the tokens per GPU of a pipeline (a pipeline rank's tokens count once per copy: / pp).

The CPU is not probed (DIR/host.json written first, as test_calibrate_mesh.py does). About 40 s on 2 shared cores.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.distributed.pp_checks import HIDDEN, REAL_RUN_JITTER_BYTES, SEQ_LEN, TINY, traced
from tests.distributed.test_calibrate_mesh import host_probe

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

CONFIG = {"pp": 2, "pp_schedule": "1f1b", "grad_accum": 4, "precision": "fp32"}


@pytest.fixture(scope="session")  # once per run: xdist may interleave modules, which re-ran module fixtures
def pp_calibration(tmp_path_factory):
    from cost_models.specs import FsdpConfig
    from planner.calibrating import CalibrationRequest, calibrate

    out = tmp_path_factory.mktemp("calib-pp")
    (out / "host.json").write_text(json.dumps(host_probe()))
    model = out / "config.json"
    model.write_text(json.dumps({**TINY, "_name_or_path": "tiny-pp"}))
    report = calibrate(CalibrationRequest(
        out_dir=str(out), gpus=2, model=str(model), device="cpu", seq_len=SEQ_LEN, global_batch=4, steps=1,
        warmup=1, timeout_s=240, config=FsdpConfig(**CONFIG), fit=False))
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {"out": out, "report": report, "records": records}


def test_the_pipeline_run_is_the_configuration_asked_for(pp_calibration):
    (record,) = pp_calibration["records"]
    assert record["error"] is None, (record["error"], (pp_calibration["out"] / record["log"]).read_text()[-3000:])
    config = record["setup"]["config"]
    assert (config["pp"], config["pp_schedule"], config["grad_accum"], config["micro_batch"]) == (2, "1f1b", 4, 1)


def test_each_pipeline_rank_is_measured_and_matches_its_trace(pp_calibration):
    from calibration import store

    run = store.RunRecord.model_validate(pp_calibration["records"][0])  # validated on read
    m = run.measured
    assert [(r.pp_rank, r.stages) for r in m.pipeline_ranks] == [(0, [0]), (1, [1])]
    assert m.peak_allocated_bytes == max(r.peak_allocated_bytes for r in m.pipeline_ranks)
    trace = traced(json.dumps(CONFIG, sort_keys=True), 2)
    sent_bytes = SEQ_LEN * HIDDEN * 4
    for rank, t in zip(m.pipeline_ranks, trace):
        extra = rank.peak_allocated_bytes - t.peak_allocated_bytes
        assert -REAL_RUN_JITTER_BYTES <= extra <= sent_bytes + REAL_RUN_JITTER_BYTES, (rank, t.peak_allocated_bytes)
        assert rank.peak_phase == t.peak_phase
        assert rank.memory_breakdown["sharded_params"] == t.breakdown["sharded_params"]


def test_the_loss_and_tokens_are_a_pipelines(pp_calibration):
    from calibration import store

    m = store.RunRecord.model_validate(pp_calibration["records"][0]).measured
    assert abs(m.loss - math.log(256)) < 0.5, m.loss  # averaged from the last stage's ranks
    # one copy of the model on 2 pipeline ranks: the local batch's 4 x 64 tokens, credited half to each GPU
    assert m.tokens_per_s_per_gpu == pytest.approx(4 * SEQ_LEN / 2 / m.step_s, rel=1e-9)


def test_a_pipeline_the_runner_cannot_cut_is_one_line(tmp_path):
    """A preset built as the project's reference Llama has no transformers stage split: one line, nothing run."""
    from cost_models.specs import FsdpConfig
    from planner.calibrating import CalibrationRequest, calibrate
    from planner.errors import PlannerError

    (tmp_path / "host.json").write_text(json.dumps(host_probe()))
    with pytest.raises(PlannerError) as err:
        calibrate(CalibrationRequest(out_dir=str(tmp_path), gpus=2, model="llama3.2-1b", device="cpu", seq_len=64,
                                     global_batch=4, config=FsdpConfig(**CONFIG), fit=False))
    assert err.value.field == "pp" and "base_model_pp_plan" in str(err.value)
    assert len(str(err.value).splitlines()) == 1 and not (tmp_path / "results.jsonl").exists()
