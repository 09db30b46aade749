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

The pieces apart: TimeBreakdown (time_breakdown.py), the priced parts (step_parts.py: tiers, blocks, root, mesh,
optimizer) and a pipeline rank's step (pipeline_step.py).
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from operator import attrgetter

from . import comm, expert_parallel, fsdp_copies, kernels, moe, operators, pipeline_time, qlora, tensor_parallel
from .compute import mfu_flops_per_token, model_flops_per_token, recompute_flops_per_token
from .kernel_time import Rates
from .memory import ParamCounts
from .pipeline_step import _pipeline_step
from .profile import Profile
from .specs import FSDP_ONLY_FIELDS, ClusterSpec, FsdpConfig, ModelSpec, Sharding, TrainingSpec
from .step_parts import (_block_times, _mesh_times, _optimizer_times, _shard_tiers, mesh_tiers, priced_block_ops,
                         root_memory_bytes_per_token)
from .time_breakdown import TimeBreakdown
from .units import DTYPE_BYTES

__all__ = ["estimate_step_time", "TimeBreakdown", "mesh_tiers", "priced_block_ops", "root_memory_bytes_per_token",
           "_shard_tiers"]  # the last four and TimeBreakdown live in step_parts.py / time_breakdown.py


# the blocks' and the mesh's seconds (_compute_parts) never read FSDP's own knobs (specs.FSDP_ONLY_FIELDS), which
# price the collectives around the blocks, the offload and the optimizer step (step_parts._shard_tiers,
# _optimizer_times), nor the pipeline's (pipeline_step.py walks a stage's blocks at a block's seconds), nor of the
# precision more than its compute dtype (c and the rates): the key holds that dtype and the other fields
_PARTS_FIELDS = attrgetter(*(f.name for f in fields(FsdpConfig) if f.name not in FSDP_ONLY_FIELDS | {
    "pp", "pp_schedule", "pp_stages_per_rank", "precision"}))


