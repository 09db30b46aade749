"""The priced parts cost_models/step_time.py adds up into a step: the process groups' network tiers, a block's and
the root's compute as the step prices them, the mesh's (TP, CP) collectives per micro-batch and the optimizer
step with CPU offload's copies."""

from __future__ import annotations

import math
from dataclasses import replace

from . import (attention_kernels, comm, context_parallel, expert_parallel, host_optimizer, kernels, operators, qlora,
               tensor_parallel)
from .identity_memo import IdentityMemo
from .kernel_time import BlockTime, Rates, eager_attention_ops, price_block
from .model_spec import dense_block_spec
from .profile import Profile
from .specs import Attention, ClusterSpec, FsdpConfig, ModelSpec, MoeDispatch, TrainingSpec
from .units import DTYPE_BYTES


def _shard_tiers(config: FsdpConfig, cluster: ClusterSpec, profile: Profile):
    """(shard-group tier, replicate-group tier) for the configuration's process groups. The mesh puts tp innermost
    (cost_models/mesh.py): FSDP's dp_shard x cp ranks are tp apart, so the group spans d x tp consecutive ranks,
    and the tp groups of a node cross the network at once (each GPU has its NIC share)."""
    d = config.shard_group_size(cluster)
    tp = config.tp
    # a group inside the scale-up domain (the node, or GB200's 72-GPU NVLink domain) stays on the fast tier
    shard = comm.Tier.for_group(cluster, profile, spans_nodes=d > 1 and d * tp > cluster.fast_tier_gpus,
                                groups_sharing_nics=min(tp, cluster.gpus_per_node))
    replicate = comm.Tier.for_group(cluster, profile, spans_nodes=cluster.n_gpus > cluster.fast_tier_gpus,
                                    groups_sharing_nics=min(d * tp, cluster.gpus_per_node))
    return shard, replicate


def mesh_tiers(config: FsdpConfig, cluster: ClusterSpec, profile: Profile) -> tuple[comm.Tier, comm.Tier]:
    """(TP group tier, CP group tier): a TP group is tp consecutive ranks; a CP group cp ranks tp apart (cp x tp
    consecutive ranks), the tp CP groups of those ranks crossing the network at once when it spans nodes. TP's
    collectives run at profile.tp_comm_efficiency of the tier's alpha-beta rate, bandwidth and per-hop latency
    alike (1.0 unless calibration fitted it)."""
    tp, cp = config.tp, config.cp
    tp_tier = comm.Tier.for_group(cluster, profile, spans_nodes=tp > cluster.fast_tier_gpus)
    tp_tier = replace(tp_tier, bus_bytes_per_s=tp_tier.bus_bytes_per_s * profile.tp_comm_efficiency,
                      latency_s=tp_tier.latency_s / profile.tp_comm_efficiency)
    cp_tier = comm.Tier.for_group(cluster, profile, spans_nodes=cp * tp > cluster.fast_tier_gpus,
                                  groups_sharing_nics=min(tp, cluster.gpus_per_node))
    return tp_tier, cp_tier


def root_memory_bytes_per_token(model: ModelSpec, config: FsdpConfig, c: int) -> tuple[tuple[str, float, float], ...]:
    """(name, forward, backward) bytes per token of the root's memory-bound chains as the step prices them:
    per-block compile leaves the final norm and the embedding eager; the loss is fused when it is compiled; a
    norm or loss kernel prices its own (kernels.root_op_bytes)."""
    _, ops = operators.root_ops(model, c)
    # sequence parallel: the final norm runs on s / tp tokens (the loss on vocab / tp is in the local model)
    share = {op.name: 1 / config.tp if op.name == "final norm" and config.sequence_parallel else 1.0 for op in ops}
    return tuple((op.name, *(share[op.name] * b for b in kernels.root_op_bytes(op, model, config, c))) for op in ops)


_PRICED = IdentityMemo(limit=1024)  # (spec, what priced_block_ops reads) -> its ops


