"""`fsdp-plan`: the typer app and the one place our errors become a one-line message and exit code 2.

Each command is its own module (parse flags -> call the API -> render), registered onto `app` below;
the options they share are defined once, in options.py. Commands import torch lazily, inside the command,
so `fsdp-plan --model ... --gpus ...` starts fast.

    plan.py        fsdp-plan [flags]         rank every configuration that fits, print the best
    estimate.py    fsdp-plan estimate        cost one explicit configuration
    catalog.py     fsdp-plan models | gpus   list the model presets and the GPU catalog
    trace.py       fsdp-plan trace           the real FSDP2 step on fake tensors
    calibrate.py   fsdp-plan calibrate       short real runs, fitted back into the cost model
    check.py       fsdp-plan check           price an existing setup, list what is wrong with it
    explain.py     fsdp-plan explain         the memory and time budget, term by term
    schema.py      fsdp-plan schema NAME     the JSON Schema of a --format json output
    rl.py          fsdp-plan rl estimate     a verl GRPO job's memory, phase by phase
"""

from __future__ import annotations

import sys

import typer
from typer.exceptions import TyperException

from cost_models.specs import SpecError

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Plan PyTorch FSDP configurations: memory, step time, and the config to use.")

from planner.cli import calibrate, catalog, check, estimate, explain, plan, rl, schema, trace  # noqa: E402

# Registration order is the order `fsdp-plan --help` lists the commands in.
for _command in (plan, estimate, catalog, trace, calibrate, check, explain, schema, rl):
    _command.register(app)


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


__all__ = ["app", "main"]
