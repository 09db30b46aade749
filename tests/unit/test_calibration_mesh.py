"""Calibration of mesh candidates (issue 17 item 6), the parts that launch nothing: which degrees the planned
candidates may take, which batch a rank draws, and the one-line refusals of what the runner cannot apply here.
The runs themselves: tests/distributed/test_calibrate_mesh.py; the fit of the TP / EP rates:
tests/unit/test_calibration_fit.py."""

import pytest

from cost_models.specs import FsdpConfig
from planner.calibrating import CalibrationRequest
from planner.calibrating.flow import _space
from planner.models import load_preset
from tests.doctor.cli_run import cli_process


def test_a_tp_or_cp_group_draws_one_batch_the_data_parallel_rank_decides():
    from calibration.runner import data_parallel_rank

    # 8 ranks, torchtitan's [dp_replicate, dp_shard, cp, tp] with tp innermost: ranks 0-3 are one model copy
    config = FsdpConfig(sharding="FULL_SHARD", tp=2, cp=2)
    assert [data_parallel_rank(r, config) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [data_parallel_rank(r, FsdpConfig(tp=2)) for r in range(4)] == [0, 0, 1, 1]
    assert [data_parallel_rank(r, FsdpConfig(ep=2)) for r in range(4)] == [0, 1, 2, 3]  # EP borrows data ranks


def test_planned_candidates_may_take_tp_and_ep_and_cp_only_where_cuda_runs_it():
    spec = load_preset("llama2-7b")
    cpu = _space(CalibrationRequest(out_dir="x", gpus=2, model="llama2-7b", device="cpu"), spec)
    assert (cpu.tp, cpu.ep, cpu.cp) == (None, None, 1)  # None: searched
    assert cpu.async_tp == (False,)  # the runner does not apply async TP
    cuda = _space(CalibrationRequest(out_dir="x", gpus=8, model="llama2-7b"), spec)
    assert (cuda.tp, cuda.ep, cuda.cp) == (None, None, None)
    fsdp1 = _space(CalibrationRequest(out_dir="x", gpus=8, model="llama2-7b", fsdp_version=1), spec)
    assert (fsdp1.tp, fsdp1.ep, fsdp1.cp) == (1, 1, 1)


@pytest.mark.parametrize("flags, line", [
    (["--device", "cpu", "--cp", "2"], "error: cp: context parallelism's ring attention has no CPU path (torch's "
     "context_parallel dispatches only CUDA SDPA kernels): calibrate cp > 1 on CUDA GPUs, or use --cp 1 with "
     "--device cpu"),
    (["--device", "cpu", "--tp", "2", "--fsdp-version", "1"],
     "error: fsdp_version: FSDP1 composes with no device mesh: tp / cp / ep need --fsdp-version 2"),
    (["--tp", "3"], "error: tp: tp=3 does not split llama2-7b's 32 attention heads, 32 KV heads and MLP width "
     "11008 evenly; choose one of: 1, 2, 4, 8"),
])
def test_what_the_runner_cannot_apply_is_one_line_before_anything_runs(tmp_path, flags, line):
    out = tmp_path / "never"
    r = cli_process(["calibrate", "--model", "llama2-7b", "--gpus", "8", "--sharding", "FULL_SHARD", *flags,
                     "--out", str(out)])
    assert r.returncode == 2 and r.stderr.strip() == line, r.stderr
    assert not (out / "results.jsonl").exists() and not (out / "host.json").exists()


def test_a_given_async_tp_config_is_refused_in_one_line(tmp_path):
    from planner.calibrating import calibrate
    from planner.errors import PlannerError

    config = FsdpConfig(sharding="FULL_SHARD", tp=2, compile=True, async_tp=True)
    with pytest.raises(PlannerError, match=r"^async_tp: async TP is not applied by the calibration runner"):
        calibrate(CalibrationRequest(out_dir=str(tmp_path / "never"), gpus=8, model="llama2-7b", config=config))
    assert not (tmp_path / "never").exists()
