"""`--plot FILE.png|.svg`: the main command draws the top candidates' memory (stacked bars against the GPU's
capacity) beside their step budget; `fsdp-plan explain --plot` draws the step budget alone. The budget is
one horizontal stacked bar per candidate, in microseconds per token (so micro-batch 1 and 2 compare like
for like), ending with its tokens/s, by the classes of
explain_time.BUDGET (TimeBreakdown's matmul, attention, memory-bound, recompute, exposed communication, ...),
which add up to the step. Files are written atomically (a temporary file beside the target, then
os.replace). matplotlib is optional (`pip install fsdp-planner[plot]`) and imported only here, when drawing.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cost_models.units import GiB

from planner.errors import PlannerError
from planner.reports.explain_time import BUDGET

MEMORY_CATEGORIES = ("sharded_params", "sharded_grads", "optimizer_state", "optimizer_temporaries",
                     "unsharded_params", "unsharded_grads", "collective_buffers", "activations", "logits_and_loss")


def _pyplot(path: Path):
    """matplotlib.pyplot on the Agg backend, after checking the file type (before the import: a clear error
    either way)."""
    if path.suffix.lower() not in (".png", ".svg"):
        raise PlannerError("plot", f"{path.name}: the file must end in .png or .svg")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlannerError("plot", "needs matplotlib: pip install 'fsdp-planner[plot]'") from None
    return plt


def _save(plt, fig, path: Path) -> Path:
    """Write the figure to a temporary file in the target's folder, then rename it over the target."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, format=path.suffix[1:].lower(), bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _label(i: int, c) -> str:
    cfg = c.config
    techniques = [t for t, on in (("compile", cfg.compile), ("float8", cfg.float8), ("offload", cfg.offload)) if on]
    return (f"#{i + 1} {cfg.sharding.value}\n{cfg.activation_checkpointing}, mb {cfg.micro_batch}"
            + "".join(f", {t}" for t in techniques))


def _budget_bars(ax, candidates, labels: list[str]) -> None:
    """One horizontal bar per candidate (the first on top), stacked by BUDGET class, in microseconds per
    token: candidates whose steps hold different numbers of tokens (micro-batch, accumulation) compare
    like for like; each bar ends with its tokens/s per GPU."""
    rows = list(range(len(candidates)))[::-1]
    per_token = [1e6 / (c.time.tokens_per_s_per_gpu * c.time.step_s) for c in candidates]  # us per step-second
    lefts = [0.0] * len(candidates)
    for key, name in BUDGET:
        widths = [getattr(c.time, key) * k for c, k in zip(candidates, per_token)]
        if any(widths):
            ax.barh(rows, widths, left=lefts, label=name)
            lefts = [a + w for a, w in zip(lefts, widths)]
    for row, left, c in zip(rows, lefts, candidates):
        ax.text(left, row, f" {c.time.tokens_per_s_per_gpu:,.0f} tok/s", va="center", fontsize=7)
    ax.set_xlim(0, 1.25 * max(lefts))
    ax.set_yticks(rows, labels, fontsize=7)
    ax.set_xlabel("microseconds per token per GPU (1e6 / tokens/s)")
    ax.set_title("Step budget by operator class")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_step_budget(candidates, path) -> Path:
    """The step budget of each candidate (or of the one explained config) as a horizontal stacked bar."""
    path = Path(path)
    plt = _pyplot(path)
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.7 * len(candidates)))
    _budget_bars(ax, candidates, [_label(i, c) for i, c in enumerate(candidates)])
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_candidates(candidates, path, capacity_bytes: int) -> Path:
    """Memory at the peak (vertical stacked bars, the GPU's capacity as a line) beside the step budget."""
    path = Path(path)
    plt = _pyplot(path)
    labels = [_label(i, c) for i, c in enumerate(candidates)]
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(9 + 1.6 * len(candidates), 5.5))
    bottoms = [0.0] * len(candidates)
    for category in MEMORY_CATEGORIES:
        heights = [c.memory.breakdown.to_dict()[category] / GiB for c in candidates]
        if any(heights):
            mem_ax.bar(labels, heights, bottom=bottoms, label=category.replace("_", " "))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    extra = [(c.memory.peak_reserved_bytes - c.memory.peak_allocated_bytes) / GiB for c in candidates]
    mem_ax.bar(labels, extra, bottom=bottoms, label="context + fragmentation", color="lightgrey")
    mem_ax.axhline(capacity_bytes / GiB, color="red", linestyle="--", label="GPU memory")
    mem_ax.set_ylabel("GiB per GPU at the peak")
    mem_ax.set_title("Memory")
    mem_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.12), ncol=3)  # below, off the bars
    mem_ax.tick_params(axis="x", labelsize=7)
    _budget_bars(time_ax, candidates, labels)
    fig.tight_layout()
    return _save(plt, fig, path)
