"""`fsdp-plan rl` (rank a small search) and `fsdp-plan rl estimate` (one configuration): a verl GRPO job priced
phase by phase (planner/rl), the flags verl's own knob names (planner/rl/request.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from planner.cli.flags import command, options, param
from planner.cli.options import CLUSTER, FormatOpt, Format
from planner.rl.request import RL_KNOBS, RlRequest

rl_app = typer.Typer(add_completion=False, rich_markup_mode=None, invoke_without_command=True,
                     help="RL post-training (verl GRPO, FSDP actor beside a vLLM / SGLang rollout engine).")
NAMES = CLUSTER + tuple(n for n in RL_KNOBS if n not in CLUSTER and n != "scale_up_domain_gpus")
TopOpt = Annotated[int, typer.Option("--top", help="Configurations to list")]


def _estimate(output_format: Format, **knobs) -> None:
    from planner.rl import rl_estimate
    from planner.rl.report import rl_json, rl_text

    e = rl_estimate(knobs.pop("model"), knobs.pop("gpus"), **knobs)
    typer.echo(rl_json(e) if output_format is Format.json else rl_text(e))


def _plan(ctx: typer.Context, output_format: Format, top: int, **knobs) -> None:
    if ctx.invoked_subcommand is not None:
        return
    from planner.errors import PlannerError
    from planner.rl.report import rl_plan_json, rl_plan_text
    from planner.rl.request import rl_request
    from planner.rl.search import plan_rl

    if knobs.get("model") is None:
        raise PlannerError("model", "missing: pass --model with a preset name (see `fsdp-plan models`)")
    p = plan_rl(rl_request(knobs.pop("model"), knobs.pop("gpus"), **knobs), top=top)
    typer.echo(rl_plan_json(p) if output_format is Format.json else rl_plan_text(p))


def register(app) -> None:
    """Add `fsdp-plan rl` and `fsdp-plan rl estimate`."""
    import inspect

    shared = [*options(*NAMES, request=RlRequest), param("output_format", FormatOpt, Format.table)]
    context = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
    rl_app.callback()(command([context, *shared, param("top", TopOpt, 5)], _plan,
                              "Rank verl GRPO configurations (offloads, micro-batch, gpu_memory_utilization, "
                              "rollout TP) by estimated step time among those that fit; then `rl estimate` one."))
    rl_app.command("estimate")(command(shared, _estimate, "Price one verl GRPO configuration: every phase's GPU "
                                                          "memory, the engine's KV cache, host RAM per node."))
    app.add_typer(rl_app, name="rl")