def priced_block_ops(spec: ModelSpec, training: TrainingSpec, config: FsdpConfig, c: int):
    """(BlockOps, eager attention's products and score traffic or None) of one block as the step prices it:
    Float8's casts among the memory-bound ops; a traced inventory already holds eager attention's work. Once per spec
    and what it reads: a search's compute parts price the block at each micro-batch and checkpointing choice, and the
    same object lets price_block's cache find its key by identity."""
    return _PRICED.get(spec, (c, training.seq_len, training.adapter_rank, training.routing, training.routing_imbalance,
                              config.attention, config.attention_kernel, config.norm_kernel, config.rope_kernel,
                              config.swiglu_kernel, config.loss_kernel, config.tp, config.sequence_parallel, config.ep,
                              config.moe_dispatch, config.float8), lambda: _priced_block_ops(spec, training, config, c))


def _priced_block_ops(spec: ModelSpec, training: TrainingSpec, config: FsdpConfig, c: int):
    ops = operators.block_ops(spec, c, training.seq_len, training.adapter_rank, config.attention.value)
    ops = kernels.kernel_block_ops(ops, kernels.Kernels.of(config))  # Liger / TE kernels: one kernel each way
    ops = attention_kernels.without_layout_copy(ops, config.attention_kernel.value, config.attention.value)
    if config.tp > 1 and config.sequence_parallel:  # norms, residuals, dropout on s / tp tokens
        ops = tensor_parallel.sequence_parallel_ops(ops, config.tp)
    if spec.moe is not None:  # Automodel's round-robin gate runs no router
        ops = expert_parallel.routing_ops(ops, spec, training.routing, c)
    if config.ep > 1 and spec.moe is not None:  # a rank's E / ep experts on the rows it receives
        ops = expert_parallel.expert_parallel_ops(ops, spec, config.ep, training.routing_imbalance, config.tp)
        if config.moe_dispatch is MoeDispatch.DEEPEP:  # DeepEP's fused permute, Megatron's weighted SwiGLU
            rows = expert_parallel.ranks_per_token(spec.moe.n_experts, spec.moe.experts_per_token, config.ep,
                                                   training.routing)
            ops = expert_parallel.deepep_ops(ops, spec, c, rows)
    if config.float8:
        ops = replace(ops, memory_ops=ops.memory_ops + (operators.float8_cast_op(ops.matmuls, c),))
    eager = eager_attention_ops(ops, spec.n_heads, c) if config.attention is Attention.EAGER and not ops.traced else None
    return ops, eager


def _block_times(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, rates: Rates, c: int,
                 tokens: int) -> tuple[BlockTime, BlockTime | None, float, float]:
    """(sparse-or-only block, dense block of an MoE model or None, recompute s of the average block (both
    kinds), per-micro-step weight-cast s): every block's forward, backward and recompute on `tokens`."""
    recompute = "selective-op" if config.selective_op_ac else ("full" if config.ac_every else "")
    n_ckpt = model.n_layers if config.selective_op_ac else (math.ceil(model.n_layers / config.ac_every)
                                                            if config.ac_every else 0)

    def price(spec: ModelSpec) -> tuple[BlockTime, BlockTime, float]:
        ops, eager = priced_block_ops(spec, training, config, c)
        kw = dict(eager_attention=eager, compiled=config.compile, float8=config.float8,
                  kernel_seq_len=context_parallel.ring_kernel_seq_len(training.seq_len, config.cp))
        casts = rates.memory_s(operators.weight_cast_bytes(ops.matmuls, c, config.fp8_all_gather)) if config.float8 else 0.0
        return _timed(ops, rates, tokens, "", kw), _timed(ops, rates, tokens, recompute, kw), casts

    plain, ckpt, casts = price(model)
    dense_spec = dense_block_spec(model)
    dense = price(dense_spec) if dense_spec is not None else None
    recompute_s = n_ckpt * ckpt.recompute_s / model.n_layers if recompute else 0.0
    if dense is not None and recompute:
        nd = model.n_dense_layers
        recompute_s += n_ckpt * nd * (dense[1].recompute_s - ckpt.recompute_s) / model.n_layers ** 2
    weight_casts = (model.n_layers - model.n_dense_layers) * casts + (model.n_dense_layers * dense[2] if dense else 0.0)
    if training.quantized:  # QLoRA: each linear dequantized in the forward, the backward and a recompute (qlora.py)
        dequantize = rates.memory_s(qlora.dequantize_bytes_moved_per_block(model, c, training.double_quant))
        weight_casts += (2 * model.n_layers + n_ckpt) * dequantize
    return plain, dense[0] if dense else None, recompute_s, weight_casts


