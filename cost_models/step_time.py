"""Step time: per-unit compute overlapped with FSDP's collectives, plus offload and the optimizer step.

Per micro-step, unit by unit (formulas.md, "Overlap"): in forward the next block's all-gather runs
during the current block's compute; in backward the next block's all-gather (backward prefetch) and the
previous block's reduce-scatter (and HSDP's all-reduce across replicas) run during the current block's
backward. A unit's exposed communication is max(0, comm - compute); the root's all-gather before the
first block and the last reduce-scatter are always exposed. Without backward prefetch the backward
all-gathers are not overlapped. Gradient accumulation repeats the micro-step; sharded strategies
reduce-scatter every micro-step (no gathered gradients are kept), NO_SHARD all-reduces only on the
last (no_sync). CPU offload adds host<->device copies of every unit's shard and the CPU optimizer
step. Mixture of experts: compute follows the active parameters (compute.py), the collectives move every
expert of a block, padded as FSDP2 pads stacked expert tensors (cost_models/moe.py), so small
micro-batches leave the all-gathers exposed (communication_note says why and what helps); an MoE model's
leading dense blocks are priced with their own sizes, each paired with blocks of its kind for the
overlap. Ignored: kernel-level compute/communication contention, stragglers, data loading.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from . import comm, moe
from .compute import (attention_flops_per_token_per_layer, mfu_flops_per_token, model_flops_per_token,
                      recompute_flops_per_token)
from .memory import ParamCounts
from .profile import Profile
from .specs import Attention, ClusterSpec, FsdpConfig, ModelSpec, Sharding, TrainingSpec
from .units import DTYPE_BYTES


@dataclass(frozen=True)
class TimeBreakdown:
    compute_s: float             # all micro-steps, recompute included
    recompute_s: float           # the part of compute_s spent re-running checkpointed forwards
    exposed_comm_s: float        # communication not hidden behind compute
    total_comm_s: float          # all collective time, hidden or not (for information)
    offload_copy_s: float        # CPU offload host<->device copies
    optimizer_s: float           # the optimizer step (GPU, or CPU with offload)
    overhead_s: float            # fixed per micro-step cost
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float                   # model FLOPs (torchtitan's count, no recompute) / (step time * peak)
    hfu: float                   # executed FLOPs (recompute included) / (step time * peak)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _shard_tiers(config: FsdpConfig, cluster: ClusterSpec, profile: Profile):
    """(shard-group tier, replicate-group tier) for the configuration's process groups."""
    d = config.shard_group_size(cluster)
    # a group inside the scale-up domain (the node, or GB200's 72-GPU NVLink domain) stays on the fast tier
    shard = comm.Tier.for_group(cluster, profile, spans_nodes=d > cluster.fast_tier_gpus)
    replicate = comm.Tier.for_group(cluster, profile, spans_nodes=cluster.n_gpus > cluster.fast_tier_gpus,
                                    groups_sharing_nics=min(d, cluster.gpus_per_node))
    return shard, replicate


