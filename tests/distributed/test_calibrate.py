"""End-to-end calibration on CPU: real FSDP2 under torchrun (2 ranks, gloo), as CI runs it.

One calibration (module fixture), then checks on what it left behind:
1. `fsdp-plan calibrate --top 3` on a 0.86M-parameter Llama-style model: a CPU probe, three planned
   candidates, the second of which loses rank 1 on purpose (`--fault 1:1:exit`, an os._exit in the
   middle of training). The other two are measured and fitted; results.jsonl holds all three.
2. `--resume` of the same calibration runs nothing and keeps the file as it was.
3. A configuration none of them ran (activation checkpointing on every other block: half the blocks
   keep only their input and re-run their forward) is predicted with the fitted profile, then measured:
   step time and peak memory must agree within the tolerances below.
4. A LoRA fine-tune of the same model (peft adapters on q, k, v, o, rank 8) with the fitted profile:
   predicted and measured memory and step time, and the measured model states against a hand count.
Plus a direct runner job under --emulate-world-size semantics (one process, fake process group) and one
FSDP1 run (meta parameters materialised by param_init_fn).

About 150 CPU s (user + sys with its subprocesses, -n 0, measured 2026-12-06; 200-330 s wall on 2 shared
cores): nine torchrun jobs (the probe, five runs, two FSDP1 runner jobs, the interrupted run) at ~8 CPU s of
start-up each (torchrun's agent and two ranks importing torch), five calibrate processes at ~3.5 CPU s each before
their jobs, and the emulated runner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.distributed.calib_models:small_llama"
COMMON = ["--factory", FACTORY, "--gpus", "2", "--device", "cpu", "--seq-len", "128", "--global-batch", "8",
          "--steps", "5", "--warmup", "2", "--timeout", "120"]
# Tolerances for the unmeasured configuration, predicted with the fitted profile. Memory is a count of
# tensors (deterministic): the cost model's ledger vs the tensor accountant, within 20% (2-5% seen).
# Step time is the ranks' CPU time per step (wall time on a shared 2-core machine moved by 2x between
# identical runs while this was written; CPU time by 10-25%). On a CPU the recomputed forward costs more
# than its FLOPs say (its memory-bound ops weigh more than in the backward), which the cost model does
# not represent: checkpointing every other block keeps that error near 15%. The fit's runs and the checked run are
# minutes apart, and on this machine's 2 vCPUs (hardware threads sharing cores) a rank's CPU time per step doubles
# while the other xdist worker computes: an idle fresh-clone run (2026-12-07) fitted under load and checked idle
# read predicted / measured 1.76 here and 2.18 for LoRA, the models unchanged (a loaded run passed both). The bound,
# a factor of 2.5 either way (LoRA 3), is for that; it still fails a step priced like nothing or like several steps.
MEMORY_TOLERANCE = 0.20
STEP_FACTOR = 2.5


def cli(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "calibrate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def probed(out: Path, into: Path) -> Path:
    """`into` with the first calibration's CPU probe (host.json, probe.json) in it: a later calibration there
    reuses it as `--out DIR` reuses its own (planner/calibrating/host.probe_host), instead of ~10 s of torchrun
    probing the same CPU again (CI time; the probe itself is checked by the first calibration)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("host.json", "probe.json"):
        (into / name).write_bytes((out / name).read_bytes())
    return into


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session")  # once per run: xdist may interleave modules, which re-ran module fixtures
def calibration(tmp_path_factory):
    out = tmp_path_factory.mktemp("calib")
    first = cli(*COMMON, "--top", "3", "--out", str(out), "--fault", "1:1:exit:1", "--torch-profile")
    before = (out / "results.jsonl").read_text()
    resumed = cli(*COMMON, "--top", "3", "--out", str(out), "--resume")
    unmeasured = probed(out, tmp_path_factory.mktemp("unmeasured"))
    check = cli(*COMMON, "--out", str(unmeasured), "--profile", str(out / "profile.json"), "--no-fit",
                "--sharding", "FULL_SHARD", "--micro-batch", "4", "--activation-checkpointing", "every-2",
                "--format", "json")
    lora_out = probed(out, tmp_path_factory.mktemp("lora"))
    lora = cli(*COMMON, "--out", str(lora_out), "--profile", str(out / "profile.json"),
               "--no-fit", "--finetune", "lora", "--lora-rank", "8", "--sharding", "FULL_SHARD", "--micro-batch", "4",
               "--format", "json")
    return {"out": out, "first": first, "before": before, "resumed": resumed, "unmeasured": unmeasured,
            "check": check, "lora": lora}


