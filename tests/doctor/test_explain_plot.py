"""`fsdp-plan explain` shows checkable arithmetic; `--plot` draws the breakdown."""

import re
import sys

import pytest

from planner import plan
from planner.errors import PlannerError
from planner.reports.explain import explain_text
from tests.doctor.cli_run import cli_process


def test_explain_terms_are_hand_checkable():
    best = plan("llama2-13b", gpus=8, seq_len=4096).best
    text = explain_text(best)
    # Adam state: 13,015,864,320 params x 8 B / 8 ranks = 12.12 GiB, by hand
    assert f"{13_015_864_320 * 8 / 8 / 2**30:.2f} GiB" in text and "optimizer state: 13,015,864,320 x 8 B" in text
    # FLOPs per token: 6 x (13,015,864,320 - 32000 x 5120) + 12 x 40 x 40 x 128 x 4096 = 87.2 GFLOP
    flops = 6 * (13_015_864_320 - 32000 * 5120) + 12 * 40 * 40 * 128 * 4096
    assert f"{flops / 1e9:,.1f} GFLOP" in text
    assert f"{100 * best.time.mfu:.1f}%" in text and f"step: {best.time.step_s:.7g} s" in text
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
    r = cli_process(["explain", "--model", "llama2-7b", "--gpus", "8"])
    assert r.returncode == 0 and "Memory per GPU" in r.stdout and "Time per optimizer step" in r.stdout
    r = cli_process(["explain", "--model", "gpt-175b", "--gpus", "1"])
    assert r.returncode == 2 and "nothing fits" in r.stderr


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_files(tmp_path, suffix):
    pytest.importorskip("matplotlib")
    from planner.reports.plot import plot_candidates

    p = plan("llama2-7b", gpus=8)
    out = plot_candidates(p.candidates[:3], tmp_path / f"plan{suffix}", p.cluster.gpu.memory_bytes)
    data = out.read_bytes()
    assert len(data) > 5000
    if suffix == ".svg":
        assert b"GPU memory" in data and b"activations" in data and b"exposed communication" in data
    else:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_rejects_other_formats(tmp_path):
    from planner.reports.plot import plot_candidates

    with pytest.raises(PlannerError, match="plot: .*png or .svg"):
        plot_candidates([], tmp_path / "plan.pdf", 1)


