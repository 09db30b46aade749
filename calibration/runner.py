"""The script torchrun starts for one calibration run: build, apply FSDP, time steps, measure memory.

    torchrun --standalone --nproc-per-node 8 -m calibration.runner --job DIR/jobs/<run_id>.json
    python -m calibration.runner --job JOB.json          # with "emulate_world_size": N (one process)
    torchrun --standalone --nproc-per-node 2 -m calibration.runner --probe --shape M,K,N --block-bytes B --out F

The job file (written by planner.calibrating) names the model, the FsdpConfig, the FSDP version, and the
steps. Each rank:

1. builds the model with its parameters on the meta device (buffers such as rotary tables are real), at
   the depth the job asks for: a preset through our reference Llama, a Hugging Face config through
   transformers' from_config, or the user's factory `pkg.module:function` (called with n_layers=L when
   the job reduces depth); with "finetune": "lora", peft adapters on the attention projections through
   calibration.lora (as the trace tier adds them: frozen base in the compute dtype, adapters in the
   parameter dtype);
2. applies the config through calibration.apply, the code path the emitted config uses (FSDP2:
   apply_fsdp2; FSDP1: apply_fsdp1 with a param_init_fn that materialises each unit on its device), then
   materialises and initialises the parameters: N(0, 0.02) for matrices, ones for norm weights, zeros
   for biases. The config's selective-op checkpointing, per-block torch.compile (the warmup steps absorb
   the compile), Float8 linears and FP8 all-gather (CUDA only; the scales precomputed after each optimizer
   step) are applied there too. Weights do not matter to speed or memory; NaN-free numbers do (fp16 loss scaling). Both
   apply functions turn a Hugging Face model's KV cache off (model.config.use_cache = False), as the
   emitted code does: left on, checkpointed recompute grows it and the measured peak with it;
3. trains on synthetic token batches (random ids, labels = ids): `warmup` steps, then `steps` timed
   steps of grad_accum micro-steps + optimizer step each. NO_SHARD skips the gradient all-reduce on all
   but the last micro-step (no_sync), sharded strategies reduce-scatter every micro-step, as the cost
   model assumes;
4. measures the median step (slowest rank per step), peak memory (GPU: torch.cuda.max_memory_allocated /
   max_memory_reserved over the timed steps and device memory outside PyTorch's allocator; CPU: the
   tensor accountant calibration.memtrack over two extra steps, since its hooks would slow the timed
   ones), and on GPU the exposed communication of one profiled step (NCCL kernel time with no other
   kernel running);
5. rank 0 writes the result JSON atomically; a rank that fails writes error_dir/rank<r>.json (kind
   "oom" or "crash", the end of its traceback) and exits at once, so torchrun tears the job down.

With pp > 1 (calibration/runner_pipeline.py) step 2 cuts this rank's pipeline stages instead (calibration/
pipeline.py's split, FSDP2 per stage, torch's schedule), a step is one schedule step over the local batch's
microbatches then the optimizer, the loss is averaged from the last stage's ranks and the result holds every
pipeline rank's peak (measured.pipeline_ranks).

The steps live apart: building and applying in calibration/worker_model.py, the step's pieces (batch, context,
optimizer, loss) in worker_step.py, the exposed communication in exposed_comm.py, --probe and the fingerprint in
host_probe.py; this module runs them in order and reports.

With "emulate_world_size": N the process is rank 0 of an N-rank job on a fake process group: its
kernels and memory are real (sharded 1/N), its collectives return at once, so the measured step has no
communication; the planner adds communication from the cost model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from calibration.apply import grad_scaler_for
from calibration.exposed_comm import profiled_exposed_comm_s
from calibration.float8 import precompute_float8_scales
from calibration.host_probe import fingerprint, probe
from calibration.model_blocks import block_classes
from calibration.profile_step import phase, profile_step
from calibration.store import write_atomic
from calibration.worker_model import _model_spec, apply_config, build
from calibration.worker_step import (CP_NEEDS_CUDA, check_same_sequences, data_parallel_rank, loss_fn_for, loss_of,
                                     make_optimizer, step_context)
from cost_models.specs import FsdpConfig, Sharding


def _clear_module_stats(tracker):
    """Between micro-steps of one tracked step, PyTorch's FSDPMemTracker must forget its per-module
    stats (it refuses a second forward of the root otherwise) while keeping the peak. Until
    calibration.memtrack offers this as `next_microstep()`, reach its tracker's reset_mod_stats."""
    inner = getattr(tracker, "_tracker", None)
    return getattr(inner, "reset_mod_stats", None)


