"""torchrun worker of the shared launch (tests/distributed/cases.shared): every --case is {"worker": a worker
module of tests/distributed, "case": its case}, run by that module's run_case in one process group. A worker
module is imported when its first case starts, so the cases before it run in a process that has not imported it."""

from __future__ import annotations

import importlib

from tests.distributed.cases import serve_cli


def run_case(case: dict, rank: int, world: int) -> dict:
    return importlib.import_module(f"tests.distributed.{case['worker']}").run_case(case["case"], rank, world)


if __name__ == "__main__":
    serve_cli(run_case)
