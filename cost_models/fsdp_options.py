"""FsdpConfig -> the FSDP1 / FSDP2 arguments, as plain names (no torch import).

The single mapping from a candidate to FSDP's options. `calibration.apply` turns these names into torch
objects, the emitters print them as code, the JSON output shows them: all three stay in step.
dtypes are torch attribute names ("bfloat16"); enums are member names ("FULL_SHARD").
"""

from __future__ import annotations

from .mesh import mesh_for
from .specs import FsdpConfig, Precision, Sharding

_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# FSDP2 has no strategy enum: each maps to reshard_after_forward and a mesh layout.
_FSDP1_STRATEGY = {
    Sharding.FULL_SHARD: "FULL_SHARD",
    Sharding.SHARD_GRAD_OP: "SHARD_GRAD_OP",
    Sharding.NO_SHARD: "NO_SHARD",
    Sharding.HYBRID_SHARD: "HYBRID_SHARD",
    Sharding.HYBRID_SHARD_ZERO2: "_HYBRID_SHARD_ZERO2",
}


def mixed_precision_dtypes(precision: Precision, reduce_dtype: str | None = None) -> dict | None:
    """param/reduce dtypes for FSDP's mixed precision, or None when the model runs in its own dtype.

    bf16-pure casts the model itself to bf16 (no fp32 master copy), so FSDP needs no policy. Buffers are
    not cast: a bf16 rotary inv_freq buffer would blur positions in long sequences, and buffers are too
    small to matter for memory. reduce_dtype (FsdpConfig.reduce_dtype) overrides the precision's; without
    mixed precision it gives a policy that casts only the gradients for their reduction (param_dtype None).
    """
    reduce = reduce_dtype or precision.reduce_dtype
    if not precision.mixed:
        return None if reduce == precision.reduce_dtype else {"param_dtype": None, "reduce_dtype": _TORCH_DTYPE[reduce]}
    return {"param_dtype": _TORCH_DTYPE[precision.compute_dtype], "reduce_dtype": _TORCH_DTYPE[reduce]}


def model_dtype(precision: Precision) -> str:
    """dtype the model's parameters are stored in before wrapping."""
    return _TORCH_DTYPE[precision.param_dtype]


def fsdp1_strategy(config: FsdpConfig, gpus_per_node: int) -> tuple[str, str]:
    """FSDP1 ShardingStrategy member name, and a note when it differs from the plan's name.

    With one GPU per node FSDP1's HYBRID clamps the 1-rank shard group to NO_SHARD on that group and
    drops the cross-node all-reduce (replicas silently diverge; seen on CPU/gloo), so NO_SHARD over all
    ranks is used: the same layout with gradients synchronised.
    """
    if config.sharding.is_hybrid and gpus_per_node == 1 and not config.shard_group_gpus:
        return "NO_SHARD", "HYBRID with 1 GPU per node is NO_SHARD (FSDP1 would skip the cross-node all-reduce)"
    if config.sharding is Sharding.HYBRID_SHARD_ZERO2:
        return "_HYBRID_SHARD_ZERO2", "ZeRO-2 inside a node, replicas across nodes (torch keeps the name private)"
    return _FSDP1_STRATEGY[config.sharding], ""


def fsdp1_mixed_precision(precision: Precision, lora: bool = False, reduce_dtype: str | None = None) -> dict | None:
    """FSDP1 MixedPrecision arguments by name (dtypes as torch attribute names), or None. lora: every unit
    casts its floating inputs to the compute dtype: peft casts an adapter's input to the dtype of its
    weight read outside the adapter's unit (the sharded fp32 one), and by default only the root casts."""
    mixed = mixed_precision_dtypes(precision, reduce_dtype)
    if mixed is not None and mixed["param_dtype"] is None:
        mixed = {"reduce_dtype": mixed["reduce_dtype"]}
    if lora and mixed is not None:
        mixed = {**mixed, "cast_forward_inputs": True}
    return mixed


