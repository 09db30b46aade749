"""`fsdp-plan trace`: the real FSDP2 step on fake tensors (registered onto the app by planner.cli).

Takes exactly the flags of `fsdp-plan estimate` (options.config_command) and prints the same JSON
shape with "source": "trace", plus the analytic estimate ("analytic") and the difference; or a table of
both by category.
"""

from __future__ import annotations

import typer

from planner.cli.options import Format, config_command


def _trace(knobs: dict, output_format: Format) -> None:
    import json

    from planner.tracing import report_text, trace

    r = trace(**knobs)
    typer.echo(json.dumps(r.to_dict(), indent=2) if output_format is Format.json else report_text(r))


def register(app) -> None:
    """Add the trace command to the typer app."""
    config_command(app, "trace", "Run the real FSDP2 training step on fake tensors (no GPU, no memory) and compare "
                   "its per-rank memory with the estimate (--alloc-conf: the reserved peak replayed under it).",
                   _trace)
