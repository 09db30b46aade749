"""Per-rank GPU memory ledger for one FSDP configuration, at the moments where the peak can happen.

Model states follow the ZeRO/FSDP papers (formulas.md): stored params, gradients and optimizer state
are divided by the shard-group size d. FSDP2's schedule (the emitted config; checked against the trace
tier, docs/accuracy.md) decides what else is alive, moment by moment:

- loss backward: everything the forward saved, the loss's three fp32 (b*s, V) tensors (log-softmax
  output, its gradient, the logits' gradient), the root unit gathered (resharded after forward under FULL_SHARD
  and gathered again at its pre-backward: root_regather.py) and the last block's all-gather prefetched for its backward;
- a block's backward: the saved tensors of the blocks below it and its own (re-computed when
  checkpointed), the backward's working set (activations.py), the root's and this block's gathered
  params and compute-dtype gradients, the next block's all-gather prefetch, the previous block's
  reduce-scatter input (reduce dtype), and the sharded gradients of the blocks done. The first and last
  blocks processed and the highest checkpointed one are the candidates (with checkpointing the last
  ones can peak: each block done adds its sharded gradient, each block below saves only its input);
- TP with sequence parallel, the embedding's backward: its whole V x h gradient, then the rank's rows copied out of
  it, beside the gathered root and its other gradients;
- FSDP2's all-gather transients (fsdp2_gathers.py): a block's pre-backward, its own all-gather output copied out
  (output and unsharded parameters at once), then its prefetch of the block below issued (the all-gather output beside
  the copy-in source of shards cast to the compute dtype); in the forward (ZeRO-2's too) the last block's copy-out
  beside its all-gather output and the block below's (a deferred free), block 0's beside the root's (edge units: the
  head's unit beside the last block's), and under ZeRO-2 the loss inside the forward beside the last block's;
- end of backward: the root's gradients and their reduce-scatter, with every block's sharded gradient (torchtitan
  0.3's edge units, the embedding's only: edge_units.py, with the head's unit gathered again at the norm's backward);
- optimizer step: stored params, gradients, optimizer state and the step's temporaries (optimizer_step.py:
  foreach, fused or for-loop).
SHARD_GRAD_OP-like strategies keep every block gathered from forward until its backward (no prefetch).
fsdp1_adapter_units: LoRA / QLoRA under FSDP1, each adapter a unit (fsdp1_adapters.py says what changes). A shard
group of one rank (NO_SHARD) copies params out to unsharded tensors, no all-gather buffers, but FSDP2 still runs
foreach_reduce there: each unit's reduce-scatter input and a full-size output (edge_units.py; FSDP1: none). Each
tensor's dim-0 padding to d x ceil(rows / d) rows is counted (dim0_padding.py), allocator rounding not; reserved adds
the profile's fragmentation and the memory outside the allocator (outside_allocator.py). Peak: memory_peak.py.
"""

from __future__ import annotations

import dataclasses
import math

from . import (activations, context_parallel, edge_units, expert_parallel, fsdp2_gathers, moe, operators,
               optimizer_step, qlora, root_regather, tensor_parallel)
from .expert_unit_terms import (NONE as expert_unit_terms_none, copy_out_moment, expert_unit_terms,
                                sparse_block_moment)
from .fsdp1_adapters import AdapterUnits
from .memory_peak import Moment as _Moment, peak_estimate
from .memory_shape import ledger_shape, shape_key
from .memory_types import MemoryBreakdown, MemoryEstimate, ParamCounts
from .offload_moments import moments_key, offloaded
from .outside_allocator import outside_allocator_terms
from .profile import Profile
from .specs import ClusterSpec, FsdpConfig, LossKernel, ModelSpec, Sharding, TrainingSpec
from .units import DTYPE_BYTES


def _shard(n_bytes: float, d: int) -> int:
    return math.ceil(n_bytes / d)


