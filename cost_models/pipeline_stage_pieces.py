"""One pipeline stage's bytes, priced once per stage: its parameters and a microbatch's saved tensors, output,
logits and loss, each block's backward moments, and the split backward's held output gradients.

What torch and FSDP2 do with them over a schedule step, and why each piece is what it is, is in
cost_models/pipeline_rank_memory.py (the replay); the per-token pieces are the single-microbatch ledger's
(cost_models/activations.py), as cost_models/memory.py uses them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from . import (activations, activations_backward, context_parallel, dim0_padding, kernels, operators,
               pipeline_techniques, tensor_parallel)
from .memory_types import ParamCounts
from .pipeline import Stage
from .specs import FsdpConfig, ModelSpec, TrainingSpec
from .units import DTYPE_BYTES


@dataclass(frozen=True)
class StagePieces:
    """Bytes of one stage: per-step states and per-microbatch activations."""

    stage: Stage
    params: int                # parameter count
    head_params: int           # of which the final norm and head (last stage)
    saved: int                 # one microbatch's saved tensors while in flight (incl. the kept output)
    output: int                # the stage output fwd_cache keeps until backward (non-last stages)
    logits: int                # last stage: one microbatch's logits, kept to the step's end (output_chunks)
    loss_saved: int            # last stage: the log-softmax output kept until the loss backward
    loss_peak: int             # last stage: the loss backward's fp32 gradients on top of loss_saved
    blocks: tuple              # each block's backward, top first: its largest (activations relative to `saved`,
    #                            in-flight gradients), the same in place (no dtype change), its post-backward
    reserved_extra: int        # last stage: what the allocator strands above the loss backward's allocations
    weight_inputs: int         # split backward: the output gradients at the stage's linears and norm weights, I to W
    input_pass: tuple          # split backward: each block's input-pass moment (top first), relative to the held state
    block_params: int          # one block's parameters (an FSDP unit)
    head_grad: int             # the head's gradients (compute dtype), waiting for the stage root's post-backward
    root_gathered: int         # the stage root's unsharded parameters (embedding, final norm, head: compute dtype)
    block_gathered: int        # one block's all-gather output: its parameters in the compute dtype, the Float8
    #                            linears' weights at 1 byte under the FP8 all-gather (the pp = 1 rule, memory.py)
    kept: tuple = ()           # per token, what each block keeps from its forward to its backward (model order)
    block_full: int = 0        # per token, a block's tensors saved without checkpointing (made again in recompute)
    checkpointed: tuple = ()   # per block (model order): whether it is checkpointed (recomputed in backward)
    working: tuple = ()        # per block (model order): its backward's largest working set above its own tensors
    grad_extra: int = 0        # elements the root's gradients hold beyond its parameters: TP with sequence parallel
    #                            makes the embedding's gradient the whole table (embedding_grad_extra_params)
    recomputed: int = 0        # per token, a checkpointed block's own tensors at its backward beyond its kept input
    #                            (memory.py's: none twice where the first norm saves the input; a block above the first)
    shared: int = 0            # the blocks' shared saved tensors (rotary tables), in `saved`
    root_padding: int = 0      # elements FSDP2's dim-0 padding adds to the stage root's tensors (dim0_padding.py):
    block_padding: int = 0     # and to one block's; in the shards, states, all-gathers and reduce-scatters, not in
    #                            the gradients autograd makes (stage_pieces at shard group d > 1)

    @property
    def gathered(self) -> int:
        """The stage's unsharded parameters while it keeps them gathered (reshard_after_forward=False)."""
        return self.root_gathered + self.stage.n_blocks * self.block_gathered

    @property
    def padded_params(self) -> int:
        """The elements FSDP2 shards: the stage's parameters with their dim-0 padding."""
        return self.params + self.root_padding + self.stage.n_blocks * self.block_padding

    def with_ledger_saved(self, shape, tokens: int, first_less: int = 0) -> StagePieces:
        """These pieces with each block's saved tensors as memory.py's ledger holds them (shape: a
        memory_shape.LedgerShape; the pp = 1 walks of lora_events.py and profile_events.py): per token a checkpointed
        block's input, another block's whole set (block 0 less first_less), a recomputed block's tensors, and the
        stage's saved bytes on `tokens` tokens (the root's among them)."""
        n = self.stage.n_blocks
        kept = [shape.ckpt if shape.is_ckpt(j) else shape.full for j in range(n)]
        kept[0] -= first_less
        return replace(self, kept=tuple(kept), block_full=shape.full + shape.ckpt_input_extra - shape.ckpt,
                       saved=tokens * (sum(kept) + shape.root_saved),
                       checkpointed=tuple(shape.is_ckpt(j) for j in range(n)))


