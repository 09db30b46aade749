"""`fsdp-plan explain`: the planner's pick, or one configuration given by flags, its memory and time budget
term by term; --plot draws the step budget by operator class; --format json gives estimate's JSON with the
same terms under "explanation" (planner.schemas.ExplainOutput)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from planner.cli.options import (CLUSTER, MESH, TRAINING, As, Format, FormatOpt, command, options, param,
                                 require_model_and_gpus)
from planner.request import PP_MICRO_BATCH

# the config flags: None unless given (any one given: explain that config, not the planner's pick)
CONFIG_FLAGS = {
    "sharding": "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, ...", "precision": "fp32, bf16, bf16-pure, fp16",
    "activation_checkpointing": "none, full, every-K, selective-op",
    "micro_batch": "sequences per GPU per micro-step; " + PP_MICRO_BATCH,
    "grad_accum": "micro-steps per optimizer step", "offload": "CPU offload", "compile": "torch.compile each block",
    "float8": "torchao Float8 linears", "fp8_all_gather": "with --float8, all-gather in FP8",
}
MESH_FLAGS = {"async_tp": "TP's collectives overlapped", "sequence_parallel": "with --tp: sequence and loss parallel",
              "shard_group_gpus": "HYBRID_SHARD*: GPUs of one shard group (default a node)"}
_GIVEN = {name: As(default=None, help=f"config: {text}") for name, text in {**CONFIG_FLAGS, **MESH_FLAGS}.items()}


def _params():
    return [
        *options(*CLUSTER, *TRAINING, "attention", *CONFIG_FLAGS, *MESH, *MESH_FLAGS, "trainer",
                  "alloc_conf", "outside_allocator", **_GIVEN),
        param("plot", Annotated[Optional[str], typer.Option("--plot", help="Draw the step budget by operator class "
                                                            "to FILE.png or FILE.svg (the pick and the next 4, or "
                                                            "the given config; needs matplotlib)")], None),
        param("timeline", Annotated[Optional[str], typer.Option("--timeline", help="Write the predicted step (the "
                                                                "explained config) to FILE.json as a Chrome trace: "
                                                                "one compute track, one per collective stream; open "
                                                                "in ui.perfetto.dev")], None),
        param("output_format", FormatOpt, Format.table),
    ]


def explain_cmd(plot: str | None, timeline: str | None, output_format: Format, **knobs):
    """Walk through the winning config's memory and time budget, formula by formula. With any config flag,
    explain that configuration instead (flags not given: `fsdp-plan estimate`'s defaults)."""
    from planner.api import estimate, plan
    from planner.errors import PlannerError
    from planner.reports.explain import explain_json, explain_text

    require_model_and_gpus(knobs)
    flags = {k: knobs.pop(k) for k in [*CONFIG_FLAGS, *MESH, *MESH_FLAGS]}
    given = {k: v for k, v in flags.items() if v is not None}
    if given:
        shown = [estimate(**given, **knobs)]
    else:
        p = plan(**knobs)
        if p.best is None:
            model, gpus, gpu = knobs["model"], knobs["gpus"], knobs["gpu"]
            raise PlannerError("model", f"nothing fits {p.model.name} on {gpus} x {gpu}; run `fsdp-plan --model "
                                        f"{model} --gpus {gpus}` for the nearest misses and what would fit")
        p.replay_top(1)  # the pick explained with estimate's reserved (a pipeline's allocator replay)
        shown = p.candidates[:5]
    if output_format is Format.json:  # stdout stays one JSON document: the plot's path goes to stderr
        typer.echo(explain_json(shown[0], "flags" if given else "plan"))
    else:
        typer.echo(explain_text(shown[0]))
        if not shown[0].fits:
            typer.echo("\nthis config does not fit: " + "; ".join(shown[0].reasons))
    if plot is not None:
        from planner.reports.plot import plot_step_budget

        drawn = plot_step_budget(shown, plot)
        if output_format is Format.json:
            typer.echo(f"step budget drawn to {drawn}", err=True)
        else:
            typer.echo(f"\nstep budget drawn to {drawn}")
    if timeline is not None:
        from planner.reports.timeline import write_timeline

        try:
            written = write_timeline(shown[0], timeline)
        except OSError as e:
            raise PlannerError("timeline", f"cannot write {timeline}: {e.strerror}") from None
        said = f"predicted step written to {written} (a Chrome trace: ui.perfetto.dev or chrome://tracing)"
        typer.echo(said if output_format is Format.json else "\n" + said, err=output_format is Format.json)


def register(app) -> None:
    app.command("explain")(command(_params(), explain_cmd, explain_cmd.__doc__))
