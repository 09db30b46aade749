"""THE one code path that turns an FsdpConfig into FSDP.

The Python API, calibration runs and traces all go through here, so what we measure is what we emit
(planner/emit/ writes the same choices as text). Layout is torchtitan's: one FSDP unit per repeated
block plus the root.

Conventions:
- Precision: fp32 and bf16-pure set no FSDP mixed precision. For bf16-pure the *caller* casts the model
  with cast_for_precision() before wrapping, so params, grads, optimizer state and reductions are bf16.
  bf16/fp16 keep fp32 master params, compute in the low dtype and reduce gradients in fp32.
- Buffers are not cast (buffer_dtype=None): a bf16 rotary inv_freq buffer would blur positions in long
  sequences, and buffers are too small to matter for memory.
- Activation checkpointing wraps blocks 0, K, 2K, ... (index % K == 0): ceil(L / K) of L blocks, the
  memory-conservative reading of "every-K". FSDP2 applies it before fully_shard (torchtitan); FSDP1
  after wrapping (apply_fsdp1, as accelerate does). Both give the same checkpointed regions.
  selective-op wraps every block with torchtitan's op-level policy (selective_op_context says what it saves).
- The order is torchtitan's: Float8 linears (torchao), the mesh's other parallelisms (tensor parallel,
  apply_mesh_parallelisms), checkpointing, torch.compile of each block, then fully_shard block by block and
  the root on the data-parallel sub-mesh (dp_shard x cp flattened; HSDP with dp_replicate in front).
  Float8 and the FP8 all-gather are GPU-only (fp8 tensor cores).
- Hugging Face models train with model.config.use_cache = False (disable_kv_cache says why).

The pieces apart: the blocks (calibration/model_blocks.py), checkpointing (checkpointing.py), Float8 (float8.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

from cost_models import fsdp_options
from cost_models.specs import FsdpConfig, Precision, Sharding

from .checkpointing import apply_checkpointing
from .float8 import convert_to_float8
from .model_blocks import _block_slots, expert_modules

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _mixed_dtypes(config: FsdpConfig) -> tuple[torch.dtype | None, torch.dtype] | None:
    """(param_dtype or None, reduce_dtype) for FSDP's mixed precision, or None when FSDP must not cast."""
    names = fsdp_options.mixed_precision_dtypes(config.precision, config.reduce_dtype)
    if names is None:
        return None
    param = names["param_dtype"]
    return (None if param is None else getattr(torch, param)), getattr(torch, names["reduce_dtype"])


# ---------------------------------------------------------------- FSDP1

def fsdp1_kwargs(config: FsdpConfig, block_classes: set[type], *, gpus_per_node: int | None = None,
                 device_id=None, trainable_mixed: bool = False) -> dict:
    """Keyword arguments for FullyShardedDataParallel(model, **kwargs), as real torch objects.

    HYBRID strategies: FSDP1 builds its intra-node (shard) and inter-node (replicate) groups itself from
    device_count() of the device it runs on (1 for CPU); gpus_per_node, when given, is checked against
    that so a plan made for another node size fails here rather than sharding over the wrong group. With
    one device per node the strategy becomes NO_SHARD (see below).

    trainable_mixed (LoRA): also wrap each leaf module whose weight requires grad, so frozen and trainable
    parameters land in different flat parameters and FSDP1 allocates no gradient for the frozen ones
    (PEFT's fsdp_auto_wrap_policy), and cast each unit's inputs to the compute dtype
    (fsdp_options.fsdp1_mixed_precision says why). Freeze the base model before calling.
    """
    if not block_classes:
        raise ValueError("block_classes is empty: FSDP would make the whole model one unit")
    per_node = gpus_per_node or 1
    device_mesh = {}
    if config.sharding.is_hybrid and config.shard_group_gpus:  # shard groups other than a node: FSDP1's 2-D mesh
        world = torch.distributed.get_world_size()
        device_mesh = {"device_mesh": make_mesh(config, world, gpus_per_node or config.shard_group_gpus,
                                                _fsdp1_device_type(device_id))}
    elif config.sharding.is_hybrid:
        per_node = _fsdp1_devices_per_node(device_id)
        if gpus_per_node is not None and per_node != gpus_per_node:
            raise ValueError(f"{config.sharding.value}: FSDP1 shards within the {per_node} local devices "
                             f"it sees, the plan assumes gpus_per_node={gpus_per_node}")
    strategy = ShardingStrategy[fsdp_options.fsdp1_strategy(config, per_node)[0]]
    mixed = fsdp_options.fsdp1_mixed_precision(config.precision, lora=trainable_mixed, reduce_dtype=config.reduce_dtype)
    classes = tuple(block_classes)
    if trainable_mixed:
        policy = CustomPolicy(lambda m: isinstance(m, classes) or _is_trainable_leaf(m))
    else:
        policy = ModuleWrapPolicy(set(classes))
    return {
        "sharding_strategy": strategy,
        "mixed_precision": None if mixed is None else MixedPrecision(
            **{k: getattr(torch, v) if k.endswith("_dtype") else v for k, v in mixed.items()}),
        "cpu_offload": CPUOffload(offload_params=True) if config.offload else None,
        "backward_prefetch": BackwardPrefetch.BACKWARD_PRE if config.backward_prefetch else None,
        "forward_prefetch": config.forward_prefetch,
        "limit_all_gathers": config.limit_all_gathers,  # rate limiter (<= 2 in flight), not message merging
        "auto_wrap_policy": policy,
        "use_orig_params": True,       # LoRA/frozen params and torch.compile need it
        "sync_module_states": False,   # every rank builds the same weights; True broadcasts rank 0's
        "device_id": device_id,
        **device_mesh,  # (dp_replicate, dp_shard): HYBRID's replicate and shard groups
    }


