"""torchrun worker: the bytes FSDP1 and FSDP2 copy around their collectives, counted op by op on gloo ranks.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_fsdp_copies.py \
        --case '{"fsdp": 1, "config": {"precision": "bf16"}, "micro_steps": 2}' [--case ...]

Each case builds BLOCKS blocks of two bias-free WIDTH x WIDTH linears (no root parameters), wraps them with
calibration.apply's apply_fsdp1 or apply_fsdp2 (the code the plans emit), runs one warm-up forward and backward
(FSDP's lazy init), then `micro_steps` forward-backward passes under a TorchDispatchMode that reads every ATen op's
tensors. The activations (TOKENS x WIDTH) are smaller than PARAM_SIZED elements and every parameter, shard and
gradient is larger, so the ops on param-sized tensors are the model's matmuls and FSDP's own copies. COPIES says
what each copy reads and writes; ops dispatched inside torch.distributed.distributed_c10d (the collectives, and
gloo's reduce-scatter copying its result out on Work.wait(), which NCCL does not) are left out. Rank 0 prints
{"case": i, "bytes": read + written, "by_op": {...}, "unexpected": [ops on param-sized tensors COPIES lacks]}.
"""

from __future__ import annotations

import traceback

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from calibration.apply import apply_fsdp1, apply_fsdp2, cast_for_precision, make_mesh
from tests.distributed.cases import config_from_dict, serve_cli

WIDTH, BLOCKS, TOKENS = 64, 2, 2
PARAM_SIZED = 1024  # elements: above TOKENS x WIDTH, below a shard of one weight (WIDTH^2 / 4 on 4 ranks)


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


# op -> (bytes read, bytes written) from (args, kwargs, out)
COPIES = {
    "copy_": lambda a, k, o: (_bytes([a[1]]), _bytes([a[0]])),
    "_to_copy": lambda a, k, o: (_bytes([a[0]]), _bytes([o])),
    "cat": lambda a, k, o: (_bytes(a[0]), _bytes([o])),
    "div_": lambda a, k, o: (_bytes([a[0]]), _bytes([a[0]])),
    "add_": lambda a, k, o: (_bytes([a[0], a[1]]), _bytes([a[0]])),
    "_foreach_copy_": lambda a, k, o: (_bytes(a[1]), _bytes(a[0])),
    "all_gather_copy_in": lambda a, k, o: (_bytes(a[0]), _bytes([o[0]])),  # into this rank's slice of the output
    "split_with_sizes_copy": lambda a, k, o: (_bytes([a[0]]), _bytes(k["out"])),
    "chunk_cat": lambda a, k, o: (_bytes(a[0]), _bytes([k["out"]])),
}
FREE = {"mm", "t", "view", "detach", "split", "split_with_sizes", "slice", "as_strided", "expand", "empty",
        "empty_like", "alias"}  # the matmuls and what moves no bytes


class CopyCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}
        self.unexpected: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in FREE or max((t.numel() for t in _tensors((args, kwargs, out))), default=0) < PARAM_SIZED:
            return out
        stack = traceback.extract_stack()[:-1]
        if any(f.filename.endswith("distributed_c10d.py") for f in stack):
            return out
        if name not in COPIES:
            self.unexpected.add(name)
            return out
        read, written = COPIES[name](args, kwargs, out)
        where = next((f.name for f in reversed(stack) if "/fsdp/" in f.filename or "/autograd/" in f.filename), "?")
        self.by_op[f"{name} ({where})"] = self.by_op.get(f"{name} ({where})", 0) + read + written
        return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def run_case(case: dict, rank: int, world: int) -> dict:
    config = config_from_dict(case["config"])
    torch.manual_seed(0)
    model = cast_for_precision(Net(), config)
    if case["fsdp"] == 1:
        model = apply_fsdp1(model, config, {Block}, device_id=torch.device("cpu"))
    else:
        apply_fsdp2(model, config, {Block}, make_mesh(config, world, world, "cpu"))
    x = torch.randn(TOKENS, WIDTH, dtype=next(model.parameters()).dtype, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    counter = CopyCounter()
    with counter:
        for _ in range(case["micro_steps"]):
            model(x).sum().backward()
    return {"bytes": sum(counter.by_op.values()), "by_op": counter.by_op, "unexpected": sorted(counter.unexpected)}


if __name__ == "__main__":
    serve_cli(run_case)
