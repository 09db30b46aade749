"""GPU checks: predicted vs measured memory and step time on a real CUDA device.

Skipped without CUDA (CI and the development machines have none); run them on a GPU host with
`pytest tests/gpu`. Two jobs: world size 1, and rank 0 of an emulated 8-rank job (fake process group:
that rank's real kernels and memory; communication from the cost model). The model is Llama 2 7B cut
to 4 blocks (`--layers 4`, widths unchanged) so it fits any 40 GB+ GPU in seconds; a third job is the
same model as a LoRA fine-tune (peft, rank 16).

With GPU_CHECK_OUT set, each calibration keeps its directory (results.jsonl, logs) there, and the
report table goes to <name>.txt beside it: `benchmarks/gpu_check.sh` runs these tests that way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")]

ROOT = Path(__file__).resolve().parents[2]
MEMORY_TOLERANCE = 0.15   # allocator rounding, cuBLAS workspaces and kernel choices the ledger leaves out
STEP_FACTOR = 2.0         # default (uncalibrated) efficiencies: a factor of 2 either way catches gross errors


def calibrate(out: Path, *extra: str) -> dict:
    keep = os.environ.get("GPU_CHECK_OUT")
    if keep:
        out = Path(keep) / out.name
        out.mkdir(parents=True, exist_ok=True)
    gpu = "h100-80gb" if "H100" in torch.cuda.get_device_name() else (
        "h200-141gb" if "H200" in torch.cuda.get_device_name() else "a100-80gb")
    args = [sys.executable, "-m", "planner.cli", "calibrate", "--model", "llama2-7b", "--layers", "4",
            "--gpu", gpu, "--device", "cuda", "--seq-len", "2048", "--sharding", "FULL_SHARD", "--precision",
            "bf16", "--micro-batch", "2", "--steps", "5", "--warmup", "2", "--no-fit", "--out", str(out),
            *extra]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if keep:
        (out.parent / f"{out.name}.txt").write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["measured"], records
    return records[0]


def check(record: dict) -> None:
    p, m = record["predicted"], record["measured"]
    print(f"{record['run_id']}: peak allocated predicted {p['peak_allocated_bytes'] / 2**30:.2f} GiB, measured "
          f"{m['peak_allocated_bytes'] / 2**30:.2f} GiB (reserved {m.get('peak_reserved_bytes', 0) / 2**30:.2f}); "
          f"step predicted {p['step_s']:.4f} s, measured {m['step_s']:.4f} s; exposed comm {m.get('exposed_comm_s')}")
    assert m["peak_allocated_bytes"] == pytest.approx(p["peak_allocated_bytes"], rel=MEMORY_TOLERANCE)
    assert 1 / STEP_FACTOR <= m["step_s"] / p["step_s"] <= STEP_FACTOR


def test_world_size_1(tmp_path):
    check(calibrate(tmp_path / "ws1", "--gpus", "1"))


def test_rank0_of_emulated_8_rank_job(tmp_path):
    check(calibrate(tmp_path / "emulated8", "--gpus", "1", "--emulate-world-size", "8"))


def test_lora_world_size_1(tmp_path):
    pytest.importorskip("peft")
    check(calibrate(tmp_path / "lora-ws1", "--gpus", "1", "--finetune", "lora", "--lora-rank", "16"))
