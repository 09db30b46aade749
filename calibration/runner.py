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
from torch import nn

from calibration.apply import (apply_fsdp1, apply_fsdp2, block_classes_for, cast_for_precision, grad_scaler_for,
                               make_mesh, precompute_float8_scales)
from calibration.build import build_model, load_factory
from calibration.profile_step import phase, profile_step
from calibration.reference import causal_lm_loss
from calibration.store import cpu_name, model_spec_from_dict, write_atomic
from cost_models.specs import FsdpConfig, ModelSpec, Sharding

INIT_STD = 0.02


# ------------------------------------------------------------------------------------------ building

@contextlib.contextmanager
def params_on_meta():
    """Modules built inside get their parameters on the meta device, buffers stay real.

    Rotary frequency tables and similar buffers are computed in __init__ and cannot be recomputed
    after a plain `with torch.device("meta")`; parameters are re-initialised anyway. (accelerate's
    init_empty_weights(include_buffers=False) does the same.) A parameter already on meta is kept as is,
    so tied weights stay tied.
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _model_spec(data: dict) -> ModelSpec:
    return model_spec_from_dict(data)  # nested MoeSpec / ActivationProfile too (MoE models crashed here)


def build(job_model: dict, attention: str) -> nn.Module:
    """The job's model, parameters on meta, at the job's depth."""
    source = job_model["source"]
    with params_on_meta():
        if source == "factory":
            kwargs = {"n_layers": job_model["n_layers"]} if job_model.get("n_layers") else {}
            model = load_factory(job_model["factory"])(**kwargs)
        elif source == "hf":
            model = build_model(_model_spec(job_model["spec"]), hf_config=job_model["hf_config"], attention=attention,
                                device="cpu")
        else:
            model = build_model(_model_spec(job_model["spec"]), attention=attention, device="cpu")
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model builder returned {type(model).__name__}, not an nn.Module")
    return model


def block_classes(model: nn.Module, name: str | None) -> set[type]:
    classes = {type(m) for m in model.modules() if name and type(m).__name__ == name}
    return classes or block_classes_for(model)


@torch.no_grad()
def init_module_params(module: nn.Module, buffers: dict[int, dict[str, torch.Tensor]]) -> None:
    """Initialise `module`'s own parameters and restore its own buffers (not its children's)."""
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters(recurse=False):
        local = p.to_local() if isinstance(p, DTensor) else p
        if p.ndim >= 2:
            local.normal_(0.0, INIT_STD)
        elif name.endswith("bias"):
            local.zero_()
        else:
            local.fill_(1.0)  # norm weights
    for name, value in buffers.get(id(module), {}).items():
        current = module._buffers.get(name)
        if current is not None:
            current.copy_(value.to(current.device))


def snapshot_buffers(model: nn.Module) -> dict[int, dict[str, torch.Tensor]]:
    return {id(m): {n: b.detach().clone() for n, b in m._buffers.items() if b is not None and b.device.type != "meta"}
            for m in model.modules()}


def apply_config(model: nn.Module, config: FsdpConfig, fsdp_version: int, classes: set[type], world: int,
                 gpus_per_node: int, device: torch.device, lora: bool = False) -> nn.Module:
    """Apply FSDP as the emitted config does, then materialise the meta parameters on `device`.
    lora: FSDP1 wraps the adapters in their own units (frozen and trainable params apart)."""
    cast_for_precision(model, config)
    buffers = snapshot_buffers(model)
    if fsdp_version == 1:
        def materialise(module: nn.Module) -> None:  # meta -> device, unit by unit, before sharding
            module.to_empty(device=device, recurse=False)
            init_module_params(module, buffers)

        return apply_fsdp1(model, config, classes, param_init_fn=materialise, gpus_per_node=gpus_per_node,
                           device_id=device, trainable_mixed=lora)
    mesh = make_mesh(config, world, gpus_per_node, device.type)
    apply_fsdp2(model, config, classes, mesh)
    model.to_empty(device=device)
    for module in model.modules():
        init_module_params(module, buffers)
    model._calibration_mesh = mesh  # the N-D mesh: context parallelism shards each step's inputs on its "cp" dim
    return model


def data_parallel_rank(rank: int, config: FsdpConfig, world: int | None = None) -> int:
    """The data-parallel rank of global `rank` in torchtitan's mesh [pp, dp_replicate, dp_shard, cp, tp] (tp
    innermost, then cp; pp outermost): the tp x cp ranks of one model copy share their sequences (TP ranks compute
    on the same tokens, CP ranks each take a slice of them), and so do its pipeline ranks (the first stage's take
    them as inputs, the last stage's as targets), so the batch is drawn from this rank, not the global one. Expert
    parallelism borrows data-parallel ranks and changes nothing here. world: needed with pp > 1."""
    if config.pp > 1:
        rank %= world // config.pp  # the coordinates inside this pipeline rank's [dp_replicate, ..., tp] block
    return rank // (config.tp * config.cp)


def check_same_sequences(model: nn.Module, config: FsdpConfig, batches: list[torch.Tensor], device: torch.device) -> None:
    """Raise unless every rank of each TP and CP group holds the same batches (a checksum's max and min over the
    group agree): ranks of one model copy that fed different sequences would train on neither."""
    mesh = getattr(model, "_calibration_mesh", None)
    if mesh is None:
        return
    checksum = sum(int((b.long().flatten() * (torch.arange(b.numel(), device=b.device) % 997 + 1)).sum())
                   for b in batches)
    for name in ("tp", "cp"):
        if getattr(config, name) > 1:
            t = torch.tensor([checksum, -checksum], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh[name].get_group())
            if int(t[0]) != -int(t[1]):
                raise RuntimeError(f"the ranks of a {name} group drew different batches (checksums {int(t[0])} vs "
                                   f"{-int(t[1])}): a {name} group must feed the same sequences")


CP_NEEDS_CUDA = ("cp: context parallelism's ring attention dispatches only CUDA SDPA kernels (torch's "
                 "context_parallel has no CPU path, shared/reference/pitfalls.md): run --cp on CUDA GPUs, or --cp 1 "
                 "on --device cpu")


def step_context(model: nn.Module, config: FsdpConfig, ids: torch.Tensor):
    """What a micro-step's forward and backward run inside: loss parallel with sequence-parallel TP (the
    cross-entropy on vocab-sharded logits, calibration.tensor_parallel.loss_context), and with cp > 1 torch's
    context_parallel on the mesh's "cp" dim, which shards the ids (the labels: labels = ids) on the sequence in
    its load-balanced chunks in place, as torchtitan does around its train step, and puts the whole sequence back
    on exit (the next step reuses the batch). Positions are each rank's local ones
    (the reference model and Hugging Face's derive them from the local length): the same kernels and shapes,
    so the same time and memory; the loss value is not the unsharded one."""
    from calibration.tensor_parallel import loss_context

    stack = contextlib.ExitStack()
    stack.enter_context(loss_context(config.tp, config.sequence_parallel))
    if config.cp > 1:
        if ids.device.type != "cuda":
            raise ValueError(CP_NEEDS_CUDA)
        from torch.distributed.tensor.experimental import context_parallel

        mesh = model._calibration_mesh
        stack.enter_context(context_parallel(mesh["cp"], buffers=[ids], buffer_seq_dims=[1]))
    return stack


def make_optimizer(name: str, params, precision_name: str):
    lr = 1e-4
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adamw-8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as exc:
            raise RuntimeError("optimizer adamw-8bit needs bitsandbytes installed") from exc
        return bnb.optim.AdamW8bit(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}")


def loss_fn_for(config: FsdpConfig):
    """The loss the plan prices: the model's own (Hugging Face computes it in the forward, from `labels`),
    or with compile (config.loss_compiled) the cross-entropy compiled apart, one fused kernel each way
    (torchtitan's compile.components "loss"); None: the model's own."""
    return torch.compile(causal_lm_loss) if config.loss_compiled else None


def loss_of(model, ids: torch.Tensor, loss_fn=None) -> torch.Tensor:
    """The loss of one forward: `.loss` (Hugging Face, our reference), else `loss_fn` (or the eager
    cross-entropy) of the logits. With a loss_fn the model is not given labels."""
    try:
        output = model(ids) if loss_fn is not None else model(ids, labels=ids)
    except TypeError:
        output = model(ids)  # a factory model without a labels argument
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    logits = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
    return (loss_fn or causal_lm_loss)(logits, ids)


# ------------------------------------------------------------------------------------------ measuring

def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def exposed_time(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Length of the time covered by communication and by no compute kernel: |C| - |C ∩ K|."""
    both = union_length(comm) + union_length(compute) - union_length(comm + compute)
    return union_length(comm) - both


def _is_comm_kernel(name: str) -> bool:
    return name.lower().startswith("nccl")


def profiled_exposed_comm_s(run_step) -> float | None:
    """Exposed communication of one step from the CUDA kernel timeline (rank's own view)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_step()
            torch.cuda.synchronize()
        comm, compute = [], []
        for event in prof.events():
            if getattr(event, "device_type", None) is None or "CUDA" not in str(event.device_type):
                continue
            interval = (event.time_range.start, event.time_range.end)
            (comm if _is_comm_kernel(event.name) else compute).append(interval)
        if not comm:
            return 0.0
        return exposed_time(comm, compute) / 1e6  # profiler times are microseconds
    except Exception as exc:  # the profiler is best effort: never fail a run over it
        print(f"calibration: exposed communication not measured ({exc})", file=sys.stderr)
        return None


def fingerprint(device: torch.device, devices_per_node: int, n_nodes: int) -> dict:
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version()
        return {"device_type": "cuda", "device_name": torch.cuda.get_device_name(device),
                "devices_per_node": devices_per_node, "n_nodes": n_nodes, "torch_version": torch.__version__,
                "nccl_version": ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)}
    return {"device_type": "cpu", "device_name": cpu_name(), "devices_per_node": devices_per_node,
            "n_nodes": n_nodes, "torch_version": torch.__version__, "nccl_version": None}


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

        model = add_lora(model, _model_spec(job["model"]["spec"]), job["lora_rank"], classes, config.precision)
    pipeline = None
    if config.pp > 1:  # this rank's stages and torch's schedule (calibration/runner_pipeline.py)
        from calibration.runner_pipeline import PipelineRun

        pipeline = PipelineRun(model, _model_spec(job["model"]["spec"]), config, classes, world, gpus_per_node,
                               device, job["seq_len"])
        model = pipeline.stages
    else:
        model = apply_config(model, config, job["fsdp_version"], classes, world, gpus_per_node, device, lora)
    optimizer = make_optimizer(job["optimizer"], [p for p in model.parameters() if p.requires_grad],
                               config.precision.value)
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


# ------------------------------------------------------------------------------------------ host probe

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