def shape_key(config: FsdpConfig, stage: Stage) -> tuple:
    """What of a stage its pieces read: its blocks' count, whether it holds the embedding and the head, and which of
    its blocks are checkpointed (every k-th of the model: its first block modulo k)."""
    k = 1 if config.selective_op_ac else config.ac_every  # pipeline_techniques.checkpoint_policy's k
    return stage.n_blocks, stage.embedding, stage.head, stage.first_block % k if k else 0


def shaped_stage_pieces(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, stage: Stage,
                        shapes: dict, d: int = 1) -> StagePieces:
    """stage_pieces, priced once per stage shape in `shapes` (a memo for one model, training and config): the pieces
    read of the stage only its blocks' count, whether it holds the embedding and the head, and which of its blocks are
    checkpointed (every k-th of the model: its first block modulo k); the stage itself put in."""
    key = shape_key(config, stage)
    pieces = shapes.get(key)
    if pieces is None:
        pieces = shapes[key] = stage_pieces(model, training, config, stage, d)
    if pieces.stage == stage:
        return pieces
    # the same pieces with the stage swapped: a copy (replace() would run __init__ over 20 fields again, for each rank)
    pieces = copy.copy(pieces)
    object.__setattr__(pieces, "stage", stage)
    return pieces


def stage_pieces(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, stage: Stage,
                 d: int = 1) -> StagePieces:
    """The stage's pieces; d: the FSDP shard group, whose dim-0 padding the all-gather outputs and the padding fields
    count (d = 1: none; the walks pad their own tensors, dim0_padding_events.py)."""
    c = DTYPE_BYTES[config.precision.compute_dtype]
    s, mb = training.seq_len, config.micro_batch
    tokens = mb * s
    attn = config.attention
    counts = ParamCounts.of(model, training)
    # FSDP2 pads every tensor to d x ceil(rows / d) rows (dim0_padding.py): the pp = 1 ledger's padded counts, a
    # sparse block's stacked experts among them (moe.py), less the real ones
    block_padding = ParamCounts.of(model, training, d, dim1=bool(config.expert_shard_dim)).block() - counts.block() \
        if d > 1 else 0
    root_padding = dim0_padding.stage_root_padding_elements(model, d, stage.embedding, stage.head)
    # Liger / TE kernels' saved tensors and working sets as memory.py prices them (pp = 1 without TP only: EAGER else)
    kern = kernels.memory_kernels(config)
    # tied embeddings: the last stage holds its own copy of the table (torchtitan's per-stage model copies); a stage
    # with the embedding too (pp = 1, step_allocations.py) holds the one table
    tied_copy = model.embedding_params if model.tied_embeddings and not stage.embedding else 0
    head = ((model.head_params or tied_copy) + model.root_other_params) if stage.head else 0
    params = stage.n_blocks * counts.block() + (model.embedding_params if stage.embedding else 0) + head
    full = activations.block_bytes_per_token(model, c, attn, s, mb, 0, kern)
    # selective-op: every block checkpointed, keeping the policy's saved outputs too (pipeline_techniques.py)
    k, ckpt = pipeline_techniques.checkpoint_policy(model, c, config, s, config.ac_every,
                                                    activations.checkpointed_block_bytes_per_token(model, c))
    h, f = model.hidden_size, model.ffn_hidden_size
    # per token, each block's saved tensors in the model's order; a non-first stage's checkpointed first block keeps
    # its input, which is the receive buffer (counted with the buffers)
    root_saved = activations.root_bytes_per_token(model, c, fused_norm=kern.fused_norm) if stage.head else 0
    # TP with sequence parallel: the residual stream (each block's norms and input, the stage's output and the
    # receive buffers) on s / tp tokens, by the rule the pp = 1 ledger is traced with (tensor_parallel.py)
    sp = config.tp if tensor_parallel.sequence_parallel(config) else 1
    if sp > 1:  # the root's residual-stream share only where the root is (it made a stage without one negative)
        full, ckpt, root_sp = tensor_parallel.sequence_parallel_saved_bytes(
            model, c, sp, full, ckpt, root_saved, selective_op=config.selective_op_ac)
        root_saved = root_sp if stage.head else 0
    # CP: ring attention's merged output, a copy the o-projection saves beside it (the pp = 1 rule, memory_shape.py)
    full += context_parallel.ring_saved_bytes_per_token(model, config.cp, c)
    kept = [ckpt if k and i % k == 0 else full for i in stage.blocks]
    # so does a first block whose first norm saves the block input itself (fp32 RMSNorm: no upcast copy; LayerNorm)
    if kept and not stage.embedding and (k and stage.first_block % k == 0
                                         or activations.input_saved_by_first_norm(model, c)):
        kept[0] -= -(-h * c // sp)
    output = 0 if stage.head else tokens * -(-h * c // sp)
    # the rotary tables are saved by the blocks' attention (a stage of the embedding or the head alone keeps none)
    shared = activations.shared_bytes(model, c, s) if stage.n_blocks else 0
    saved = tokens * (sum(kept) + root_saved) + shared + output
    v = model.vocab_size
    logits = tokens * v * c if stage.head else 0
    # eager: log_softmax's fp32 output saved by the NLL, then its fp32 gradients (loss parallel under TP: three beside
    # the saved output, loss_memory.loss_parallel_events); compiled: the logits' gradient alone
    loss_saved, loss_peak = (pipeline_techniques.loss_bytes(model, c, tokens, config.loss_compiled,
                                                            tensor_parallel.loss_parallel(config)) if stage.head
                             else (0, 0))
    # each block's backward, top first (memory.py's moments): the saved tensors of the blocks below it, its own
    # (recomputed when checkpointed), the larger of its MLP's and attention's working sets with their gradients;
    # relative to the microbatch's whole `saved` (the root's and the kept output are gone by then)
    w_mlp = activations_backward.mlp_backward_working_bytes_per_token(model, c, kernels=kern)
    w_attn = activations_backward.attention_backward_working_bytes_per_token(model, c, attn, s)
    w_attn += context_parallel.ring_working_bytes_per_token(model, config.cp, c)  # CP: the ring's transients
    freed = activations_backward.attention_freed_before_backward_bytes_per_token(model, c, attention=attn,
                                                                                 micro_batch=mb, kernels=kern)
    mlp_grad = min(counts.block(), h * f) * c
    attn_grad = pipeline_techniques.attention_grad_bytes(  # MoE: every expert's, as memory.py counts them
        model, c, counts.block(), min(counts.block(), (3 if model.gated_mlp else 2) * h * f + model.q_dim * h) * c)
    # selective-op: the input only
    input_extra = 0 if activations.input_saved_by_first_norm(model, c, kern.fused_norm) else (
        pipeline_techniques.recompute_input_bytes_per_token(model, c, config, ckpt))
    # RMSNorm's fp32 backward chain: four h-sized fp32 gradients, and the upcast incoming one under a 16-bit compute
    # dtype (5 x 4 h per token in the trace's timelines)
    # (a fused RMSNorm kernel writes its input gradient in place: no chain)
    norm_chain = 4 * h * (4 + (c < 4))
    rms = model.norm == "rmsnorm" and not model.parallel_block and not kern.fused_norm
    mlp_grads = min(counts.block(), (3 if model.gated_mlp else 2) * h * f) * c
    blocks, working = [], []
    below = [0]  # below[j]: sum(kept[:j]), the blocks below block j (a stage holds up to ~60 blocks: not summed each)
    for x in kept:
        below.append(below[-1] + x)
    for j in reversed(range(stage.n_blocks)):
        recomputed = bool(k) and (stage.first_block + j) % k == 0
        this = full + (input_extra if j or stage.embedding else 0) if recomputed else kept[j]
        base = tokens * (below[j] + this) + shared - saved
        at_attn = (base + tokens * (w_attn - freed), attn_grad)
        # MoE: the MoE MLP's own moments (moe.backward_moments) in place of fc2's
        at_mlp = pipeline_techniques.mlp_moment(model, c, tokens, s, counts.block(), recomputed, base,
                                                (base + tokens * w_mlp, mlp_grad))
        # RMSNorm's backward between the two (post_attention_layernorm): the MLP's saved tensors and the norm's output
        # gone, its own (fp32 upcast, normalised input) still there, beside its fp32 chain and the MLP's weight
        # gradients (5 x 4 h per token in the trace's timeline, llama-16 tp 2: larger than the MLP's and attention's
        # moments where TP splits f and the heads but not h)
        # (without it, the attention's moment again: a (0, 0) stand-in outranked the others on the blocks far below the
        # top, whose moments are negative relative to `saved`, giving them a working set of all the blocks above)
        # Under sequence parallel the norm runs on the rank's s / tp tokens (torchtitan's SequenceParallel norms,
        # tensor_parallel.py): its chain and its own saved tensors / sp, what the MLP freed stays at full tokens.
        # At 405B's widths with TP 8, full-token norm bytes made this the block's moment: +31% over the trace on a
        # middle stage, +0.4% now (benchmarks/pipeline_replay_wide.py)
        at_norm = (base + tokens * (norm_chain + 4 * h + c * h) // sp - tokens * freed, mlp_grads) if rms else at_attn
        # without a dtype change AccumulateGrad adds into the kept gradients in place, but autograd makes each weight's
        # gradient whole first: the MLP's moment is fc2's (h x f) beside the incoming gradient and fc2's input's; then,
        # fc2's gradient added and freed, the activation's factors' gradients beside fc2's input's (the first
        # backward's MLP working set, no gradient: the larger at the tiny Llama's shapes, pp 2 fp32 in the trace's
        # timeline, 2 f against h + f and h x f); the attention's as in the other cases, without one
        in_place = max((base + tokens * c * (h + f), mlp_grad), (at_mlp[0], 0), (at_attn[0], 0), key=sum)
        # its post-backward: the block's whole compute-dtype gradient (converted or added one parameter at a time)
        # beside the saved tensors below and the gradient passed down
        post = tokens * (below[j] + h * c) + shared - saved
        blocks.append((max(at_mlp, at_attn, at_norm, key=sum), max(in_place, (at_norm[0], 0), key=sum), post))
        working.insert(0, blocks[-1][0][0] - base)
    head_grad = head * c
    # split backward, input pass (stage_backward_input: autograd.grad to the stage input with retain_graph=True):
    # nothing saved is freed, and a pre-hook on each linear's mm and each norm's weight product keeps the gradient
    # of its output for the weight pass: per block q, k, v, o, gate, up, down and the two norms (c (q + 2 kv + 4 h
    # + 2 f) per token, 12 h at Llama's shapes; counted in the trace's param_groups). The first stage skips the
    # pass (torch runs its whole backward at W), so it keeps none.
    weight_inputs = 0 if stage.embedding else tokens * c * (model.q_dim + 2 * model.kv_dim + 4 * h + 2 * f)
    head_inputs = tokens * c * h if stage.head and not stage.embedding else 0  # the final norm's (the head's: logits)
    # block j's input-pass moment (j blocks above done, their gradients kept): its MLP's working set with fc2's input
    # still saved, its attention's beside the MLP half's kept gradients (norm 2, down, gate, up), or - the largest at
    # Llama's shapes - its first norm's backward, every gradient of the block kept but that norm's own, beside the
    # RMSNorm's fp32 chain (the trace's timeline, llama-8 zero-bubble bf16)
    input_pass = tuple(max(j * weight_inputs + tokens * max(w_mlp + c * f, w_attn + c * (2 * h + 2 * f)),
                           (j + 1) * weight_inputs + tokens * (norm_chain - c * h))
                       for j in range(stage.n_blocks))
    return StagePieces(stage, params, head, saved, output, logits, loss_saved, loss_peak, tuple(blocks),
                        tokens * activations.logits_reserved_extra_bytes_per_token(model, c, config.loss_compiled)
                        if stage.head else 0, weight_inputs * stage.n_blocks + head_inputs, input_pass,
                        counts.block(), head_grad, (params - stage.n_blocks * counts.block() + root_padding) * c,
                        (counts.block() + block_padding) * c - (operators.fp8_all_gather_saving_bytes(model, c, s)
                                                                if config.fp8_all_gather else 0),
                        tuple(kept), full, tuple(bool(k) and i % k == 0 for i in stage.blocks), tuple(working),
                        tensor_parallel.embedding_grad_extra_params(model, config) if stage.embedding else 0,
                        full + input_extra - ckpt, shared, root_padding, block_padding)
