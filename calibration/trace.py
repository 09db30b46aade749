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
Three things are made to behave as on a GPU run (see cuda_kernel_choices, _real_run_masking and
_grouped_mm_shapes_any_dtype): transformers' choice of attention mask, which fake tensors would turn into
an s x s mask per layer; the dropout / SDPA-with-dropout kernels, whose CPU versions keep other tensors
than CUDA's; and torch._grouped_mm's meta function, which refuses the fp32/fp16 inputs the real kernels
take. tests/distributed/test_trace_families.py checks the result against real CPU runs of small
configs of today's families, to the byte when it was written.

foreach=False because the tracker mis-accounts foreach kernels on DTensors (pitfalls.md). The
multi-tensor (foreach) step that training actually runs by default differs from the for-loop one only in
its temporaries: Adam/AdamW's foreach step holds sqrt(exp_avg_sq) for every local parameter shard at
once, i.e. one more copy of the sharded trainable parameters in the state dtype; SGD's updates in place.
The traced optimizer-step phase replaces the for-loop temporaries with that figure.

LoRA fine-tuning adds peft adapters through calibration.lora (frozen base in the compute dtype, adapters
in the parameter dtype), as calibration runs do.

Limits (raised as TraceUnsupported): LoRA without peft installed, CPU offload (on a CPU mesh device and host
memory are the same), 8-bit Adam (bitsandbytes). A model whose code cannot run on fake tensors
(data-dependent shapes, custom kernels, remote code) raises UntraceableModel naming the failing step.
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cost_models.specs import Finetune, FsdpConfig, ModelSpec, Optimizer, Sharding, TrainingSpec

from .memtrack import BREAKDOWN_KEYS, MemorySnapshot, MemoryTracker


class TraceError(RuntimeError):
    """The trace tier cannot produce a figure for this request."""


class TraceUnsupported(TraceError):
    """A configuration the trace tier does not model (offload, 8-bit optimizers; LoRA without peft)."""


class UntraceableModel(TraceError):
    """The model's code does not run under FakeTensorMode (data-dependent ops, custom code)."""


