"""Whether a configuration can run on a cluster at all, whatever the memory: the one table of rules.

Each rule reads (config, cluster) and returns a Refusal (the field at fault, the reason, the fix) or None; none reads
the micro-batch or the accumulation (the search checks a knob combination once for all its micro-batches).
The estimate lists the reasons of a rejected candidate (cost_models.evaluate), the search skips such
configurations, the API raises a PlannerError naming the field (planner.api.cluster_rejects) and `fsdp-plan
check` turns each into an error finding with its fix (planner.doctor). What works but costs (Float8 linears
around fp32 compute, a reshard group that is the whole shard group) is the doctor's to say, not a rule here.

`as_run` is the other half: a setting FSDP accepts and reads as another one is priced as what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .specs import ClusterSpec, FsdpConfig, Precision


@dataclass(frozen=True)
class Refusal:
    field: str          # the setting at fault, as the API and CLI name it
    code: str           # the doctor's finding code
    reason: str         # why it cannot run (a clause: no final period)
    fix: str            # the change that makes it run
    priced: bool = True  # the cost model still prices it, so a report can show what it would need


def _compute_dtype(config: FsdpConfig, cluster: ClusterSpec) -> Refusal | None:
    dtype = config.precision.compute_dtype
    if cluster.gpu.supports(dtype):
        return None
    runs = [p.value for p in Precision if cluster.gpu.supports(p.compute_dtype)]
    scaler = " (fp16: with ShardedGradScaler)" if "fp16" in runs else ""
    return Refusal("precision", "dtype-not-supported",
                   f"{cluster.gpu.id} has no {dtype} support: no {dtype} tensor cores, so the run fails or falls back "
                   "to slow emulation",
                   f"choose one of: {', '.join(runs)}{scaler}")


def _float8_tensor_cores(config: FsdpConfig, cluster: ClusterSpec) -> Refusal | None:
    if not config.float8 or cluster.gpu.supports("fp8"):
        return None
    return Refusal("float8", "float8-without-fp8-tensor-cores",
                   f"{cluster.gpu.id} has no FP8 tensor cores: torchao's Float8 matmul (torch._scaled_mm) needs "
                   "compute capability 8.9+ (Ada, Hopper, Blackwell) or CDNA 3/4, and fails here",
                   "drop Float8 (bf16 linears), or plan for a GPU that has them (fsdp-plan gpus: the fp8 TF column)")


def _reshard_group(config: FsdpConfig, cluster: ClusterSpec) -> Refusal | None:
    """FSDP2's int reshard_after_forward must divide the shard group (torch.distributed.fsdp._fully_shard.
    _fsdp_init._get_post_forward_mesh_info raises "should be a factor of d" otherwise, and for one above d);
    equal to d it is True (as_run)."""
    r = config.reshard_after_forward
    if not r:
        return None
    d = config.shard_group_size(cluster)
    if d % r == 0:
        return None
    return Refusal("reshard_after_forward", "reshard-after-forward-not-a-divisor",
                   f"reshard_after_forward={r} does not divide the shard group of {d} ranks (FSDP2 raises 'should "
                   f"be a factor of {d}'): after forward each block's params are resharded over groups of {r} "
                   "consecutive ranks",
                   f"choose a divisor >= 2 of {d} (e.g. the node's {cluster.gpus_per_node} GPUs), or the strategy's "
                   "own (0; fully_shard: True)")


def _hybrid_whole_nodes(config: FsdpConfig, cluster: ClusterSpec) -> Refusal | None:
    if not config.sharding.is_hybrid:
        return None
    if config.shard_group_gpus:
        return _hybrid_shard_group(config, cluster)
    if cluster.n_gpus % cluster.gpus_per_node == 0:
        return None
    return Refusal("gpus_per_node", "hybrid-needs-whole-nodes",
                   f"{config.sharding.value} needs gpus ({cluster.n_gpus}) divisible by gpus_per_node "
                   f"({cluster.gpus_per_node})",
                   f"a multiple of {cluster.gpus_per_node} GPUs, or FULL_SHARD", priced=False)


def _hybrid_shard_group(config: FsdpConfig, cluster: ClusterSpec) -> Refusal | None:
    """A shard group of shard_group_gpus GPUs: whole groups in each pipeline stage's GPUs (the mesh is [pp,
    dp_replicate, dp_shard, cp, tp]), and a part of a node or whole nodes (a group straddling a node boundary
    would put some of its ring on the network and some on NVLink, which the tiers do not price)."""
    g, node, stage = config.shard_group_gpus, cluster.gpus_per_node, cluster.n_gpus // config.pp
    if stage % g == 0 and (node % g == 0 or g % node == 0):
        return None
    return Refusal("shard_group_gpus", "shard-group-not-a-divisor",
                   f"a shard group of {g} GPUs does not split {stage} GPUs{' per pipeline stage' if config.pp > 1 else ''}"
                   f" into whole groups of part of a {node}-GPU node or of whole nodes",
                   f"choose a divisor of {stage} that divides {node} or is a multiple of it (0: one node)",
                   priced=False)


def _attention_kernel(config: FsdpConfig, cluster: ClusterSpec) -> Refusal | None:
    """flash-attention 3 and Transformer Engine's cuDNN fused attention as priced are Hopper kernels (wgmma, TMA:
    cost_models/attention_kernels.py); the catalog lists the kernels of each architecture."""
    kernel, gpu = config.attention_kernel.value, cluster.gpu
    if kernel == "flash2" or kernel in gpu.attention_kernels():  # (every part has flash2: the search's common case)
        return None
    return Refusal("attention_kernel", "attention-kernel-not-on-gpu",
                   f"{kernel} attention is priced on Hopper GPUs only (wgmma / TMA kernels); {gpu.id} "
                   f"({gpu.architecture or 'unknown architecture'}) runs {', '.join(gpu.attention_kernels())}",
                   f"choose attention_kernel {' or '.join(gpu.attention_kernels())}, or a Hopper GPU")


RULES: tuple[Callable[[FsdpConfig, ClusterSpec], Refusal | None], ...] = (
    _compute_dtype, _float8_tensor_cores, _reshard_group, _hybrid_whole_nodes, _attention_kernel)


def refusals(cluster: ClusterSpec, config: FsdpConfig) -> list[Refusal]:
    """Every rule's refusal of `config` on `cluster`, in the table's order (empty: it can run)."""
    return [r for rule in RULES if (r := rule(config, cluster)) is not None]


def as_run(config: FsdpConfig, cluster: ClusterSpec) -> FsdpConfig:
    """The configuration FSDP runs: reshard_after_forward equal to the shard group is True, the strategy's own
    resharding (_get_post_forward_mesh_info: `elif reshard_after_forward == shard_mesh_size:
    reshard_after_forward = True`), so it is priced and emitted as plain FULL_SHARD / HYBRID_SHARD."""
    if config.reshard_after_forward and config.reshard_after_forward == config.shard_group_size(cluster):
        config = replace(config, reshard_after_forward=0)
    return node_shard_group(config, cluster)


def node_shard_group(config: FsdpConfig, cluster: ClusterSpec) -> FsdpConfig:
    """shard_group_gpus of one node is the default's (0): one spelling, so a plan and its file read back compare
    equal."""
    if config.shard_group_gpus and config.shard_group_gpus == cluster.gpus_per_node:
        return replace(config, shard_group_gpus=0)
    return config
