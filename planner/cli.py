"""`fsdp-plan`: each command parses flags, calls the API, renders. Errors become one line and exit 2."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from typer.exceptions import TyperException

from cost_models.specs import SpecError
from planner.cli_options import (AttentionOpt, CpuRam, Emit, FinetuneOpt, Format, FormatOpt, GlobalBatch, Gpu,
                                 ForceProfile, GpuMemory, Gpus, GpusPerNode, InternodeGbps, IntraNode, LoraRank, Model,
                                 Optim, Pcie, ProfileOpt, SeqLen, TrustRemoteCode, cluster_and_training,
                                 config_command, load_profile_flag)

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Plan PyTorch FSDP configurations: memory, step time, and the config to use.")


@app.callback(invoke_without_command=True)
def main_plan(
    ctx: typer.Context,
    model: Model = None, gpus: Gpus = None, gpus_per_node: GpusPerNode = None, gpu: Gpu = "a100-80gb",
    internode_gbps: InternodeGbps = None, gpu_memory: GpuMemory = None, intra_node_gb_per_s: IntraNode = None,
    pcie_gb_per_s: Pcie = None, cpu_ram_per_node: CpuRam = None,
    seq_len: SeqLen = 2048, global_batch: GlobalBatch = None, optimizer: Optim = "adamw",
    finetune: FinetuneOpt = "full", lora_rank: LoraRank = 16, attention: AttentionOpt = None,
    precision: Annotated[Optional[list[str]], typer.Option("--precision", help="Precisions to search (repeatable)")] = None,
    reduce_dtype: Annotated[Optional[list[str]], typer.Option("--reduce-dtype", help="Gradient reduction dtypes to "
                                                              "search, fp32 | bf16 (repeatable; default: each "
                                                              "precision's own)")] = None,
    top: Annotated[int, typer.Option("--top", help="Candidates to show")] = 5,
    output_format: FormatOpt = Format.table,
    emit: Annotated[Optional[Emit], typer.Option("--emit", help="Print only this artifact of the best config")] = None,
    verify_top: Annotated[int, typer.Option("--verify-top", help="Re-check the top K candidates with the trace tier "
                                                               "(real FSDP2 step on fake tensors, no GPU)")] = 0,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Draw the top candidates' memory and step time "
                                                               "to FILE.png or FILE.svg (needs matplotlib)")] = None,
    profile: ProfileOpt = None, force_profile: ForceProfile = False, trust_remote_code: TrustRemoteCode = False,
):
    """Rank every FSDP configuration that fits; print the best as ready-to-use code."""
    if ctx.invoked_subcommand is not None:
        return
    from planner import report
    from planner.api import plan
    from planner.emit import emit_artifact, recommendation_text

    args = cluster_and_training(model, gpus, gpus_per_node, gpu, internode_gbps, gpu_memory, intra_node_gb_per_s,
                                 pcie_gb_per_s, cpu_ram_per_node, seq_len, global_batch, optimizer, finetune,
                                 lora_rank, trust_remote_code)
    if top < 1:
        raise SpecError("top", f"must be >= 1, got {top}")
    if verify_top < 0:
        raise SpecError("verify_top", f"must be >= 0, got {verify_top}")
    fitted = load_profile_flag(profile, gpu, force_profile)
    p = plan(model, precisions=precision, attention=attention, profile=fitted, reduce_dtypes=reduce_dtype, **args)
    if plot is not None:
        from planner.plot import plot_candidates

        plot_candidates((p.candidates or p.misses)[:top], plot, p.cluster.gpu.memory_bytes)
    if verify_top and emit is None:
        from planner.tracing import verified_plan_json, verified_plan_text, verify_top as run_verification

        checks = run_verification(p, verify_top, model, fitted)
        typer.echo(verified_plan_json(p, top, checks) if output_format is Format.json
                   else verified_plan_text(p, top, checks))
        if output_format is not Format.json and p.best is not None:
            typer.echo("\n" + recommendation_text(p.best))
        return
    if emit is not None:
        if p.best is None:
            raise SpecError("emit", "nothing fits, so there is no config to emit; run without --emit to see why")
        typer.echo(emit_artifact(emit.value, p.best))
        return
    if output_format is Format.json:
        typer.echo(report.plan_json(p, top))
        return
    typer.echo(report.plan_text(p, top))
    if p.best is not None:
        typer.echo("\n" + recommendation_text(p.best))


def _estimate(model, args: dict, config: dict, output_format: Format) -> None:
    from planner import report
    from planner.api import estimate

    c = estimate(model, **config, **args)
    typer.echo(report.estimate_json(c) if output_format is Format.json else report.estimate_text(c))


config_command(app, "estimate", "Cost one explicit configuration.", _estimate, takes_profile=True)


@app.command("models")
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


@app.command("gpus")
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


# Commands that live in their own modules (they import torch lazily, inside the command).
from planner import cli_calibrate, cli_check, cli_explain, cli_trace  # noqa: E402

cli_trace.register(app)
cli_calibrate.register(app)
cli_check.register(app)
cli_explain.register(app)


def _fail(message: str) -> None:
    # a value read from a user's file may hold lone surrogates (YAML's "\ud800" escapes): print them escaped
    typer.echo(f"error: {message}".encode("utf-8", "backslashreplace").decode("utf-8"), err=True)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: typer's usage errors and our input errors become one line and exit code 2."""
    try:
        result = app(args=argv, standalone_mode=False)
    except SpecError as exc:
        _fail(str(exc))
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _fail("aborted")
    except TyperException as exc:  # typer's vendored click usage errors: bad or missing flags and values
        _fail(exc.format_message().replace("\n", " "))
    if isinstance(result, int) and result:  # --help and friends return an exit code
        sys.exit(result)


if __name__ == "__main__":
    main()
