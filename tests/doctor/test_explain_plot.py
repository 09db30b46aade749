"""`fsdp-plan explain` shows checkable arithmetic; `--plot` draws the breakdown."""

import subprocess
import sys

import pytest

from planner import plan
from planner.errors import PlannerError
from planner.explain import explain_text


def test_explain_terms_are_hand_checkable():
    best = plan("llama2-13b", gpus=8, seq_len=4096).best
    text = explain_text(best)
    # Adam state: 13,015,864,320 params x 8 B / 8 ranks = 12.12 GiB, by hand
    assert f"{13_015_864_320 * 8 / 8 / 2**30:.2f} GiB" in text and "optimizer state: 13,015,864,320 x 8 B" in text
    # FLOPs per token: 6 x (13,015,864,320 - 32000 x 5120) + 12 x 40 x 40 x 128 x 4096 = 87.2 GFLOP
    flops = 6 * (13_015_864_320 - 32000 * 5120) + 12 * 40 * 40 * 128 * 4096
    assert f"{flops / 1e9:,.1f} GFLOP" in text
    assert f"{100 * best.time.mfu:.1f}%" in text and f"{best.time.step_s:.3f} s" in text
    for source in ("Korthikanti", "Kaplan", "ZeRO"):
        assert source in text


def test_explain_lora_uses_the_lora_formulas():
    """LoRA: 4 FLOPs per frozen weight, 6 per adapter weight; a block's saved bytes without the tensors only
    weight gradients need (what the memory estimate itself uses)."""
    from planner import estimate

    c = estimate("llama2-7b", 8, finetune="lora", lora_rank=16, micro_batch=1, seq_len=4096)
    text = explain_text(c)
    h, q, kv, f, L = 4096, 4096, 4096, 11008, 32
    adapters = L * 16 * ((h + q) + 2 * (h + kv) + (q + h))              # q, k, v, o: 16,777,216
    flops = 4 * (6_738_415_616 - 32000 * h) + 6 * adapters + 12 * L * q * 4096
    assert f"{flops / 1e9:,.1f} GFLOP" in text and "4 x frozen non-embedding params + 6 x adapter params" in text
    # per token and block, bf16: frozen RMSNorms keep fp32 inputs (2 x 4h) + the attention norm's output (2h);
    # rotated q, k and v (2 x 3h), the kernel output (2h), fp32 logsumexp (4 x 32); gate, act, up (3 x 2f);
    # the 4 adapters' lora_A outputs (4 x 16 x 2)
    per_block = 8 * h + 2 * h + 6 * h + 2 * h + 4 * 32 + 6 * f + 4 * 16 * 2
    assert f"{L} blocks x {per_block:,} B per token" in text


def test_explain_cli_and_nothing_fits():
    cli = [sys.executable, "-m", "planner.cli", "explain"]
    r = subprocess.run([*cli, "--model", "llama2-7b", "--gpus", "8"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Memory per GPU" in r.stdout and "Time per optimizer step" in r.stdout
    r = subprocess.run([*cli, "--model", "gpt-175b", "--gpus", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nothing fits" in r.stderr


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_files(tmp_path, suffix):
    pytest.importorskip("matplotlib")
    from planner.plot import plot_candidates

    p = plan("llama2-7b", gpus=8)
    out = plot_candidates(p.candidates[:3], tmp_path / f"plan{suffix}", p.cluster.gpu.memory_bytes)
    data = out.read_bytes()
    assert len(data) > 5000
    if suffix == ".svg":
        assert b"GPU memory" in data and b"activations" in data and b"exposed communication" in data
    else:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_rejects_other_formats(tmp_path):
    from planner.plot import plot_candidates

    with pytest.raises(PlannerError, match="plot: .*png or .svg"):
        plot_candidates([], tmp_path / "plan.pdf", 1)


def test_plot_flag_on_main_command(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.svg"
    r = subprocess.run([sys.executable, "-m", "planner.cli", "--model", "llama2-7b", "--gpus", "8", "--top", "3",
                        "--plot", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 5000 and b"GPU memory" in out.read_bytes()
