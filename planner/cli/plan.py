"""`fsdp-plan [flags]` (the app's default command): rank every FSDP configuration that fits and print the best
as ready-to-use code, or only one artifact of it with --emit."""

from __future__ import annotations

import inspect
from typing import Annotated, Optional

import typer

from cost_models.specs import SpecError
from planner.cli.options import (CLUSTER, MESH, TRAINING, As, Emit, ForceProfile, Format, FormatOpt, ProfileOpt,
                                 command, load_profile_flag, options, param, require_model_and_gpus)

ASYNC_TP = As(help="Pin TP's overlap of its collectives with the matmuls (default: searched where compile and TP run)")


def _params() -> list[inspect.Parameter]:
    return [
        inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context),
        *options(*CLUSTER, *TRAINING, "attention", "attention_kernel", "liger", "norm_kernel", "rope_kernel",
                 "swiglu_kernel", "loss_kernel", "precisions", "reduce_dtypes"),
        param("top", Annotated[int, typer.Option("--top", help="Candidates to show")], 5),
        param("wide", Annotated[bool, typer.Option("--wide", help="Every column of the table (default: the ones "
                                                                  "that fit 100 columns)")], False),
        param("output_format", FormatOpt, Format.table),
        param("emit", Annotated[Optional[Emit], typer.Option("--emit", help="Print only this artifact of the best "
                                                                            "config")], None),
        param("verify_top", Annotated[int, typer.Option("--verify-top", help="Re-check the top K candidates with "
                                                        "the trace tier (real FSDP2 step on fake tensors, no "
                                                        "GPU)")], 0),
        param("plot", Annotated[Optional[str], typer.Option("--plot", help="Draw the top candidates' memory and "
                                                            "step time to FILE.png or FILE.svg (needs "
                                                            "matplotlib)")], None),
        *options(*MESH, "shard_group_gpus", "async_tp", "sequence_parallel", "routing_imbalance", "routing",
                 async_tp=ASYNC_TP),
        param("profile", ProfileOpt, None), param("force_profile", ForceProfile, False),
        *options("trainer", "alloc_conf", "outside_allocator", "trust_remote_code"),
    ]


def main_plan(ctx: typer.Context, top: int, wide: bool, output_format: Format, emit, verify_top: int, plot,
              profile: str | None, force_profile: bool, **knobs):
    """Rank every FSDP configuration that fits, the device mesh included; print the best as ready-to-use code."""
    if ctx.invoked_subcommand is not None:
        return
    from planner.reports import table as report
    from planner.api import plan
    from planner.emit import emit_artifact, recommendation_text
    from planner.trainers import resolve_trainer

    require_model_and_gpus(knobs)
    knobs["trainer"] = resolve_trainer(knobs.get("trainer"), emit.value if emit is not None else None).id
    if top < 1:
        raise SpecError("top", f"must be >= 1, got {top}")
    if verify_top < 0:
        raise SpecError("verify_top", f"must be >= 0, got {verify_top}")
    fitted = load_profile_flag(profile, knobs["gpu"], force_profile)
    p = plan(profile=fitted, **knobs)
    p.replay_top(1 if emit is not None else top)  # the rows printed (or emitted) get estimate's reserved memory
    if plot is not None:
        from planner.reports.plot import plot_candidates

        plot_candidates((p.candidates or p.misses)[:top], plot, p.cluster.gpu.memory_bytes)
    if verify_top and emit is None:
        from planner.tracing import verified_plan_json, verified_plan_text, verify_top as run_verification

        checks = run_verification(p, verify_top, knobs["model"], fitted)
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
    app.callback(invoke_without_command=True)(command(_params(), main_plan, main_plan.__doc__))
