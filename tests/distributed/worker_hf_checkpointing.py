"""torchrun worker (2 ranks, gloo, CPU): how many all-gathers one forward + backward issues when each block is
checkpointed from outside its FSDP unit, as Hugging Face Trainer's own activation checkpointing does
(torch.utils.checkpoint around the wrapped block's call), for FSDP1 and FSDP2, reentrant or not, and without
checkpointing. A case is {"fsdp", "checkpointed", "reentrant"}; rank 0 prints one JSON line per case:
{"fsdp", "reentrant", "checkpointed", "all_gathers", "blocks"}."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.distributed.cases import serve_cli

N_BLOCKS = 3


class Model(nn.Module):
    def __init__(self, checkpointed: bool, reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
                                    for _ in range(N_BLOCKS))
        self.head = nn.Linear(16, 1)
        self.checkpointed, self.reentrant = checkpointed, reentrant

    def forward(self, x):
        for block in self.blocks:  # like transformers' GradientCheckpointingLayer: the call is checkpointed
            x = checkpoint(block.__call__, x, use_reentrant=self.reentrant) if self.checkpointed else block(x)
        return self.head(x)


def count_all_gathers(version: int, checkpointed: bool, reentrant: bool) -> int:
    torch.manual_seed(0)
    model = Model(checkpointed, reentrant)
    calls = [0]
    if version == 2:
        from torch.distributed.fsdp import fully_shard
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as group

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        original, owner, name = group.foreach_all_gather, group, "foreach_all_gather"
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._flat_param import FlatParamHandle
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
                                         use_orig_params=True, device_id=torch.device("cpu"))
        original, owner, name = FlatParamHandle._all_gather_flat_param, FlatParamHandle, "_all_gather_flat_param"

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    finally:
        setattr(owner, name, original)
    return calls[0]


def run_case(case: dict, rank: int, world: int) -> dict:
    n = count_all_gathers(case["fsdp"], case["checkpointed"], case["reentrant"])
    return {**case, "all_gathers": n, "blocks": N_BLOCKS}


if __name__ == "__main__":
    serve_cli(run_case)
