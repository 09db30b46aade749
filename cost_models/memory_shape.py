"""What the memory ledger (cost_models/memory.py) reads of a candidate's shape and not of FSDP's own knobs
(specs.FSDP_ONLY_FIELDS: the strategy, its shard group, offload, prefetch, the rate limiter, resharding, gradient
accumulation, the reduce dtype): a rank's model slice and tokens, the precision's widths, the activations each block
saves per token with and without checkpointing, a block's backward working sets, the loss's bytes, the blocks whose
moments can peak. A search holds ~6 candidates a shape (planner/search/memo.py prices it once per shape, as
step_time._compute_parts prices the compute); every figure is what memory.py computed inline before."""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter

from . import (activation_notes, activations, activations_backward, context_parallel, fsdp1_adapters, kernels,
               lora_dropout, moe, moe_lora, operators, qlora, root_regather, tensor_parallel)
from .memory_types import ParamCounts, traced_block_terms
from .model_spec import dense_block_spec
from .quick_init import quick_init, replaced
from .specs import FSDP_ONLY_FIELDS, FsdpConfig, ModelSpec, TrainingSpec
from .units import DTYPE_BYTES

# nor Float8 linears or async TP, which change the step alone (planner/search/memo.py's MEMORY_FREE_FIELDS), nor the
# FP8 all-gather, which memory.py takes off the gathered bytes (operators.fp8_all_gather_saving_bytes), nor how the
# experts are sharded (their own units, dim 1), which memory.py's counts and expert_unit_terms.py read
_SHAPE_FIELDS = attrgetter(*(f.name for f in fields(FsdpConfig) if f.name not in FSDP_ONLY_FIELDS | {
    "float8", "async_tp", "fp8_all_gather", "expert_units", "expert_shard_dim"}))


