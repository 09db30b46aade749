"""What the torchrun workers share: FsdpConfig from a case's JSON, and running the cases of one launch."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

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
