"""`fsdp-plan estimate`: cost one explicit configuration (the flags of options.config_command)."""

from __future__ import annotations

import typer

from planner.cli.options import Format, config_command


def _estimate(knobs: dict, output_format: Format) -> None:
    from planner.reports import table as report
    from planner.api import estimate

    c = estimate(**knobs)
    typer.echo(report.estimate_json(c) if output_format is Format.json else report.estimate_text(c))


def register(app) -> None:
    """Add the estimate command to the typer app."""
    config_command(app, "estimate", "Cost one explicit configuration.", _estimate, takes_profile=True)