def apply_fsdp1(model: nn.Module, config: FsdpConfig, block_classes: set[type], *, param_init_fn=None,
                **kwargs) -> nn.Module:
    """FSDP1-wrap `model` (kwargs go to fsdp1_kwargs), then checkpoint every K-th block (or every block with
    the selective-op policy) inside its unit; float8 converts the blocks' linears before wrapping, compile
    compiles each block (the wrapper inside its unit) after. FSDP1 has no FP8 all-gather and no int
    reshard_after_forward: both raise.

    param_init_fn: FSDP1's hook that materialises a meta-device unit before it is sharded."""
    for field, value in (("fp8_all_gather", config.fp8_all_gather), ("reshard_after_forward", config.reshard_after_forward)):
        if value:
            raise ValueError(f"{field}: FSDP2 only (fully_shard); FSDP1 has no such option")
    extra = {"param_init_fn": param_init_fn} if param_init_fn is not None else {}
    disable_kv_cache(model)
    if config.float8:
        convert_to_float8(model, block_classes, config, _fsdp1_device_type(kwargs.get("device_id")))
    wrapped = FullyShardedDataParallel(model, **fsdp1_kwargs(config, block_classes, **kwargs), **extra)
    apply_checkpointing(wrapped, block_classes, config)
    if config.compile:
        for parent, name in _block_slots(wrapped, block_classes):
            unit = getattr(parent, name)
            (unit._fsdp_wrapped_module if isinstance(unit, FullyShardedDataParallel) else unit).compile()
    return wrapped


