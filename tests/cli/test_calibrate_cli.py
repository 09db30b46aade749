"""--profile on plan/estimate, and the calibrate command's paths that launch nothing (multi-node printing,
SLURM script, refusals). The runs themselves are tested in tests/distributed/ (test_calibrate.py; a relative --out
in test_calibration_lock.py)."""

import dataclasses
import json
import sys

import pytest

from calibration import store
from cost_models.profile import DEFAULT_PROFILE
from tests.doctor.cli_run import cli_process


def run(*args):
    """`fsdp-plan ARGS` in this process (tests/doctor/cli_run.py): what a subprocess would show, without its start."""
    return cli_process(list(args))


@pytest.fixture
def slow_profile(tmp_path):
    """A profile 'fitted' on A100s whose GPUs reach half the default compute efficiency."""
    half = {k: v / 2 for k, v in DEFAULT_PROFILE.compute_efficiency.items()}
    profile = dataclasses.replace(DEFAULT_PROFILE, compute_efficiency=half)
    pf = store.ProfileFile(
        created="2025-01-01T00:00:00+00:00", gpu_id="a100-80gb",
        fingerprint=store.Fingerprint(device_type="cuda", device_name="NVIDIA A100-SXM4-80GB", devices_per_node=8,
                                      torch_version="2.13.0", nccl_version="2.27.3"),
        coefficients=store.Coefficients.of(profile),
        fit=store.FitSummary(n_runs=3, fitted=["compute_efficiency[bf16]"], step_error_before=0.5, step_error_after=0.1))
    path = tmp_path / "profile.json"
    store.write_profile(path, pf)
    return path


ESTIMATE = ["estimate", "--model", "llama2-7b", "--gpus", "8", "--micro-batch", "2", "--format", "json"]


def test_estimate_predicts_with_the_profile(slow_profile):
    default = json.loads(run(*ESTIMATE).stdout)
    fitted = json.loads(run(*ESTIMATE, "--profile", str(slow_profile)).stdout)
    # half the matmul efficiency: the matmul part of the step doubles, the memory-bound part does not change
    fit, base = fitted["time"]["breakdown"], default["time"]["breakdown"]
    assert fit["matmul_s"] == pytest.approx(2 * base["matmul_s"])
    assert fit["memory_bound_s"] == pytest.approx(base["memory_bound_s"])
    assert fitted["time"]["step_s"] > default["time"]["step_s"]


def test_plan_predicts_with_the_profile(slow_profile):
    args = ["--model", "llama2-7b", "--gpus", "8", "--format", "json", "--top", "1"]
    default = json.loads(run(*args).stdout)["candidates"][0]["time"]["tokens_per_s_per_gpu"]
    fitted = json.loads(run(*args, "--profile", str(slow_profile)).stdout)["candidates"][0]["time"]
    assert fitted["tokens_per_s_per_gpu"] < 0.75 * default


def test_profile_from_another_gpu_type_is_refused_unless_forced(slow_profile):
    r = run(*ESTIMATE, "--gpu", "h100-80gb", "--profile", str(slow_profile))
    assert r.returncode == 2
    assert "fitted on a100-80gb" in r.stderr and "this plan is for h100-80gb" in r.stderr and "--force-profile" in r.stderr
    assert run(*ESTIMATE, "--gpu", "h100-80gb", "--profile", str(slow_profile), "--force-profile").returncode == 0


