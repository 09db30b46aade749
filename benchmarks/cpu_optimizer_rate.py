"""The CPU-offloaded optimizer step measured on this machine, against cost_models/host_optimizer.py.

    .venv/bin/python benchmarks/cpu_optimizer_rate.py [--tensors 64 --numel 2097152]

1. One process: torch.optim.AdamW (fp32, lr 1e-4, weight_decay 0.01) over `tensors` CPU tensors of `numel` elements
   (2 GiB of params, grads and states by default: past this machine's 300 MiB L3), each implementation (for-loop:
   torch's default for CPU tensors; foreach=True; fused=True, ATen's CPU kernel) at 1 and 2 threads (torch.set_num_
   threads), the fastest of 3 steps after the one that makes the state; and a 1 GiB copy's bandwidth (read + write).
2. Two ranks under torchrun (gloo, OMP_NUM_THREADS=1 each, as torchrun sets it): `tensors` nn.Linear(h, h) blocks,
   h = sqrt(2 numel), each under FSDP2's fully_shard with CPUOffloadPolicy, so each rank's shards are the tensors of
   part 1; a real forward and backward, then AdamW() as a user writes it (torch picks the implementation: printed),
   3 timed steps, both ranks at once; and both ranks' copy bandwidth at once.
3. The model's figures with this machine's host facts: a thread's rate from part 1's one-thread for-loop step (as the
   default comes from the published H100 host's), the node's memory bandwidth from part 2's two copies at once.

Two threads are unreliable on a loaded 2-core machine (an OpenMP region waits for a descheduled thread), so no test
asserts them; docs/step_time.md records a run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMPLS = {"for-loop": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
COPY_NUMEL = 2 ** 28   # 1 GiB of fp32


def copy_bytes_per_s(torch) -> float:
    a = torch.randn(COPY_NUMEL)
    b = torch.empty_like(a)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() * a.element_size() / best


def timed_steps(optimizer, sync=lambda: None, repeats: int = 3) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest step: the process's CPU time is what a one-thread step costs even while
    other work on the machine deschedules it (a loaded CI machine); with 2 threads it counts OpenMP's spinning too."""
    optimizer.step()  # makes the state
    wall = cpu = math.inf
    for _ in range(repeats):
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        optimizer.step()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def single_process(tensors: int, numel: int) -> dict:
    import torch

    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        row = {"copy_gb_per_s": copy_bytes_per_s(torch) / 1e9}
        for impl, how in IMPLS.items():
            params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
            for p in params:
                p.grad = torch.randn(numel)
            row[impl] = timed_steps(torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **how))
            del params
        out[threads] = row
    return out


