"""`fsdp-plan [flags]` (the app's default command): rank every FSDP configuration that fits and print the best
as ready-to-use code, or only one artifact of it with --emit."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cost_models.specs import SpecError
from planner.cli.options import (AttentionOpt, CpuRam, Emit, FinetuneOpt, Format, FormatOpt, GlobalBatch, Gpu,
                                 ForceProfile, GpuMemory, Gpus, GpusPerNode, InternodeGbps, IntraNode, LoraRank, Model,
                                 Optim, Pcie, ProfileOpt, SeqLen, TrustRemoteCode, Cp, Ep, Pp, RoutingImbalance,
                                 SequenceParallel, Tp, PpSchedule, PpStagesPerRank,
                                 cluster_and_training, load_profile_flag, mesh_degrees, pipeline_args)


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
    wide: Annotated[bool, typer.Option("--wide", help="Every column of the table (default: the ones that fit "
                                                      "100 columns)")] = False,
    output_format: FormatOpt = Format.table,
    emit: Annotated[Optional[Emit], typer.Option("--emit", help="Print only this artifact of the best config")] = None,
    verify_top: Annotated[int, typer.Option("--verify-top", help="Re-check the top K candidates with the trace tier "
                                                               "(real FSDP2 step on fake tensors, no GPU)")] = 0,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Draw the top candidates' memory and step time "
                                                               "to FILE.png or FILE.svg (needs matplotlib)")] = None,
    tp: Tp = None, cp: Cp = None, ep: Ep = None, pp: Pp = None, pp_schedule: PpSchedule = None,
    pp_stages_per_rank: PpStagesPerRank = None,
    async_tp: Annotated[Optional[bool], typer.Option("--async-tp/--no-async-tp", help="Pin TP's overlap of its "
                                                     "collectives with the matmuls (default: searched where "
                                                     "compile and TP run)")] = None,
    sequence_parallel: SequenceParallel = True, routing_imbalance: RoutingImbalance = 1.0,
    profile: ProfileOpt = None, force_profile: ForceProfile = False, trust_remote_code: TrustRemoteCode = False,
):
    """Rank every FSDP configuration that fits, the device mesh included; print the best as ready-to-use code."""
    if ctx.invoked_subcommand is not None:
        return
    from planner.reports import table as report
    from planner.api import plan
    from planner.emit import emit_artifact, recommendation_text

    args = cluster_and_training(model, gpus, gpus_per_node, gpu, internode_gbps, gpu_memory, intra_node_gb_per_s,
                                 pcie_gb_per_s, cpu_ram_per_node, seq_len, global_batch, optimizer, finetune,
                                 lora_rank, trust_remote_code, routing_imbalance)
    if top < 1:
        raise SpecError("top", f"must be >= 1, got {top}")
    if verify_top < 0:
        raise SpecError("verify_top", f"must be >= 0, got {verify_top}")
    fitted = load_profile_flag(profile, gpu, force_profile)
    p = plan(model, precisions=precision, attention=attention, profile=fitted, reduce_dtypes=reduce_dtype,
             **mesh_degrees(tp, cp, ep, pp), **pipeline_args(pp_schedule, pp_stages_per_rank), async_tp=async_tp, sequence_parallel=sequence_parallel, **args)
    if plot is not None:
        from planner.reports.plot import plot_candidates

        plot_candidates((p.candidates or p.misses)[:top], plot, p.cluster.gpu.memory_bytes)
    if verify_top and emit is None:
        from planner.tracing import verified_plan_json, verified_plan_text, verify_top as run_verification

        checks = run_verification(p, verify_top, model, fitted)
        typer.echo(verified_plan_json(p, top, checks) if output_format is Format.json
                   else verified_plan_text(p, top, checks, wide))
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
    typer.echo(report.plan_text(p, top, wide))
    if p.best is not None:
        typer.echo("\n" + recommendation_text(p.best))


def register(app) -> None:
    """Make planning the app's default command (its flags come before any subcommand)."""
    app.callback(invoke_without_command=True)(main_plan)
