"""The `fsdp-plan` command: outputs scripts can read, and one-line errors with exit code 2.

In-process (tests/doctor/cli_run.py: planner.cli.main, the console entry point, its exit code and streams);
the first test runs `python -m planner.cli` in a process of its own."""

import json
import subprocess
import sys

import pytest

from tests.doctor.cli_run import cli_process

CLI = [sys.executable, "-m", "planner.cli"]


def run(*args):
    return cli_process(list(args))


def test_main_job_table_and_recommendation():
    r = subprocess.run([*CLI, "--model", "gpt-13b", "--gpus", "8"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "gpt-13b" in r.stdout and "FULL_SHARD" in r.stdout and "tok/s/GPU" in r.stdout
    assert "fully_shard(" in r.stdout  # the recommended config as FSDP2 code


def test_plan_json_shape():
    r = run("--model", "llama2-7b", "--gpus", "16", "--format", "json", "--top", "3")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"] == {"name": "llama2-7b", "n_params": 6_738_415_616, "priced_by": "formula"}
    assert 1 <= len(d["candidates"]) <= 3
    c = d["candidates"][0]
    assert set(c) >= {"config", "fits", "reasons", "memory", "time", "fsdp_kwargs", "fully_shard_kwargs"}
    assert c["fits"] is True
    tps = [x["time"]["tokens_per_s_per_gpu"] for x in d["candidates"]]
    assert tps == sorted(tps, reverse=True)  # best first


def test_estimate_json_keys_and_values():
    r = run("estimate", "--model", "llama2-70b", "--gpus", "64", "--seq-len", "4096", "--micro-batch", "2",
            "--activation-checkpointing", "full", "--format", "json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"]["name"] == "llama2-70b"
    assert d["config"]["activation_checkpointing"] == "full" and d["config"]["micro_batch"] == 2
    m, t = d["memory"], d["time"]
    assert set(m) >= {"peak_allocated_bytes", "peak_reserved_bytes", "breakdown", "cpu_bytes_per_node"}
    assert set(t) >= {"step_s", "tokens_per_s_per_gpu", "mfu", "breakdown"}
    assert m["peak_reserved_bytes"] > m["peak_allocated_bytes"] == sum(m["breakdown"].values())
    assert d["fits"] is True and d["reasons"] == []
    assert t["tokens_per_s_per_gpu"] == pytest.approx(353, rel=0.15)  # torchtitan row, HF norms


@pytest.mark.parametrize("args,field", [
    (["--model", "llama2-7", "--gpus", "8"], "model"),
    (["--model", "gpt-13b", "--gpus", "0"], "gpus"),
    (["--model", "gpt-13b", "--gpus", "8", "--gpu", "a100"], "gpu"),
    (["estimate", "--model", "gpt-13b", "--gpus", "8", "--sharding", "ZERO3"], "sharding"),
    (["estimate", "--model", "gpt-13b", "--gpus", "8", "--precision", "fp8"], "precision"),
    (["estimate", "--model", "gpt-13b", "--gpus", "8", "--micro-batch", "-1"], "micro_batch"),
    (["estimate", "--model", "gpt-13b", "--gpus", "8", "--seq-len", "-5"], "seq_len"),
    (["estimate", "--model", "gpt-13b", "--gpus", "12", "--gpus-per-node", "8", "--sharding", "HYBRID_SHARD"],
     "gpus_per_node"),
    (["estimate", "--model", "gpt-13b", "--gpus", "8", "--gpu", "v100-32gb", "--precision", "bf16"], "precision"),
    (["--model", "gpt-13b", "--gpus", "eight"], "gpus"),
    (["--gpus", "8"], "model"),
    # the issue-10 options: each bad value names its field and what is valid
    (["estimate", "--model", "gpt-13b", "--gpus", "8", "--activation-checkpointing", "selective"],
     "activation_checkpointing"),
    (["estimate", "--model", "gpt-13b", "--gpus", "8", "--fp8-all-gather"], "fp8_all_gather"),
    (["estimate", "--model", "gpt-13b", "--gpus", "8", "--float8"], "float8"),  # a100-80gb: no FP8
    (["estimate", "--model", "gpt-13b", "--gpus", "16", "--reshard-after-forward", "1"], "reshard_after_forward"),
    (["estimate", "--model", "gpt-13b", "--gpus", "16", "--reshard-after-forward", "3"], "reshard_after_forward"),
    (["estimate", "--model", "gpt-13b", "--gpus", "16", "--reshard-after-forward", "8", "--sharding", "SHARD_GRAD_OP"],
     "reshard_after_forward"),
    (["estimate", "--model", "gpt-13b", "--gpus", "16", "--reshard-after-forward", "eight"], "reshard-after-forward"),
])
def test_bad_input_one_line_exit_2(args, field):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert field in lines[0]


@pytest.mark.parametrize("args,valid", [
    (["--activation-checkpointing", "selective"], "selective-op"),
    (["--reshard-after-forward", "3"], "divisor >= 2 of 16"),
    (["--fp8-all-gather"], "needs float8"),
])
def test_bad_issue10_values_say_what_is_valid(args, valid):
    r = run("estimate", "--model", "gpt-13b", "--gpus", "16", "--gpu", "h100-80gb", *args)
    assert r.returncode == 2 and valid in r.stderr, r.stderr


def test_estimate_selective_op_compile_float8_and_int_reshard():
    r = run("estimate", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-80gb", "--seq-len", "8192",
            "--micro-batch", "2", "--activation-checkpointing", "selective-op", "--compile", "--float8",
            "--fp8-all-gather", "--reshard-after-forward", "8", "--format", "json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["config"]["activation_checkpointing"] == "selective-op"
    assert {k: d["config"].get(k) for k in ("compile", "float8", "fp8_all_gather", "reshard_after_forward")} == {
        "compile": True, "float8": True, "fp8_all_gather": True, "reshard_after_forward": 8}
    # blocks keep params sharded over the node's 8 ranks after forward; the root keeps FULL_SHARD's bool
    assert d["fully_shard_kwargs"]["reshard_after_forward"] == 8
    assert d["fully_shard_kwargs"]["root_reshard_after_forward"] is True


def test_unknown_preset_suggests_close_names():
    r = run("--model", "llama2-7", "--gpus", "8")
    assert "llama2-7b" in r.stderr


def test_malformed_config_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    r = run("--model", str(bad), "--gpus", "8")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "model" in r.stderr


def test_nothing_fits_explains_and_suggests():
    r = run("--model", "gpt-175b", "--gpus", "8")
    assert r.returncode == 0, r.stderr
    assert "Nothing fits" in r.stdout and "Would fit with" in r.stdout
    assert "GPUs with FULL_SHARD" in r.stdout


def test_import_planner_does_not_import_torch():
    code = "import sys, planner, cost_models, planner.cli, planner.search; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_catalog_listings_show_counts_and_sources():
    models = run("models")
    assert models.returncode == 0
    row = next(line for line in models.stdout.splitlines() if line.startswith("llama2-7b "))
    assert "6,738,415,616" in row and "LlamaDecoderLayer" in row
    assert "Brown et al. 2020" in models.stdout
    gpus = run("gpus")
    row = next(line for line in gpus.stdout.splitlines() if line.startswith("h100-80gb "))
    assert "989" in row and "1979" in row and "datasheet" in row  # bf16 and fp8 dense TFLOP/s
    gb200 = next(line for line in gpus.stdout.splitlines() if line.startswith("gb200 "))
    assert " 72 " in gb200  # the NVL72 scale-up domain
    a100 = next(line for line in gpus.stdout.splitlines() if line.startswith("a100-80gb "))
    assert a100.split()[a100.split().index("312") + 3] == "-"  # bf16 312, fp16 312, fp32 19.5, no fp8
