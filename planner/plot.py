"""`--plot FILE.png|.svg`: memory breakdown of the top candidates as stacked bars against the GPU's
capacity, and step time split into compute / exposed communication / offload / optimizer / overhead.
matplotlib is optional (`pip install fsdp-planner[plot]`).
"""

from __future__ import annotations

from pathlib import Path

from cost_models.units import GiB

from .errors import PlannerError

MEMORY_CATEGORIES = ("sharded_params", "sharded_grads", "optimizer_state", "optimizer_temporaries",
                     "unsharded_params", "unsharded_grads", "collective_buffers", "activations", "logits_and_loss")
TIME_PARTS = (("compute_s", "compute"), ("exposed_comm_s", "exposed communication"),
              ("offload_copy_s", "offload copies"), ("optimizer_s", "optimizer step"), ("overhead_s", "overhead"))


def plot_candidates(candidates, path, capacity_bytes: int) -> Path:
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise PlannerError("plot", f"{path.name}: the file must end in .png or .svg")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlannerError("plot", "needs matplotlib: pip install 'fsdp-planner[plot]'") from None
    labels = [f"#{i + 1} {c.config.sharding.value}\n{c.config.activation_checkpointing}, mb {c.config.micro_batch}"
              + (", offload" if c.config.offload else "") for i, c in enumerate(candidates)]
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(6 + 1.6 * len(candidates), 5.5))
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
    mem_ax.legend(fontsize=7)
    bottoms = [0.0] * len(candidates)
    for key, name in TIME_PARTS:
        heights = [getattr(c.time, key) for c in candidates]
        if any(heights):
            time_ax.bar(labels, heights, bottom=bottoms, label=name)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    time_ax.set_ylabel("seconds per optimizer step")
    time_ax.set_title("Step time")
    time_ax.legend(fontsize=7)
    for ax in (mem_ax, time_ax):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