def test_plot_flag_on_main_command(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.svg"
    r = cli_process(["--model", "llama2-7b", "--gpus", "8", "--top", "3", "--plot", str(out)])
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 5000 and b"GPU memory" in out.read_bytes()


# ---------------------------------------------------------------- the step's budget by operator class

def _class_seconds(text: str) -> dict[str, float]:
    """The seconds each budget term of the explain text starts with."""
    from planner.reports.explain_time import BUDGET

    out = {}
    for _, name in BUDGET:
        m = re.search(rf"^  {re.escape(name)}: ([0-9.e+-]+) s", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


@pytest.mark.parametrize("kwargs", [
    dict(model="llama3-8b", gpus=8, gpu="h100-80gb", seq_len=8192, micro_batch=2,
         activation_checkpointing="selective-op", compile=True),
    dict(model="llama2-13b", gpus=16, gpu="a100-80gb", seq_len=4096, sharding="HYBRID_SHARD",
         activation_checkpointing="full", grad_accum=2),
    dict(model="llama2-7b", gpus=8, offload=True, attention="eager"),
])
def test_explain_class_seconds_sum_to_the_step(kwargs):
    """Every class TimeBreakdown holds is printed (offload only with offload), with the model's own seconds,
    and the printed figures add up to the printed step."""
    from planner import estimate

    c = estimate(**kwargs)
    text = explain_text(c)
    seconds = _class_seconds(text)
    assert ("offload copies" in seconds) == c.config.offload and len(seconds) == 8 + c.config.offload
    step = float(re.search(r"^  step: ([0-9.e+-]+) s", text, re.M).group(1))
    assert sum(seconds.values()) == pytest.approx(step, rel=1e-6)
    assert step == pytest.approx(c.time.step_s, rel=1e-6)
    assert seconds["matmul"] == pytest.approx(c.time.matmul_s, rel=1e-6)
    assert seconds["recompute"] == pytest.approx(c.time.recompute_s, rel=1e-6)


def test_matmul_formula_reproduces_the_model_by_hand():
    """llama2-7b, one A100, one 2,048-token sequence: 32 blocks of q, k, v, o (4096 x 4096), gate, up
    (4096 -> 11008) and down, plus the 32,000-wide head; each 2mnk x 3 passes at 312 TFLOP/s x 0.87
    (catalog) x 0.89 (profile) x the shape factor prod x / (x + 64)."""
    from planner import estimate

    c = estimate("llama2-7b", 1, gpu="a100-80gb", seq_len=2048, micro_batch=1)
    text = explain_text(c)
    assert c.config.grad_accum == 1
    shapes = [(2048, 4096, 4096)] * 4 + [(2048, 11008, 4096)] * 2 + [(2048, 4096, 11008)]
    for name, (m, n, k) in zip(("q", "k", "v", "o", "gate", "up", "down"), shapes):
        assert f"{name} {m}x{n}x{k} [" in text
    assert "output head 2048x32000x4096 [" in text
    assert "312 TFLOP/s bf16 peak x 0.87 large-GEMM" in text and "x 0.89 training fraction" in text
    assert "x / (x + 64)" in text
    rate = 312e12 * 0.87 * 0.89

    def seconds(m, n, k):
        shape = m / (m + 64) * n / (n + 64) * k / (k + 64)
        return 3 * 2 * m * n * k / (rate * shape)

    by_hand = 32 * sum(seconds(*s) for s in shapes) + seconds(2048, 32000, 4096)
    assert by_hand == pytest.approx(c.time.matmul_s, rel=1e-9)
    assert _class_seconds(text)["matmul"] == pytest.approx(by_hand, rel=1e-6)


def test_compile_shrinks_the_memory_bound_term():
    from planner import estimate

    eager, compiled = (explain_text(estimate("llama3-8b", 8, gpu="h100-80gb", seq_len=8192, compile=on))
                       for on in (False, True))
    assert "(eager kernels)" in eager and "(compiled: inductor" in compiled
    assert _class_seconds(compiled)["memory-bound"] < 0.8 * _class_seconds(eager)["memory-bound"]
    assert _class_seconds(compiled)["matmul"] == _class_seconds(eager)["matmul"]


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_step_budget_plot(tmp_path, suffix):
    pytest.importorskip("matplotlib")
    from planner.reports.plot import plot_step_budget

    p = plan("llama3-8b", gpus=8, gpu="h100-80gb", seq_len=8192)
    out = plot_step_budget(p.candidates[:3], tmp_path / f"budget{suffix}")
    assert out == tmp_path / f"budget{suffix}" and [f.name for f in tmp_path.iterdir()] == [out.name]  # no temp left
    data = out.read_bytes()
    if suffix == ".png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) > 5000
    else:
        for name in (b"matmul", b"attention", b"memory-bound", b"exposed communication", b"microseconds per token",
                     b"tok/s"):
            assert name in data


def test_budget_bars_are_time_per_token():
    # candidates at micro-batch 1 and 2 hold different tokens per step: each bar's length is 1e6 / tokens/s
    from planner.reports.plot import _budget_bars

    p = plan("llama3-8b", gpus=8, gpu="h100-80gb", seq_len=8192)
    picks = [next(c for c in p.candidates if c.config.micro_batch == mb) for mb in (1, 2)]

    class Axes:
        def __init__(self):
            self.lengths = [0.0, 0.0]

        def barh(self, rows, widths, left, label):
            for row, w in zip(rows, widths):
                self.lengths[1 - row] += w

        def __getattr__(self, name):
            return lambda *a, **k: None

    ax = Axes()
    _budget_bars(ax, picks, ["a", "b"])
    for length, c in zip(ax.lengths, picks):
        assert length == pytest.approx(1e6 / c.time.tokens_per_s_per_gpu, rel=1e-9)


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    from planner.reports.plot import plot_step_budget

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(PlannerError, match="needs matplotlib: pip install"):
        plot_step_budget([], tmp_path / "budget.png")
    assert not (tmp_path / "budget.png").exists()


def test_explain_cli_explains_a_given_config_and_plots_it(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "budget.png"
    r = cli_process(["explain", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--micro-batch", "2",
                     "--seq-len", "8192", "--activation-checkpointing", "selective-op", "--compile", "--plot", str(out)])
    assert r.returncode == 0, r.stderr
    assert "(selective-op)" in r.stdout and "(compiled: inductor" in r.stdout and "16,384 tokens" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"drawn to {out}" in r.stdout