def test_each_run_is_one_line_and_the_failure_does_not_stop_the_others(calibration):
    records = lines(calibration["out"] / "results.jsonl")
    assert len(records) == 3
    ok = [r for r in records if r["measured"]]
    failed = [r for r in records if r["error"]]
    assert len(ok) == 2 and len(failed) == 1
    assert records[1]["error"]["kind"] == "crash" and records[1]["error"]["rank"] == 1  # run 2, rank 1
    assert "died" in records[1]["error"]["message"]
    for r in ok:
        m, p = r["measured"], r["predicted"]
        assert len(m["step_s_all"]) == 5 and m["step_s"] > 0 and m["loss"] == m["loss"]  # not NaN
        assert m["memory_source"] == "memtrack" and m["peak_allocated_bytes"] > 0
        assert p["step_s"] > 0 and p["peak_allocated_bytes"] > 0
        assert r["fingerprint"]["device_type"] == "cpu" and r["fingerprint"]["devices_per_node"] == 2
    # the planned candidates differ, and what was run is what was planned
    assert len({json.dumps(r["setup"]["config"], sort_keys=True) for r in records}) == 3
    text = calibration["first"].stdout
    assert "CRASH" in text and "Re-ranked by measured throughput" in text and "fully_shard(" in text
    assert "run 3/3" in calibration["first"].stderr  # progress


def test_profile_is_fitted_from_the_measured_runs(calibration):
    profile = json.loads((calibration["out"] / "profile.json").read_text())
    assert profile["kind"] == "fsdp-plan-profile" and profile["gpu_id"] == "cpu" and profile["host"]["ranks"] == 2
    assert profile["fit"]["n_runs"] == 2 and "compute_efficiency[fp32]" in profile["fit"]["fitted"]
    assert profile["fit"]["step_error_after"] <= profile["fit"]["step_error_before"]
    assert 0.01 < profile["coefficients"]["compute_efficiency"]["fp32"] < 2
    assert profile["fingerprint"]["torch_version"].startswith("2.")


def test_resume_skips_runs_already_recorded(calibration):
    assert (calibration["out"] / "results.jsonl").read_text() == calibration["before"]
    assert "--resume: 3 run(s) already in" in calibration["resumed"].stderr
    assert "run 1/" not in calibration["resumed"].stderr  # nothing launched


def test_fitted_profile_predicts_a_configuration_it_never_saw(calibration):
    measured_configs = [r["setup"]["config"] for r in lines(calibration["out"] / "results.jsonl")]
    report = json.loads(calibration["check"].stdout)
    (run,) = report["runs"]
    assert run["setup"]["config"]["activation_checkpointing"] == "every-2"
    assert run["setup"]["config"] not in measured_configs
    assert run["predicted"]["profile_source"].startswith("fitted")
    p, m = run["predicted"], run["measured"]
    memory_error = abs(p["peak_allocated_bytes"] - m["peak_allocated_bytes"]) / m["peak_allocated_bytes"]
    step_error = abs(p["step_s"] - m["step_s"]) / m["step_s"]
    print(f"unmeasured config: step predicted {p['step_s']:.3f} s, measured {m['step_s']:.3f} s "
          f"({100 * step_error:.0f}%); peak predicted {p['peak_allocated_bytes']}, measured "
          f"{m['peak_allocated_bytes']} ({100 * memory_error:.0f}%)")
    assert memory_error < MEMORY_TOLERANCE
    assert 1 / STEP_FACTOR < p["step_s"] / m["step_s"] < STEP_FACTOR
    assert not (calibration["unmeasured"] / "profile.json").exists()  # --no-fit