@dataclass(frozen=True)
class TraceResult:
    """Per-rank memory of the second training step, as MemoryBreakdown categories (bytes)."""

    peak_allocated_bytes: int
    breakdown: dict[str, int]
    peak_phase: str                           # "forward", "backward" or "optimizer_step"
    phases: dict[str, MemorySnapshot]         # "forward_backward" and "optimizer_step" windows
    world_size: int
    shard_group_size: int
    builder: str                              # "transformers" or "reference"
    seconds: float
    notes: tuple[str, ...] = ()
    attention: str = ""                       # the implementation traced (eager where a family refuses sdpa)
    experts: str | None = None                # mixture-of-experts kernel ("grouped_mm"); None: no experts

    def to_dict(self) -> dict:
        return {
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_phase": self.peak_phase,
            "breakdown": dict(self.breakdown),
            "phases": {name: snap.to_dict() for name, snap in self.phases.items()},
            "world_size": self.world_size,
            "shard_group_size": self.shard_group_size,
            "builder": self.builder,
            "attention": self.attention,
            "experts": self.experts,
            "seconds": round(self.seconds, 2),
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------- the fake world

class _FakeWorld:
    """A fake process group of `world_size` ranks for the duration of a trace (rank 0 is us).

    An already initialised fake group of the same size is reused and left alone; any other initialised
    group is an error (the trace would shard over the wrong world)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.owned = False

    def __enter__(self):
        if dist.is_initialized():
            if dist.get_backend() == "fake" and dist.get_world_size() == self.world_size:
                return self
            raise TraceError(f"a {dist.get_backend()} process group of {dist.get_world_size()} ranks is already "
                             f"initialised; the trace needs its own fake group of {self.world_size}")
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=self.world_size, store=FakeStore())
        self.owned = True
        return self

    def __exit__(self, *exc):
        if self.owned:
            dist.destroy_process_group()
            _forget_dtensor_placements()


def _forget_dtensor_placements() -> None:
    """Clear DTensor's sharding-propagation caches once a fake world is gone.

    They are keyed by op schemas whose meshes compare equal across worlds (a tp=2 sub-mesh of 16 ranks
    equals another one of 16 ranks, whatever the other dims), and their
    answers hold the old meshes, whose process groups (by name) died with the world: the next trace of
    the same mesh shape in this process would redistribute over a group that no longer exists ("Could
    not resolve the process group registered under the name ...")."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python caches and the C++ dispatch fast path's
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


# ---------------------------------------------------------------- building and stepping

def _block_classes(model: nn.Module, spec: ModelSpec) -> set[type]:
    classes = {type(m) for m in model.modules() if type(m).__name__ == spec.block_class}
    if classes:
        return classes
    from .model_blocks import block_classes_for

    return block_classes_for(model)


def make_optimizer(params, optimizer: Optimizer | str = Optimizer.ADAMW) -> torch.optim.Optimizer:
    """The optimizer the trace steps: the configured one with foreach=False (see the module docstring)."""
    optimizer = Optimizer(optimizer)
    params = [p for p in params if p.requires_grad]
    if optimizer is Optimizer.SGD:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False)
    if optimizer is Optimizer.ADAM:
        return torch.optim.Adam(params, lr=1e-4, foreach=False)
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def foreach_temporary_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the multi-tensor (foreach) step allocates on top of the state: Adam/AdamW's
    torch._foreach_sqrt(exp_avg_sqs), one tensor per local parameter shard (then divided and added to
    in place); SGD with momentum updates in place (0)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 0
    from torch.distributed.tensor import DTensor

    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                local = p.to_local() if isinstance(p, DTensor) else p
                total += local.numel() * local.element_size()
    return total


def _loss(model: nn.Module, ids: torch.Tensor, is_hf: bool, compiled: bool) -> torch.Tensor:
    """The model's own loss, or with a compiled loss (config.loss_compiled) the fused cross-entropy of its
    logits (calibration/fused_loss.py: the compiled kernel's memory, runnable on fake tensors)."""
    if compiled:  # as calibration runs it, with the fused loss standing for the compiled one
        from calibration.fused_loss import fused_causal_lm_loss
        from calibration.worker_step import loss_of

        return loss_of(model, ids, fused_causal_lm_loss)
    out = model(input_ids=ids, labels=ids) if is_hf else model(ids, labels=ids)
    return out.loss if hasattr(out, "loss") else out[0]


def _replace_temporaries(snap: MemorySnapshot, temporaries: int) -> MemorySnapshot:
    """The optimizer-step window with the for-loop step's temporaries swapped for the foreach step's."""
    b = dict(snap.breakdown)
    peak = snap.peak_allocated_bytes - b["optimizer_temporaries"] + temporaries
    b["optimizer_temporaries"] = temporaries
    return MemorySnapshot(peak_allocated_bytes=peak, breakdown=b, peak_phase="optimizer_step")


def _untraceable(what: str, exc: BaseException) -> UntraceableModel:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return UntraceableModel(f"{what} failed under FakeTensorMode: {type(exc).__name__}: {text[:300]} "
                            "(data-dependent ops or custom code cannot be traced; use the analytic estimate "
                            "or `fsdp-plan calibrate` on real hardware)")


def trace_memory(spec: ModelSpec, config: FsdpConfig, *, n_gpus: int, gpus_per_node: int, seq_len: int,
                 optimizer: Optimizer | str = Optimizer.ADAMW, hf_config: dict | None = None,
                 finetune: Finetune | str = Finetune.FULL, lora_rank: int = 16,
                 routing_imbalance: float = 1.0) -> TraceResult:
    """Run two FSDP2 training steps of `spec` under FakeTensorMode on rank 0 of `n_gpus`; see the module
    docstring. hf_config (a config.json dict with model_type) builds the transformers model; without
    it the reference Llama is built from `spec`. routing_imbalance (EP): rank 0's experts receive that many
    times the balanced rows (calibration/expert_parallel.py)."""
    training = TrainingSpec(seq_len=seq_len, optimizer=optimizer, finetune=finetune, lora_rank=lora_rank,
                            routing_imbalance=routing_imbalance)
    _check_supported(config, training)
    _check_mesh(spec, config, n_gpus)
    if n_gpus < 1 or gpus_per_node < 1:
        raise TraceError(f"need gpus >= 1 and gpus_per_node >= 1, got {n_gpus} and {gpus_per_node}")
    if config.sharding.is_hybrid and n_gpus % gpus_per_node:
        raise TraceError(f"{config.sharding.value} needs gpus ({n_gpus}) divisible by gpus_per_node ({gpus_per_node})")
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


@contextmanager
def cuda_kernel_choices():
    """Run the ops whose CPU kernels save different tensors than the CUDA ones a GPU run uses.

    - dropout: the CPU kernel multiplies by a mask kept in the input's dtype; CUDA's fused native_dropout
      keeps a one-byte bool mask. We call native_dropout, which is CUDA's choice on every device.
    - scaled_dot_product_attention with dropout_p > 0: CPU falls back to the math path (fp32 upcast,
      s^2 scores saved); CUDA's flash / memory-efficient kernels take dropout in the kernel and save the
      same q, k, v, output and logsumexp as without dropout (plus an RNG seed). We run it with
      dropout_p=0, which saves exactly those.
    - scaled_dot_product_attention with a v head dim unlike q/k's (DeepSeek MLA): CPU takes the math path
      again, CUDA the memory-efficient kernel; calibration.sdpa_kernels saves what the latter saves.
    Everything else (matmuls, norms, softmax, losses) saves the same tensors on both devices. The two
    functions are swapped on torch.nn.functional for the duration (models look them up at call time), so
    the choice also holds for activation checkpointing's recompute inside backward."""
    import torch.nn.functional as F

    from .sdpa_kernels import sdpa_unequal_head_dims, takes_unequal_head_dims

    sdpa, dropout = F.scaled_dot_product_attention, F.dropout

    def sdpa_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if takes_unequal_head_dims(query, key, value):
            return sdpa_unequal_head_dims(query, key, value, attn_mask, is_causal, scale)
        return sdpa(query, key, value, attn_mask, 0.0, is_causal, scale=scale, **kwargs)

    def dropout_cuda(input, p=0.5, training=True, inplace=False):
        if training and p > 0 and input.is_floating_point() and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    F.scaled_dot_product_attention, F.dropout = sdpa_cuda, dropout_cuda
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout


@contextmanager
def _real_run_masking(is_hf: bool):
    """Make transformers choose the attention mask a real run would.

    Without a KV cache (training), transformers looks for packed sequences in position_ids; on a FakeTensor
    it cannot read the values, takes the tensor for a compile-time trace, and materialises a (b, 1, s, s)
    causal mask that SDPA then converts and saves in every layer (b*s*s*c bytes per layer). On real
    tensors the check finds one sequence per row (our random ids are unpacked) and SDPA runs with
    is_causal and no mask: we give transformers that answer."""
    masking = None
    if is_hf:
        try:
            import transformers.masking_utils as masking
        except ImportError:
            masking = None
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is not None:
        masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original


@contextmanager
def _grouped_mm_shapes_any_dtype():
    """Let torch._grouped_mm (transformers' grouped_mm experts kernel) run on fake tensors of any dtype.

    Its meta function - what FakeTensorMode runs - checks the inputs as the CUDA CUTLASS kernel needs
    them (bf16 only), but the real kernels take fp32 and fp16 too (CPU; CUDA through its fallback path),
    and an fp32 or fp16 run of a mixture-of-experts model goes through them. For those dtypes we give
    FakeTensorMode the output the meta function would make - same shape, the inputs' dtype - skipping
    only the dtype check; bf16 keeps the meta function as it is. The override is a dispatcher
    registration for the Meta key, removed on exit."""
    try:
        from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm
    except ImportError:  # a torch without grouped_mm: nothing to do
        yield
        return

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.dtype == torch.bfloat16 or mat_a.dtype != mat_b.dtype or bias is not None:
            return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        library.impl("_grouped_mm", meta, "Meta")
    try:
        yield
    finally:
        library._destroy()


def _trace(spec, config, training, n_gpus, gpus_per_node, seq_len, hf_config, started) -> TraceResult:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .apply import TORCH_DTYPES, apply_fsdp2, make_mesh
    from .build import build_model, model_kernels

    is_hf = hf_config is not None
    shard = _shard_group(config, n_gpus, gpus_per_node)
    notes = []
    lora = training.finetune is Finetune.LORA
    with _FakeWorld(n_gpus), _dtensors_under_fake_mode():
        mesh = make_mesh(config, n_gpus, gpus_per_node, "cpu")  # outside FakeTensorMode (pitfalls.md)
        # LoRA: built on meta, where peft can add its adapters (it cannot move fake tensors) and the frozen
        # base can be cast (calibration.lora's dtypes); materialised below.
        if lora:
            from .lora import add_lora

            try:
                model = build_model(spec, hf_config, attention=config.attention.value, device="meta",
                                    dtype=TORCH_DTYPES[config.precision.param_dtype])
                classes = _block_classes(model, spec)
                model = add_lora(model, spec, training.lora_rank, classes, config.precision)
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
                    classes = _block_classes(model, spec)
            except Exception as exc:  # noqa: BLE001 - any failure of foreign model code is reported as such
                raise _untraceable(f"building {spec.name}", exc) from exc
            model.train()
            if is_hf and hasattr(model, "config"):
                model.config.use_cache = False  # no KV cache in training (HF warns and drops it with AC)
            name, (attention, experts) = type(model).__name__, model_kernels(model, config.attention.value)
            apply_fsdp2(model, config, classes, mesh)
            opt = make_optimizer(model.parameters(), training.optimizer)
            ids = torch.randint(0, spec.vocab_size, (config.micro_batch, seq_len))
            try:
                phases = measure_training_steps(model, opt, ids, config, vocab_size=spec.vocab_size, is_hf=is_hf,
                                                mesh=mesh)
            except Exception as exc:  # noqa: BLE001
                raise _untraceable(f"the training step of {spec.name}", exc) from exc
    if attention != config.attention.value:
        notes.append(f"{name} does not run {config.attention.value} attention: traced with {attention}")
    if training.optimizer in (Optimizer.ADAM, Optimizer.ADAMW):
        notes.append("optimizer traced with foreach=False; the foreach step's temporaries (one more copy of the "
                     "sharded trainable params, in their dtype) are added analytically")
    if spec.vocab_size == seq_len:
        notes.append("vocab size equals sequence length: logits are counted under activations")
    peak = max(phases.values(), key=lambda s: s.peak_allocated_bytes)
    return TraceResult(peak_allocated_bytes=peak.peak_allocated_bytes, breakdown=dict(peak.breakdown),
                       peak_phase=peak.peak_phase, phases=phases, world_size=n_gpus, shard_group_size=shard,
                       builder="transformers" if is_hf else "reference", seconds=time.perf_counter() - started,
                       notes=tuple(notes), attention=attention, experts=experts)


def measure_training_steps(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, config: FsdpConfig,
                           *, vocab_size: int, is_hf: bool, mesh=None) -> dict[str, MemorySnapshot]:
    """Two training steps of an FSDP2-wrapped `model` on `ids` (labels = ids) under calibration.memtrack:
    the second step's "forward_backward" window (min(grad_accum, 2) micro-steps) and its "optimizer_step"
    window, the latter with the for-loop step's temporaries replaced by the foreach step's (see the module
    docstring; `optimizer` must be a foreach=False one). Fake or real tensors alike: the trace runs it
    under FakeTensorMode, tests/distributed runs it on gloo ranks to check the trace against real memory.
    Tensors whose last dimension is the vocabulary (a TP rank's vocab / tp with loss parallel) count as
    logits_and_loss, unless it equals the sequence length. With tensor parallelism the step runs inside
    loss_parallel() when the config has sequence parallel (calibration/tensor_parallel.loss_context)."""
    from contextlib import ExitStack

    from .tensor_parallel import local_vocab_size, loss_context

    vocab_size = local_vocab_size(vocab_size, config.tp, config.sequence_parallel)  # a TP rank's logits
    seq_len = ids.shape[-1]
    with ExitStack() as cp:
        _shard_context_parallel_inputs(cp, ids, config, mesh)
        tracker = MemoryTracker(model, optimizer, vocab_size=vocab_size if vocab_size != seq_len else None)
        tracker.track_inputs(ids)
        return _measured_steps(model, optimizer, ids, config, tracker, is_hf)


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
    from torch.distributed.tensor.experimental import context_parallel

    from .context_parallel import cpu_ring_attention

    stack.enter_context(context_parallel(mesh["cp"], buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={ids}))
    stack.enter_context(cpu_ring_attention())


def _measured_steps(model, optimizer, ids, config, tracker, is_hf) -> dict[str, MemorySnapshot]:
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
                    loss = _loss(model, ids, is_hf, config.loss_compiled)
                    loss.backward()
                    del loss
            if step == 1:
                phases["forward_backward"] = tracker.snapshot()
                tracker.reset()
            optimizer.step()
            if step == 1:
                phases["optimizer_step"] = _replace_temporaries(tracker.snapshot(), foreach_temporary_bytes(optimizer))
            optimizer.zero_grad(set_to_none=True)
    return phases


def _meta_to_fake(model: nn.Module) -> None:
    """Replace every meta parameter and buffer with a fresh (fake, under FakeTensorMode) CPU tensor of the
    same shape and dtype, one per original so tied weights stay tied. Module.to_empty would call
    empty_like on the meta tensors, which FakeTensorMode refuses as non-fake inputs."""
    made: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return made[id(t)]

    for module in model.modules():
        for slots, param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(slots.items()):
                if t is not None and t.device.type == "meta":
                    slots[name] = fresh(t, param)


def _shard_group(config: FsdpConfig, n_gpus: int, gpus_per_node: int) -> int:
    """FSDP's shard group: dp_shard x cp of the mesh (calibration.apply.dense_mesh_dims)."""
    if config.tp > 1 or config.cp > 1:
        from .apply import dense_mesh_dims

        dims = dense_mesh_dims(config, n_gpus, gpus_per_node)
        return dims["dp_shard"] * dims["cp"]
    if config.sharding is Sharding.NO_SHARD:
        return 1
    return gpus_per_node if config.sharding.is_hybrid else n_gpus


@contextmanager
def _dtensors_under_fake_mode():
    """Two things DTensor does differently when the whole step already runs under FakeTensorMode, put back
    as a real run does them (both patches are undone on exit):

    - DeviceMesh creation. A mesh holds real rank tensors; built inside FakeTensorMode it fails
      (pitfalls.md). make_mesh runs outside the mode, but fully_shard on tensor-parallel parameters
      concatenates the data-parallel and the TP meshes into a new one (FSDPParam._init_sharding_spec_tp,
      DeviceMesh._concatenate) while the fake parameters are being sharded: DeviceMesh.__init__ runs under
      unset_fake_temporarily.
    - Shape propagation. For some ops (loss parallel's log-softmax and nll handlers, ops whose output
      metadata is not cached) DTensor runs the op once on *global-shape* fake tensors to learn the output's
      shape (ShardingPropagator._propagate_tensor_meta_non_cached, `detect_fake_mode() or FakeTensorMode()`).
      On a real run that is a private FakeTensorMode the memory tracker never sees; inside the trace it
      finds the trace's own mode and the tracker counts those global tensors as allocations (loss parallel:
      two fp32 b x s x V tensors, +24% over the real run of a tiny Llama, tp 2). It runs with the
      dispatch modes set aside, so it takes a private FakeTensorMode as on a real run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    mesh_init = DeviceMesh.__init__
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def init_outside_fake_mode(self, *args, **kwargs):
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    def propagate_untracked(self, op_schema):
        with _disable_current_modes():
            return propagate(self, op_schema)

    DeviceMesh.__init__ = init_outside_fake_mode
    ShardingPropagator._propagate_tensor_meta_non_cached = propagate_untracked
    try:
        yield
    finally:
        DeviceMesh.__init__ = mesh_init
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate


def _check_mesh(spec: ModelSpec, config: FsdpConfig, n_gpus: int) -> None:
    """The mesh the trace runs: tensor parallel (calibration/tensor_parallel.py) on dense models, expert
    parallelism (calibration/expert_parallel.py) on MoE models with tp = 1, context parallelism
    (calibration/context_parallel.py) with SDPA."""
    if config.cp > 1 and config.attention.value != "sdpa":
        raise TraceUnsupported("context parallelism runs ring attention in place of SDPA: trace it with sdpa")
    if config.ep > 1 and (config.tp > 1 or spec.moe is None):  # EP: calibration/expert_parallel.py (tp = 1)
        raise TraceUnsupported("the trace tier runs expert parallelism on mixture-of-experts models with tp = 1 "
                               "(transformers' AllToAllEP); use the analytic estimate")
    if config.pp > 1:
        raise TraceUnsupported("the trace tier does not run pipeline parallelism; use the analytic estimate")
    if config.tp > 1:
        from .tensor_parallel import check_tensor_parallel

        if n_gpus % config.tp:
            raise TraceError(f"tp={config.tp} does not divide the {n_gpus} GPUs")
        if spec.moe is not None:
            raise TraceUnsupported("the trace tier runs tensor parallelism on dense models only (the experts' TP "
                                   "plan belongs to expert parallelism); use the analytic estimate")
        try:
            check_tensor_parallel(spec.n_heads, spec.n_kv_heads, config.tp)
        except ValueError as exc:
            raise TraceUnsupported(str(exc)) from None


def _check_supported(config: FsdpConfig, training: TrainingSpec) -> None:
    if training.finetune is Finetune.LORA:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise TraceUnsupported("tracing LoRA fine-tuning needs peft: pip install 'fsdp-planner[lora]'") from None
    if config.offload:
        raise TraceUnsupported("the trace tier does not model CPU offload (on a CPU mesh, device and host "
                               "memory are one); use the analytic estimate")
    if training.optimizer is Optimizer.ADAMW_8BIT:
        raise TraceUnsupported("the trace tier does not model 8-bit AdamW (bitsandbytes kernels); trace with "
                               "adamw and subtract 6 bytes per sharded parameter, or use the analytic estimate")


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise TraceError("tracing a Hugging Face model needs transformers: pip install 'fsdp-planner[trace]'") from None


__all__ = ["TraceResult", "TraceError", "TraceUnsupported", "UntraceableModel", "trace_memory",
           "measure_training_steps", "make_optimizer", "foreach_temporary_bytes", "BREAKDOWN_KEYS"]
