"""Apply the planner's pick to a real model and train a few steps, under torchrun.

On CPU (gloo), no GPU needed:
    torchrun --standalone --nproc_per_node=2 examples/train_with_plan.py --fsdp-version 2
On GPUs, the same script with --device cuda. The model is a small Llama-style transformer built from a
ModelSpec (calibration/reference.py); any nn.Module works the same way: plan(module, gpus=...) counts its
parameters on the meta device and finds its repeated block class.

Rank 0 prints one JSON line: {"fsdp_version", "config", "losses"}.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel

from calibration.reference import build_reference, tiny_llama_spec
from planner import plan
from planner.search.space import SearchSpace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    spec = tiny_llama_spec(n_layers=4)
    seq_len = 32
    # Plan for this job's world size; bf16 mixed precision (bf16 runs on CPU too). On CPU the search leaves
    # torch.compile out: inductor would first build C++ kernels for every block (~20 s of a cold start).
    space = None if device.type == "cuda" else SearchSpace(compile=(False,))
    best = plan(spec, gpus=world, gpus_per_node=world, seq_len=seq_len, precisions=["bf16"], space=space).best
    torch.manual_seed(0)  # identical initial weights on every rank (the plan sets sync_module_states=False)
    with device:
        model = build_reference(spec)
    if args.fsdp_version == 1:
        model = FullyShardedDataParallel(model, **best.fsdp_kwargs(model, device_id=device))
    else:
        best.apply_fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, spec.vocab_size, (best.config.micro_batch, seq_len + 1), generator=generator)
    inputs = tokens.to(device)
    losses = []
    for _ in range(args.steps):
        loss = model(inputs[:, :-1], labels=inputs[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if rank == 0:
        print(json.dumps({"fsdp_version": args.fsdp_version, "config": best.config.to_dict(), "losses": losses}))
    # every rank done with its collectives before gloo's threads are torn down (a rank that destroys the
    # group while its peer is still in the last all-reduce aborts: "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
