"""`fsdp-plan models` and `fsdp-plan gpus`: the model presets and the GPU catalog, with their sources."""

from __future__ import annotations

import typer


def models_cmd():
    """List the model presets."""
    from tabulate import tabulate

    from planner.models import list_presets, load_preset, preset_source

    rows = []
    for name in list_presets():
        s = load_preset(name)
        rows.append([name, f"{s.n_params:,}", s.n_layers, s.hidden_size, s.n_heads, s.n_kv_heads,
                     s.vocab_size, s.block_class, preset_source(name)])
    typer.echo(tabulate(rows, headers=["preset", "params", "layers", "hidden", "heads", "kv heads", "vocab",
                                       "block", "source"], disable_numparse=True))


def gpus_cmd():
    """List the GPU catalog with sources."""
    from tabulate import tabulate

    from planner.hardware import gpu_catalog

    rows = [[g.id, g.name, f"{g.memory_bytes / 2**30:.0f}", f"{g.hbm_bytes_per_s / 1e12:g}",
             *(f"{g.peak_flops[k] / 1e12:g}" if k in g.peak_flops else "-" for k in ("bf16", "fp16", "fp32", "fp8")),
             f"{g.intra_node_bus_bytes_per_s / 1e9:g}", g.scale_up_domain_gpus or "-", g.source]
            for g in gpu_catalog().values()]
    typer.echo(tabulate(rows, headers=["id", "name", "GiB", "HBM TB/s", "bf16 TF", "fp16 TF", "fp32 TF", "fp8 TF",
                                       "bus GB/s", "scale-up GPUs", "source"], disable_numparse=True))


def register(app) -> None:
    """Add the models and gpus commands to the typer app."""
    app.command("models")(models_cmd)
    app.command("gpus")(gpus_cmd)
