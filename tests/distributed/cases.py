"""What the torchrun workers share: FsdpConfig from a case's JSON, and running the cases of one launch (a worker's
own `main`: serve_cli; for the tests, launching them: shared).

The shared launch: every test file whose worker serves plain cases (`run_case(case, rank, world) -> dict`) registers
them with `shared(__file__, worker, cases)` and gets a function returning their results. The first call starts ONE
torchrun job per rank count for every registered file that pytest collected (worker_shared.py dispatches each case
to its worker module), so the torchrun unit pays a job's start-up (~8 CPU s: torchrun and two ranks importing torch,
measured 2026-12-06) and each worker's imports once instead of once per file.

While the job runs, the test process would wait idle, then compute the in-process side of the tests (the traces
the real runs are compared with, ~45 s of one core for the 2-rank files). A file gives that work as `while_launching`
(a function warming its own cache): it runs in a thread of the test process during the launch, which returns when
both are done, so no test runs beside it. The torchrun unit is the suite's longest (tests/conftest.py): this takes
its traces off its critical path, onto the core the job leaves."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch.distributed as dist

from cost_models.specs import FsdpConfig


def config_from_dict(data: dict) -> FsdpConfig:
    """FsdpConfig from FsdpConfig.to_dict() JSON (any subset; activation_checkpointing by its CLI name)."""
    data = dict(data)
    if "activation_checkpointing" in data:
        data["ac_every"] = data.pop("activation_checkpointing")
    return FsdpConfig(**data)


def serve(cases: Iterable, run_case: Callable[[object, int, int], dict]) -> None:
    """Run every case in one gloo process group (CI time); rank 0 prints {"case": i, **result} per case."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for i, case in enumerate(cases):
            result = run_case(case, rank, world)
            if rank == 0:
                print(json.dumps({"case": i, **result}), flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def learnable_batch(micro_batch: int, seq_len: int, rank: int, period: int = 8, vocab: int = 256):
    """A fixed batch per rank (different across ranks: real data parallelism): rows cycle through one
    random `period`-token pattern from different offsets, so the next token is learnable from the current one."""
    import torch

    pattern = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:period]
    offsets = torch.randint(0, period, (micro_batch, 1), generator=torch.Generator().manual_seed(1 + rank))
    return pattern[(offsets + torch.arange(seq_len)) % period]


ROOT = Path(__file__).resolve().parents[2]


def _launch(worker: Path, cases: list, timeout_s: float, nproc: int) -> tuple[tuple[dict, ...], str | None]:
    """One `nproc`-rank torchrun job of `worker` over every case (one process group for all: CI time): rank 0's
    results in case order, and why the job failed (None when every case ended)."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(worker)]
    for case in cases:
        args += ["--case", json.dumps(case)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error"}
    try:
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as timeout:
        stdout = timeout.stdout.decode(errors="replace") if isinstance(timeout.stdout, bytes) else timeout.stdout or ""
        stderr = timeout.stderr.decode(errors="replace") if isinstance(timeout.stderr, bytes) else timeout.stderr or ""
        proc = subprocess.CompletedProcess(args, f"timeout after {timeout_s:.0f} s", stdout, stderr)
    results = tuple(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    assert [r["case"] for r in results] == list(range(len(results))), proc.stdout[-3000:]
    # A rank that has printed every case's result and destroyed its process group can still abort in the C++
    # runtime's teardown ("terminate called without an active exception", seen once in a fresh-clone CI run of
    # the MoE cases): that exit says nothing about the cases. Any other failure, or a missing result, fails.
    teardown_abort = len(results) == len(cases) and "terminate called without an active exception" in proc.stderr
    if (proc.returncode == 0 or teardown_abort) and len(results) == len(cases):
        return results, None
    return results, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


class _Shared:
    """The cases registered for the shared launch of one rank count, and (once launched) their results."""

    def __init__(self):
        self.files: dict[str, tuple[str, list, float]] = {}  # test file -> (worker module, cases, timeout_s)
        self.while_launching: dict[str, Callable[[], object]] = {}  # test file -> its in-process side
        self.results: dict[str, tuple[dict, ...]] = {}
        self.failure: str | None = None
        self.launched = False


_SHARED: dict[int, _Shared] = {}
# The test files pytest collected (tests/distributed/conftest.py): the shared launch runs their cases only.
# None (no collection seen): every registered file's.
COLLECTED: set[str] | None = None


def _quietly(work: list[Callable[[], object]]) -> None:
    """Each function in turn; one that raises is left to the tests, which call it again and see the error."""
    for fn in work:
        try:
            fn()
        except Exception:  # noqa: BLE001 - raised again where a test asks for the result
            pass


def shared(test_file: str, worker: str, cases: list, timeout_s: float, nproc: int = 2, first: bool = False,
           while_launching: Callable[[], object] | None = None):
    """Register `cases` of `worker` (a module of tests/distributed with `run_case(case, rank, world) -> dict`) for
    the shared `nproc`-rank launch of the test file `test_file` (its __file__); `first`: before every other file's
    (a worker that reads the process's resident set wants a heap no other case has grown); `while_launching`: the
    file's in-process work, run in a thread while the job runs (module docstring). Returns a function that gives
    the cases' results (rank 0's, in order), launching the shared job on its first call."""
    pool = _SHARED.setdefault(nproc, _Shared())
    key = str(Path(test_file).resolve())
    entry = (worker, list(cases), timeout_s)
    pool.files = {key: entry, **pool.files} if first else {**pool.files, key: entry}
    if while_launching is not None:
        pool.while_launching[key] = while_launching

    def results() -> tuple[dict, ...]:
        if not pool.launched:
            pool.launched = True
            files = [f for f in pool.files if COLLECTED is None or f in COLLECTED or f == key]
            batch = [{"worker": pool.files[f][0], "case": case} for f in files for case in pool.files[f][1]]
            timeout_s = sum(pool.files[f][2] for f in files)
            beside = threading.Thread(target=_quietly, daemon=True, args=(
                [pool.while_launching[f] for f in files if f in pool.while_launching],))
            beside.start()
            got, pool.failure = _launch(Path(__file__).with_name("worker_shared.py"), batch, timeout_s, nproc)
            beside.join()  # no test runs beside it
            start = 0
            for f in files:
                n = len(pool.files[f][1])
                if start + n <= len(got):
                    pool.results[f] = tuple({**r, "case": r["case"] - start} for r in got[start:start + n])
                start += n
        assert key in pool.results, pool.failure or f"{test_file}: its cases were not in the shared launch"
        return pool.results[key]

    return results


def serve_cli(run_case: Callable[[object, int, int], dict]) -> None:
    """A worker's main: its --case JSON arguments, served in one process group."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", required=True, help="JSON: hf_config, config, seq_len")
    args = parser.parse_args()
    serve([json.loads(text) for text in args.case], run_case)