def _is_trainable_leaf(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return not list(module.children()) and isinstance(weight, nn.Parameter) and weight.requires_grad


def _fsdp1_device_type(device_id) -> str:
    if isinstance(device_id, torch.device):
        return device_id.type
    if isinstance(device_id, int):
        return "cuda"
    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"


def _fsdp1_devices_per_node(device_id) -> int:
    """What FSDP1 takes as the node size for HYBRID: device_count() of the device type it runs on."""
    if isinstance(device_id, torch.device):
        device_type = device_id.type
    elif torch.accelerator.is_available():
        device_type = torch.accelerator.current_accelerator().type
    else:
        device_type = "cpu"
    return torch.get_device_module(device_type).device_count()


# ---------------------------------------------------------------- FSDP2

def make_mesh(config: FsdpConfig, world_size: int, gpus_per_node: int, device_type: str = "cuda") -> DeviceMesh:
    """Data parallelism only: 1-D ("dp_shard",) for FULL_SHARD/SHARD_GRAD_OP; 2-D ("dp_replicate", "dp_shard")
    otherwise. With tp or cp > 1: the N-D mesh of dense_mesh_dims (make_dense_mesh).

    HYBRID shards inside a node: (world / gpus_per_node, gpus_per_node), or over shard_group_gpus. NO_SHARD is (world, 1): every
    rank holds a full replica and gradients are all-reduced, i.e. DDP through FSDP2.
    """
    group = config.shard_group_gpus or gpus_per_node
    if config.sharding.is_hybrid and world_size % group:
        raise ValueError(f"world size {world_size} is not a multiple of the shard group's {group} GPUs")
    if config.tp > 1 or config.cp > 1:
        return make_dense_mesh(config, world_size, gpus_per_node, device_type)
    layout = fsdp_options.mesh_layout(config, world_size, gpus_per_node)
    return init_device_mesh(device_type, tuple(layout["shape"]), mesh_dim_names=tuple(layout["dim_names"]))


# torchtitan's dense mesh (torchtitan/distributed/parallel_dims.py), outermost first; pp joins in front later.
DENSE_MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
FSDP_DIM = "dp_shard_cp"  # torchtitan's name for dp_shard x cp flattened: the axis fully_shard shards over


def dense_mesh_dims(config: FsdpConfig, world_size: int, gpus_per_node: int) -> dict[str, int]:
    """{dim: size} in DENSE_MESH_DIMS order: tp and cp as configured, the data-parallel ranks left split as
    FsdpConfig.dp_shard_size does (cost_models/mesh.py: FULL_SHARD-like over all of them, HYBRID inside a
    node or shard_group_gpus, NO_SHARD replicated)."""
    model_parallel = config.tp * config.cp * config.pp
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not a multiple of tp x cp x pp = {model_parallel}")
    dp = world_size // model_parallel
    if config.sharding is Sharding.NO_SHARD:
        dp_shard = 1
    elif config.sharding.is_hybrid:
        dp_shard = config.dp_degrees(world_size, gpus_per_node)[1]
    else:
        dp_shard = dp
    if dp % dp_shard:
        raise ValueError(f"{dp} data-parallel ranks do not split into shard groups of {dp_shard}")
    return {"dp_replicate": dp // dp_shard, "dp_shard": dp_shard, "cp": config.cp, "tp": config.tp}


def make_dense_mesh(config: FsdpConfig, world_size: int, gpus_per_node: int, device_type: str = "cuda") -> DeviceMesh:
    """The N-D DeviceMesh [dp_replicate, dp_shard, cp, tp] (size-1 dims kept, so every name exists), with
    dp_shard x cp flattened to FSDP_DIM (build it outside FakeTensorMode, pitfalls.md)."""
    dims = dense_mesh_dims(config, world_size, gpus_per_node)
    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    mesh["dp_shard", "cp"]._flatten(FSDP_DIM)
    return mesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh fully_shard takes: dp_shard x cp (HSDP: with dp_replicate in front), or the mesh itself
    when it has no model-parallel dims (make_mesh's data-parallel layouts)."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names and "cp" not in names:
        return mesh
    return mesh["dp_replicate", FSDP_DIM] if mesh["dp_replicate"].size() > 1 else mesh[FSDP_DIM]


def apply_mesh_parallelisms(model: nn.Module, config: FsdpConfig, block_classes: set[type], mesh: DeviceMesh) -> None:
    """The per-mesh step: every parallelism other than FSDP, applied to the model in torchtitan's order before
    checkpointing, compile and fully_shard. Tensor parallel (calibration/tensor_parallel.py) on the "tp" dim;
    expert parallelism (calibration/expert_parallel.py) joins here. Context parallelism shards the step's
    inputs rather than the model (context_parallel around each step). No-op on a data-parallel-only mesh."""
    names = mesh.mesh_dim_names or ()
    if config.tp > 1:
        if "tp" not in names:
            raise ValueError(f"tp={config.tp} needs a mesh with a 'tp' dim (make_mesh), got {names}")
        from .tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], _block_slots(model, block_classes), config.sequence_parallel)


def fsdp2_kwargs(config: FsdpConfig, mesh: DeviceMesh, block: bool = False) -> dict:
    """Keyword arguments for fully_shard(module, **kwargs). block: a block's unit, which takes the config's
    int reshard_after_forward when it has one (after forward its params stay sharded over that many ranks,
    and backward all-gathers among them only); the root keeps the strategy's bool (FSDP2 keeps the root's
    params for backward anyway)."""
    dtypes = _mixed_dtypes(config)
    reshard = fsdp_options.fully_shard_options(config)["reshard_after_forward"]
    return {
        "mesh": mesh,
        # FULL/HYBRID free gathered params after forward (ZeRO-3); the ZeRO-2 forms keep them for backward.
        "reshard_after_forward": config.reshard_after_forward if block and config.reshard_after_forward else reshard,
        "mp_policy": MixedPrecisionPolicy() if dtypes is None
        else MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1]),
        # Pinned host memory needs an accelerator; on a CPU mesh (tests) the policy is a no-op anyway.
        **({"offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")} if config.offload else {}),
        **({"shard_placement_fn": dim1_placement(mesh.size(-1))} if config.expert_shard_dim else {}),
    }