def test_broken_profile_is_one_line_error(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    r = run(*ESTIMATE, "--profile", str(bad))
    assert r.returncode == 2 and r.stderr.startswith("error: profile:") and "not an fsdp-plan profile" in r.stderr


MULTI = ["calibrate", "--model", "llama2-7b", "--gpus", "16", "--nodes", "2", "--gpu", "h100-80gb", "--top", "2",
         "--seq-len", "1024", "--steps", "5"]


def test_multi_node_prints_per_node_commands_and_runs_nothing(tmp_path):
    r = run(*MULTI, "--rdzv-endpoint", "node0:29400", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("--node-rank 0") == 2 and out.count("--node-rank 1") == 2  # 2 runs x 2 nodes
    assert "--master-addr node0 --master-port 29400" in out and "--master-port 29401" in out  # a port per run
    assert "--nproc-per-node 8" in out and "-m calibration.runner --job" in out
    assert not (tmp_path / "results.jsonl").exists()
    jobs = list((tmp_path / "jobs").glob("*.json"))
    assert len(jobs) == 2 and json.loads(jobs[0].read_text())["model"]["source"] == "reference"


def test_one_hsdp_config_takes_its_shard_group(tmp_path):
    """--shard-group-gpus reaches the run's job (calibration/apply.py builds its (replicas, group) mesh from it; a
    4-rank CPU run of (2, 2) measured 10.4 MiB vs 10.3 predicted, by hand: too slow for the suite)."""
    top = MULTI.index("--top")
    one = MULTI[:top] + MULTI[top + 2:]
    r = run(*one, "--rdzv-endpoint", "node0:29400", "--out", str(tmp_path), "--sharding", "HYBRID_SHARD",
            "--shard-group-gpus", "16")
    assert r.returncode == 0, r.stderr
    jobs = list((tmp_path / "jobs").glob("*.json"))
    assert len(jobs) == 1 and json.loads(jobs[0].read_text())["config"]["shard_group_gpus"] == 16


def test_multi_node_needs_a_rendezvous(tmp_path):
    r = run(*MULTI, "--out", str(tmp_path))
    assert r.returncode == 2 and "--rdzv-endpoint HOST:PORT" in r.stderr


def test_slurm_script(tmp_path):
    r = run(*MULTI, "--out", str(tmp_path), "--emit", "slurm")
    assert r.returncode == 0, r.stderr
    s = r.stdout
    assert s.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in s and "#SBATCH --gpus-per-node=8" in s
    assert "srun" in s and '--node-rank "$SLURM_NODEID"' in s and '"$HEAD_NODE:29500"' in s
    assert "--launch" in s and "--emit" not in s.split("srun", 1)[1]
    assert not (tmp_path / "jobs").exists()


def test_existing_results_need_resume(tmp_path):
    (tmp_path / "results.jsonl").write_text("")
    rec = json.loads((store.RunRecord(
        run_id="x", model_name="m", predicted=store.Predicted(step_s=1, peak_allocated_bytes=1, peak_reserved_bytes=1,
                                                              exposed_comm_s=0, compute_s=1, tokens_per_s_per_gpu=1),
        setup=store.RunSetup(model={}, full_n_layers=1, gpu={"id": "x"}, n_gpus=1, gpus_per_node=1,
                             internode_bytes_per_s=1, training={}, config={}, fsdp_version=2, device="cuda", steps=1,
                             warmup=0),
        error=store.RunError(kind="timeout", message="m"))).model_dump_json())
    (tmp_path / "results.jsonl").write_text(json.dumps(rec) + "\n")
    r = run(*MULTI, "--rdzv-endpoint", "node0:29400", "--out", str(tmp_path))
    assert r.returncode == 2 and "already holds 1 run(s): pass --resume" in r.stderr


def test_trace_takes_no_profile(slow_profile):
    r = run("trace", "--model", "llama2-7b", "--gpus", "8", "--profile", str(slow_profile))
    assert r.returncode == 2 and "does not use a profile" in r.stderr


def test_lora_bad_rank_and_missing_peft_are_one_line_errors_before_anything_is_written(tmp_path, monkeypatch):
    out = tmp_path / "never"
    r = run("calibrate", "--model", "llama2-7b", "--gpus", "8", "--finetune", "lora", "--lora-rank", "0",
            "--out", str(out))
    assert r.returncode == 2 and r.stderr.strip() == "error: lora_rank: must be > 0, got 0"
    assert not out.exists()
    # without peft installed: the same refusal, naming the extra to install
    from planner.calibrating import CalibrationRequest, calibrate
    from planner.errors import PlannerError

    monkeypatch.setitem(sys.modules, "peft", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "peft" else object())
    with pytest.raises(PlannerError, match=r"finetune: LoRA runs add peft adapters: pip install 'fsdp-planner\[lora\]'"):
        calibrate(CalibrationRequest(out_dir=str(out), gpus=8, model="llama2-7b", finetune="lora"))
    assert not out.exists()
