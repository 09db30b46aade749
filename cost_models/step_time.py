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
overlap. Compute runs per operator class (kernel_time.py), and slows by profile.overlap_slowdown for each
second of communication it hides. Ignored: stragglers, data loading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from . import comm, context_parallel, expert_parallel, moe, operators, pipeline_time, tensor_parallel
from .compute import mfu_flops_per_token, model_flops_per_token, recompute_flops_per_token
from .kernel_time import BlockTime, Rates, eager_attention_ops, price_block
from .memory import ParamCounts
from .profile import Profile
from .specs import Attention, ClusterSpec, FsdpConfig, ModelSpec, Sharding, TrainingSpec
from .units import DTYPE_BYTES


@dataclass(frozen=True)
class TimeBreakdown:
    compute_s: float             # all micro-steps, recompute included: matmul + attention + memory-bound
    recompute_s: float           # the part of compute_s spent re-running checkpointed forwards
    matmul_s: float              # of compute_s without recompute: the matmuls (block linears, experts, head)
    attention_s: float           # ... the attention kernels (eager: the score products)
    memory_bound_s: float        # ... norms, activations, rotary, residuals, loss, casts, FSDP's copies
    exposed_comm_s: float        # communication not hidden behind compute
    overlap_slowdown_s: float    # compute slowed by the NCCL kernels running beside it
    total_comm_s: float          # all collective time, hidden or not (for information)
    offload_copy_s: float        # CPU offload host<->device copies
    optimizer_s: float           # the optimizer step (GPU, or CPU with offload)
    overhead_s: float            # fixed per micro-step cost
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float                   # model FLOPs (torchtitan's count, no recompute) / (step time * peak)
    hfu: float                   # executed FLOPs (recompute included) / (step time * peak)
    # the mesh's collectives, of total_comm_s and exposed_comm_s (FSDP's are the rest): tensor parallel's
    # all-gathers / reduce-scatters (all-reduces without sequence parallel), context parallel's ring exchanges
    tp_comm_s: float = 0.0
    tp_exposed_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    cp_exposed_comm_s: float = 0.0
    # expert parallelism's dispatch and combine all-to-alls (forward, backward, recompute), on the critical path
    ep_comm_s: float = 0.0
    # pipeline parallelism (cost_models/pipeline_time.py; 0 without): with pp > 1 compute_s and the mesh's exposed
    # collectives are the mean pipeline rank's, and the step adds the schedule's warm-up and cool-down (bubble),
    # the slowest rank's excess over the mean (imbalance: the first and last stages' embedding, head and loss) and
    # the exposed stage-to-stage sends of activations and gradients (pp_comm_s, of exposed_comm_s)
    pp_bubble_s: float = 0.0
    pp_imbalance_s: float = 0.0
    pp_comm_s: float = 0.0

    def to_dict(self) -> dict:
        """Every field; the pipeline's only with a pipeline (the output schemas leave them out without one)."""
        pipeline = ("pp_bubble_s", "pp_imbalance_s", "pp_comm_s")
        piped = any(getattr(self, name) for name in pipeline)
        return {f.name: getattr(self, f.name) for f in fields(self) if piped or f.name not in pipeline}


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
    per-block compile leaves the final norm and the embedding eager; the loss is fused when it is compiled."""
    _, ops = operators.root_ops(model, c)
    fused = {op.name: op.name == "loss" and config.loss_compiled for op in ops}
    # sequence parallel: the final norm runs on s / tp tokens (the loss on vocab / tp is in the local model)
    share = {op.name: 1 / config.tp if op.name == "final norm" and config.sequence_parallel else 1.0 for op in ops}
    return tuple((op.name, share[op.name] * op.bytes(fused[op.name], False), share[op.name] * op.bytes(fused[op.name], True))
                 for op in ops)


def priced_block_ops(spec: ModelSpec, training: TrainingSpec, config: FsdpConfig, c: int):
    """(BlockOps, eager attention's products and score traffic or None) of one block as the step prices it:
    Float8's casts among the memory-bound ops; a traced inventory already holds eager attention's work."""
    ops = operators.block_ops(spec, c, training.seq_len, training.adapter_rank, config.attention.value)
    if config.tp > 1 and config.sequence_parallel:  # norms, residuals, dropout on s / tp tokens
        ops = tensor_parallel.sequence_parallel_ops(ops, config.tp)
    if config.ep > 1 and spec.moe is not None:  # a rank's E / ep experts on the rows it receives
        ops = expert_parallel.expert_parallel_ops(ops, spec, config.ep, training.routing_imbalance, config.tp)
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
        kw = dict(eager_attention=eager, compiled=config.compile, float8=config.float8)
        casts = rates.memory_s(operators.weight_cast_bytes(ops.matmuls, c, config.fp8_all_gather)) if config.float8 else 0.0
        return price_block(ops, rates, tokens, **kw), price_block(ops, rates, tokens, recompute=recompute, **kw), casts

    plain, ckpt, casts = price(model)
    dense_spec = moe.dense_block_spec(model)
    dense = price(dense_spec) if dense_spec is not None else None
    recompute_s = n_ckpt * ckpt.recompute_s / model.n_layers if recompute else 0.0
    if dense is not None and recompute:
        nd = model.n_dense_layers
        recompute_s += n_ckpt * nd * (dense[1].recompute_s - ckpt.recompute_s) / model.n_layers ** 2
    weight_casts = (model.n_layers - model.n_dense_layers) * casts + (model.n_dense_layers * dense[2] if dense else 0.0)
    return plain, dense[0] if dense else None, recompute_s, weight_casts


_NO_TP, _NO_CP = tensor_parallel.TpTime(), context_parallel.CpTime()


def _optimizer_times(trainable_shard: float, trainable: int, frozen: int, d: int, accum: int, gathers: int, gpu,
                     training: TrainingSpec, config: FsdpConfig, profile: Profile) -> tuple[float, float]:
    """(offload copies, optimizer step) seconds of a rank holding trainable_shard parameters (d x its shard of
    `trainable` and `frozen` elements); CPU offload copies each unit's shard in `gathers` times per micro-step."""
    precision = config.precision
    p, c = DTYPE_BYTES[precision.param_dtype], DTYPE_BYTES[precision.compute_dtype]
    stored_shard_bytes = (trainable * p + frozen * (c if precision.mixed else p)) / d
    opt_bytes = training.optimizer.state_bytes_per_param(precision.param_dtype)
    if config.offload:
        copy_bytes = accum * (gathers * stored_shard_bytes + trainable_shard * p)
        return (copy_bytes / (gpu.pcie_bytes_per_s * profile.pcie_efficiency),
                trainable_shard / profile.cpu_optimizer_params_per_s)
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


def estimate_step_time(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
                       profile: Profile, terms: dict | None = None) -> TimeBreakdown:
    """terms: a dict to receive the per-unit terms of one micro-step (cost_models/step_timeline.py draws them)."""
    full_model, model = model, tensor_parallel.local_model(model, config)  # a TP rank's slice of the model
    gpu = cluster.gpu
    precision = config.precision
    dtype = precision.compute_dtype
    peak = gpu.priced_peak_flops(dtype)
    rates = Rates.of(gpu, dtype, profile)
    c = DTYPE_BYTES[dtype]
    p = DTYPE_BYTES[precision.param_dtype]
    r = DTYPE_BYTES[config.gradient_reduce_dtype]
    L = model.n_layers
    d = config.shard_group_size(cluster)
    n_replicas = config.replicate_group_size(cluster)
    # what is gathered and reduce-scattered (MoE: padded on dim 0, the expert matrices not when sharded on dim 1)
    counts = ParamCounts.of(model, training, d, dim1=bool(config.expert_shard_dim))
    shard_counts = counts  # what a rank's optimizer touches x d (EP: the experts' efsdp shard scaled to d)
    ep_view = expert_parallel.view(model, config, cluster, training)  # EP: E / ep experts per rank, over efsdp
    if ep_view is not None:
        counts, shard_counts = ep_view.param_counts(training)
    # a CP rank's share of each sequence; its queries still attend over all s keys (load-balanced causal: the
    # same FLOPs per token as the whole sequence), so the operators are priced at training.seq_len
    tokens = config.micro_batch * training.seq_len // config.cp

    # --- compute per micro-step: every operator priced by its class (kernel_time.py) -------------------
    model_flops = model_flops_per_token(model, training) * tokens
    recompute_flops = recompute_flops_per_token(model, training, config) * tokens
    block, dense_block, block_recompute_s, weight_casts_s = _block_times(model, training, config, rates, c, tokens)
    nd = model.n_dense_layers
    dense_delta = (counts.trainable_dense_delta + counts.frozen_dense_delta) // nd if nd else 0  # per dense block
    blocks = [(L - nd, block)] + ([(nd, dense_block)] if dense_block is not None else [])
    head, _ = operators.root_ops(model, c)
    if head is not None and config.tp > 1 and not config.sequence_parallel:  # colwise: vocab / tp, then gathered
        head = replace(head, n=max(1, head.n // config.tp))
    head_s = 3 * rates.matmul_forward_s(head, tokens) if head is not None else 0.0
    root_memory_s = rates.memory_s(tokens * sum(f + b for _, f, b in root_memory_bytes_per_token(model, config, c)))
    # FSDP2's copies around its collectives: each all-gather's output split into the unsharded parameters
    # (read + write c), each reduce-scatter's input packed (and cast) from the gradients (c + r)
    gathers = 2 if config.sharding.reshards_after_forward and config.pp == 1 else 1  # PP keeps them gathered
    gathered_elements = counts.block() * L + dense_delta * nd + counts.root()
    fsdp_copy_s = rates.memory_s(gathers * gathered_elements * 2 * c + counts.trainable(L) * (c + r)) if d > 1 else 0.0
    matmul_s = head_s + sum(n * (b.matmul_forward_s + b.matmul_backward_s) for n, b in blocks)
    attention_s = sum(n * (b.attention_forward_s + b.attention_backward_s) for n, b in blocks)
    # --- the mesh's collectives per micro-batch: TP's per block and at the root, CP's ring per attention call -----
    tp_t, cp_t = _mesh_times(full_model, model, training, config, cluster, profile, rates, c, tokens, head, block)
    mesh_copy_f = tp_t.block_copy_forward_s + rates.memory_s(cp_t.merge_forward_bytes)
    mesh_copy_b = tp_t.block_copy_backward_s + rates.memory_s(cp_t.merge_backward_bytes)
    memory_bound_s = root_memory_s + fsdp_copy_s + weight_casts_s + sum(
        n * (b.memory_forward_s + b.memory_backward_s) for n, b in blocks) + L * (mesh_copy_f + mesh_copy_b) \
        + tp_t.root_copy_s
    recompute_s = L * block_recompute_s
    compute_s = matmul_s + attention_s + memory_bound_s + recompute_s
    # a block's forward and backward as FSDP's prefetch sees them: its compute, then what TP and CP leave exposed
    mesh_fwd_s = mesh_copy_f + tp_t.block_forward_exposed_s + cp_t.forward_exposed_s
    mesh_bwd_s = mesh_copy_b + tp_t.block_backward_exposed_s + cp_t.backward_exposed_s
    block_fwd_s = block.forward_s + mesh_fwd_s
    block_bwd_s = block.backward_s - block.recompute_s + block_recompute_s + mesh_bwd_s
    # EP: a sparse block's dispatch and combine all-to-alls, forward, backward and in a checkpointed block's
    # recompute, between the router and the experts (nothing to overlap them with): in the block's windows
    # (a TP group's ranks dispatch disjoint slices of the tokens they share: tokens / tp each)
    a2a_s = expert_parallel.all_to_all_seconds(ep_view, cluster, profile, tokens // config.tp, c) if ep_view else 0.0
    ckpt_blocks = L if config.selective_op_ac else (math.ceil(L / config.ac_every) if config.ac_every else 0)
    block_fwd_s += 2 * a2a_s
    block_bwd_s += 2 * a2a_s * (1 + ckpt_blocks / L)
    ep_comm = config.grad_accum * (L - model.n_dense_layers) * 2 * a2a_s * (2 + ckpt_blocks / L)

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
    # FSDP2's FP8 all-gather moves the Float8 linears' weights in 1 byte
    fp8_saving = operators.fp8_all_gather_saving_bytes(model, c, training.seq_len) if config.fp8_all_gather else 0
    ag, rs = collectives(counts.block() * c - fp8_saving, counts.trainable_block * r)
    experts = moe.experts_gathered_elements(model, d, bool(config.expert_shard_dim)) if config.expert_units else 0
    if ep_view is not None:  # EP: the experts are a unit of their own, on the efsdp mesh
        experts = ep_view.experts_gathered_elements()
    if experts:  # two collectives per sparse block (its experts, the rest): the same bytes, twice the latency
        trained = 0 if counts.frozen_block else experts   # LoRA: frozen experts reduce nothing
        shell_ag, shell_rs = collectives((counts.block() - experts) * c, (counts.trainable_block - trained) * r)
        own_ag, own_rs = collectives(experts * c, trained * r) if ep_view is None else \
            expert_parallel.expert_fsdp_seconds(ep_view, cluster, profile, experts * c, trained * r, n_replicas,
                                                replicate_tier)
        ag, rs = shell_ag + own_ag, shell_rs + (own_rs if trained else 0.0)
    # reshard_after_forward=N: backward all-gathers each block among N ranks (inside the node: the fast tier)
    bwd_gather = 1.0
    if config.reshard_after_forward and gathers_in_backward and sync_every_microstep and ag > 0:
        n_partial = config.reshard_after_forward
        tier = comm.Tier.for_group(cluster, profile, spans_nodes=n_partial > cluster.fast_tier_gpus)
        block_bytes = counts.block() * c - fp8_saving
        bwd_gather = comm.all_gather_s(block_bytes, n_partial, tier) / comm.all_gather_s(block_bytes, d, shard_tier)
    # Blocks by kind: (count, forward all-gather s, backward all-gather s, reduction s, forward s, backward s)
    kinds = [(L - model.n_dense_layers, ag, ag * bwd_gather, rs, block_fwd_s, block_bwd_s)]
    if model.n_dense_layers:  # an MoE model's leading dense blocks: their own sizes and FLOPs
        d_ag, d_rs = collectives((counts.block() + dense_delta) * c,
                                 (counts.trainable_block + counts.trainable_dense_delta // nd) * r)
        kinds.append((nd, d_ag, d_ag * bwd_gather, d_rs, dense_block.forward_s + mesh_fwd_s,
                      dense_block.backward_s - dense_block.recompute_s + block_recompute_s + mesh_bwd_s))
    first_ag, last_rs = kinds[-1][1], kinds[-1][3]
    if config.pp > 1:  # one schedule step of grad_accum microbatches (cost_models/pipeline_time.py)
        w_share = 0.0 if counts.frozen_block else 0.5  # W: the weight-gradient half of the matmuls' backward
        blocks_pp = tuple(pipeline_time.BlockCost(n, f + weight_casts_s / L, b, w_share * bt.matmul_backward_s, a, red)
                          for (n, a, _, red, f, b), bt in zip(kinds, [block] + ([dense_block] if nd else [])))
        root_bytes = {name: (f, b) for name, f, b in root_memory_bytes_per_token(model, config, c)}
        emb = model.embedding_params / max(1, model.root_params)  # the root's collectives split by parameters
        tp_root = tp_t.root_exposed_s + tp_t.root_copy_s  # loss-parallel statistics, the head's: the last stage
        root_pp = pipeline_time.RootCost(
            rates.memory_s(tokens * root_bytes["embedding"][0]), rates.memory_s(tokens * root_bytes["embedding"][1]),
            head_s / 3 + rates.memory_s(tokens * (root_bytes["final norm"][0] + root_bytes["loss"][0])) + tp_root / 2,
            2 * head_s / 3 + rates.memory_s(tokens * (root_bytes["final norm"][1] + root_bytes["loss"][1]))
            + tp_root / 2, w_share * 2 * head_s / 3, emb * root_ag, emb * root_rs, (1 - emb) * root_ag,
            (1 - emb) * root_rs)
        return _pipeline_step(model, full_model, cluster, training, config, profile, blocks_pp, root_pp,
                              dict(compute_s=compute_s - fsdp_copy_s, recompute_s=recompute_s, matmul_s=matmul_s,
                                   attention_s=attention_s, memory_bound_s=memory_bound_s - fsdp_copy_s),
                              (L * tp_t.block_s + tp_t.root_s, L * tp_t.block_exposed_s + tp_t.root_exposed_s),
                              (L * cp_t.total_s, L * cp_t.exposed_s), ep_comm / config.grad_accum, fsdp_copy_s,
                              counts, shard_counts, d, tokens, c, peak, model_flops + recompute_flops, terms)

    fwd_exposed = root_ag + first_ag + sum(n * max(0.0, a - f) for n, a, _, _, f, _ in kinds) \
        - max(0.0, first_ag - kinds[-1][4])

    def backward_exposed(reducing: bool) -> float:
        exposed_s = (last_rs if reducing else 0.0) + root_rs
        for n, _, a, reduce_s, _, bwd_s in kinds:
            a, reduce_s = (a if gathers_in_backward else 0.0), (reduce_s if reducing else 0.0)
            if config.backward_prefetch:
                exposed_s += n * max(0.0, a + reduce_s - bwd_s)
            else:
                exposed_s += n * (a + max(0.0, reduce_s - bwd_s))
        return exposed_s

    accum = config.grad_accum
    gathered_s = sum(n * (a_f + (a_b if gathers_in_backward else 0.0)) for n, a_f, a_b, *_ in kinds)
    reduced_s = sum(n * reduce_s for n, _, _, reduce_s, *_ in kinds)
    if sync_every_microstep:
        exposed = accum * (fwd_exposed + backward_exposed(True))
        total_comm = accum * (root_ag + root_rs + gathered_s + reduced_s)
    else:
        exposed = accum * fwd_exposed + (accum - 1) * backward_exposed(False) + backward_exposed(True)
        total_comm = accum * (root_ag + gathered_s) + root_rs + reduced_s
    # TP's and CP's collectives run on the compute stream's critical path (unless hidden, above): every micro-step
    tp_comm = accum * (L * tp_t.block_s + tp_t.root_s)
    tp_exposed = accum * (L * tp_t.block_exposed_s + tp_t.root_exposed_s)
    cp_comm, cp_exposed = accum * L * cp_t.total_s, accum * L * cp_t.exposed_s
    exposed += tp_exposed + cp_exposed + ep_comm
    total_comm += tp_comm + cp_comm + ep_comm
    if terms is not None:
        terms.update(kinds=kinds, root_ag=root_ag, root_rs=root_rs, last_rs=last_rs, compute_s=compute_s,
                     gathers_in_backward=gathers_in_backward, sync_every_microstep=sync_every_microstep, tp=tp_t,
                     cp=cp_t, a2a_s=a2a_s, ckpt_blocks=ckpt_blocks, recompute_s=block_recompute_s, head_s=head_s,
                     root_memory_s=root_memory_s, fsdp_copy_s=fsdp_copy_s, weight_casts_s=weight_casts_s)

    # --- CPU offload and optimizer step ---------------------------------------------------------------
    offload_copy_s, optimizer_s = _optimizer_times(shard_counts.trainable(L) / d, counts.trainable(L),
                                                   counts.frozen(L), d, accum, 2 if gathers_in_backward else 1,
                                                   gpu, training, config, profile)

    overhead_s = accum * profile.microstep_overhead_s
    compute_total = accum * compute_s
    overlap_slowdown_s = profile.overlap_slowdown * max(0.0, min(total_comm - exposed, compute_total))
    step_s = compute_total + exposed + overlap_slowdown_s + offload_copy_s + optimizer_s + overhead_s
    # tokens per GPU: a TP group shares its tokens, a CP group splits them (tokens is already a CP rank's)
    tokens_per_step = accum * tokens / config.tp
    full_tokens_per_step = accum * config.micro_batch * training.seq_len / config.model_parallel
    return TimeBreakdown(
        compute_s=compute_total,
        recompute_s=accum * recompute_s,
        matmul_s=accum * matmul_s,
        attention_s=accum * attention_s,
        memory_bound_s=accum * memory_bound_s,
        exposed_comm_s=exposed,
        overlap_slowdown_s=overlap_slowdown_s,
        total_comm_s=total_comm,
        offload_copy_s=offload_copy_s,
        optimizer_s=optimizer_s,
        overhead_s=overhead_s,
        step_s=step_s,
        tokens_per_s_per_gpu=tokens_per_step / step_s,
        mfu=full_tokens_per_step * mfu_flops_per_token(full_model, training) / (step_s * peak),
        hfu=accum * (model_flops + recompute_flops) / (step_s * peak),
        tp_comm_s=tp_comm,
        tp_exposed_comm_s=tp_exposed,
        cp_comm_s=cp_comm,
        cp_exposed_comm_s=cp_exposed,
        ep_comm_s=ep_comm,
    )


def _pipeline_step(model, full_model, cluster, training, config, profile, blocks, root, per_mb: dict, tp_mb, cp_mb,
                   ep_mb: float, fsdp_copy_s: float, counts, shard_counts, d: int, tokens: int, c: int, peak: float,
                   flops_mb: float, terms: dict | None = None) -> TimeBreakdown:
    """A pipeline rank's step (cost_models/pipeline_time.py): the compute classes and the mesh's collectives are
    the mean rank's (the whole model's per microbatch x m / pp), the step the schedule's critical path. per_mb,
    tp_mb, cp_mb ((all, exposed) s), ep_mb: the whole model's seconds for one microbatch."""
    pp, m = config.pp, config.pp_microbatches
    passes = pipeline_time.stage_passes(model, config, blocks, root)
    p2p_s = pipeline_time.p2p_seconds(model, config, cluster, profile, tokens, c)
    pipe = pipeline_time.pipeline_time(model, config, passes, p2p_s)
    if terms is not None:  # what explain shows of the walk
        terms.update(pipeline_passes=passes, pipeline_p2p_s=p2p_s, pipeline=pipe)
    share = m / pp
    compute = share * per_mb["compute_s"] + fsdp_copy_s / pp  # FSDP2's copies once per step (gathered all step)
    mesh_exposed = share * (tp_mb[1] + cp_mb[1] + ep_mb)
    fsdp_total = sum(s.gather_s + s.reduce_s for s in passes) / pp
    total_comm = share * (tp_mb[0] + cp_mb[0] + ep_mb) + fsdp_total + pipe.p2p_total_s
    exposed = mesh_exposed + pipe.fsdp_exposed_s + pipe.p2p_exposed_s
    trainable, frozen = pipeline_time.largest_rank_params(model, config, counts)
    shard_trainable, _ = pipeline_time.largest_rank_params(model, config, shard_counts)
    offload_copy_s, optimizer_s = _optimizer_times(shard_trainable / d, trainable, frozen, d, 1, 1, cluster.gpu,
                                                   training, config, profile)
    overhead_s = m * profile.microstep_overhead_s
    overlap_slowdown_s = profile.overlap_slowdown * max(0.0, min(total_comm - exposed, compute))
    step_s = compute + exposed + pipe.bubble_s + pipe.imbalance_s + overlap_slowdown_s + offload_copy_s \
        + optimizer_s + overhead_s
    full_tokens = m * config.micro_batch * training.seq_len / config.model_parallel
    return TimeBreakdown(
        compute_s=compute, recompute_s=share * per_mb["recompute_s"], matmul_s=share * per_mb["matmul_s"],
        attention_s=share * per_mb["attention_s"], memory_bound_s=share * per_mb["memory_bound_s"] + fsdp_copy_s / pp,
        exposed_comm_s=exposed, overlap_slowdown_s=overlap_slowdown_s, total_comm_s=total_comm,
        offload_copy_s=offload_copy_s, optimizer_s=optimizer_s, overhead_s=overhead_s, step_s=step_s,
        tokens_per_s_per_gpu=m * tokens / config.tp / pp / step_s,
        mfu=full_tokens * mfu_flops_per_token(full_model, training) / (step_s * peak),
        hfu=share * flops_mb / (step_s * peak),
        tp_comm_s=share * tp_mb[0], tp_exposed_comm_s=share * tp_mb[1], cp_comm_s=share * cp_mb[0],
        cp_exposed_comm_s=share * cp_mb[1], ep_comm_s=share * ep_mb,
        pp_bubble_s=pipe.bubble_s, pp_imbalance_s=pipe.imbalance_s, pp_comm_s=pipe.p2p_exposed_s)
