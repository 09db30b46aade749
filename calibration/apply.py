"""THE one code path that turns an FsdpConfig into FSDP.

The Python API, calibration runs and traces all go through here, so what we measure is what we emit
(planner/emit.py writes the same choices as text). Layout is torchtitan's: one FSDP unit per repeated
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
- Hugging Face models train with model.config.use_cache = False (disable_kv_cache says why).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
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
from cost_models.specs import FsdpConfig, Precision

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
    if config.sharding.is_hybrid:
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
    }


def apply_fsdp1(model: nn.Module, config: FsdpConfig, block_classes: set[type], *, param_init_fn=None,
                **kwargs) -> nn.Module:
    """FSDP1-wrap `model` (kwargs go to fsdp1_kwargs), then checkpoint every K-th block inside its unit.

    param_init_fn: FSDP1's hook that materialises a meta-device unit before it is sharded."""
    extra = {"param_init_fn": param_init_fn} if param_init_fn is not None else {}
    disable_kv_cache(model)
    wrapped = FullyShardedDataParallel(model, **fsdp1_kwargs(config, block_classes, **kwargs), **extra)
    if config.ac_every:
        apply_activation_checkpointing(wrapped, block_classes, config.ac_every)
    return wrapped


def _is_trainable_leaf(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return not list(module.children()) and isinstance(weight, nn.Parameter) and weight.requires_grad


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
    """1-D ("dp_shard",) for FULL_SHARD/SHARD_GRAD_OP; 2-D ("dp_replicate", "dp_shard") otherwise.

    HYBRID shards inside a node: (world / gpus_per_node, gpus_per_node). NO_SHARD is (world, 1): every
    rank holds a full replica and gradients are all-reduced, i.e. DDP through FSDP2.
    """
    if config.sharding.is_hybrid and world_size % gpus_per_node:
        raise ValueError(f"world size {world_size} is not a multiple of gpus_per_node={gpus_per_node}")
    layout = fsdp_options.mesh_layout(config, world_size, gpus_per_node)
    return init_device_mesh(device_type, tuple(layout["shape"]), mesh_dim_names=tuple(layout["dim_names"]))


def fsdp2_kwargs(config: FsdpConfig, mesh: DeviceMesh) -> dict:
    """Keyword arguments for fully_shard(module, **kwargs)."""
    dtypes = _mixed_dtypes(config)
    return {
        "mesh": mesh,
        # FULL/HYBRID free gathered params after forward (ZeRO-3); the ZeRO-2 forms keep them for backward.
        "reshard_after_forward": fsdp_options.fully_shard_options(config)["reshard_after_forward"],
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


def apply_fsdp2(model: nn.Module, config: FsdpConfig, block_classes: set[type], mesh: DeviceMesh) -> nn.Module:
    """torchtitan-style: checkpoint every K-th block, fully_shard each block (the checkpoint wrapper when
    there is one, so recompute stays inside the unit), then the root. Returns the same module."""
    disable_kv_cache(model)
    if config.ac_every:
        apply_activation_checkpointing(model, block_classes, config.ac_every)
    kwargs = fsdp2_kwargs(config, mesh)
    for parent, name in _block_slots(model, block_classes):
        block = getattr(parent, name)
        if config.expert_units:  # the routed experts first: a unit of their own inside the block's
            for experts in expert_modules(block):
                fully_shard(experts, **kwargs)
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def expert_modules(block: nn.Module) -> list[nn.Module]:
    """The modules holding a block's stacked expert tensors (fsdp_options.IS_EXPERTS_MODULE)."""
    return [m for m in block.modules() if any(p.ndim == 3 for p in m.parameters(recurse=False))]


# ---------------------------------------------------------------- shared helpers

def _block_slots(model: nn.Module, block_classes: set[type]) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of each block in module order, looking through checkpoint wrappers and FSDP1
    wrappers; blocks nested inside a block are not separate slots."""
    classes = tuple(block_classes)
    slots: list[tuple[nn.Module, str]] = []

    def unwrap(module):
        while isinstance(module, (CheckpointWrapper, FullyShardedDataParallel)):
            module = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) \
                else module._fsdp_wrapped_module
        return module

    def visit(parent):
        for name, child in parent.named_children():
            if isinstance(unwrap(child), classes):
                slots.append((parent, name))
            else:
                visit(child)

    visit(model)
    return slots


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


def apply_activation_checkpointing(model: nn.Module, block_classes: set[type], every: int) -> int:
    """Wrap blocks 0, K, 2K, ... in a non-reentrant checkpoint_wrapper; returns how many were wrapped.

    Non-reentrant: works with FSDP, frozen params and kwargs. Works before or after FSDP1 wrapping
    (after, the wrapper sits inside the block's FSDP unit). Already-wrapped blocks are left alone.
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    count = 0
    for index, (parent, name) in enumerate(_block_slots(model, block_classes)):
        if index % every:
            continue
        holder, attr = parent, name
        # Under FSDP1 put the wrapper inside the unit: FSDP(CheckpointWrapper(block)).
        while isinstance(getattr(holder, attr), FullyShardedDataParallel):
            holder, attr = getattr(holder, attr), "_fsdp_wrapped_module"
        if isinstance(getattr(holder, attr), CheckpointWrapper):
            continue
        setattr(holder, attr, checkpoint_wrapper(getattr(holder, attr), checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        count += 1
    return count


def block_classes_for(model: nn.Module) -> set[type]:
    """Fallback detector of the repeated block: the class repeated most inside ModuleLists, weighted by
    parameters (so a list of tiny modules loses to the list of decoder layers)."""
    weight: Counter = Counter()
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                weight[type(child)] += sum(p.numel() for p in child.parameters())
    weight = Counter({cls: w for cls, w in weight.items() if w > 0})
    if not weight:
        raise ValueError(f"no nn.ModuleList of parameterised modules in {type(model).__name__}; "
                         "name the block class explicitly")
    return {weight.most_common(1)[0][0]}


def cast_for_precision(model: nn.Module, config: FsdpConfig) -> nn.Module:
    """bf16-pure stores everything in bf16: cast the model before wrapping. Other precisions: unchanged."""
    if config.precision is Precision.BF16_PURE:
        model.to(torch.bfloat16)
    return model


def grad_scaler_for(config: FsdpConfig, device: str = "cuda") -> ShardedGradScaler | None:
    """fp16 gradients underflow without loss scaling; the sharded scaler all-reduces the inf check across
    ranks. bf16 has fp32's exponent range and needs none."""
    return ShardedGradScaler(device=device) if config.precision is Precision.FP16 else None