def estimate_memory(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
                    profile: Profile, fsdp1_adapter_units: bool | AdapterUnits = False, shapes: dict | None = None,
                    outside: tuple | None = None, frozen_stored_bytes: int | None = None,
                    input_requires_grad: bool = False, ledgers: dict | None = None) -> MemoryEstimate:
    """shapes: a memo of memory_shape.ledger_shape for this model, training and profile (a search's candidates share
    them across FSDP's own knobs: planner/search/memo.py), ledgers: of the moments without offload, likewise
    (offload_moments.py); outside: the memory outside the allocator where the caller has it (outside_allocator_terms,
    without a DeepEP buffer). A trainer's own ways with LoRA (verl's engine,
    rl_actor.py): frozen_stored_bytes, the frozen base's stored width where it is not the ledger's compute dtype
    (FSDP2 casts it at every all-gather: fsdp2_gathers.py; its sharded bytes stay the caller's to add);
    input_requires_grad, PEFT's enable_input_require_grads (see the moments' end)."""
    if config.pp > 1:  # per pipeline rank: its stages and its schedule's in-flight microbatches; the largest leads
        from .pipeline_memory import pipeline_estimate

        return pipeline_estimate(model, cluster, training, config, profile, outside)
    # The mesh's per-rank view: a TP rank's slice of the model (tensor_parallel.local_model) on a CP rank's
    # s / cp tokens of each sequence (SDPA keeps nothing that grows with the keys' length).
    full_model = model
    model = tensor_parallel.local_model(model, config)
    ep_view = expert_parallel.view(model, config, cluster, training)  # EP: E / ep experts, FSDP over efsdp
    if ep_view is not None:
        model = ep_view.model
    if config.cp > 1:
        training = dataclasses.replace(training, seq_len=training.seq_len // config.cp)
    key = shape_key(config, ep_view, fsdp1_adapter_units) if shapes is not None else None
    s = shapes.get(key) if shapes is not None else None
    if s is None:  # what the blocks save and work on, FSDP's knobs aside (memory_shape.py)
        s = ledger_shape(model, training, config, ep_view, fsdp1_adapter_units)
        if shapes is not None:
            shapes[key] = s
    L, d = model.n_layers, config.shard_group_size(cluster)
    precision = config.precision
    c, p, frozen_p, real = s.c, s.p, s.frozen_p, s.real
    r = DTYPE_BYTES[config.gradient_reduce_dtype]   # reduce-scatter / all-reduce buffers
    # MoE: stacked experts padded as FSDP2 pads them on dim 0 (the matrices unpadded when sharded on dim 1)
    counts = ParamCounts.of(model, training, d, dim1=bool(config.expert_shard_dim))
    shard_counts = counts  # what the model states divide by d (EP: the experts' efsdp shard, scaled to d)
    if ep_view is not None:
        counts, shard_counts = ep_view.param_counts(training)
    trainable, frozen = shard_counts.trainable(L), shard_counts.frozen(L)
    gpu_states = 0 if config.offload else 1
    quantized, quant_state = s.quantized, s.quant_state  # QLoRA (qlora.py, memory_shape.py)

    # --- model states, sharded over d (on the CPU with offload) -------------------------------------
    sharded_params = _shard(trainable * p + frozen * frozen_p - L * qlora.saving_bytes(quantized, frozen_p), d)
    sharded_grads = _shard(trainable * p, d)
    optimizer_state = _shard(trainable * s.opt_per_param, d)
    # what the step allocates on top, by optimizer and implementation (foreach: one state's worth; fused: none)
    step_temporaries = optimizer_step.step_temporary_bytes(model, training, precision, d, trainable)
    block_sharded_grad = _shard(shard_counts.trainable_block * p, d)
    # earlier micro-steps' sharded grads: the whole shard, into which FSDP2 adds each unit's new one in place (the
    # reduce-scatter's output, freed after the add), so the blocks done in this micro-step add nothing
    accumulated = sharded_grads if config.grad_accum > 1 else 0
    step = MemoryBreakdown(sharded_params=gpu_states * sharded_params + quant_state,
                           sharded_grads=gpu_states * sharded_grads, optimizer_state=gpu_states * optimizer_state,
                           optimizer_temporaries=gpu_states * step_temporaries)
    if outside is None:
        outside = outside_allocator_terms(cluster, config, profile, full_model, training,
                                          ep_view.outside_allocator_bytes(c) if ep_view is not None else 0)
    cpu_per_rank = (sharded_params + sharded_grads + optimizer_state + step_temporaries) if config.offload else 0
    notes = (s.quirks + tuple(n for n in [None if config.expert_shard_dim or ep_view else moe.padding_note(model, d, c)]
                              if n) + (ep_view.notes() if ep_view is not None else ()))
    keeps_gathered = config.sharding in (Sharding.SHARD_GRAD_OP, Sharding.HYBRID_SHARD_ZERO2)
    prefetches = not keeps_gathered and d > 1  # (the rate limiter bounds the backward prefetch alone: prefetch_below)
    ledger_key = ledgers is not None and moments_key(config, prefetches and config.limit_all_gathers,
                                                     fsdp1_adapter_units, frozen_stored_bytes, input_requires_grad)
    if ledger_key in (ledgers or ()):  # the same ledger's moments (without offload: offload_moments.py)
        moments = offloaded(ledgers[ledger_key], quant_state) if config.offload else ledgers[ledger_key]
        return peak_estimate(moments, step, s.loss_reserved_extra, outside, profile, cluster, cpu_per_rank, notes)

    # --- gathered params and collective buffers ------------------------------------------------------
    block_c = counts.block() * c - qlora.saving_bytes(quantized, c)
    adapter_units = s.adapter_units  # FSDP1: each adapter a unit of its own
    block_c -= s.adapter_bytes if adapter_units else 0
    if config.fp8_all_gather:  # FSDP2 gathers the Float8 linears' weights in FP8: 1 byte each, not c
        block_c -= operators.fp8_all_gather_saving_bytes(model, c, training.seq_len)
    root = edge_units.root_terms(model, counts.trainable_root, counts.root(), c, r, p, d, keeps_gathered,
                                 fsdp1=bool(adapter_units))

    # --- activations, per token of the micro-batch (memory_shape.py) ----------------------------------
    tokens, kern = s.tokens, s.kern
    full, traced, ckpt, root_saved, shared, first_less = s.full, s.traced, s.ckpt, s.root_saved, s.shared, s.first_less
    is_ckpt, n_dense_below, saved_below = s.is_ckpt, s.n_dense_below, s.saved_below

    # MoE models' leading dense blocks (n_dense_layers): their own saved bytes, gathered bytes and sharded
    # gradient in what lies below / has been done at a moment and at its own moment.
    nd = model.n_dense_layers
    traced_dense = s.traced_dense
    dense_delta = (counts.trainable_dense_delta + counts.frozen_dense_delta) // nd if nd else 0
    dense_grad_delta = (shard_counts.trainable_dense_delta // nd * p) // d if nd else 0
    dense_rs_delta = counts.trainable_dense_delta // nd * r if nd else 0
    dense_blocks = s.dense_blocks

    def gathered(i: int) -> int:
        """Bytes of block i's all-gather output (its unsharded parameters)."""
        return block_c + (dense_delta * c if i in dense_blocks else 0)

    # Routed experts as units of their own (expert_units): FSDP2's backward prefetches in reverse order of
    # the post-forwards (block_i, experts_i, block_i-1, ...), so the prefetched unit is a block without its
    # experts; after the experts' backward their unit has resharded and its reduce-scatter is the one in flight.
    experts = expert_unit_terms(model, config, ep_view, d, c, r, p, bool(counts.frozen_block))
    experts_c, experts_rs = experts.gathered, experts.reduce_input

    def prefetched(i: int) -> int:
        return gathered(i) - (0 if i in dense_blocks else experts_c)

    def prefetch_below(i: int) -> int:
        """The backward prefetch's all-gather outputs at block i's moment: block i-1's (and i-2's without
        limit_all_gathers), block 0's the embedding unit's (edge_units.py); at the loss backward (i = L) the last
        blocks'."""
        if not prefetches or i <= 0:
            return root.prefetch_at_first if i == 0 else 0
        return prefetched(i - 1) + (0 if config.limit_all_gathers else prefetched(max(i - 2, 0)))

    def reduce_scatter_above(i: int) -> int:
        """The reduce-scatter input of block i+1, done just before block i's backward (FSDP2 makes it at d = 1 too;
        FSDP1's NO_SHARD all-reduces the gradient in place)."""
        if d == 1 and adapter_units or i >= L - 1:
            return root.rs_at_last_block if i == L - 1 else 0
        return counts.trainable_block * r + (dense_rs_delta if i + 1 in dense_blocks else -experts_rs)

    def gathered_below(i: int) -> int:
        return i * block_c + n_dense_below(i) * dense_delta * c if nd else i * block_c

    # reshard_after_forward=N (FSDP2 int): after its forward each block keeps an N-way shard of its params
    # (what its backward all-gathers among N ranks) until its backward
    partial_n = config.reshard_after_forward if not keeps_gathered else 0

    def partial_below(i: int) -> int:
        return _shard(gathered_below(i), partial_n) if partial_n else 0

    def params_at(i: int) -> int:
        """Gathered parameters at block i's moments: the root, block i, what stays gathered or partly so below."""
        return root.at_blocks + gathered(i) + (gathered_below(i) if keeps_gathered else 0) + partial_below(i)

    def grads_done(i: int) -> int:
        """Sharded gradients of blocks i+1 .. L-1 (and of the head unit: edge_units.py), reduce-scattered already."""
        done = (L - 1 - i) * block_sharded_grad + root.done_grads
        return done + (nd - n_dense_below(i + 1)) * dense_grad_delta if nd else done

    w_mlp, w_attn, freed_attn = s.w_mlp, s.w_attn, s.freed_attn
    h, f = model.hidden_size, model.ffn_hidden_size
    mlp_grad, attn_grad, mlp_moments, head_grad = s.mlp_grad, s.attn_grad, s.mlp_moments, root.head_grad

    held_params, held_optimizer = gpu_states * sharded_params + quant_state, gpu_states * optimizer_state

    def states(sharded_grad_bytes: int) -> dict:
        return dict(sharded_params=held_params, optimizer_state=held_optimizer,
                    sharded_grads=gpu_states * (accumulated or sharded_grad_bytes))

    moments: dict[str, _Moment] = {}
    moments["loss backward"] = _Moment(
        **states(0),
        unsharded_params=root.at_loss + (gathered_below(L) if keeps_gathered else 0) + partial_below(L),
        collective_buffers=prefetch_below(L) if root.prefetch_at_loss else 0,
        activations=tokens * (saved_below(L) + root_saved) + shared,
        logits_and_loss=s.loss_peak,
    )
    if not keeps_gathered and d > 1 and root.prefetch_at_loss and not adapter_units:
        # The root's post-forward reshards it (reshard_after_forward is explicit: root_regather.py), its pre-backward
        # gathers it again: before the loss's backward, or after a compiled loss's (run on the logits, outside)
        loss_moment = moments["loss backward"]
        moments["root gathered again in backward"] = root_regather.regather_moment(loss_moment, root.at_loss,
                                                                                   s.loss_at_regather)
        if config.loss_compiled:
            moments["loss backward"] = loss_moment._replace(
                unsharded_params=loss_moment.unsharded_params - root.at_loss, collective_buffers=0)
            moments["head backward"] = loss_moment._replace(logits_and_loss=tokens * c * model.vocab_size)
    # The loss is computed inside the model's forward, before the root's post-forward frees the last unit's all-gather
    # output (FSDP2 defers that free for an implicit prefetch): with expert units, the last block's experts', larger
    # than the block the loss backward prefetches; under ZeRO-2 the last block's, which no backward prefetch replaces
    # (a compiled loss runs outside the model, after that free; FSDP1 and edge units free it otherwise)
    last_in_forward = experts_c if experts_c and L - 1 not in dense_blocks else (
        gathered(L - 1) * (keeps_gathered and not adapter_units and not config.loss_compiled and not root.regather))
    if last_in_forward and (prefetches or keeps_gathered and d > 1):
        moments["loss in forward"] = moments["loss backward"]._replace(
            collective_buffers=last_in_forward,
            # (a loss kernel runs its forward and backward there: its whole peak)
            logits_and_loss=s.loss_peak if kern.loss is not LossKernel.EAGER else
            tokens * activations.forward_logits_bytes_per_token(model, c, config.loss_compiled))
    for i, label, recomputed, below, this in s.blocks:  # the blocks whose moment can peak (memory_shape.py)
        own_traced = traced_dense if traced_dense is not None and i in dense_blocks else traced
        params_adjust = buffers_adjust = shard_adjust = 0
        if own_traced is not None:  # the traced block's own backward moments
            w_acts, w_grads = own_traced.backward_peak(tokens, training.seq_len)
            block_acts, block_grads = tokens * (below + this) + round(w_acts), min(w_grads, real.trainable_block * c)
            # CP: the ring's transients on top (a profile does not say whether its peak is the attention's: an
            # upper bound where the MLP's is)
            block_acts += tokens * context_parallel.ring_working_bytes_per_token(model, config.cp, c)
            if experts_c and i not in dense_blocks:
                # a profile does not say which moments follow the experts' backward: the peak's activations
                # with the worse of the two states (experts gathered, or resharded with their reduce-scatter)
                buffers_adjust = max(0, experts_rs - reduce_scatter_above(i) - experts_c)
        elif mlp_moments:  # MoE: the largest of its MLP's moments and the attention's, gradients included
            at_attn = tokens * (below + this - freed_attn + w_attn)
            # (expert units: after the experts' post-backward, expert_unit_terms.py)
            block_acts, block_grads, params_adjust, buffers_adjust, shard_adjust = sparse_block_moment(
                mlp_moments[recomputed], tokens, training.seq_len, tokens * (below + this), at_attn, attn_grad,
                real.trainable_block * c, experts if i not in dense_blocks else expert_unit_terms_none,
                reduce_scatter_above(i), bool(accumulated))
        else:
            at_mlp = tokens * (below + this + w_mlp)
            at_attn = tokens * (below + this - freed_attn + w_attn)
            if quantized:  # bitsandbytes' backward: the output projection dequantized beside its gradients (qlora.py)
                in_flight = qlora.backward_in_flight_bytes(f, h, c, training.double_quant, tokens)
                at_mlp = max(at_mlp, tokens * (below + this + h * c) + in_flight)
                at_attn += qlora.dequantized_attention_bytes(model, c)
            mlp_first = at_mlp >= at_attn
            if adapter_units:  # FSDP1: block i-1 prefetched by its first adapter's pre-backward, in the attention's
                mlp_first = at_mlp + mlp_grad >= at_attn + attn_grad + prefetch_below(i)  # (fsdp1_adapters.py)
                buffers_adjust = -prefetch_below(i) if mlp_first else 0
            block_acts, block_grads = (at_mlp, mlp_grad) if mlp_first else (at_attn, attn_grad)
        moments[label] = _Moment(  # (the states spelled out: the moment the search makes most, ~5 a ledger)
            sharded_params=held_params, optimizer_state=held_optimizer,
            sharded_grads=gpu_states * ((accumulated or grads_done(i)) + shard_adjust),
            unsharded_params=params_at(i) + params_adjust,
            collective_buffers=prefetch_below(i) + reduce_scatter_above(i) + buffers_adjust,
            unsharded_grads=head_grad + block_grads,
            activations=block_acts + shared,
        )
        if s.out_proj_in_flight and recomputed:
            # a checkpointed block's recompute of its MLP output projection (the forward moment below, in the
            # backward): the block's saved tensors remade, the residual sum, the MLP's and the projection's inputs
            # and the incoming gradient, its weight dequantized or its adapter running; the gradients and buffers of
            # its backward moment (under FSDP1's adapter units without the block below, prefetched later in the
            # attention's backward)
            moments[f"recompute of block {i}'s MLP output projection"] = _Moment(
                **states(grads_done(i)), unsharded_params=params_at(i),
                collective_buffers=(0 if adapter_units else prefetch_below(i)) + reduce_scatter_above(i),
                unsharded_grads=head_grad,
                activations=tokens * (below + this + activations.output_projection_forward_held_bytes_per_token(
                    model, c, False, s.mlp_inputs_saved)) + shared + s.out_proj_in_flight,
            )
    if s.out_proj_in_flight and not is_ckpt(L - 1):
        # the forward of the last block's MLP output projection: bitsandbytes' (qlora.forward_in_flight_bytes says what
        # it holds), or peft's adapter on it (activations.lora_output_projection_in_flight_bytes_per_token); FSDP2's
        # all-gather output of the block kept as in "loss in forward" (FSDP1 gathers into the unit's flat parameter:
        # fsdp1_adapters.py). A checkpointed last block's forward keeps less: its recompute leads.
        i = L - 1
        moments[f"forward of block {i}'s MLP output projection"] = _Moment(
            **states(0),
            unsharded_params=params_at(i),
            collective_buffers=gathered(i) if d > 1 and not adapter_units else 0,  # (ZeRO-2: deferred too)
            activations=tokens * (saved_below(i) + full - (first_less if i == 0 else 0)
                                  + activations.output_projection_forward_held_bytes_per_token(
                                      model, c, i > 0, s.mlp_inputs_saved)) + shared + s.out_proj_in_flight,
        )
    if experts_c and prefetches and ep_view is None and L - 1 not in dense_blocks:  # (expert_unit_terms.py)
        moments.update(copy_out_moment(s, model, experts, states, grads_done(L - 1), params_at(L - 1),
                                       reduce_scatter_above(L - 1), head_grad, bool(training.adapter_rank)))
    if config.expert_shard_dim and d > 1 and model.moe is not None and not keeps_gathered and ep_view is None:
        # FSDP2 copies a dim-1 shard's all-gather out through a temporary as large as the tensor (chunk-cat
        # into the unsharded parameter): at a block's pre-backward its flat all-gather output, the temporary
        # and the unsharded block are alive at once, with the saved tensors of the blocks up to it.
        temp = moe.dim1_elements(model, d) * c
        for i, *_ in s.blocks:
            moments[f"all-gather copy-out of block {i}"] = _Moment(  # (the temporary: an ordinary allocation, as
                **states(grads_done(i)), unsharded_params=root.at_blocks + gathered(i),  # the trace files it)
                collective_buffers=gathered(i) + reduce_scatter_above(i), unsharded_grads=head_grad,
                activations=tokens * (saved_below(i) + (ckpt if is_ckpt(i) else full)) + shared + temp)
    sp = tensor_parallel.sequence_parallel(config)
    if counts.trainable_root and (sp or not (model.split_edge_units or adapter_units)):
        # The embedding's backward, the step's last op: the root still gathered, its other gradients made, block 0's
        # reduce-scatter input kept, beside its input gradient and its rows' (tied without SP: added into the head's;
        # traced, docs/accuracy.md "TP with CP, and traced block profiles"). TP with sequence parallel makes the whole
        # V x h table (tensor_parallel.embedding_grad_extra_params) from its output's gradient all-gathered over the
        # sequence. DTensor copies the rank's rows out of it while it is alive: at the root's post-backward (torch 2.13
        # _fsdp_param.py:965 redistribute to Shard(0), placement_types.py:619 clone=True), or, tied, when AccumulateGrad
        # adds it to the head's gradient (two rank-shard allocations beside the table). Traced (test_mesh_trace.py).
        whole = model.embedding_params * (sp or not model.tied_embeddings) + \
            tensor_parallel.embedding_grad_extra_params(model, config)
        root_grads = head_grad + whole * c
        at_table = _Moment(**states(grads_done(-1)), unsharded_params=root.at_blocks + root.prefetch_at_first,
                           collective_buffers=reduce_scatter_above(-1), unsharded_grads=root_grads)
        moments["embedding backward"] = at_table._replace(activations=tokens * h * c)
        copies = 2 if model.tied_embeddings else 1
        moments.update({"embedding's gradient, its rows copied": at_table._replace(
            unsharded_grads=root_grads + copies * model.embedding_params * c)} if sp else {})
    block_gathers = d > 1 and not adapter_units and not experts_c and L > 1 and not sp  # FSDP2's per-block all-gathers
    if root.regather:  # edge units: the final norm's backward, the head's unit copied out in forward (edge_units.py)
        moments.update(edge_units.edge_moments(moments["loss backward"], states(root.done_at_regather), root,
                                               gathered(L - 1) if block_gathers else 0))
    if block_gathers and not keeps_gathered:
        # FSDP2's transients around a block's all-gather (fsdp2_gathers.py). Backward: block i's pre-backward issues
        # block i-1's prefetch beside block i gathered, the copy-in source (shards cast to c) and the all-gather
        # output at once, before block i's backward adds its working set; a checkpointed block holds its input yet
        copy_in = fsdp2_gathers.copy_in_bytes(counts.trainable_block, counts.frozen_block, p,
                                              frozen_stored_bytes or frozen_p, c, d)
        for i, label, recomputed, below, this in s.blocks:
            held = tokens * (below + (ckpt if recomputed else this) + c * h) + shared
            if i > 0 and copy_in:
                moments[f"backward of block {i} (its prefetch issued)"] = _Moment(
                    **states(grads_done(i)), unsharded_params=params_at(i),
                    collective_buffers=prefetch_below(i) + copy_in + reduce_scatter_above(i),
                    unsharded_grads=head_grad, activations=held)
            if i < L - 1:  # ... and before it, its own prefetched all-gather output copied out (the last block's
                # parameters stay gathered from its forward)
                moments[f"backward of block {i} (its all-gather copied out)"] = _Moment(
                    **states(grads_done(i)), unsharded_params=params_at(i),
                    collective_buffers=gathered(i) + reduce_scatter_above(i), unsharded_grads=head_grad,
                    activations=held)
        if root.prefetch_at_first:  # the embedding's unit copied out at its pre-backward (edge_units.py)
            moments["embedding's all-gather copied out"] = _Moment(
                **states(grads_done(-1)), unsharded_params=root.prefetch_at_first,
                collective_buffers=root.prefetch_at_first + reduce_scatter_above(-1), activations=tokens * h * c)
    if block_gathers:
        # Forward (ZeRO-2's too): the last block's copy-out beside its all-gather output and the block below's
        # (deferred free); its input and the embedding's output held (output_projection_forward_held_bytes_per_token)
        i = L - 1
        moments[f"forward all-gather copy-out of block {i}"] = _Moment(
            **states(0), unsharded_params=params_at(i), collective_buffers=gathered(i - 1) + gathered(i),
            activations=tokens * (saved_below(i) + 2 * c * h) + shared)
        if not model.split_edge_units:  # ... and block 0's beside the root's all-gather output (the same deferred
            # free) and the embedding's output: where the root outweighs a block (fp32, small activations) it leads
            moments["forward all-gather copy-out of block 0"] = _Moment(
                **states(0), unsharded_params=params_at(0), collective_buffers=root.at_blocks + gathered(0),
                activations=tokens * c * h + shared)
    if input_requires_grad and training.adapter_rank and not s.K:
        # PEFT's enable_input_require_grads (verl's LoRA engine) makes the embedding's output a leaf that needs a
        # gradient: block 0's first norm saves its input as any block's (no first_less), and the leaf's AccumulateGrad
        # node keeps it until block 0's backward is done (a forward moment holds it already). Checkpointed, it is
        # block 0's saved input anyway. Measured: tests/distributed/test_torchrun_verl_actor.py (FSDP2 LoRA)
        for k, m in moments.items():
            if k != "end of backward" and not k.startswith("embedding"):
                moments[k] = m._replace(activations=m.activations + tokens * (
                    s.first_less + (0 if k.startswith("forward") else c * h)))
    # The root's post-backward reshards its parameters before it reduce-scatters their gradients (FSDP2's
    # FSDPParamGroup.post_backward): the gathered root is gone when its reduce-scatter input is built.
    moments["end of backward"] = _Moment(**states(grads_done(-1)), unsharded_params=root.end_params,
                                         unsharded_grads=root.end_grads, collective_buffers=root.end_rs)
    if d == 1 and not adapter_units and counts.trainable_root:
        # FSDP2 at world size 1: once the gradients are copied in and freed, foreach_reduce's full-size output beside
        # its input (the root's sharded gradient, not yet among grads_done; a new one added into it under accumulation;
        # copied to the host under offload). Above the moment before where r > c (bf16 compute, fp32 reduce).
        moments["end of backward (the root's reduce output)"] = _Moment(
            **states(grads_done(-1)), collective_buffers=root.end_rs + counts.trainable_root * r)
    if ledger_key and not config.offload:
        ledgers[ledger_key] = moments
    return peak_estimate(moments, step, s.loss_reserved_extra, outside, profile, cluster, cpu_per_rank, notes)
