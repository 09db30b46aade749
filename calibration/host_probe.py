"""This host measured as the cost model's "GPU" (`python -m calibration.runner --probe`, see calibration/runner.py)
and the fingerprint of a device that calibration results and profiles carry."""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from calibration.store import cpu_name, write_atomic


def fingerprint(device: torch.device, devices_per_node: int, n_nodes: int) -> dict:
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version()
        return {"device_type": "cuda", "device_name": torch.cuda.get_device_name(device),
                "devices_per_node": devices_per_node, "n_nodes": n_nodes, "torch_version": torch.__version__,
                "nccl_version": ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)}
    return {"device_type": "cpu", "device_name": cpu_name(), "devices_per_node": devices_per_node,
            "n_nodes": n_nodes, "torch_version": torch.__version__, "nccl_version": None}


def _rate(fn, min_s: float = 0.15) -> float:
    """Calls per CPU second of fn (local work, one thread), best of 3 windows of at least min_s, after one
    warm-up call. CPU time, like the runs' step times on a CPU: other processes do not slow it down."""
    fn()
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.process_time()
        while True:
            fn()
            n += 1
            elapsed = time.process_time() - t0
            if elapsed >= min_s:
                break
        best = max(best, n / elapsed)
    return best


def _collective_rate(fn, count: int) -> float:
    """Calls per second of a collective: every rank runs the same count (a time limit would let ranks
    disagree on how many calls to make, and hang). Median of 3 windows after 2 warm-up calls."""
    for _ in range(2):
        fn()
    rates = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        rates.append(count / (time.perf_counter() - t0))
    return statistics.median(rates)


def probe(shape: tuple[int, int, int], block_bytes: int, out: str, dtypes: tuple[str, ...] = ("fp32",)) -> None:
    """Measure this host as a 'GPU': matmul FLOP/s per dtype at the model's shape, copy bandwidth and
    gloo bus bandwidth and latency, all ranks at once (the conditions of a run). About 3 s."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m, k, n = shape
    flops = dict.fromkeys(("fp32", "bf16", "fp16"), 0.0)  # 0: not measured (the planner skips that dtype)
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        dist.barrier()
        flops[name] = 2 * m * k * n * _rate(lambda: torch.mm(a, b))
    big = 16 * 2**20  # 64 MiB fp32: beyond the caches
    src, dst = torch.randn(big), torch.empty(big)
    dist.barrier()
    copy_bytes_per_s = 2 * 4 * big * _rate(lambda: dst.copy_(src))
    per_rank = max(1, block_bytes // 4 // world)
    shard, gathered = torch.randn(per_rank), torch.empty(per_rank * world)
    gathers = _collective_rate(lambda: dist.all_gather_into_tensor(gathered, shard), count=5)
    # One rank has no peer to measure: 1 GB/s stands in (loopback TCP order of magnitude); runs with one
    # rank per host (emulation) do no real communication anyway.
    bus = (world - 1) / world * gathered.numel() * 4 * gathers if world > 1 else 1e9
    one = torch.zeros(1)
    all_reduces = _collective_rate(lambda: dist.all_reduce(one), count=50)
    hop_latency_s = 1.0 / all_reduces / max(1, 2 * (world - 1))
    figures = torch.tensor([flops["fp32"], flops["bf16"], flops["fp16"], copy_bytes_per_s, bus, hop_latency_s],
                           dtype=torch.float64)
    dist.all_reduce(figures)  # mean over ranks
    figures /= world
    if rank == 0:
        f = figures.tolist()
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        write_atomic(out, json.dumps({
            "host": {"name": cpu_name(), "ranks": world, "peak_flops": {"fp32": f[0], "bf16": f[1], "fp16": f[2]},
                     "hbm_bytes_per_s": f[3], "bus_bytes_per_s": f[4], "memory_bytes": int(ram // world)},
            "hop_latency_s": f[5], "fingerprint": fingerprint(torch.device("cpu"), world, 1)}))
    dist.destroy_process_group()