def test_lora_run_measures_adapters_only_and_matches_the_prediction(calibration):
    from tests.distributed.calib_models import small_llama

    spec = small_llama().spec
    (run,) = json.loads(calibration["lora"].stdout)["runs"]
    assert run["setup"]["training"]["finetune"] == "lora" and run["setup"]["training"]["lora_rank"] == 8
    p, m = run["predicted"], run["measured"]
    # by hand: fp32 AdamW keeps exp_avg and exp_avg_sq of the adapters only, sharded over 2 ranks
    # (+ one fp32 step counter per adapter tensor: 2 per linear, 4 linears per block, 4 blocks)
    adapters = spec.n_layers * spec.lora_params_per_block(8)  # r * (in + out) of q, k, v, o; 4 blocks
    assert adapters == 4 * 8 * ((128 + 128) + 2 * (128 + 64) + (128 + 128)) == 28_672
    assert m["memory_breakdown"]["optimizer_state"] == pytest.approx(2 * 4 * adapters / 2 + 32 * 4, rel=0.01)
    memory_error = abs(p["peak_allocated_bytes"] - m["peak_allocated_bytes"]) / m["peak_allocated_bytes"]
    print(f"LoRA run: step predicted {p['step_s']:.3f} s, measured {m['step_s']:.3f} s; peak predicted "
          f"{p['peak_allocated_bytes']}, measured {m['peak_allocated_bytes']} ({100 * memory_error:.1f}%)")
    assert memory_error < MEMORY_TOLERANCE
    # Step time, a coarse check: the profile was fitted on full fine-tuning, and on a CPU the 32 rank-8
    # adapter matmuls per step cost per-op overhead more than FLOPs (predicted 25-30% low while writing
    # this). A factor of 3 either way (STEP_FACTOR's load, above) still catches a LoRA step priced like nothing or
    # like several steps.
    assert 1 / 3 < p["step_s"] / m["step_s"] < 3


def test_torch_profile_saves_a_trace_of_each_candidate_and_the_report_sets_phases_side_by_side(calibration):
    """--torch-profile: each measured run's folder holds a torch.profiler Chrome trace of one more step. It parses
    and holds that step: the runner's forward / backward ranges once per micro-step and one optimizer range, AdamW's
    step, the blocks' matmuls, FSDP2's collectives per block (by hand: 4 blocks; FULL_SHARD gathers each block in
    forward and again in backward and reduce-scatters it once, per micro-step). The crashed run left none."""
    from planner.calibrating.step_profile import phase_seconds, trace_path

    records = lines(calibration["out"] / "results.jsonl")
    traced = 0
    for r in records:
        path = trace_path(calibration["out"] / "runs" / r["run_id"])
        if r["error"]:
            assert not path.exists()  # rank 1 died in warm-up, before the profiled step
            continue
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        count = {}
        for e in events:
            count[e["name"]] = count.get(e["name"], 0) + 1
        config, accum = r["setup"]["config"], r["setup"]["config"]["grad_accum"]
        assert count["calibration.forward"] == count["calibration.backward"] == accum
        assert count["calibration.optimizer"] == count["Optimizer.step#AdamW.step"] == 1
        assert count.get("aten::mm", 0) + count.get("aten::addmm", 0) > 0
        if config["sharding"] == "FULL_SHARD":
            assert [count[f"FSDP::all_gather (layers.{i})"] for i in range(4)] == [2 * accum] * 4
            assert [count[f"FSDP::post_backward_reduce (layers.{i})"] for i in range(4)] == [accum] * 4
        phases = phase_seconds(json.loads(path.read_text()))
        assert set(phases) == {"forward", "backward", "optimizer"} and min(phases.values()) > 0
        traced += 1
    assert traced == 2
    text = calibration["first"].stdout
    assert "Per phase: predicted (the fitted profile) / measured s" in text
    assert text.count("torch_profile.json") == 2


def runner_job(tmp_path, **overrides) -> dict:
    sys.path.insert(0, str(ROOT))
    import dataclasses

    from tests.distributed.calib_models import small_llama

    spec = small_llama().spec
    job = {"run_id": "t", "model": {"source": "factory", "factory": FACTORY, "spec": dataclasses.asdict(spec),
                                    "block_class": "Block"},
           "config": {"sharding": "FULL_SHARD", "precision": "fp32", "micro_batch": 2}, "fsdp_version": 2,
           "gpus_per_node": 4, "seq_len": 64, "optimizer": "adamw", "steps": 2, "warmup": 1, "device": "cpu",
           "result_path": str(tmp_path / "result.json"), "error_dir": str(tmp_path / "errors"), **overrides}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    return job, path, spec


