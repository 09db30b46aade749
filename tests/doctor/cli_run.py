"""`fsdp-plan` in this process: what a run of the command shows (exit code, stdout, stderr) without starting one.

A subprocess costs its interpreter, its imports (~1 s for the planner, +2.3 s of CPU with torch) and no more
checks: `planner.cli.main` is the console entry point, its exit codes come through SystemExit and its
one-line errors through sys.stderr. An exception it does not turn into a message is printed as a subprocess's
interpreter would print it, exit code 1. The tests that need a process of their own (what a fresh interpreter
imports, the `python -m planner.cli` entry, an environment of its own) start one.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import traceback


def cli_process(argv: list[str]) -> subprocess.CompletedProcess:
    """Run `fsdp-plan ARGV` in-process: a CompletedProcess as subprocess.run(capture_output=True, text=True)."""
    from planner.cli import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:  # noqa: BLE001 - what a subprocess would show: its traceback, exit 1
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_cli(argv: list[str]) -> str:
    """`fsdp-plan ARGV` in-process: its stdout, failing the test on a non-zero exit."""
    r = cli_process(argv)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    return r.stdout
