"""A real CPU calibration of a tensor-parallel candidate (issue 17 item 6): `fsdp-plan calibrate --tp 2` runs
FSDP2 + TP under torchrun (2 gloo ranks, tp 2 x dp_shard 1) on the 0.86M-parameter Llama of
tests/distributed/calib_models.py for two timed steps, records it, fits.

One launch, then checks on what it left: the run is the configuration the plan priced (its record's prediction
is the cost model's for the recorded config), memory and step time are per rank (a rank holds its TP half of
the model; tokens per GPU count a TP group's tokens once), both ranks drew the same batches (the runner
all-reduces a checksum over the TP group and fails the run otherwise), and one run does not identify TP's
collective rate, so the profile keeps it at 1.0 and says so.

The CPU is not probed: DIR/host.json is written first with this machine's order of magnitude (a probe of the
same 2-rank layout measured 83 GFLOP/s fp32, 29 GB/s copies, 0.9 GB/s gloo), which the flow reuses as it does on
--resume; the prediction's step time depends on it, the memory and the checks here do not. About 30-40 s on
2 shared cores (one torchrun job: start-up, import torch, 1 + 2 steps, two tracked steps).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SEQ, GLOBAL_BATCH, MICRO_BATCH = 128, 8, 4
MEMORY_TOLERANCE = 0.10  # the ledger against the tensor accountant (-2.6% when written)


def host_probe() -> dict:
    from importlib.metadata import version

    from calibration.store import cpu_name

    return {"schema_version": 1,
            "host": {"name": cpu_name(), "ranks": 2, "peak_flops": {"fp32": 83e9, "bf16": 0.0, "fp16": 0.0},
                     "hbm_bytes_per_s": 29e9, "bus_bytes_per_s": 0.9e9, "memory_bytes": 4 * 2**30},
            "hop_latency_s": 75e-6,
            "fingerprint": {"device_type": "cpu", "device_name": cpu_name(), "devices_per_node": 2, "n_nodes": 1,
                            "torch_version": version("torch"), "nccl_version": None}}


@pytest.fixture(scope="session")  # once per run: xdist may interleave modules, which re-ran module fixtures
def tp_calibration(tmp_path_factory):
    out = tmp_path_factory.mktemp("calib-tp")
    (out / "host.json").write_text(json.dumps(host_probe()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "calibrate", "--factory",
                           "tests.distributed.calib_models:small_llama", "--gpus", "2", "--device", "cpu",
                           "--seq-len", str(SEQ), "--global-batch", str(GLOBAL_BATCH), "--steps", "2", "--warmup", "1",
                           "--timeout", "180", "--sharding", "FULL_SHARD", "--micro-batch", str(MICRO_BATCH),
                           "--tp", "2", "--out", str(out), "--format", "json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    report = json.loads(proc.stdout)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {"out": out, "report": report, "records": records, "stderr": proc.stderr}


def test_the_tp_run_is_the_configuration_the_plan_priced(tp_calibration):
    from calibration import store
    from calibration.fit import specs_from_setup
    from cost_models.evaluate import evaluate
    from cost_models.profile import DEFAULT_PROFILE
    from dataclasses import replace

    (record,) = tp_calibration["records"]
    assert record["error"] is None, record["error"]
    config = record["setup"]["config"]
    assert (config["tp"], config["cp"], config["ep"], config["pp"]) == (2, 1, 1, 1)
    # the global batch over the one data-parallel rank: 8 sequences = micro-batch 4 x 2 accumulation steps
    assert (config["micro_batch"], config["grad_accum"]) == (MICRO_BATCH, GLOBAL_BATCH // MICRO_BATCH)
    # the prediction stored with the run is the cost model's for exactly the recorded configuration
    run = store.RunRecord.model_validate(record)
    spec, cluster, training, fsdp = specs_from_setup(run.setup)
    probe = host_probe()
    base = replace(DEFAULT_PROFILE, intra_node_latency_s=probe["hop_latency_s"],
                   inter_node_latency_s=probe["hop_latency_s"], cuda_context_bytes=0, fragmentation=0.0)
    priced = evaluate(spec, cluster, training, fsdp, base)
    assert run.predicted.step_s == pytest.approx(priced.time.step_s, rel=1e-9)
    assert run.predicted.peak_allocated_bytes == priced.memory.peak_allocated_bytes
    assert priced.time.tp_comm_s > 0  # TP's collectives are in the price


def test_memory_and_time_are_per_rank(tp_calibration):
    from calibration import store
    from calibration.fit import specs_from_setup
    from cost_models.evaluate import evaluate
    from cost_models.profile import DEFAULT_PROFILE
    from cost_models.tensor_parallel import local_model

    run = store.RunRecord.model_validate(tp_calibration["records"][0])
    m = run.measured
    spec, cluster, training, config = specs_from_setup(run.setup)
    local = local_model(spec, config)
    # a rank's fp32 parameters are its TP half of the matrices plus the replicated norms, unsharded by FSDP (one
    # data-parallel rank): exactly the TP slice, not the whole model
    assert m.memory_breakdown["sharded_params"] == 4 * local.n_params
    assert local.n_params < 0.55 * spec.n_params
    assert m.memory_breakdown["optimizer_state"] == pytest.approx(2 * 4 * local.n_params, rel=1e-3)
    predicted = evaluate(spec, cluster, training, config, DEFAULT_PROFILE).memory.peak_allocated_bytes
    assert m.peak_allocated_bytes == pytest.approx(predicted, rel=MEMORY_TOLERANCE)
    # tokens per GPU: a TP group works on one set of sequences, so each of its 2 GPUs is credited half of them
    tokens = MICRO_BATCH * SEQ * (GLOBAL_BATCH // MICRO_BATCH) / 2
    assert m.tokens_per_s_per_gpu == pytest.approx(tokens / m.step_s, rel=1e-9)
    assert 5.0 < m.loss < 7.5  # ~ln(512) = 6.2 at initialisation: real, finite numbers through loss parallel


def test_one_tp_run_leaves_the_tp_rate_at_its_default(tp_calibration):
    out = tp_calibration["out"]
    profile = json.loads((out / "profile.json").read_text())
    assert profile["schema_version"] == 5
    assert profile["coefficients"]["tp_comm_efficiency"] == 1.0
    fit = tp_calibration["report"]["fit"]
    assert "tp_comm_efficiency" not in fit["fitted"]
    assert any("tp_comm_efficiency" in note and "kept at their starting values" in note for note in fit["notes"])
    assert not math.isnan(tp_calibration["records"][0]["measured"]["step_s"])
