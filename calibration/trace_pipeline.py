"""The trace tier for pipeline parallelism: torch.distributed.pipelining's real schedule on fake tensors, one
pipeline rank at a time.

    results = trace_pipeline(spec, config, n_gpus=8, gpus_per_node=8, seq_len=2048, hf_config=cfg)
    results[r].peak_allocated_bytes        # pipeline rank r (its dp / tp coordinates 0), a TraceResult

For each pipeline rank r, as calibration/trace.py does for FSDP2 (its helpers are reused):
- a fake process group of the real world size in which we are global rank r x (world / pp) - the pp coordinate r,
  every other coordinate 0 - and torchtitan's mesh [pp, dp_replicate, dp_shard, cp, tp] built from it outside
  FakeTensorMode (dp_shard x cp flattened for FSDP);
- the Hugging Face model built inside FakeTensorMode (calibration.build.build_model), cut into this rank's stages
  by calibration.pipeline.split_stages, each stage given apply_fsdp2 on the data-parallel sub-mesh (checkpointing,
  compile, fully_shard per block then the stage root; reshard_after_forward=False under PP, torchtitan's default,
  cost_models/fsdp_options.py), then wrapped in PipelineStage and scheduled by calibration.pipeline.build_schedule;
- two steps (schedule.step over config.pp_microbatches microbatches, then the optimizer) under calibration.memtrack
  (all of the rank's stages tracked as one model), the figures those of the second step.

Two shims make the schedules run here. On the fake group: torch's warm-up vote (_PipelineSchedule._warmup_p2p) sends a
one-element tensor around the ranks and reads it with .item(), which a fake tensor received from a fake group
cannot answer; every rank passes complete static metadata (build_schedule), so every rank of a real run votes
STATIC, and the shim sets that outcome on each stage. The P2P sends and receives of activations and gradients
themselves run on the fake group as no-ops into real (fake) buffers, so the receive buffers are counted as on a
real run. Under the memory tracker: its hooks on module inputs are left out (leaf_inputs_untracked: zero-bubble's
autograd.grad refuses them, and they form a reference cycle no real run has).
The tracker files the schedule's receive buffers and the stage inputs kept for backward as activations.

Tensor parallelism inside a stage runs as calibration.pipeline.apply_stage_tensor_parallel applies it (transformers'
tp_plan, or torchtitan's with sequence parallel: local (mb, s / tp, h) shards between stages, loss parallel);
context parallelism as calibration.pipeline.stage_context_parallel does (torch's context_parallel around the schedule,
the ids and each stage's positions sharded, ring attention on the CPU kernel; (mb, s / cp, h) between stages).

Limits (TraceUnsupported): expert parallelism inside a stage, LoRA, offload and 8-bit Adam,
a model without transformers' base_model_pp_plan (calibration.pipeline.PipelineSplitError).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from cost_models import caching_allocator
from cost_models.specs import Finetune, FsdpConfig, ModelSpec, Optimizer, OptimizerImpl, TrainingSpec

from .alloc_sequence import record_allocations
from .fake_world import _dtensors_under_fake_mode, _forget_dtensor_placements
from .gpu_run_choices import _real_run_masking, cuda_kernel_choices
from .trace_limits import _check_supported, _require_transformers
from .trace_optimizer import make_optimizer, step_window
from .trace_result import TraceError, TraceResult, TraceUnsupported, _untraceable


@contextmanager
def _fake_world(world_size: int, rank: int):
    """A fake process group in which we are `rank`; refuses to run beside an initialised group."""
    if dist.is_initialized():
        raise TraceError(f"a {dist.get_backend()} process group is already initialised; the pipeline trace needs "
                         f"its own fake group of {world_size} ranks")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_dtensor_placements()


@contextmanager
def static_vote():
    """Every stage's warm-up vote decided STATIC, as it is on a real run where every rank passes complete
    static metadata (see the module docstring); the P2P neighbours are warmed up lazily by the first send."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    original = schedules._PipelineSchedule._warmup_p2p

    def vote(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = vote
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original


@contextmanager
def leaf_inputs_untracked():
    """The memory tracker's module tracker (torch.distributed._tools.mod_tracker) hooks every module's inputs with
    register_multi_grad_hook(mode="all") only to mark where a module's backward ends (bookkeeping of parent modules,
    no memory); under pipelining those hooks are left out, for two reasons. (1) Zero-bubble and DualPipeV run the
    input pass as torch.autograd.grad on the stage's inputs, and the hook's first call asks the engine about each
    input's node, which autograd.grad refuses for a leaf (the receive buffer). (2) The hook's closure holds the
    inputs' autograd nodes, which hold the hook: a reference cycle, so a graph kept with retain_graph=True (the
    input pass, stage_backward_input) outlives the weight pass until Python's cycle collector runs, and the
    figures depend on when it does. A run without the tracker has no such cycle (FSDP2 and pipelining register no
    multi-grad hook): without these hooks the trace frees what torch frees, when it frees it, gc on or off."""
    from torch.distributed._tools import mod_tracker

    original = mod_tracker.register_multi_grad_hook

    def outputs_only(tensors, fn, *args, mode="all", **kwargs):
        return original(tensors, fn, *args, mode=mode, **kwargs) if mode == "any" else None

    mod_tracker.register_multi_grad_hook = outputs_only
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original


def make_pipeline_mesh(config: FsdpConfig, world_size: int, gpus_per_node: int, device_type: str):
    """torchtitan's [pp, dp_replicate, dp_shard, cp, tp] (size-1 dims kept) with dp_shard x cp flattened."""
    from torch.distributed.device_mesh import init_device_mesh

    from .apply import FSDP_DIM, dense_mesh_dims

    dims = {"pp": config.pp, **dense_mesh_dims(config, world_size, gpus_per_node)}
    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    mesh["dp_shard", "cp"]._flatten(FSDP_DIM)
    return mesh


def _check_pipeline(spec: ModelSpec, config: FsdpConfig, hf_config: dict | None) -> None:
    if config.pp < 2:
        raise TraceError("trace_pipeline needs pp >= 2; calibration.trace.trace_memory traces pp = 1")
    if config.ep > 1:
        raise TraceUnsupported("the pipeline trace runs FSDP, tensor and context parallelism inside each stage; ep = 1")
    if config.tp > 1 and not config.sequence_parallel and spec.tied_embeddings:
        raise TraceUnsupported("tensor parallel without sequence parallel: tied embeddings are not supported")
    if hf_config is None:
        raise TraceUnsupported("the pipeline trace splits transformers models (base_model_pp_plan); pass hf_config")
    from cost_models.pipeline import pipeline_refusals

    refusals = pipeline_refusals(spec, config)
    if refusals:
        raise TraceError(f"{refusals[0].field}: {refusals[0].reason}")


def trace_pipeline(spec: ModelSpec, config: FsdpConfig, *, n_gpus: int, gpus_per_node: int, seq_len: int,
                   optimizer: Optimizer | str = Optimizer.ADAMW, hf_config: dict | None = None,
                   ranks: tuple[int, ...] | None = None,
                   finetune: Finetune | str = Finetune.FULL,
                   optimizer_impl: OptimizerImpl | str = OptimizerImpl.FOREACH) -> tuple[TraceResult, ...]:
    """One TraceResult per pipeline rank (or per rank in `ranks`), each its own fake world; see the module
    docstring. optimizer_impl: whose step window is reported (trace_optimizer.step_window)."""
    if Finetune(finetune) is not Finetune.FULL:
        raise TraceUnsupported("the pipeline trace runs full fine-tuning only; LoRA under PP: use the estimate")
    training = TrainingSpec(seq_len=seq_len, optimizer=optimizer, finetune=Finetune.FULL, optimizer_impl=optimizer_impl)
    _check_supported(config, training)
    _check_pipeline(spec, config, hf_config)
    if n_gpus % (config.pp * config.tp * config.cp):
        raise TraceError(f"pp x tp x cp = {config.pp * config.tp * config.cp} does not divide the {n_gpus} GPUs")
    _require_transformers()
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with _real_run_masking(True), static_vote(), leaf_inputs_untracked():
            return tuple(_trace_rank(spec, config, training, n_gpus, gpus_per_node, seq_len, hf_config, r)
                         for r in (range(config.pp) if ranks is None else ranks))
    finally:
        transformers.logging.set_verbosity(verbosity)


def _trace_rank(spec, config, training, n_gpus, gpus_per_node, seq_len, hf_config, pp_rank) -> TraceResult:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .apply import TORCH_DTYPES, apply_fsdp2
    from .build import build_model
    from .memtrack import MemoryTracker
    from .pipeline import apply_stage_tensor_parallel, build_schedule, split_stages, stage_context_parallel, \
        stage_indices, stage_loss
    from .model_blocks import block_classes
    from .tensor_parallel import local_vocab_size, loss_context

    started = time.perf_counter()
    dp_ranks = n_gpus // config.pp
    indices = stage_indices(spec, config, pp_rank)
    first, last = 0 in indices, config.pp_stages - 1 in indices
    with _fake_world(n_gpus, pp_rank * dp_ranks), _dtensors_under_fake_mode():
        mesh = make_pipeline_mesh(config, n_gpus, gpus_per_node, "cpu")  # outside FakeTensorMode (pitfalls.md)
        shard = mesh["dp_shard_cp"].size()
        with FakeTensorMode(allow_non_fake_inputs=False):
            try:
                model = build_model(spec, hf_config, attention=config.attention.value, device="cpu",
                                    dtype=TORCH_DTYPES[config.precision.param_dtype])
            except Exception as exc:  # noqa: BLE001 - foreign model code
                raise _untraceable(f"building {spec.name}", exc) from exc
            model.train()
            model.config.use_cache = False
            classes = block_classes(model, spec.block_class)
            modules = split_stages(model, spec, config, pp_rank)
            for module in modules:
                if config.tp > 1:  # TP before FSDP (torchtitan's order); apply_fsdp2 then does the rest
                    apply_stage_tensor_parallel(module, mesh["tp"], classes, config.sequence_parallel)
                apply_fsdp2(module, dataclasses.replace(config, tp=1) if config.tp > 1 else config, classes, mesh)
            stages = nn.ModuleList(modules)
            opt = make_optimizer(stages.parameters(), training.optimizer)
            schedule = build_schedule(modules, indices, config, mesh.get_group("pp"), "cpu", stage_loss(config),
                                      seq_len=seq_len, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                                      dtype=TORCH_DTYPES[config.precision.compute_dtype],
                                      sequence_shards=config.tp if config.sequence_parallel else 1)
            ids = torch.randint(0, spec.vocab_size, (config.micro_batch * config.pp_microbatches, seq_len))
            vocab = local_vocab_size(spec.vocab_size, config.tp, config.sequence_parallel)  # a TP rank's logits
            # CP: the ids (the labels too: their values do not change the memory) sharded before the tracker sees them
            with stage_context_parallel(modules, mesh["cp"], [ids]):
                tracker = MemoryTracker(stages, opt, vocab_size=vocab if vocab != seq_len // config.cp else None)
                allocations = record_allocations(tracker)
                tracker.track_inputs(ids)
                try:
                    with loss_context(config.tp, config.sequence_parallel):
                        phases = _measured_steps(schedule, opt, ids, tracker, first, last, training.optimizer_impl)
                except Exception as exc:  # noqa: BLE001
                    raise _untraceable(f"the {config.pp_schedule.value} schedule of {spec.name}", exc) from exc
    peak = max(phases.values(), key=lambda s: s.peak_allocated_bytes)
    notes = (f"pipeline rank {pp_rank} of {config.pp}: stages {', '.join(map(str, indices))}",)
    return TraceResult(peak_allocated_bytes=peak.peak_allocated_bytes, breakdown=dict(peak.breakdown),
                       peak_phase=peak.peak_phase, phases=phases, world_size=n_gpus,
                       shard_group_size=shard, builder="transformers",
                       seconds=time.perf_counter() - started, notes=notes, attention=config.attention.value,
                       allocator=caching_allocator.replay(allocations), allocation_events=tuple(allocations))


def _measured_steps(schedule, optimizer, ids, tracker, first: bool, last: bool, impl, labels=None) -> dict:
    """The second of two steps: its schedule window and its optimizer window (`impl`'s temporaries). labels: the
    last stage's targets (default the ids: causal_lm_loss shifts them)."""
    target = ids if labels is None else labels

    def run_schedule():
        with cuda_kernel_choices():
            schedule.step(*((ids,) if first else ()), **({"target": target, "losses": []} if last else {}))

    with tracker:
        run_schedule()  # warm-up: optimizer state, first all-gathers
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker.reset()
        run_schedule()
        schedule_window = tracker.snapshot()
        tracker.reset()
        optimizer.step()
        step = step_window(tracker.snapshot(), optimizer, impl)
        optimizer.zero_grad(set_to_none=True)
    return {"forward_backward": schedule_window, "optimizer_step": step}


__all__ = ["trace_pipeline", "static_vote", "make_pipeline_mesh"]