def worker(tensors: int, numel: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.optim.optimizer import _default_to_fused_or_foreach

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    h = math.isqrt(world * numel)
    model = torch.nn.Sequential(*(torch.nn.Linear(h, h, bias=False) for _ in range(tensors)))
    for block in model:
        fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    model(torch.randn(4, h)).square().mean().backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    fused, foreach = _default_to_fused_or_foreach(list(model.parameters()), False, False)
    local = [p.to_local() for p in model.parameters()]
    wall, cpu = timed_steps(optimizer, sync=dist.barrier)
    # the same step on plain tensors of the shards' sizes, both ranks at once: DTensor's dispatch apart from sharing
    plain = [torch.nn.Parameter(t.detach().clone()) for t in local]
    for p, q in zip(plain, model.parameters()):
        p.grad = q.grad.to_local().clone()
    plain_wall, plain_cpu = timed_steps(torch.optim.AdamW(plain, lr=1e-4, weight_decay=0.01), sync=dist.barrier)
    del plain
    dist.barrier()
    copy = copy_bytes_per_s(torch)
    figures = torch.tensor([wall, cpu, copy, plain_wall, plain_cpu], dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(gathered, figures)
    if rank == 0:
        print(json.dumps({"ranks": world, "threads": torch.get_num_threads(),
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                          "implementation": "fused" if fused else "foreach" if foreach else "for-loop",
                          "local_tensors": len(local), "local_numel": local[0].numel(),
                          "local_device": str(local[0].device), "params_per_rank": sum(t.numel() for t in local),
                          "step_s": [g[0].item() for g in gathered], "step_cpu_s": [g[1].item() for g in gathered],
                          "copy_gb_per_s": [g[2].item() / 1e9 for g in gathered],
                          "plain_step_s": [g[3].item() for g in gathered],
                          "plain_step_cpu_s": [g[4].item() for g in gathered]}))
    dist.destroy_process_group()


def two_ranks(tensors: int, numel: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           "--tensors", str(tensors), "--numel", str(numel)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torchrun's default: 1 a rank
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"torchrun failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(tensors: int, numel: int, one: dict, two: dict) -> None:
    from cost_models import host_optimizer
    from cost_models.profile import DEFAULT_PROFILE
    from cost_models.specs import ClusterSpec, HostCpu, TrainingSpec
    from planner.hardware import get_gpu

    params = tensors * numel
    print(f"one process, {tensors} x {numel:,} fp32 elements = {params:,} params (AdamW, the best of 3 steps, "
          "wall / CPU s):")
    for threads, row in one.items():
        print(f"  {threads} thread(s): copy {row['copy_gb_per_s']:.2f} GB/s; " + ", ".join(
            f"{impl} {row[impl][0]:.3f} / {row[impl][1]:.3f} s" for impl in IMPLS))
    print(f"two ranks under torchrun (gloo, FSDP2 CPUOffloadPolicy, OMP_NUM_THREADS={two['omp_num_threads']}, "
          f"torch threads {two['threads']}): torch ran {two['implementation']} on {two['local_tensors']} local "
          f"{two['local_device']} shards of {two['local_numel']:,}; step wall / CPU s per rank "
          f"{', '.join(f'{w:.3f} / {c:.3f}' for w, c in zip(two['step_s'], two['step_cpu_s']))} (plain tensors of "
          f"the shards' sizes, at once: "
          f"{', '.join(f'{w:.3f} / {c:.3f}' for w, c in zip(two['plain_step_s'], two['plain_step_cpu_s']))}); "
          "copy GB/s per rank at once "
          f"{', '.join(f'{b:.2f}' for b in two['copy_gb_per_s'])}")

    def training(impl):
        return TrainingSpec(optimizer="adamw", optimizer_impl=impl)

    loop_1 = one[1]["for-loop"][1]  # CPU seconds of one thread
    thread = params * host_optimizer.bytes_per_param(training("for-loop"), "fp32") / loop_1
    node = sum(two["copy_gb_per_s"]) * 1e9 / DEFAULT_PROFILE.host_memory_efficiency  # as the model's peak
    print(f"this machine's host facts: a thread streams {thread / 1e9:.2f} GB/s (for-loop, 48 B a param, one "
          f"thread's CPU s); memory {sum(two['copy_gb_per_s']):.2f} GB/s with both cores copying")

    def predicted(impl, ranks, threads, n=params):
        cluster = ClusterSpec(gpu=get_gpu("h100-80gb"), n_gpus=ranks, gpus_per_node=ranks, internode_bytes_per_s=1e9,
                              host_cpu=HostCpu(cores_per_node=2, memory_bytes_per_s=node, thread_bytes_per_s=thread,
                                               threads_per_rank=threads))
        return host_optimizer.step_seconds(n, training(impl), "fp32", cluster, DEFAULT_PROFILE)

    # one thread: against CPU seconds (robust to other load); two threads: wall seconds (OpenMP's spin counts as CPU)
    rows = [(f"1 rank, 1 thread, {impl} (CPU s)", predicted(impl, 1, 1), one[1][impl][1]) for impl in IMPLS]
    rows += [(f"1 rank, 2 threads, {impl} (wall s)", predicted(impl, 1, 2), one[2][impl][0]) for impl in IMPLS]
    rows.append((f"2 ranks x 1 thread, {two['implementation']} (torchrun, CPU s)",
                 predicted(two["implementation"], 2, 1, two["params_per_rank"]), max(two["step_cpu_s"])))
    rows.append((f"2 ranks x 1 thread, {two['implementation']} (torchrun, wall s)",
                 predicted(two["implementation"], 2, 1, two["params_per_rank"]), max(two["step_s"])))
    for name, model_s, measured_s in rows:
        print(f"  {name}: model {model_s:.3f} s, measured {measured_s:.3f} s ({model_s / measured_s - 1:+.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--numel", type=int, default=2 ** 21)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.tensors, args.numel)
    one = single_process(args.tensors, args.numel)
    report(args.tensors, args.numel, one, two_ranks(args.tensors, args.numel))


if __name__ == "__main__":
    main()
