"""`fsdp-plan rl estimate`: one verl GRPO configuration priced phase by phase (planner/rl), its flags verl's own
knob names (planner/rl/request.py)."""

from __future__ import annotations

import typer

from planner.cli.flags import command, options, param
from planner.cli.options import CLUSTER, FormatOpt, Format
from planner.rl.request import RL_KNOBS, RlRequest

rl_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                     help="RL post-training (verl GRPO, FSDP actor beside a vLLM / SGLang rollout engine).")


def _estimate(output_format: Format, **knobs) -> None:
    from planner.rl import rl_estimate
    from planner.rl.report import rl_json, rl_text

    e = rl_estimate(knobs.pop("model"), knobs.pop("gpus"), **knobs)
    typer.echo(rl_json(e) if output_format is Format.json else rl_text(e))


def register(app) -> None:
    """Add `fsdp-plan rl estimate`."""
    names = CLUSTER + tuple(n for n in RL_KNOBS if n not in CLUSTER and n != "scale_up_domain_gpus")
    params = [*options(*names, request=RlRequest), param("output_format", FormatOpt, Format.table)]
    rl_app.command("estimate")(command(params, _estimate, "Price one verl GRPO configuration: every phase's GPU "
                                                          "memory, the engine's KV cache, host RAM per node."))
    app.add_typer(rl_app, name="rl")