def dim1_placement(d: int):
    """shard_placement_fn for expert_shard_dim=1 (fsdp_options.DIM1_PLACEMENT): stacked expert matrices,
    whose dim 0 (the expert index) the shard group d does not divide, go on dim 1 unpadded."""
    from torch.distributed.tensor import Shard

    def placement(p):
        return Shard(1) if p.ndim == 3 and p.shape[0] % d and p.shape[1] % d == 0 else None

    return placement


def apply_fsdp2(model: nn.Module, config: FsdpConfig, block_classes: set[type], mesh: DeviceMesh,
                edge_units: bool = False) -> nn.Module:
    """torchtitan-style: the mesh's other parallelisms (apply_mesh_parallelisms: TP), Float8 linears, checkpoint every K-th block (or every block by op), compile each
    block, fully_shard each block (the checkpoint wrapper when there is one, so recompute stays inside the
    unit), then the root. edge_units (ModelSpec.split_edge_units): first the embedding as a unit resharded after
    forward as the root would be, and [final norm, head] as one kept gathered to its backward (torchtitan 0.3's
    distributed/fsdp.py apply_fsdp_to_decoder, untied). Returns the same module."""
    disable_kv_cache(model)
    if config.float8:  # a model converter, before any parallelism (torchtitan)
        convert_to_float8(model, block_classes, config, mesh.device_type)
    apply_mesh_parallelisms(model, config, block_classes, mesh)
    mesh = data_parallel_mesh(mesh)
    apply_checkpointing(model, block_classes, config)
    kwargs, block_kwargs = fsdp2_kwargs(config, mesh), fsdp2_kwargs(config, mesh, block=True)
    if config.ep > 1:  # E / ep experts per rank, all-to-all dispatch, fully_shard over efsdp (calibration/expert_parallel.py)
        from .expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, config, mesh, block_kwargs)
    if edge_units:
        embedding, norm, head = edge_modules(model)
        fully_shard(embedding, **kwargs)
        fully_shard([norm, head], **{**kwargs, "reshard_after_forward": False})
    for parent, name in _block_slots(model, block_classes):
        block = getattr(parent, name)
        if config.compile:  # in place (nn.Module.compile): names, state dict keys and FSDP's hooks unchanged
            block.compile()
        if config.expert_units and config.ep == 1:  # the routed experts first: a unit of their own inside the block's
            for experts in expert_modules(block):
                fully_shard(experts, **block_kwargs)
        fully_shard(block, **block_kwargs)
    fully_shard(model, **kwargs)
    return model


def edge_modules(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The embedding, final norm and head of a transformers causal LM (its decoder's `norm`) or the reference Llama."""
    if hasattr(model, "get_output_embeddings"):
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        if not isinstance(getattr(base, "norm", None), nn.Module):
            raise ValueError(f"{type(model).__name__}: no final `norm` on its decoder to wrap with the head")
        return model.get_input_embeddings(), base.norm, model.get_output_embeddings()
    return model.embed_tokens, model.norm, model.lm_head


# ---------------------------------------------------------------- shared helpers

def disable_kv_cache(model: nn.Module) -> None:
    """Set `model.config.use_cache = False` when the model has a config with that attribute (Hugging Face).

    Training needs no KV cache, and HF configs default to use_cache=True. HF's gradient_checkpointing_enable
    turns it off, our checkpoint_wrapper does not: the forward fills a live cache and each checkpointed
    block's recompute appends its keys and values again, held to the end of backward (more memory; SDPA's
    gradients are unchanged, eager attention fails in the recompute). apply_fsdp1/apply_fsdp2 call this,
    and the emitted snippets do the same."""
    config = getattr(model, "config", None)
    if hasattr(config, "use_cache"):
        config.use_cache = False


def set_attention(model: nn.Module, attn_implementation: str) -> None:
    """Run the attention a plan priced on a Hugging Face model (transformers' name: "sdpa", "eager",
    "flex_attention", "flash_attention_3"), whatever its loader picked; another nn.Module is left alone. As the
    emitted snippets do (planner/emit/attention.py says why: gpt-oss loaded without it runs eager)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attn_implementation)


def cast_for_precision(model: nn.Module, config: FsdpConfig) -> nn.Module:
    """bf16-pure stores everything in bf16: cast the model before wrapping. Other precisions: unchanged."""
    if config.precision is Precision.BF16_PURE:
        model.to(torch.bfloat16)
    return model


def grad_scaler_for(config: FsdpConfig, device: str = "cuda") -> ShardedGradScaler | None:
    """fp16 gradients underflow without loss scaling; the sharded scaler all-reduces the inf check across
    ranks. bf16 has fp32's exponent range and needs none."""
    return ShardedGradScaler(device=device) if config.precision is Precision.FP16 else None