def _compute_parts(full_model, model, training, config, cluster, profile, rates, c: int, tokens: int) -> tuple:
    """What a micro-batch's compute costs, FSDP's knobs aside: the blocks' seconds (step_parts._block_times), the
    head, the root's memory-bound seconds, the mesh's (TP, CP) seconds per micro-batch, the model's and the
    recompute's FLOPs."""
    block, dense_block, block_recompute_s, weight_casts_s = _block_times(model, training, config, rates, c, tokens)
    head, _ = operators.root_ops(model, c)
    if head is not None and config.tp > 1 and not config.sequence_parallel:  # colwise: vocab / tp, then gathered
        head = replace(head, n=max(1, head.n // config.tp))
    head_s = kernels.head_seconds(rates, head, tokens, config, model) if head is not None else 0.0  # loss kernels
    root_memory_s = rates.memory_s(tokens * sum(f + b for _, f, b in root_memory_bytes_per_token(model, config, c)))
    tp_t, cp_t = _mesh_times(full_model, model, training, config, cluster, profile, rates, c, tokens, head, block)
    flops = model_flops_per_token(model, training) * tokens, recompute_flops_per_token(model, training, config) * tokens
    return (block, dense_block, block_recompute_s, weight_casts_s, head, head_s, root_memory_s, tp_t, cp_t, *flops)


# what _fsdp_collectives reads of a configuration: the strategy and its shard group, the mesh (the rank's model slice,
# EP's view), the dtypes, what a unit gathers (experts, Float8's FP8 all-gather) and the backward's reshard group
_FSDP_FIELDS = attrgetter("sharding", "shard_group_gpus", "tp", "cp", "ep", "pp", "sequence_parallel", "precision",
                          "reduce_dtype", "fp8_all_gather", "expert_shard_dim", "expert_units", "reshard_after_forward",
                          "moe_dispatch")


def _fsdp_collectives(model, cluster, training, config, profile, c: int, r: int) -> tuple:
    """FSDP's side of a step, whatever the blocks compute: the shard and replica groups (d, replicas), what is gathered
    and reduced (ParamCounts; EP's view), a block's gather savings (QLoRA's packing, the FP8 all-gather's), the root's
    and a block's (all-gather, reduction) seconds, the backward all-gather's share under a reshard group, an MoE
    model's dense blocks' seconds. model: a TP rank's slice."""
    d = config.shard_group_size(cluster)
    n_replicas = config.replicate_group_size(cluster)
    # what is gathered and reduce-scattered (MoE: padded on dim 0, the expert matrices not when sharded on dim 1)
    counts = ParamCounts.of(model, training, d, dim1=bool(config.expert_shard_dim))
    shard_counts = counts  # what a rank's optimizer touches x d (EP: the experts' efsdp shard scaled to d)
    ep_view = expert_parallel.view(model, config, cluster, training)  # EP: E / ep experts per rank, over efsdp
    if ep_view is not None:
        counts, shard_counts = ep_view.param_counts(training)
    # QLoRA's blocks gather their linears packed (qlora.py): n / 2 bytes, not n x c
    packing_saving = qlora.saving_bytes(qlora.quantized_per_block(model), c) if training.quantized else 0
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
    gather_saving = fp8_saving + packing_saving  # (never both: QLoRA refuses Float8, qlora.refusals)
    ag, rs = collectives(counts.block() * c - gather_saving, counts.trainable_block * r)
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
        block_bytes = counts.block() * c - gather_saving
        bwd_gather = comm.all_gather_s(block_bytes, n_partial, tier) / comm.all_gather_s(block_bytes, d, shard_tier)
    nd = model.n_dense_layers  # an MoE model's leading dense blocks: their own sizes
    dense = collectives((counts.block() + (counts.trainable_dense_delta + counts.frozen_dense_delta) // nd) * c,
                        (counts.trainable_block + counts.trainable_dense_delta // nd) * r) if nd else None
    return (d, n_replicas, counts, shard_counts, ep_view, (packing_saving, fp8_saving), root_ag, root_rs, ag, rs,
            bwd_gather, dense)


def estimate_step_time(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
                       profile: Profile, terms: dict | None = None, parts: dict | None = None,
                       fsdp_parts: dict | None = None, fsdp2: bool = True) -> TimeBreakdown:
    """fsdp2: the trainer runs FSDP2 (fully_shard), else FSDP1 (FullyShardedDataParallel), whose copies around the
    collectives differ (fsdp_copies.py); terms: a dict to receive the per-unit terms of one micro-step
    (cost_models/step_timeline.py draws them); parts: a memo of _compute_parts for this model, cluster, training and
    profile (a search's candidates share them across FSDP_ONLY_FIELDS: planner/search/memo.py); fsdp_parts: likewise
    of _fsdp_collectives (across the compute's knobs)."""
    full_model, model = model, tensor_parallel.local_model(model, config)  # a TP rank's slice of the model
    gpu = cluster.gpu
    precision = config.precision
    dtype = precision.compute_dtype
    peak = gpu.priced_peak_flops(dtype)
    c = DTYPE_BYTES[dtype]
    r = DTYPE_BYTES[config.gradient_reduce_dtype]
    L = model.n_layers
    # FSDP's collectives of a unit and what they move (_fsdp_collectives), priced once per what they read
    fsdp_parts, fsdp_key = {} if fsdp_parts is None else fsdp_parts, _FSDP_FIELDS(config)
    if fsdp_key not in fsdp_parts:
        fsdp_parts[fsdp_key] = _fsdp_collectives(model, cluster, training, config, profile, c, r)
    (d, n_replicas, counts, shard_counts, ep_view, (packing_saving, fp8_saving), root_ag, root_rs, ag, rs, bwd_gather,
     dense_collectives) = fsdp_parts[fsdp_key]
    # a CP rank's share of each sequence; its queries still attend over all s keys (load-balanced causal: the
    # same FLOPs per token as the whole sequence), so the operators are priced at training.seq_len
    tokens = config.micro_batch * training.seq_len // config.cp

    # --- compute per micro-step: every operator priced by its class (kernel_time.py) -------------------
    parts, key = {} if parts is None else parts, (dtype, _PARTS_FIELDS(config))
    if key not in parts:  # the rates read the precision and the attention kernel, in the key
        rates = Rates.of(gpu, dtype, profile, config.attention_kernel.value)
        parts[key] = (rates, mfu_flops_per_token(full_model, training),
                      *_compute_parts(full_model, model, training, config, cluster, profile, rates, c, tokens))
    (rates, mfu_per_token, block, dense_block, block_recompute_s, weight_casts_s, head, head_s, root_memory_s, tp_t,
     cp_t, model_flops, recompute_flops) = parts[key]
    nd = model.n_dense_layers
    dense_delta = (counts.trainable_dense_delta + counts.frozen_dense_delta) // nd if nd else 0  # per dense block
    blocks = [(L - nd, block)] + ([(nd, dense_block)] if dense_block is not None else [])
    # FSDP's copies around its collectives, by API (fsdp_copies.py): the blocks gathered twice where they reshard
    # after forward (PP keeps them gathered), the root once (neither API reshards it: as root_ag is priced)
    gathers = 2 if config.sharding.reshards_after_forward and config.pp == 1 else 1
    copies_key = ("copies", fsdp_key, fsdp2)  # they read what the collectives do, and the API: once per these
    if copies_key not in fsdp_parts:
        trained = counts.trainable(L) - counts.trainable_root  # the blocks' (dense ones' included)
        fsdp_parts[copies_key] = (
            fsdp_copies.gather_copy_bytes(
                fsdp2, precision, (counts.block() * L + dense_delta * nd) * c - L * (packing_saving + fp8_saving),
                trained, trained * c - L * fp8_saving, d),
            fsdp_copies.gather_copy_bytes(fsdp2, precision, counts.root() * c, counts.trainable_root,
                                          counts.trainable_root * c, d),
            fsdp_copies.reduce_copy_bytes(fsdp2, precision, config.gradient_reduce_dtype, counts.trainable(L), d,
                                          d * n_replicas),
            fsdp_copies.accumulate_bytes(precision, counts.trainable(L), d))
    block_gather, root_gather, reduce, accumulate_bytes = fsdp_parts[copies_key]
    # a sharded gradient kept across micro-steps (PP's accumulate unsharded and reduce once)
    accumulated = (config.grad_accum - 1) / config.grad_accum if config.pp == 1 else 0.0
    fsdp_copy_s = rates.memory_s(gathers * block_gather + root_gather + reduce + accumulated
                                 * accumulate_bytes) if d > 1 else 0.0
    matmul_s = head_s + sum(n * (b.matmul_forward_s + b.matmul_backward_s) for n, b in blocks)
    attention_s = sum(n * (b.attention_forward_s + b.attention_backward_s) for n, b in blocks)
    # --- the mesh's collectives per micro-batch (_compute_parts): TP's per block and at the root, CP's ring -------
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
    a2a_key = ("all-to-all", fsdp_key, tokens)  # they read EP's view (fsdp_key's) and the tokens: once per these
    if ep_view and a2a_key not in fsdp_parts:
        fsdp_parts[a2a_key] = expert_parallel.all_to_all_seconds(ep_view, cluster, profile, tokens // config.tp, c)
    a2a_s = fsdp_parts[a2a_key] if ep_view else 0.0
    ckpt_blocks = L if config.selective_op_ac else (math.ceil(L / config.ac_every) if config.ac_every else 0)
    block_fwd_s += 2 * a2a_s
    block_bwd_s += 2 * a2a_s * (1 + ckpt_blocks / L)
    ep_comm = config.grad_accum * (L - model.n_dense_layers) * 2 * a2a_s * (2 + ckpt_blocks / L)

    # --- collectives per micro-step (_fsdp_collectives) ------------------------------------------------
    sync_every_microstep = config.sharding is not Sharding.NO_SHARD
    gathers_in_backward = config.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
    # Blocks by kind: (count, forward all-gather s, backward all-gather s, reduction s, forward s, backward s)
    kinds = [(L - model.n_dense_layers, ag, ag * bwd_gather, rs, block_fwd_s, block_bwd_s)]
    if model.n_dense_layers:  # an MoE model's leading dense blocks: their own sizes and FLOPs
        d_ag, d_rs = dense_collectives
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

    # --- CPU offload and optimizer step: what the collectives read (their counts, d, the strategy, the precision),
    # the accumulation and offload, so in their memo once per these ---------------------------------------------
    optimizer_key = ("optimizer", fsdp_key, accum, config.offload)
    if optimizer_key not in fsdp_parts:
        fsdp_parts[optimizer_key] = _optimizer_times(shard_counts.trainable(L) / d, counts.trainable(L),
                                                     counts.frozen(L), d, accum, 2 if gathers_in_backward else 1,
                                                     cluster, training, config, profile)
    offload_copy_s, optimizer_s = fsdp_parts[optimizer_key]

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
        mfu=full_tokens_per_step * mfu_per_token / (step_s * peak),
        hfu=accum * (model_flops + recompute_flops) / (step_s * peak),
        tp_comm_s=tp_comm,
        tp_exposed_comm_s=tp_exposed,
        cp_comm_s=cp_comm,
        cp_exposed_comm_s=cp_exposed,
        ep_comm_s=ep_comm,
    )