@quick_init
@dataclass(frozen=True)
class LedgerShape:
    c: int                      # compute dtype's bytes: gathered params, activations, compute grads
    p: int                      # stored params and their gradients
    frozen_p: int               # frozen (LoRA base) weights, kept in compute dtype under mixed precision
    real: ParamCounts           # what autograd's gradients hold
    opt_per_param: float
    quantized: int              # QLoRA: a block's packed linears' elements (qlora.quantized_per_block)
    quant_state: int
    adapter_units: bool         # FSDP1: each adapter a unit of its own
    adapter_bytes: int          # what a block's all-gather output holds less: its adapters as units of their own,
    tokens: int
    kern: kernels.Kernels
    full: int                   # saved bytes per token of a block, not checkpointed
    traced: object              # the block memory profile's terms (None: formulas)
    ckpt: int                   # ... of a checkpointed block
    root_saved: int
    K: int                      # checkpoint every K blocks (selective op: 1)
    shared: int
    first_less: int
    full_dense: int
    traced_dense: object
    dense_blocks: frozenset
    leading: bool
    dense_prefix: tuple
    w_mlp: int
    w_attn: int
    freed_attn: int
    mlp_grad: int
    attn_grad: int
    mlp_moments: object
    ckpt_input_extra: int
    loss_peak: int
    loss_reserved_extra: int
    loss_at_regather: int       # the loss's tensors at the root's pre-backward gather (root_regather.py)
    # the forward (and a checkpointed block's recompute) of the MLP's output projection, where it can peak: QLoRA's
    # weight dequantized, LoRA's adapter on it (all-linear); 0: no such moment. Bytes beside what the block holds
    out_proj_in_flight: int
    mlp_inputs_saved: bool      # ... the MLP's and that projection's inputs saved (its adapters', no copies)
    # the blocks whose backward moments can peak, top first: (block, its moment's name, whether it is checkpointed,
    # the saved bytes per token of the blocks below it, its own at its backward)
    blocks: tuple
    quirks: tuple
    n_layers: int
    n_dense: int

    def is_ckpt(self, i: int) -> bool:
        return bool(self.K) and i % self.K == 0

    def n_dense_below(self, i: int) -> int:
        """Dense blocks among blocks 0 .. i-1."""
        return min(i, self.n_dense) if self.leading else self.dense_prefix[min(max(i, 0), self.n_layers)]

    def saved_below(self, i: int) -> int:
        """Saved bytes per token of blocks 0 .. i-1 (checkpointed ones keep their input)."""
        K = self.K
        n_ck = -(-i // K) if K else 0   # blocks 0, K, 2K, ... below i
        dense_below = self.n_dense_below(i)
        dense_full_below = dense_below - (-(-dense_below // K) if K else 0)
        return (n_ck * self.ckpt + (i - n_ck) * self.full - (self.first_less if i > 0 else 0)
                - dense_full_below * (self.full - self.full_dense))


def shape_key(config: FsdpConfig, ep_view, fsdp1_adapter_units: bool | fsdp1_adapters.AdapterUnits) -> tuple:
    """What ledger_shape reads of config, the EP view's shard groups and the FSDP1 adapter units (the model, training
    and profile are the caller's memo's)."""
    return _SHAPE_FIELDS(config), fsdp1_adapter_units, None if ep_view is None else (ep_view.efsdp, ep_view.d)


def ledger_shape(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, ep_view,
                 fsdp1_adapter_units: bool | fsdp1_adapters.AdapterUnits) -> LedgerShape:
    """model: the rank's (TP slice, EP's experts), training: its s / cp tokens."""
    L = model.n_layers
    precision = config.precision
    c = DTYPE_BYTES[precision.compute_dtype]
    p = DTYPE_BYTES[precision.param_dtype]
    # QLoRA (qlora.py): each block's linears packed in 4 bits, sharded and gathered so; their QuantState on
    # every rank (on the GPU even with offload); the linear in flight dequantized in its forward and backward
    quantized = qlora.quantized_per_block(model) if training.quantized else 0
    adapter_units = fsdp1_adapter_units and training.adapter_rank > 0
    adapter_bytes = fsdp1_adapters.block_adapter_bytes(model, training.adapter_rank, c) if adapter_units else 0

    # --- activations, per token of the micro-batch ----------------------------------------------------
    tokens = config.micro_batch * training.seq_len
    attn = config.attention
    lora_rank, kern = training.adapter_rank, kernels.memory_kernels(config)  # Liger / TE kernels (kernels.py)
    full = activations.block_bytes_per_token(model, c, attn, training.seq_len, config.micro_batch, lora_rank, kern)
    traced = traced_block_terms(model, precision, attn) if not lora_rank else None
    if traced is not None:
        full = round(traced.saved_bytes_per_token(training.seq_len))
    # LoRA on a generic family: its block traced under the adapters (planner/models/block_profiles.py) saves what the
    # formulas, reading a guessed spec, do not see (Llama 4's experts run every token); its saved bytes, formulas the rest
    lora_traced = traced_block_terms(model, precision, attn, lora=True) if lora_rank and ep_view is None \
        and config.tp == config.cp == 1 and not training.adapter_dropout else None
    if lora_traced is not None:
        full = round(lora_traced.saved_bytes_per_token(training.seq_len))
    # all-linear on an MoE: peft's merged expert stacks and router weight (moe_lora.py), a block's, per token; freed
    # with the MLP's nodes, before the attention's backward
    merged = moe_lora.merged_bytes_per_token(model, c if precision.mixed else p, c, lora_rank, tokens)
    full += merged
    if ep_view is not None:  # the dispatch / combine's own saved tensors, the busiest rank's extra rows
        full += round(ep_view.saved_delta_bytes_per_token(c))
    ckpt = activations.checkpointed_block_bytes_per_token(model, c)
    if config.selective_op_ac:  # every block checkpointed, keeping its input and the policy's saved outputs
        ckpt = activations.selective_op_held_bytes_per_token(model, c, attn, training.seq_len, lora_rank)
    root_saved = activations.root_bytes_per_token(model, c, lora=bool(lora_rank), fused_norm=kern.fused_norm)
    if tensor_parallel.sequence_parallel(config) and traced is None:  # the residual stream on s / tp tokens
        full, ckpt, root_saved = tensor_parallel.sequence_parallel_saved_bytes(
            model, c, config.tp, full, ckpt, root_saved, lora=bool(lora_rank), selective_op=config.selective_op_ac)
    if config.cp > 1 and traced is None:  # ring attention's output and the o-projection's copy of it
        full += context_parallel.ring_saved_bytes_per_token(model, config.cp, c)
    casts = adapter_units and precision.mixed and fsdp1_adapters.casts_inputs(fsdp1_adapter_units, training.quantized)
    if adapter_units:  # each adapter's own copy of its input (not bitsandbytes' under autocast: casts_inputs)
        full += fsdp1_adapters.saved_copies_bytes_per_token(model, c, casts,
                                                            activations.uses_s2_attention(model, attn))
    dropout = training.adapter_dropout > 0  # each adapter's dropout mask and output (lora_dropout.py)
    o_copied = lora_dropout.o_input_copied(model, attn)
    if dropout:  # where each adapter saves its own copy of its input (casts), the dropout's output replaces it
        full += lora_dropout.saved_bytes_per_token(model, c, casts, o_copied)
    K = 1 if config.selective_op_ac else config.ac_every
    shared = activations.shared_bytes(model, c, training.seq_len)
    held = traced if traced is not None else lora_traced  # (under LoRA the block traced under peft's adapters: its
    # masks too, e.g. Llama 4's chunked-attention mask, which SDPA gets from a chunk no longer than the sequence on,
    # transformers 5.24 masking_utils.py:286, s x s bool: docs/accuracy.md "2026-12-08: llama4 LoRA's held mask")
    if K and held is not None:  # the blocks' other inputs (masks, rotary tables), kept for the recompute
        shared = round(held.checkpoint_held_bytes(config.micro_batch, training.seq_len))
    elif K:
        shared += activations.eager_mask_bytes(model, c, training.seq_len, config.micro_batch, attn)
    # LoRA without checkpointing: block 0's first norm saves nothing (its input needs no gradient).
    first_less = activations.first_block_lora_savings(model, c, kern.fused_norm) if lora_rank and not K else 0
    if lora_rank and not K and dropout:  # nor do the dropouts of its adapters on that input save masks
        first_less += lora_dropout.first_block_masks_bytes_per_token(model)

    # MoE models' leading dense blocks (n_dense_layers): their own saved bytes at their own moment
    nd = model.n_dense_layers
    dense = dense_block_spec(model)
    full_dense = activations.block_bytes_per_token(dense, c, attn, training.seq_len, config.micro_batch,
                                                   lora_rank, kern) if dense else full
    traced_dense = traced.dense if traced is not None and nd else None
    if traced_dense is not None:
        full_dense = round(traced_dense.saved_bytes_per_token(training.seq_len))
    elif traced is not None or lora_traced is not None:
        full_dense = full  # interleaved dense blocks (Llama 4): the profile's mean over the pattern covers them
        if lora_traced is not None and lora_traced.dense is not None and nd:  # leading ones, profiled apart
            full_dense = round(lora_traced.dense.saved_bytes_per_token(training.seq_len))
    # Which blocks are dense: all leading (DeepSeek) or interleaved (Llama 4, Qwen's decoder_sparse_step).
    dense_blocks = model.dense_block_indices()
    leading = dense_blocks == frozenset(range(nd))
    dense_prefix = [0]
    for i in range(L if dense_blocks and not leading else 0):
        dense_prefix.append(dense_prefix[-1] + (i in dense_blocks))

    # loss parallel (vocab / tp): its own events, as the pipeline ledger reads them (loss_memory.events)
    _, logits_peak = activations.logits_bytes_per_token(model, c, config.loss_compiled,
                                                        tensor_parallel.loss_parallel(config))
    w_mlp = activations_backward.mlp_backward_working_bytes_per_token(model, c, lora=bool(lora_rank), kernels=kern)
    w_attn = activations_backward.attention_backward_working_bytes_per_token(model, c, attn, training.seq_len)
    w_attn += context_parallel.ring_working_bytes_per_token(model, config.cp, c)  # CP: the ring's transients
    freed_attn = activations_backward.attention_freed_before_backward_bytes_per_token(
        model, c, lora=bool(lora_rank), attention=attn, kernels=kern, micro_batch=config.micro_batch) + merged
    if dropout:  # the o-projection's and the MLP's adapters' dropout tensors, freed by their backward; the down
        # projection's mask, with its output (w_mlp frees the projection's saved input), before the activation's
        freed_attn += lora_dropout.freed_before_attention_backward_bytes_per_token(model, c, casts, o_copied)
        w_mlp -= model.ffn_hidden_size if model.lora_mlp else 0
    h, f = model.hidden_size, model.ffn_hidden_size
    real = ParamCounts.of(model, training)
    # Gradients accumulated when the MLP's backward peaks (fc2's weight), and the attention's (the MLP's and o's).
    # LoRA: only the down projection's adapter (all-linear; its lora_A and lora_B), none with attention targets, whose
    # adapters' backward comes after the MLP's (measured: tests/distributed/test_torchrun_verl_actor.py)
    mlp_grad = min(real.trainable_block, h * f) * c
    if lora_rank and model.moe is None:
        mlp_grad = lora_rank * sum(model.mlp_linear_shapes[-1]) * c if model.lora_mlp else 0
    attn_grad = min(real.trainable_block, (3 if model.gated_mlp else 2) * h * f + model.q_dim * h) * c
    mlp_moments = ()
    if model.moe is not None:  # the MoE MLP's own moments (cost_models/moe.py); at the attention's, all its grads
        mlp_moments = {ck: moe_lora.backward_moments(model, c, ck, lora_rank) if lora_rank and model.lora_moe
                       else moe.backward_moments(model, c, lora=bool(lora_rank), recomputed=ck) for ck in (False, True)}
        attn_grad = min(real.trainable_block, moe.mlp_param_elements(model) + model.q_dim * h) * c
        if ep_view is not None:
            mlp_moments = {ck: ep_view.backward_moments(c, recomputed=ck) for ck in (False, True)}
            attn_grad = min(real.trainable_block, moe.mlp_param_elements(model) + model.q_dim * h
                            - model.moe.routed_params + ep_view.local_experts * model.moe.expert_params) * c
    ckpt_input_extra = 0 if activations.input_saved_by_first_norm(model, c, kern.fused_norm) else ckpt
    # Within blocks of one kind (checkpointed or not) a block's moment is linear in its index: the saved
    # tensors below it shrink going down while the sharded gradients of the blocks done grow. The extremes
    # of each kind, and the neighbours where the prefetch / reduce-scatter buffers start or stop, suffice.
    # (K: the lowest checkpointed block with a block below to prefetch; block 0 has none; nd + 1: the lowest sparse
    # block prefetching a sparse one, where the blocks done's sharded gradients outweigh the inputs kept: traced,
    # tests/unit/test_moe_dense_blocks_allocations.py)
    candidates = {i for i in (0, 1, L - 2, L - 1, K * ((L - 1) // K) if K else 0, K, nd - 1, nd, nd + 1) if 0 <= i < L}
    if dense_blocks and not leading:  # interleaved: the extremes of each kind of block and of its neighbours
        kinds: dict[tuple, list[int]] = {}
        for i in range(L):
            kinds.setdefault((bool(K) and i % K == 0, i in dense_blocks, i - 1 in dense_blocks, i + 1 in dense_blocks),
                             []).append(i)
        candidates |= {ends[0] for ends in kinds.values()} | {ends[-1] for ends in kinds.values()}
    loss_peak = kernels.loss_peak_bytes(model, c, config, kern, tokens, tokens * logits_peak, not lora_rank)
    loss_reserved_extra = kernels.loss_reserved_extra_bytes(
        model, c, config, kern, tokens, tokens * activations.logits_reserved_extra_bytes_per_token(
            model, c, config.loss_compiled))
    loss_at_regather = root_regather.loss_bytes_at_regather(model, c, config, kern, tokens,
                                                            not training.finetune.adapters)
    out_proj_in_flight = qlora.forward_in_flight_bytes(f, h, c, training.double_quant, tokens) if quantized else 0
    if lora_rank and model.lora_mlp and model.moe is None:   # (an MoE's experts: moe_lora.py)
        # peft runs the adapter after the base's forward (its dequantized weight freed), so what the adapter saves
        # (lora_A's output; under FSDP1's adapter units its input's copy: fsdp1_adapters.py), in `full`, is not there
        # yet while the base runs
        not_yet_saved = tokens * (c * (lora_rank + (f if casts else 0))
                                  + (lora_dropout.down_projection_bytes_per_token(model, c, casts) if dropout else 0))
        out_proj_in_flight = max(out_proj_in_flight - not_yet_saved, tokens * (
            activations.lora_output_projection_in_flight_bytes_per_token(model, c, p if casts else 0)))
    shape = LedgerShape(
        c=c, p=p, frozen_p=c if precision.mixed else p, real=real,
        opt_per_param=training.optimizer.state_bytes_per_param(precision.param_dtype), quantized=quantized,
        quant_state=qlora.replicated_bytes(model, training.double_quant) if quantized else 0,
        adapter_units=adapter_units, adapter_bytes=adapter_bytes, tokens=tokens, kern=kern,
        full=full, traced=traced, ckpt=ckpt, root_saved=root_saved, K=K, shared=shared, first_less=first_less,
        full_dense=full_dense, traced_dense=traced_dense, dense_blocks=dense_blocks, leading=leading,
        dense_prefix=tuple(dense_prefix), w_mlp=w_mlp, w_attn=w_attn, freed_attn=freed_attn,
        mlp_grad=mlp_grad, attn_grad=attn_grad, mlp_moments=mlp_moments, ckpt_input_extra=ckpt_input_extra,
        loss_peak=loss_peak, loss_reserved_extra=loss_reserved_extra, loss_at_regather=loss_at_regather,
        out_proj_in_flight=out_proj_in_flight,
        mlp_inputs_saved=bool(lora_rank) and model.lora_mlp and model.moe is None and not casts and not dropout,
        blocks=(),
        quirks=tuple(activation_notes.quirks(model, config.attention, training.seq_len)), n_layers=L, n_dense=nd)
    # A checkpointed block re-runs its forward; its saved input stays (unless the first norm saves that very tensor).
    blocks = tuple((i, f"backward of block {i}" + (" (recomputed)" if shape.is_ckpt(i) else ""), shape.is_ckpt(i),
                    shape.saved_below(i), (full_dense if traced_dense is not None and i in dense_blocks else full)
                    + (ckpt_input_extra if shape.is_ckpt(i) else 0) - (first_less if i == 0 else 0))
                   for i in sorted(candidates, reverse=True))
    return replaced(shape, blocks=blocks)
