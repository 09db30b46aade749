"""`fsdp-plan trace`: the real FSDP2 step on fake tensors (registered onto the app by planner.cli).

Takes exactly the flags of `fsdp-plan estimate` (options.config_command) and prints the same JSON
shape with "source": "trace", plus the analytic estimate ("analytic") and the difference; or a table of
both by category.
"""

from __future__ import annotations

import typer

from typing import Annotated

from planner.cli.options import Format, config_command, param

# PyTorch's caching-allocator settings (PYTORCH_CUDA_ALLOC_CONF's syntax) the trace's reserved replay runs under
AllocConf = Annotated[str, typer.Option("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF the run will set, e.g. "
                                        "expandable_segments:True or max_split_size_mb:512: the reserved peak is "
                                        "replayed under it (cost_models/caching_allocator.py)")]


def _trace(knobs: dict, output_format: Format) -> None:
    import json

    from planner.tracing import report_text, trace

    r = trace(**knobs)
    typer.echo(json.dumps(r.to_dict(), indent=2) if output_format is Format.json else report_text(r))


def register(app) -> None:
    """Add the trace command to the typer app."""
    config_command(app, "trace", "Run the real FSDP2 training step on fake tensors (no GPU, no memory) and compare "
                   "its per-rank memory with the estimate.", _trace, own=(param("alloc_conf", AllocConf, ""),))
