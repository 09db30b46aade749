"""Progress of long work (a block profile's trace, a model's trace) on stderr, only where a person watches.

    with progress("tracing a block of deepseek-v3 (bf16, sdpa)") as advance:   # a spinner and the time
        ...
    with progress("verifying the top 3 by trace", total=3) as advance:          # a bar, n / total
        for ...: ...; advance()

rich (which typer brings) draws it on stderr when stderr is a terminal, and removes it when the work is
done (transient), so what is left on the screen is the command's own output. Piped or captured stderr
(CI, `2> log`, tests) and `--format json` (the CLI's --format option calls quiet_for) get nothing: the
output is byte-identical with and without it. rich is imported only when a bar is drawn.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

_quiet = False


def quiet_for(output_format):
    """typer callback of --format: json output draws no progress (table does). Returns the value unchanged."""
    global _quiet
    _quiet = str(getattr(output_format, "value", output_format)) == "json"
    return output_format


def _console():
    """The rich Console that progress draws on: stderr's, or None when stderr is not a terminal."""
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def progress(description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
    """Show `description` with the elapsed time (and a bar of `total` steps) while the block runs; yields
    advance(n=1). A no-op off a terminal and under --format json."""
    console = None if _quiet else _console()
    if console is None or not console.is_terminal:
        yield lambda n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar_columns = (BarColumn(), MofNCompleteColumn()) if total else ()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), *bar_columns, TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