def _reduce_max(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------ the run

def run(job: dict) -> None:
    emulate = job.get("emulate_world_size")
    device_type = job["device"]
    if emulate:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=emulate, store=FakeStore())
        local_rank = 0
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    gpus_per_node = job["gpus_per_node"]
    fault = job.get("fault") or {}

    def maybe_fault(step: int) -> None:
        if fault and fault.get("rank") == rank and fault.get("step") == step:
            kind = fault.get("kind", "exit")
            print(f"calibration: injected fault '{kind}' on rank {rank} at step {step}", file=sys.stderr, flush=True)
            if kind == "exit":
                os._exit(3)
            if kind == "hang":
                time.sleep(10**6)
            if kind == "oom":
                raise torch.OutOfMemoryError(f"out of memory (injected on rank {rank})")
            raise RuntimeError(f"injected failure on rank {rank}")

    config = FsdpConfig(**{**{k: v for k, v in job["config"].items() if k != "activation_checkpointing"},
                           "ac_every": job["config"].get("activation_checkpointing", 0)})
    if config.cp > 1 and device.type != "cuda":
        raise ValueError(CP_NEEDS_CUDA)
    if job["fsdp_version"] == 1 and config.model_parallel * config.ep > 1:
        raise ValueError("fsdp_version 1: FSDP1 composes with no device mesh; tp / cp / ep need FSDP2")
    torch.manual_seed(job.get("seed", 0))
    model = build(job["model"], config.attention.value)
    classes = block_classes(model, job["model"].get("block_class"))
    lora = job.get("finetune") == "lora"
    if lora:
        from calibration.lora import add_lora

        model = add_lora(model, _model_spec(job["model"]["spec"]), job["lora_rank"], classes, config.precision,
                         job.get("lora_dropout", 0.0))  # jobs written before it: peft's identity
    pipeline = None
    if config.pp > 1:  # this rank's stages and torch's schedule (calibration/runner_pipeline.py)
        from calibration.runner_pipeline import PipelineRun

        pipeline = PipelineRun(model, _model_spec(job["model"]["spec"]), config, classes, world, gpus_per_node,
                               device, job["seq_len"])
        model = pipeline.stages
    else:
        model = apply_config(model, config, job["fsdp_version"], classes, world, gpus_per_node, device, lora)
    optimizer = make_optimizer(job["optimizer"], [p for p in model.parameters() if p.requires_grad],
                               config.precision.value, job.get("optimizer_impl", "foreach"))  # older jobs: foreach
    scaler = grad_scaler_for(config, device=device.type)
    loss_fn = loss_fn_for(config)

    vocab = job["model"]["spec"]["vocab_size"]
    seq = job["seq_len"]
    # every rank of a TP / CP group feeds the same sequences: the data-parallel rank decides the batch
    gen = torch.Generator(device="cpu").manual_seed(1000 + data_parallel_rank(rank, config, world))
    batches = [torch.randint(0, vocab, (config.micro_batch, seq), generator=gen).to(device)
               for _ in range(config.grad_accum)]
    check_same_sequences(model, config, batches, device)
    no_sync_possible = config.sharding is Sharding.NO_SHARD and config.grad_accum > 1
    last_loss = [float("nan")]

    def step(between_microsteps=None) -> None:
        if pipeline is not None:  # one schedule step over all microbatches, then the optimizer
            with phase("forward_backward"):
                loss = pipeline.step(batches)
            with phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            last_loss[0] = float("nan") if loss is None else loss.float().item()
            return
        for micro, ids in enumerate(batches):
            if micro and between_microsteps:
                between_microsteps()
            last = micro == config.grad_accum - 1
            if job["fsdp_version"] == 2 and no_sync_possible:
                model.set_requires_gradient_sync(last)
            with model.no_sync() if job["fsdp_version"] == 1 and no_sync_possible and not last \
                    else contextlib.nullcontext(), step_context(model, config, ids):
                with phase("forward"):  # phase: a range only under --torch-profile's profiler
                    loss = loss_of(model, ids, loss_fn) / config.grad_accum
                with phase("backward"):
                    (scaler.scale(loss) if scaler else loss).backward()
        with phase("optimizer"):
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            precompute_float8_scales(model, config)  # FP8 all-gather: next step's weight scales, one all-reduce
            optimizer.zero_grad(set_to_none=True)
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # loss parallel: a replicated DTensor
        last_loss[0] = loss.detach().float().item() * config.grad_accum

    warmup, steps = job["warmup"], job["steps"]
    times, cpu_times = [], []
    for i in range(warmup + steps):
        maybe_fault(i)
        if i == warmup:
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    times = _reduce_max(times, device)
    if pipeline is not None:  # the loss lives on the last stage's ranks
        last_loss[0] = pipeline.mean_loss(None if math.isnan(last_loss[0]) else last_loss[0], device)
    measured = {"wall_step_s": statistics.median(times), "loss": last_loss[0]}
    if job.get("torch_profile"):  # one more step under torch.profiler, its trace beside the result
        profile_step(step, job["torch_profile"], device, record=rank == 0)
    # A pipeline's bubble is a rank waiting for its neighbours' stages: no CPU time, so a pipeline is timed by the
    # wall clock, on a CPU too (where other processes on a shared host inflate it)
    if device.type == "cpu" and pipeline is None:
        # A CPU host is usually shared (CI, a laptop): other processes inflate wall time by tens of percent
        # from one run to the next. The CPU time of the rank's process (all its threads: compute and gloo)
        # is what this step cost; it leaves out waits for a peer, which one core per rank keeps short.
        cpu_times = _reduce_max(cpu_times, device)
        measured.update(step_s=statistics.median(cpu_times), step_s_all=cpu_times, step_clock="process_cpu")
    else:
        measured.update(step_s=statistics.median(times), step_s_all=times, step_clock="wall")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        memory = [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                  (total - free) - torch.cuda.memory_reserved(device)]
        if pipeline is not None:  # every pipeline rank's own peak (this rank's, before the max below)
            measured["pipeline_ranks"] = pipeline.rank_peaks(memory[0], memory[1])
        memory = [int(x) for x in _reduce_max([float(x) for x in memory], device)]
        measured.update(peak_allocated_bytes=memory[0], peak_reserved_bytes=memory[1], non_torch_bytes=memory[2],
                        memory_source="cuda_allocator")
        if job.get("measure_comm", True) and not emulate:
            exposed = profiled_exposed_comm_s(step)
            if exposed is not None:
                measured["exposed_comm_s"] = _reduce_max([exposed], device)[0]
    else:
        from calibration.memtrack import MemoryTracker

        from calibration.tensor_parallel import local_vocab_size

        # a TP rank's logits are vocab / tp wide under loss parallel (the tracker files them as logits_and_loss)
        tracker = MemoryTracker(model, optimizer, vocab_size=local_vocab_size(vocab, config.tp, config.sequence_parallel),
                                device=device)
        between = getattr(tracker, "next_microstep", None) or _clear_module_stats(tracker)
        with tracker, pipeline.tracked() if pipeline else contextlib.nullcontext():
            step(between)    # the tracker's own warm-up: it must see the state tensors being used
            tracker.reset()
            step(between)
        snap = tracker.snapshot()
        peak = int(_reduce_max([float(snap.peak_allocated_bytes)], device)[0])
        breakdown, peak_phase = {k: int(v) for k, v in snap.breakdown.items()}, snap.peak_phase
        if pipeline is not None:  # every pipeline rank's own peak; the headline is the largest rank's
            ranks = measured["pipeline_ranks"] = pipeline.rank_peaks(peak_phase=peak_phase, breakdown=breakdown,
                                                                     peak_allocated_bytes=snap.peak_allocated_bytes)
            largest = max(ranks, key=lambda r: r["peak_allocated_bytes"])
            breakdown, peak_phase = largest["memory_breakdown"], largest["peak_phase"]
        measured.update(peak_allocated_bytes=peak, memory_source="memtrack", memory_breakdown=breakdown,
                        peak_phase=peak_phase)
    # per GPU, as the cost model counts them: a TP group computes on one set of sequences, a CP group splits them
    tokens = config.micro_batch * seq * config.grad_accum / config.model_parallel
    measured["tokens_per_s_per_gpu"] = tokens / measured["step_s"]
    if rank == 0:
        local = 1 if emulate else int(os.environ.get("LOCAL_WORLD_SIZE", world))
        n_nodes = 1 if emulate else max(1, world // local)
        result = {"measured": measured, "fingerprint": fingerprint(device, local, n_nodes)}
        write_atomic(job["result_path"], json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def report_failure(job: dict, exc: BaseException) -> None:
    rank = int(os.environ.get("RANK", 0))
    text = "".join(traceback.format_exception(exc))
    print(text, file=sys.stderr, flush=True)
    message = f"{type(exc).__name__}: {exc}".strip()
    tail = text.strip().splitlines()[-12:]
    error = {"kind": "oom" if _is_oom(exc) else "crash", "rank": rank,
             "message": message if len(message) < 2000 else message[:2000] + " ...", "traceback": tail}
    error_dir = job.get("error_dir")
    if error_dir:
        write_atomic(Path(error_dir) / f"rank{rank}.json", json.dumps(error))






def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", help="job JSON written by planner.calibrating")
    parser.add_argument("--probe", action="store_true", help="measure this host instead (CPU)")
    parser.add_argument("--shape", default="512,512,512", help="probe: matmul M,K,N")
    parser.add_argument("--dtypes", default="fp32", help="probe: matmul dtypes, comma-separated")
    parser.add_argument("--block-bytes", type=int, default=4 * 2**20, help="probe: all-gather message bytes")
    parser.add_argument("--out", help="probe: output JSON")
    args = parser.parse_args(argv)
    if args.probe:
        probe(tuple(int(x) for x in args.shape.split(",")), args.block_bytes, args.out, tuple(args.dtypes.split(",")))
        return
    job = json.loads(Path(args.job).read_text())
    try:
        run(job)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the rank leaves at once
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        report_failure(job, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # not destroy_process_group: peers may be stuck in a collective


if __name__ == "__main__":
    main()