def estimate_step_time(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
                       profile: Profile) -> TimeBreakdown:
    gpu = cluster.gpu
    precision = config.precision
    dtype = precision.compute_dtype
    # A dtype the GPU lacks runs emulated: price it at the fp32 rate (evaluate rejects it anyway).
    peak = gpu.peak_flops.get(dtype) or gpu.peak_flops["fp32"]
    flops_per_s = peak * profile.efficiency(dtype)
    c = DTYPE_BYTES[dtype]
    p = DTYPE_BYTES[precision.param_dtype]
    r = DTYPE_BYTES[config.gradient_reduce_dtype]
    L = model.n_layers
    d = config.shard_group_size(cluster)
    n_replicas = config.replicate_group_size(cluster)
    # what is gathered and reduce-scattered (MoE: padded on dim 0, the expert matrices not when sharded on dim 1)
    counts = ParamCounts.of(model, training, d, dim1=bool(config.expert_shard_dim))
    tokens = config.micro_batch * training.seq_len

    # --- compute per micro-step -----------------------------------------------------------------------
    model_flops = model_flops_per_token(model, training) * tokens
    recompute_flops = recompute_flops_per_token(model, training, config) * tokens
    compute_s = (model_flops + recompute_flops) / flops_per_s
    recompute_s = recompute_flops / flops_per_s
    if config.attention is Attention.EAGER:
        # Eager attention streams a*s^2 score tensors through HBM: write scores, softmax read/write
        # (fp32), read probabilities for P@V, and about twice that in backward.
        score_bytes = L * config.micro_batch * model.n_heads * training.seq_len ** 2 * (3 * c + 8) * 3
        compute_s += score_bytes / (gpu.hbm_bytes_per_s * profile.optimizer_hbm_efficiency)
    attn_fwd_flops = attention_flops_per_token_per_layer(model, training.seq_len) / 3
    adapters = counts.trainable_block if counts.frozen_block else 0   # LoRA
    block_fwd_s = (2 * (moe.active_block_params(model) + adapters) + attn_fwd_flops) * tokens / flops_per_s
    block_bwd_s = 2 * block_fwd_s + (recompute_s / L)

    # --- collectives per micro-step --------------------------------------------------------------------
    shard_tier, replicate_tier = _shard_tiers(config, cluster, profile)
    root_gather = counts.root() * c
    root_reduce = counts.trainable_root * r
    sync_every_microstep = config.sharding is not Sharding.NO_SHARD

    def collectives(gather_bytes: float, reduce_bytes: float) -> tuple[float, float]:
        """(all-gather, gradient reduction) seconds of one unit."""
        if not sync_every_microstep:
            return 0.0, comm.all_reduce_s(reduce_bytes, n_replicas, replicate_tier)
        return (comm.all_gather_s(gather_bytes, d, shard_tier),
                comm.reduce_scatter_s(reduce_bytes, d, shard_tier)
                + comm.all_reduce_s(reduce_bytes / d, n_replicas, replicate_tier))

    root_ag, root_rs = collectives(root_gather, root_reduce)
    gathers_in_backward = config.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
    # Blocks by kind: (count, all-gather s, reduction s, forward s, backward s); block 0 is of the last kind.
    ag, rs = collectives(counts.block() * c, counts.trainable_block * r)
    experts = moe.experts_gathered_elements(model, d, bool(config.expert_shard_dim)) if config.expert_units else 0
    if experts:  # two collectives per sparse block (its experts, the rest): the same bytes, twice the latency
        trained = 0 if counts.frozen_block else experts   # LoRA: frozen experts reduce nothing
        shell_ag, shell_rs = collectives((counts.block() - experts) * c, (counts.trainable_block - trained) * r)
        own_ag, own_rs = collectives(experts * c, trained * r)
        ag, rs = shell_ag + own_ag, shell_rs + (own_rs if trained else 0.0)
    kinds = [(L - model.n_dense_layers, ag, rs, block_fwd_s, block_bwd_s)]
    if model.n_dense_layers:  # an MoE model's leading dense blocks: their own sizes and FLOPs
        nd, dense_delta = model.n_dense_layers, (counts.trainable_dense_delta + counts.frozen_dense_delta) // model.n_dense_layers
        d_fwd = block_fwd_s + 2 * (model.moe.dense_block_params - moe.active_block_params(model)) * tokens / flops_per_s
        d_ag, d_rs = collectives((counts.block() + dense_delta) * c,
                                 (counts.trainable_block + counts.trainable_dense_delta // nd) * r)
        kinds.append((nd, d_ag, d_rs, d_fwd, 2 * d_fwd + recompute_s / L))
    first_ag, last_rs = kinds[-1][1], kinds[-1][2]

    fwd_exposed = root_ag + first_ag + sum(n * max(0.0, a - f) for n, a, _, f, _ in kinds) \
        - max(0.0, first_ag - kinds[-1][3])

    def backward_exposed(reducing: bool) -> float:
        exposed_s = (last_rs if reducing else 0.0) + root_rs
        for n, a, reduce_s, _, bwd_s in kinds:
            a, reduce_s = (a if gathers_in_backward else 0.0), (reduce_s if reducing else 0.0)
            if config.backward_prefetch:
                exposed_s += n * max(0.0, a + reduce_s - bwd_s)
            else:
                exposed_s += n * (a + max(0.0, reduce_s - bwd_s))
        return exposed_s

    accum = config.grad_accum
    gathered_s = sum(n * a * (2 if gathers_in_backward else 1) for n, a, *_ in kinds)
    reduced_s = sum(n * reduce_s for n, _, reduce_s, *_ in kinds)
    if sync_every_microstep:
        exposed = accum * (fwd_exposed + backward_exposed(True))
        total_comm = accum * (root_ag + root_rs + gathered_s + reduced_s)
    else:
        exposed = accum * fwd_exposed + (accum - 1) * backward_exposed(False) + backward_exposed(True)
        total_comm = accum * (root_ag + gathered_s) + root_rs + reduced_s

    # --- CPU offload and optimizer step ---------------------------------------------------------------
    trainable_shard = counts.trainable(L) / d
    stored_shard_bytes = (counts.trainable(L) * p + counts.frozen(L) * (c if precision.mixed else p)) / d
    opt_bytes = training.optimizer.state_bytes_per_param(precision.param_dtype)
    if config.offload:
        gathers = 2 if gathers_in_backward else 1
        copy_bytes = accum * (gathers * stored_shard_bytes + trainable_shard * p)
        offload_copy_s = copy_bytes / (gpu.pcie_bytes_per_s * profile.pcie_efficiency)
        optimizer_s = trainable_shard / profile.cpu_optimizer_params_per_s
    else:
        offload_copy_s = 0.0
        # read/write params and states, read grads
        touched = trainable_shard * (2 * p + p + 2 * opt_bytes)
        optimizer_s = touched / (gpu.hbm_bytes_per_s * profile.optimizer_hbm_efficiency)

    overhead_s = accum * profile.microstep_overhead_s
    compute_total = accum * compute_s
    step_s = compute_total + exposed + offload_copy_s + optimizer_s + overhead_s
    tokens_per_step = accum * tokens
    return TimeBreakdown(
        compute_s=compute_total,
        recompute_s=accum * recompute_s,
        exposed_comm_s=exposed,
        total_comm_s=total_comm,
        offload_copy_s=offload_copy_s,
        optimizer_s=optimizer_s,
        overhead_s=overhead_s,
        step_s=step_s,
        tokens_per_s_per_gpu=tokens_per_step / step_s,
        mfu=tokens_per_step * mfu_flops_per_token(model, training) / (step_s * peak),
        hfu=accum * (model_flops + recompute_flops) / (step_s * peak),
    )
