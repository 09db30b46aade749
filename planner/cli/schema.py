"""`fsdp-plan schema NAME`: print the JSON Schema of a command's --format json output (planner.schemas)."""

from __future__ import annotations

from typing import Annotated

import typer


def register(app) -> None:
    """Add the schema command to the typer app."""

    @app.command("schema")
    def schema_cmd(
        name: Annotated[str, typer.Argument(help="The output: plan, estimate, trace, calibrate, check or explain")],
    ):
        """Print the JSON Schema of `fsdp-plan NAME --format json`'s output (versioned: see its $id)."""
        from planner.schemas import schema_text

        typer.echo(schema_text(name), nl=False)