def fsdp1_options(config: FsdpConfig, block_class: str, gpus_per_node: int, lora: bool = False) -> dict:
    """Keyword arguments of FSDP1's FullyShardedDataParallel, by name. lora: adapters in their own units
    and unit inputs cast to the compute dtype (calibration.apply.fsdp1_kwargs' trainable_mixed)."""
    return {
        "sharding_strategy": fsdp1_strategy(config, gpus_per_node)[0],
        "mixed_precision": fsdp1_mixed_precision(config.precision, lora, config.reduce_dtype),
        "cpu_offload": {"offload_params": True} if config.offload else None,
        "auto_wrap_policy": {"CustomPolicy": {"blocks": [block_class], "trainable_leaves": True}} if lora
        else {"ModuleWrapPolicy": [block_class]},
        "backward_prefetch": "BACKWARD_PRE" if config.backward_prefetch else None,
        "forward_prefetch": config.forward_prefetch,
        "limit_all_gathers": config.limit_all_gathers,
        # Needed for frozen + trainable params in one unit (LoRA) and for torch.compile; costs nothing.
        "use_orig_params": True,
        # Only needed when rank 0 alone loads weights or the model is built on the meta device.
        "sync_module_states": False,
    }


def mesh_layout(config: FsdpConfig, n_gpus: int, gpus_per_node: int) -> dict:
    """FSDP2 DeviceMesh: 1-D over all ranks, or 2-D (replicate, shard) for HSDP and plain replication; with
    tensor / context parallelism torchtitan's [dp_replicate, dp_shard, cp, tp] (its dims of size > 1, dp_shard
    always: FSDP's axis). pp joins outermost with pipeline stages."""
    if config.model_parallel > 1:
        used = mesh_for(config, n_gpus, gpus_per_node, ep=1).used_dims()  # the dense mesh (experts: their view)
        return {"shape": [size for _, size in used], "dim_names": [name for name, _ in used]}
    if config.sharding.is_hybrid:  # shard groups of a node, or of shard_group_gpus
        return {"shape": list(config.dp_degrees(n_gpus, gpus_per_node)), "dim_names": ["dp_replicate", "dp_shard"]}
    if config.sharding is Sharding.NO_SHARD:
        return {"shape": [n_gpus, 1], "dim_names": ["dp_replicate", "dp_shard"]}
    return {"shape": [n_gpus], "dim_names": ["dp_shard"]}


def fully_shard_options(config: FsdpConfig) -> dict:
    """Keyword arguments of FSDP2's fully_shard for each block (the mesh comes from mesh_layout)."""
    mp = mixed_precision_dtypes(config.precision, config.reduce_dtype)
    return {
        # under PP torchtitan keeps the blocks gathered from forward to backward (fsdp_reshard_after_forward
        # "default": not pp_enabled), saving an all-gather per microbatch
        "reshard_after_forward": (config.sharding.reshards_after_forward or config.sharding is Sharding.NO_SHARD)
        and config.pp == 1,
        "mp_policy": None if mp is None else {"param_dtype": mp["param_dtype"], "reduce_dtype": mp["reduce_dtype"]},
        "offload_policy": "CPUOffloadPolicy" if config.offload else None,
        **({"shard_placement_fn": DIM1_PLACEMENT} if config.expert_shard_dim else {}),
    }


# FSDP2's shard_placement_fn for expert_shard_dim=1: a stacked expert matrix (the only 3-D parameters of a
# transformers MoE) whose dim 0 the shard group d does not divide is sharded on dim 1, when that divides evenly
# (FSDP2 needs even shards off dim 0); everything else stays on dim 0.
DIM1_PLACEMENT = "Shard(1) if p.ndim == 3 and p.shape[0] % d and p.shape[1] % d == 0 else None"
# expert_units: the modules that hold a transformers MoE's stacked expert tensors (its only 3-D parameters),
# each fully_shard-ed before its block (torchtitan shards an MoE block's experts the same way)
IS_EXPERTS_MODULE = "any(p.ndim == 3 for p in m.parameters(recurse=False))"