_TIMED = IdentityMemo(limit=4096)  # (ops, what else price_block reads) -> its BlockTime


def _timed(ops, rates: Rates, tokens: int, recompute: str, kw: dict) -> BlockTime:
    """price_block by the ops' identity (priced_block_ops' object): its lru_cache hashes every operator of the key
    at each call (~3% of a DeepSeek-V2-Lite search)."""
    return _TIMED.get(ops, (rates, tokens, recompute, *kw.values()),
                      lambda: price_block(ops, rates, tokens, recompute=recompute, **kw))


_NO_TP, _NO_CP = tensor_parallel.TpTime(), context_parallel.CpTime()


def _optimizer_times(trainable_shard: float, trainable: int, frozen: int, d: int, accum: int, gathers: int,
                     cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
                     profile: Profile) -> tuple[float, float]:
    """(offload copies, optimizer step) seconds of a rank holding trainable_shard parameters (d x its shard of
    `trainable` and `frozen` elements); CPU offload copies each unit's shard in `gathers` times per micro-step and
    steps on the host's CPUs (host_optimizer.py)."""
    precision, gpu = config.precision, cluster.gpu
    p, c = DTYPE_BYTES[precision.param_dtype], DTYPE_BYTES[precision.compute_dtype]
    stored_shard_bytes = (trainable * p + frozen * (c if precision.mixed else p)) / d
    opt_bytes = training.optimizer.state_bytes_per_param(precision.param_dtype)
    if config.offload:
        copy_bytes = accum * (gathers * stored_shard_bytes + trainable_shard * p)
        return (copy_bytes / (gpu.pcie_bytes_per_s * profile.pcie_efficiency),
                host_optimizer.step_seconds(trainable_shard, training, precision.param_dtype, cluster, profile))
    # read/write params and states, read grads
    touched = trainable_shard * (2 * p + p + 2 * opt_bytes)
    return 0.0, touched / (gpu.hbm_bytes_per_s * profile.optimizer_hbm_efficiency)


def _mesh_times(full_model: ModelSpec, model: ModelSpec, training: TrainingSpec, config: FsdpConfig,
                cluster: ClusterSpec, profile: Profile, rates: Rates, c: int, tokens: int, head, block: BlockTime):
    """(TP's, CP's) seconds per micro-batch: TP's collectives per block and at the root, CP's ring per attention
    call (model: a TP rank's slice; block: its priced block, whose attention the ring hides behind)."""
    if config.tp == 1 and config.cp == 1:
        return _NO_TP, _NO_CP
    L = model.n_layers
    tp_tier, cp_tier = mesh_tiers(config, cluster, profile)
    ckpt_share = 1.0 if config.selective_op_ac else (math.ceil(L / config.ac_every) / L if config.ac_every else 0.0)
    products = {}  # async TP: each product's forward seconds, what a collective can hide behind
    if config.async_tp:
        block_ops_local, _ = priced_block_ops(model, training, config, c)
        products = {m.name: rates.matmul_forward_s(m, tokens, config.float8) for m in block_ops_local.matmuls}
        if head is not None:
            products[head.name] = rates.matmul_forward_s(head, tokens)
    tp_t = tensor_parallel.step_seconds(full_model, config, tokens, c, tp_tier, rates, products, ckpt_share)
    cp_t = context_parallel.ring_seconds(model, config, tokens, c, cp_tier, block.attention_forward_s,
                                         block.attention_backward_s, 0.0 if config.selective_op_ac else ckpt_share)
    return tp_t, cp_t
