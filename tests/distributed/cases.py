"""What the torchrun workers share: FsdpConfig from a case's JSON, and running the cases of one launch (and, for
the tests, launching them: run_cases; the worker's own `main`: serve_cli)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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


def run_cases(worker: Path, cases: list[dict], timeout_s: float, nproc: int = 2) -> tuple[dict, ...]:
    """One `nproc`-rank torchrun job of `worker` over every case (one process group for all: CI time); rank 0's
    results."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(worker)]
    for case in cases:
        args += ["--case", json.dumps(case)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    results = tuple(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    # A rank that has printed every case's result and destroyed its process group can still abort in the C++
    # runtime's teardown ("terminate called without an active exception", seen once in a fresh-clone CI run of
    # the MoE cases): that exit says nothing about the cases. Any other failure, or a missing result, fails.
    teardown_abort = len(results) == len(cases) and "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or teardown_abort, \
        f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert len(results) == len(cases), proc.stdout
    return results


def serve_cli(run_case: Callable[[object, int, int], dict]) -> None:
    """A worker's main: its --case JSON arguments, served in one process group."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", required=True, help="JSON: hf_config, config, seq_len")
    args = parser.parse_args()
    serve([json.loads(text) for text in args.case], run_case)