def run(argv, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def test_emulated_world_size_runs_rank_0_with_real_sharded_memory(tmp_path):
    """One process, rank 0 of 4 on a fake process group: its parameter shards are a quarter of the model."""
    job, path, spec = runner_job(tmp_path, emulate_world_size=4)
    job["model"]["source"] = "reference"  # what a llama preset builds: our reference Llama from the spec
    path.write_text(json.dumps(job))
    run([sys.executable, "-m", "calibration.runner", "--job", str(path)])
    result = json.loads((tmp_path / "result.json").read_text())
    m = result["measured"]
    assert result["fingerprint"]["devices_per_node"] == 1
    # fp32 shards of every parameter, padded to a multiple of 4 rows at most: within 1% of n_params * 4 / 4
    assert m["memory_breakdown"]["sharded_params"] == pytest.approx(spec.n_params, rel=0.01)
    assert m["memory_breakdown"]["optimizer_state"] == pytest.approx(2 * spec.n_params, rel=0.01)


def test_fsdp1_run_materialises_meta_parameters_per_unit(tmp_path):
    job, path, spec = runner_job(tmp_path, fsdp_version=1, gpus_per_node=2,
                                 config={"sharding": "SHARD_GRAD_OP", "precision": "fp32", "micro_batch": 2,
                                         "grad_accum": 2, "activation_checkpointing": "every-2"})
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "calibration.runner", "--job", str(path)])
    m = json.loads((tmp_path / "result.json").read_text())["measured"]
    assert 4.0 < m["loss"] < 8.0  # ~ln(512) = 6.2 at initialisation: real, finite numbers
    # the tensor accountant's peak against the cost model's ledger for the same run
    from cost_models.evaluate import evaluate
    from cost_models.profile import DEFAULT_PROFILE
    from cost_models.specs import FsdpConfig, TrainingSpec
    from planner.hardware import make_cluster

    config = FsdpConfig(sharding="SHARD_GRAD_OP", precision="fp32", micro_batch=2, grad_accum=2, ac_every=2)
    cluster = make_cluster(2, gpus_per_node=2)  # memory does not depend on the device's speed
    predicted = evaluate(spec, cluster, TrainingSpec(seq_len=64), config, DEFAULT_PROFILE).memory.peak_allocated_bytes
    assert m["memory_source"] == "memtrack"
    assert abs(m["peak_allocated_bytes"] - predicted) / m["peak_allocated_bytes"] < MEMORY_TOLERANCE, (m, predicted)


def test_fsdp1_lora_run_materialises_base_and_adapters(tmp_path):
    """FSDP1 + LoRA through the runner: the frozen bf16 base on meta and the fp32 adapters, each adapter
    linear its own unit (trainable_mixed), all materialised by param_init_fn; the loss is finite."""
    job, path, spec = runner_job(tmp_path, fsdp_version=1, gpus_per_node=2, finetune="lora", lora_rank=8,
                                 config={"sharding": "FULL_SHARD", "precision": "bf16", "micro_batch": 2})
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "calibration.runner", "--job", str(path)])
    m = json.loads((tmp_path / "result.json").read_text())["measured"]
    assert 4.0 < m["loss"] < 8.0 and m["step_s"] > 0
    from cost_models.evaluate import evaluate
    from cost_models.profile import DEFAULT_PROFILE
    from cost_models.specs import FsdpConfig, TrainingSpec
    from planner.hardware import make_cluster

    training = TrainingSpec(seq_len=64, finetune="lora", lora_rank=8)
    predicted = evaluate(spec, make_cluster(2, gpus_per_node=2), training, FsdpConfig(precision="bf16", micro_batch=2),
                         DEFAULT_PROFILE).memory.peak_allocated_bytes
    print(f"FSDP1 LoRA: peak predicted {predicted}, measured {m['peak_allocated_bytes']}")
    assert abs(m["peak_allocated_bytes"] - predicted) / m["peak_allocated_bytes"] < MEMORY_TOLERANCE


def test_ctrl_c_kills_the_run_in_flight_and_says_how_to_resume(tmp_path, calibration):
    """SIGINT while a rank hangs: exit 130 with one line naming results.jsonl and --resume, and no rank of
    the killed torchrun job left running."""
    import signal
    import time

    probed(calibration["out"], tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # SIGINT as a terminal delivers it: a suite started in the background (`.ci/run &`) has SIGINT ignored,
    # which children inherit and Python then never turns into KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "calibrate", *COMMON, "--sharding", "FULL_SHARD",
                             "--micro-batch", "4", "--out", str(tmp_path), "--fault", "0:1:hang:1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    def hanging() -> bool:  # rank 1 has reached its injected hang (the runner logs it first)
        return any("injected fault 'hang'" in log.read_text(errors="replace")
                   for log in (tmp_path / "runs").glob("*/log.txt"))

    deadline = time.monotonic() + 120
    while not hanging() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert hanging(), "the run never reached the injected hang"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert f"interrupted: every run that ended is in {tmp_path}/results.jsonl" in err and "--resume" in err
    assert "Traceback" not in err
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "jobs")], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout
