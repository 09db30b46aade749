"""`fsdp-plan` in this process: its stdout, failing the test on a non-zero exit."""

from __future__ import annotations

import contextlib
import io


def run_cli(argv: list[str]) -> str:
    from planner.cli import main

    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code
    assert code in (0, None), out.getvalue()[-2000:]
    return out.getvalue()
