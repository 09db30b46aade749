"""The trace tier: the real FSDP2 training step on fake tensors, with every tensor's memory accounted.

    result = trace_memory(spec, config, n_gpus=64, gpus_per_node=8, seq_len=4096, hf_config=cfg)
    result.peak_allocated_bytes, result.breakdown, result.peak_phase

What runs is what the plan emits, on no GPU and no real memory:
- a fake process group of the real world size (we are rank 0) and the DeviceMesh built from it by
  calibration.apply.make_mesh, *outside* FakeTensorMode (inside it, mesh creation fails);
- the model built inside FakeTensorMode by calibration.build.build_model: transformers' from_config (no
  weights) when there is a Hugging Face config, else the project's reference Llama;
- with tp or cp > 1 the N-D mesh [dp_replicate, dp_shard, cp, tp]: the model's TP plan applied by
  parallelize_module before anything else (calibration/tensor_parallel.py; loss parallel around the step
  with sequence parallel); with cp, the step inside torch's context_parallel (the token ids sharded over
  the sequence, load-balanced) with its ring attention reaching the CPU SDPA kernel
  (calibration/context_parallel.py); with ep, the experts over the ep group (calibration/expert_parallel.py);
  FSDP on the dp_shard x cp sub-mesh;
- the precision's storage dtype (bf16-pure builds in bf16, as cast_for_precision would cast), then
  apply_fsdp2 (checkpoint every K-th block, fully_shard each block, then the root; a 2-D (replicate,
  shard) mesh for HYBRID with the shard group inside a node);
- the configured optimizer with foreach=False, two full steps (forward with the model's own loss on
  random token ids, backward - two micro-steps when grad_accum > 1, the second one holding the first's
  sharded gradients as every later one does - optimizer step, zero_grad) measured by calibration.memtrack;
  the figures are those of the second step. The training loop drops the model output before backward.

The model is built as a GPU run builds it (calibration.build): the attention implementation the family
runs (eager for Gemma 2 and gpt-oss, which refuse SDPA; TraceResult.attention says which), transformers'
grouped_mm experts kernel for mixture-of-experts layers (TraceResult.experts), the KV cache off.
Three things are made to behave as on a GPU run (calibration/gpu_run_choices.py: cuda_kernel_choices,
_real_run_masking and _grouped_mm_shapes_any_dtype): transformers' choice of attention mask, which fake tensors would turn into
an s x s mask per layer; the dropout / SDPA-with-dropout kernels, whose CPU versions keep other tensors
than CUDA's; and torch._grouped_mm's meta function, which refuses the fp32/fp16 inputs the real kernels
take. tests/distributed/test_trace_families.py checks the result against real CPU runs of small
configs of today's families, to the byte when it was written.

foreach=False because the tracker mis-accounts foreach kernels on DTensors (pitfalls.md). The
implementation priced (optimizer_impl: foreach, fused, for-loop; cost_models/optimizer_step.py) differs from the
for-loop step only in its temporaries: Adam/AdamW's foreach step holds sqrt(exp_avg_sq) for every local parameter
shard at once, i.e. one more copy of the sharded trainable parameters in the state dtype; the fused step
(torch._fused_adamw_) none; SGD's updates in place. The traced optimizer-step phase replaces the for-loop
temporaries with the priced implementation's (trace_optimizer.step_window); a for-loop plan keeps them.

LoRA fine-tuning adds peft adapters through calibration.lora (frozen base in the compute dtype, adapters
in the parameter dtype), as calibration runs do.

Limits (raised as TraceUnsupported): LoRA without peft installed, CPU offload (on a CPU mesh device and host
memory are the same), 8-bit Adam (bitsandbytes). A model whose code cannot run on fake tensors
(data-dependent shapes, custom kernels, remote code) raises UntraceableModel naming the failing step.

The pieces apart: what it returns and raises (trace_result.py), what it refuses (trace_limits.py), the fake
world (fake_world.py), the GPU run's choices (gpu_run_choices.py), the optimizer (trace_optimizer.py).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from cost_models import caching_allocator
from cost_models.specs import Finetune, FsdpConfig, ModelSpec, Optimizer, OptimizerImpl, Sharding, TrainingSpec

from .alloc_sequence import record_allocations
from .fake_world import _dtensors_under_fake_mode, _FakeWorld, _meta_to_fake
from .gpu_run_choices import _grouped_mm_shapes_any_dtype, _real_run_masking, cuda_kernel_choices
from .memtrack import BREAKDOWN_KEYS, MemorySnapshot, MemoryTracker
from .model_blocks import block_classes
from .trace_limits import _check_mesh, _check_supported, _require_transformers
from .trace_optimizer import foreach_temporary_bytes, make_optimizer, step_window
from .trace_result import TraceError, TraceResult, TraceUnsupported, UntraceableModel, _untraceable


def _loss(model: nn.Module, ids: torch.Tensor, is_hf: bool, compiled: bool, outside: bool = False) -> torch.Tensor:
    """The model's own loss, or with a compiled loss (config.loss_compiled) the fused cross-entropy of its
    logits (calibration/fused_loss.py: the compiled kernel's memory, runnable on fake tensors); outside: the eager
    loss on the logits the model returns (torchtitan's loop, after the root's post-forward), not in its forward."""
    if compiled or outside:  # as calibration runs it (the fused loss standing for the compiled one)
        from calibration.fused_loss import fused_causal_lm_loss
        from calibration.worker_step import causal_lm_loss, loss_of

        return loss_of(model, ids, fused_causal_lm_loss if compiled else causal_lm_loss)
    out = model(input_ids=ids, labels=ids) if is_hf else model(ids, labels=ids)
    return out.loss if hasattr(out, "loss") else out[0]


def trace_memory(spec: ModelSpec, config: FsdpConfig, *, n_gpus: int, gpus_per_node: int, seq_len: int,
                 optimizer: Optimizer | str = Optimizer.ADAMW, hf_config: dict | None = None,
                 finetune: Finetune | str = Finetune.FULL, lora_rank: int = 16, lora_dropout: float = 0.0,
                 routing_imbalance: float = 1.0,
                 optimizer_impl: OptimizerImpl | str = OptimizerImpl.FOREACH) -> TraceResult:
    """Run two FSDP2 training steps of `spec` under FakeTensorMode on rank 0 of `n_gpus`; see the module
    docstring. hf_config (a config.json dict with model_type) builds the transformers model; without
    it the reference Llama is built from `spec`. routing_imbalance (EP): rank 0's experts receive that many
    times the balanced rows (calibration/expert_parallel.py). optimizer_impl: whose step window is reported."""
    training = TrainingSpec(seq_len=seq_len, optimizer=optimizer, finetune=finetune, lora_rank=lora_rank,
                            lora_dropout=lora_dropout, routing_imbalance=routing_imbalance,
                            optimizer_impl=optimizer_impl)
    _check_supported(config, training)
    _check_mesh(spec, config, n_gpus)
    if n_gpus < 1 or gpus_per_node < 1:
        raise TraceError(f"need gpus >= 1 and gpus_per_node >= 1, got {n_gpus} and {gpus_per_node}")
    if config.sharding.is_hybrid and n_gpus % (config.shard_group_gpus or gpus_per_node):
        raise TraceError(f"{config.sharding.value} needs gpus ({n_gpus}) divisible by the shard group's "
                         f"{config.shard_group_gpus or gpus_per_node} GPUs")
    started = time.perf_counter()
    is_hf = hf_config is not None
    if is_hf:
        _require_transformers()
        import transformers

        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # config warnings about token ids etc. are not ours to show
    try:
        from .expert_parallel import routing_imbalance as ep_imbalance

        with _real_run_masking(is_hf), _grouped_mm_shapes_any_dtype(), ep_imbalance(training.routing_imbalance):
            return _trace(spec, config, training, n_gpus, gpus_per_node, seq_len, hf_config, started)
    finally:
        if is_hf:
            transformers.logging.set_verbosity(verbosity)


FOR_LOOP = OptimizerImpl.FOR_LOOP


def _trace(spec, config, training, n_gpus, gpus_per_node, seq_len, hf_config, started) -> TraceResult:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .apply import TORCH_DTYPES, apply_fsdp2, make_mesh
    from .build import build_model, model_kernels

    is_hf = hf_config is not None
    shard = _shard_group(config, n_gpus, gpus_per_node)
    notes = []
    lora = training.finetune.adapters
    with _FakeWorld(n_gpus), _dtensors_under_fake_mode():
        mesh = make_mesh(config, n_gpus, gpus_per_node, "cpu")  # outside FakeTensorMode (pitfalls.md)
        # LoRA: built on meta, where peft can add its adapters (it cannot move fake tensors) and the frozen
        # base can be cast (calibration.lora's dtypes); materialised below.
        if lora:
            from .lora import add_lora

            try:
                model = build_model(spec, hf_config, attention=config.attention.value, device="meta",
                                    dtype=TORCH_DTYPES[config.precision.param_dtype])
                classes = block_classes(model, spec.block_class)
                model = add_lora(model, spec, training.lora_rank, classes, config.precision, training.lora_dropout)
            except Exception as exc:  # noqa: BLE001 - any failure of foreign model code is reported as such
                raise _untraceable(f"building {spec.name} with LoRA", exc) from exc
        with FakeTensorMode(allow_non_fake_inputs=False):
            try:
                if lora:
                    _meta_to_fake(model)
                else:
                    # bf16-pure: built in bf16 rather than cast afterwards (cast_for_precision's model.to()
                    # must swap fake parameters, which fails when transformers holds references to them); the
                    # parameters end up the same, only fp32-computed buffers (rotary inv_freq) stay fp32.
                    model = build_model(spec, hf_config, attention=config.attention.value, device="cpu",
                                        dtype=TORCH_DTYPES[config.precision.param_dtype])
                    classes = block_classes(model, spec.block_class)
            except Exception as exc:  # noqa: BLE001 - any failure of foreign model code is reported as such
                raise _untraceable(f"building {spec.name}", exc) from exc
            model.train()
            if is_hf and hasattr(model, "config"):
                model.config.use_cache = False  # no KV cache in training (HF warns and drops it with AC)
            name, (attention, experts) = type(model).__name__, model_kernels(model, config.attention.value)
            apply_fsdp2(model, config, classes, mesh, edge_units=spec.split_edge_units)
            opt = make_optimizer(model.parameters(), training.optimizer)
            ids = torch.randint(0, spec.vocab_size, (config.micro_batch, seq_len))
            allocations = []
            try:
                phases = measure_training_steps(model, opt, ids, config, vocab_size=spec.vocab_size, is_hf=is_hf,
                                                mesh=mesh, optimizer_impl=training.optimizer_impl,
                                                allocations=allocations, loss_outside=spec.split_edge_units)
            except Exception as exc:  # noqa: BLE001
                raise _untraceable(f"the training step of {spec.name}", exc) from exc
    if attention != config.attention.value:
        notes.append(f"{name} does not run {config.attention.value} attention: traced with {attention}")
    if training.optimizer in (Optimizer.ADAM, Optimizer.ADAMW) and training.optimizer_impl is not FOR_LOOP:
        notes.append("optimizer traced with foreach=False; " + (
            "the foreach step's temporaries (one more copy of the sharded trainable params, in their dtype) are "
            "added analytically" if training.optimizer_impl is OptimizerImpl.FOREACH else
            "the fused step (torch._fused_adamw_, in place) allocates no temporaries: the for-loop's are removed"))
    if spec.vocab_size == seq_len:
        notes.append("vocab size equals sequence length: logits are counted under activations")
    peak = max(phases.values(), key=lambda s: s.peak_allocated_bytes)
    return TraceResult(peak_allocated_bytes=peak.peak_allocated_bytes, breakdown=dict(peak.breakdown),
                       peak_phase=peak.peak_phase, phases=phases, world_size=n_gpus, shard_group_size=shard,
                       builder="transformers" if is_hf else "reference", seconds=time.perf_counter() - started,
                       notes=tuple(notes), attention=attention, experts=experts,
                       allocator=caching_allocator.replay(allocations), allocation_events=tuple(allocations))


def measure_training_steps(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, config: FsdpConfig,
                           *, vocab_size: int, is_hf: bool, mesh=None,
                           optimizer_impl: OptimizerImpl | str = OptimizerImpl.FOREACH,
                           allocations: list | None = None, loss_outside: bool = False) -> dict[str, MemorySnapshot]:
    """Two training steps of an FSDP2-wrapped `model` on `ids` (labels = ids) under calibration.memtrack:
    the second step's "forward_backward" window (min(grad_accum, 2) micro-steps) and its "optimizer_step"
    window of `optimizer_impl`: measured when `optimizer` runs it, else from a foreach=False step with its
    temporaries replaced (trace_optimizer.step_window; see the module docstring). Fake or real tensors alike:
    the trace runs it under FakeTensorMode, tests/distributed runs it on gloo ranks to check the trace against
    real memory. Tensors whose last dimension is the vocabulary (a TP rank's vocab / tp with loss parallel) count as
    logits_and_loss, unless it equals the sequence length. With tensor parallelism the step runs inside
    loss_parallel() when the config has sequence parallel (calibration/tensor_parallel.loss_context).
    allocations: a list to fill with both steps' ordered allocations and frees (calibration/alloc_sequence.py).
    loss_outside: the loss computed on the returned logits (_loss's outside)."""
    from contextlib import ExitStack

    from .tensor_parallel import local_vocab_size

    vocab_size = local_vocab_size(vocab_size, config.tp, config.sequence_parallel)  # a TP rank's logits
    seq_len = ids.shape[-1]
    with ExitStack() as cp:
        _shard_context_parallel_inputs(cp, ids, config, mesh)
        tracker = MemoryTracker(model, optimizer, vocab_size=vocab_size if vocab_size != seq_len else None)
        if allocations is not None:
            record_allocations(tracker, allocations)
        tracker.track_inputs(ids)
        return _measured_steps(model, optimizer, ids, config, tracker, is_hf, optimizer_impl, loss_outside)


def _shard_context_parallel_inputs(stack, ids: torch.Tensor, config: FsdpConfig, mesh) -> None:
    """With cp > 1: enter torch's context_parallel on the mesh's "cp" dim for the whole measurement, the token
    ids sharded in place over the sequence with its load balancing (rank r holds chunks r and 2cp-1-r), and
    ring attention reaching the CPU SDPA kernel (calibration/context_parallel.py). No position ids are
    passed: the load-balanced position ids a numerically faithful run passes are not increasing, and
    on real tensors transformers takes them for packed sequences and builds an attention mask, which ring
    attention refuses; without them the model numbers its s/cp tokens 0.. (other rotary angles, the same
    tensors and memory)."""
    if config.cp == 1:
        return
    if mesh is None or "cp" not in (mesh.mesh_dim_names or ()):
        raise TraceError(f"cp={config.cp} needs the N-D mesh with a 'cp' dim (calibration.apply.make_mesh)")
    from .context_parallel import sequence_sharded

    stack.enter_context(sequence_sharded(mesh["cp"], [ids]))


def _measured_steps(model, optimizer, ids, config, tracker, is_hf, optimizer_impl,
                    loss_outside=False) -> dict[str, MemorySnapshot]:
    from .tensor_parallel import loss_context

    phases = {}
    with tracker:
        for step in range(2):
            if step == 1:
                tracker.reset()
            for micro in range(min(config.grad_accum, 2)):
                if micro:
                    tracker.next_microstep()
                # also in backward: checkpoint recompute runs there, and loss parallel's backward
                with cuda_kernel_choices(), loss_context(config.tp, config.sequence_parallel):
                    loss = _loss(model, ids, is_hf, config.loss_compiled, loss_outside)
                    loss.backward()
                    del loss
            if step == 1:
                phases["forward_backward"] = tracker.snapshot()
                tracker.reset()
            optimizer.step()
            if step == 1:
                phases["optimizer_step"] = step_window(tracker.snapshot(), optimizer, optimizer_impl)
            optimizer.zero_grad(set_to_none=True)
    return phases


def _shard_group(config: FsdpConfig, n_gpus: int, gpus_per_node: int) -> int:
    """FSDP's shard group: dp_shard x cp of the mesh (calibration.apply.dense_mesh_dims)."""
    if config.tp > 1 or config.cp > 1:
        from .apply import dense_mesh_dims

        dims = dense_mesh_dims(config, n_gpus, gpus_per_node)
        return dims["dp_shard"] * dims["cp"]
    if config.sharding is Sharding.NO_SHARD:
        return 1
    return config.dp_degrees(n_gpus, gpus_per_node)[1] if config.sharding.is_hybrid else n_gpus


__all__ = ["TraceResult", "TraceError", "TraceUnsupported", "UntraceableModel", "trace_memory",
           "measure_training_steps", "make_optimizer", "foreach_temporary_bytes", "BREAKDOWN_KEYS"]
