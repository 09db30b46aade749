"""GPU memory of each pipeline rank: its stages' model states and the microbatches its schedule holds in flight.

What torch.distributed.pipelining and FSDP2 do in one schedule step (torch 2.13 schedules.py / stage.py,
torchtitan 0.3's FSDP policy under PP; checked against the trace tier, calibration/trace_pipeline.py,
docs/accuracy.md):
- model states: each stage's parameters (its blocks; the embedding on the first stage, the final norm and head on
  the last) sharded over dp_shard x cp with their optimizer state; gradients set to None between steps;
- reshard_after_forward=False and, for every microbatch but the last, no gradient sync and no reshard after
  backward (PipelineStage.backward_maybe_with_nosync): from a stage's first forward to the step's end its
  parameters stay gathered (compute dtype), and from its first backward on FSDP2 keeps the unsharded gradients
  accumulated in the reduce dtype (FSDPParam.to_accumulated_grad_if_needed); they are reduce-scattered once,
  when the schedule ends (perform_reduce_grad), then resharded;
- activations: a microbatch's saved tensors live from its forward to its backward on that stage; the order
  of forwards and backwards on each rank is torch's (cost_models/pipeline_orders.py), replayed action by action;
  a non-last stage keeps its output in fwd_cache until that backward; receive buffers (activations into a
  non-first stage, gradients into a non-last one) are made once per microbatch at the first step and kept;
- the last stage keeps every microbatch's logits for the step's merged output (output_chunks), its loss's
  log-softmax output until the loss backward, and computes the loss backward on three fp32 copies.
- split backward (zero-bubble, DualPipeV; torch's _backward.py): a non-first stage's input pass (I) keeps the
  microbatch's whole graph and the output gradient of each linear and norm weight until its weight pass (W); W
  leaves the stage's compute-dtype weight gradients in param.grad until the stage's next pass's post-backward adds
  them into the reduce-dtype sums; the first stage skips I and runs its whole backward at W.
The per-token pieces (a block's saved bytes, its backward working set, the final norm's, the loss's) are the
single-microbatch ledger's (cost_models/activations.py), as cost_models/memory.py uses them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from . import activations, pipeline_techniques, tensor_parallel
from .memory_types import MemoryBreakdown, MemoryEstimate, ParamCounts
from .pipeline import Stage, rank_stages
from .pipeline_orders import active_stages, orders
from .specs import FsdpConfig, ModelSpec, Optimizer, Precision, TrainingSpec
from .units import DTYPE_BYTES


SPLIT_BACKWARD = ("zero-bubble", "dualpipev")  # backward split into input (I) and weight (W) passes


@dataclass(frozen=True)
class PipelineRankMemory:
    """One pipeline rank (its dp / tp coordinate 0) at its own peak."""

    rank: int
    stages: tuple[int, ...]
    description: str                  # "stage 0: embedding + blocks 0-7"
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    breakdown: MemoryBreakdown
    peak_moment: str                  # "backward of microbatch 3 on stage 0", "optimizer step", ...
    phases: dict = field(default_factory=dict)   # "backward" (the schedule's peak) and "optimizer_step"


@dataclass(frozen=True)
class _StagePieces:
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


def _stage_pieces(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, stage: Stage) -> _StagePieces:
    c = DTYPE_BYTES[config.precision.compute_dtype]
    s, mb = training.seq_len, config.micro_batch
    tokens = mb * s
    attn = config.attention
    counts = ParamCounts.of(model, training)
    # tied embeddings: the last stage holds its own copy of the table (torchtitan's per-stage model copies)
    head = ((model.head_params or (model.embedding_params if model.tied_embeddings else 0))
            + model.root_other_params) if stage.head else 0
    params = stage.n_blocks * counts.block() + (model.embedding_params if stage.embedding else 0) + head
    full = activations.block_bytes_per_token(model, c, attn, s, mb, 0)
    # selective-op: every block checkpointed, keeping the policy's saved outputs too (pipeline_techniques.py)
    k, ckpt = pipeline_techniques.checkpoint_policy(model, c, config, s, config.ac_every,
                                                    activations.checkpointed_block_bytes_per_token(model, c))
    h, f = model.hidden_size, model.ffn_hidden_size
    # per token, each block's saved tensors in the model's order; a non-first stage's checkpointed first block keeps
    # its input, which is the receive buffer (counted with the buffers)
    root_saved = activations.root_bytes_per_token(model, c) if stage.head else 0
    # TP with sequence parallel: the residual stream (each block's norms and input, the stage's output and the
    # receive buffers) on s / tp tokens, by the rule the pp = 1 ledger is traced with (tensor_parallel.py)
    sp = config.tp if tensor_parallel.sequence_parallel(config) else 1
    if sp > 1:
        full, ckpt, root_saved = tensor_parallel.sequence_parallel_saved_bytes(model, c, sp, full, ckpt, root_saved)
    kept = [ckpt if k and i % k == 0 else full for i in stage.blocks]
    if kept and not stage.embedding and k and stage.first_block % k == 0:
        kept[0] -= -(-h * c // sp)
    output = 0 if stage.head else tokens * -(-h * c // sp)
    # the rotary tables are saved by the blocks' attention (a stage of the embedding or the head alone keeps none)
    shared = activations.shared_bytes(model, c, s) if stage.n_blocks else 0
    saved = tokens * (sum(kept) + root_saved) + shared + output
    v = model.vocab_size
    logits = tokens * v * c if stage.head else 0
    # eager: log_softmax's fp32 output saved by the NLL, then its fp32 gradients; compiled: the logits' gradient alone
    loss_saved, loss_peak = (pipeline_techniques.loss_bytes(model, c, tokens, config.loss_compiled) if stage.head
                             else (0, 0))
    # each block's backward, top first (memory.py's moments): the saved tensors of the blocks below it, its own
    # (recomputed when checkpointed), the larger of its MLP's and attention's working sets with their gradients;
    # relative to the microbatch's whole `saved` (the root's and the kept output are gone by then)
    w_mlp = activations.mlp_backward_working_bytes_per_token(model, c)
    w_attn = activations.attention_backward_working_bytes_per_token(model, c, attn, s)
    freed = activations.attention_freed_before_backward_bytes_per_token(model, c, attention=attn, micro_batch=mb)
    mlp_grad = min(counts.block(), h * f) * c
    attn_grad = pipeline_techniques.attention_grad_bytes(  # MoE: every expert's, as memory.py counts them
        model, c, counts.block(), min(counts.block(), (3 if model.gated_mlp else 2) * h * f + model.q_dim * h) * c)
    input_extra = 0 if activations.input_saved_by_first_norm(model, c) else (  # selective-op: the input only
        pipeline_techniques.recompute_input_bytes_per_token(model, c, config, ckpt))
    # RMSNorm's fp32 backward chain: four h-sized fp32 gradients, and the upcast incoming one under a 16-bit compute
    # dtype (5 x 4 h per token in the trace's timelines)
    norm_chain, rms = 4 * h * (4 + (c < 4)), model.norm == "rmsnorm" and not model.parallel_block
    mlp_grads = min(counts.block(), (3 if model.gated_mlp else 2) * h * f) * c
    blocks = []
    for j in reversed(range(stage.n_blocks)):
        recomputed = bool(k) and (stage.first_block + j) % k == 0
        this = full + (input_extra if j or stage.embedding else 0) if recomputed else kept[j]
        base = tokens * (sum(kept[:j]) + this) + shared - saved
        at_attn = (base + tokens * (w_attn - freed), attn_grad)
        # MoE: the MoE MLP's own moments (moe.backward_moments) in place of fc2's
        at_mlp = pipeline_techniques.mlp_moment(model, c, tokens, s, counts.block(), recomputed, base,
                                                (base + tokens * w_mlp, mlp_grad))
        # RMSNorm's backward between the two (post_attention_layernorm): the MLP's saved tensors and the norm's output
        # gone, its own (fp32 upcast, normalised input) still there, beside its fp32 chain and the MLP's weight
        # gradients (5 x 4 h per token in the trace's timeline, llama-16 tp 2: larger than the MLP's and attention's
        # moments where TP splits f and the heads but not h)
        at_norm = (base + tokens * (norm_chain - (freed - 4 * h - c * h)), mlp_grads) if rms else (0, 0)
        # without a dtype change AccumulateGrad adds into the kept gradients in place, but autograd makes each weight's
        # gradient whole first: the MLP's moment is fc2's (h x f) beside the incoming gradient and fc2's input's (the
        # activation's factors' gradients come after); the attention's as in the other cases, without one
        in_place = max((base + tokens * c * (h + f), mlp_grad), (at_attn[0], 0), key=sum)
        # its post-backward: the block's whole compute-dtype gradient (converted or added one parameter at a time)
        # beside the saved tensors below and the gradient passed down
        post = tokens * (sum(kept[:j]) + h * c) + shared - saved
        blocks.append((max(at_mlp, at_attn, at_norm, key=sum), max(in_place, (at_norm[0], 0), key=sum), post))
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
    return _StagePieces(stage, params, head, saved, output, logits, loss_saved, loss_peak, tuple(blocks),
                        tokens * activations.logits_reserved_extra_bytes_per_token(model, c, config.loss_compiled)
                        if stage.head else 0, weight_inputs * stage.n_blocks + head_inputs, input_pass,
                        counts.block(), head_grad)


def _breakdown(**parts) -> MemoryBreakdown:
    return MemoryBreakdown(**{k: int(v) for k, v in parts.items()})


def rank_memory(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int, rank: int,
                profile) -> PipelineRankMemory:
    """Pipeline rank `rank`'s peak (d: the FSDP shard group, dp_shard x cp): torch's order replayed."""
    precision = config.precision
    c, p = DTYPE_BYTES[precision.compute_dtype], DTYPE_BYTES[precision.param_dtype]
    r = DTYPE_BYTES[config.gradient_reduce_dtype]
    m = config.pp_microbatches
    pieces = {st.index: _stage_pieces(model, training, config, st) for st in rank_stages(model, config, rank)}
    total_params = sum(x.params for x in pieces.values())
    opt_per_param = training.optimizer.state_bytes_per_param(precision.param_dtype)
    sharded_params = math.ceil(total_params * p / d)
    optimizer_state = math.ceil(total_params * opt_per_param / d)
    step_temporaries = math.ceil(total_params * p / d) if training.optimizer is not Optimizer.SGD else 0
    if precision is Precision.FP16:
        step_temporaries += 4 * 1024
    sp = config.tp if tensor_parallel.sequence_parallel(config) else 1
    tokens_h = config.micro_batch * training.seq_len * -(-model.hidden_size * c // sp)
    # receive buffers, one per microbatch, kept from the first step on
    buffers = sum(m * tokens_h * ((not x.stage.embedding) + (not x.stage.head)) for x in pieces.values())

    gathered: set[int] = set()
    backwards: dict[int, int] = {s: 0 for s in pieces}
    in_flight: dict[int, int] = {s: 0 for s in pieces}  # microbatches forwarded, not yet through their last pass
    waiting: dict[int, int] = {s: 0 for s in pieces}    # of which input pass done, weight pass not yet
    pending: dict[int, int] = {s: 0 for s in pieces}    # a weight pass's gradients in param.grad (compute dtype)
    reduced: set[int] = set()  # stages whose gradients are reduce-scattered (the step's end)
    most: dict[int, int] = {s: 0 for s in pieces}  # the most microbatches each stage holds at once
    logits_kept = 0
    best: list = [-1, None, None]  # total, (what, microbatch, stage), the breakdown's parts
    loss_moment = 0  # the loss backward's segments stay reserved once made (allocator.py), as in memory.py

    def moment(what: tuple, acts_extra: int, grads_extra: int, logits_extra: int, params_extra: int = 0,
               buffers_extra: int = 0, sharded_extra: int = 0) -> int:
        acts, loss, acc, gathered_c, sharded = buffers, logits_kept, 0, 0, sharded_extra
        for s, x in pieces.items():
            acts += x.saved * in_flight[s] + x.weight_inputs * waiting[s]
            if s + 1 in pieces:  # V-shape: this output is the next stage's input (set_local_fwd_input), no copy
                acts -= x.output * (in_flight[s] - (what[2] == s and what[0] != "input pass"))
            loss += x.loss_saved * (in_flight[s] - waiting[s]) + x.logits * waiting[s]
            if s in reduced:
                sharded += math.ceil(x.params * p / d)
            elif backwards[s]:
                acc += x.params * r
            acc += pending[s]
            if s in gathered:
                gathered_c += x.params * c
        parts = (sharded_params, optimizer_state, sharded, gathered_c + params_extra, acc + grads_extra,
                 acts + acts_extra, loss + logits_extra, buffers_extra)
        total = sum(parts)
        if total > best[0]:
            best[:] = [total, what, parts]
        return total

    def reduce(stage: int) -> None:
        """perform_reduce_grad after the stage's last backward: each FSDP unit (the stage root's params first, then
        the blocks) reshards, copies its accumulated gradients into the reduce-scatter input and gets its shard."""
        x = pieces[stage]
        convert(stage)
        root = x.params - x.stage.n_blocks * x.block_params
        done = 0
        for i, group in enumerate(([root] if root else []) + [x.block_params] * x.stage.n_blocks):
            rs_in, rs_out = (group * r, math.ceil(group * r / d)) if d > 1 else (0, 0)
            shards = math.ceil(done * p / d)
            # foreach_reduce copies a block unit's gradients into the reduce-scatter input and frees them before it
            # allocates the output (the previous unit's input dropped first); the stage root's, reduced first, are still
            # there then (the trace's timeline: llama3.2-1b's 1,051 MB embedding gradient beside its input and output)
            kept = group if root and i == 0 else 0
            for gone in (done, done + group - kept):
                moment(("reduce-scatter", None, stage), 0, -gone * r, 0, -(done + group) * c,
                       rs_in + (rs_out if gone > done or kept else 0), shards)
            done += group
        gathered.discard(stage)
        reduced.add(stage)

    def convert(stage: int) -> None:
        """The stage's next pass's post-backwards (or the reduce) add a W's gradients into the reduce-dtype sums."""
        if pending[stage]:
            pending[stage] = 0
            backwards[stage] = max(backwards[stage], 1)

    def input_pass(x: _StagePieces, mb: int) -> None:
        """A non-first stage's input pass: block by block (top first) its moment over everything held, each unit's
        post-backward converting the last weight pass's gradients once the unit is done."""
        had, fresh, unit = pending[x.stage.index], backwards[x.stage.index] == 0, x.block_params
        for j, acts in enumerate(x.input_pass):
            converted = -min(had, j * unit * c) + (j * unit * r if had and fresh else 0)
            moment(("input pass", mb, x.stage.index), acts, converted, x.logits if x.stage.head else 0)
        convert(x.stage.index)

    def block_moments(x: _StagePieces) -> dict:
        """The stage's block moments that can be largest, by case (first backward / later / later in place): for
        block j (j blocks above done) its backward and its post-backward (the block's whole compute-dtype
        gradient); the base state is the same for every block of one backward, so the largest sum decides."""
        out = {}
        for case in ("first", "later", "in place"):
            options = []
            for j, (largest, in_place, post) in enumerate(x.blocks):
                acts, grads = in_place if case == "in place" else largest
                done = j * x.block_params * r + x.head_grad if case == "first" else (
                    0 if case == "in place" else x.head_grad)
                held = grads
                whole = 0 if case == "in place" else x.block_params * c
                options += [("backward", acts, done + held), ("post-backward of a block", post, done + whole)]
            out[case] = [max((o for o in options if o[0] == kind), key=lambda o: o[1] + o[2])
                         for kind in ("backward", "post-backward of a block") if options]
        return out

    cases = {s: block_moments(x) for s, x in pieces.items()}
    actions = orders(config.pp_schedule, config.pp, config.pp_stages_per_rank, m)[rank]
    kept_ahead = active_stages(actions) if len(pieces) > 1 else []
    for i, action in enumerate(actions):
        stage, mb = action.stage, action.microbatch
        x = pieces[stage]
        if len(pieces) > 1:  # a multi-stage schedule's runtime keeps the next stages gathered, and only those
            gathered.clear()
            gathered.update(kept_ahead[i])
        if action.kind == "F":
            gathered.add(stage)
            in_flight[stage] += 1
            most[stage] = max(most[stage], in_flight[stage])
            logits_kept += x.logits
            continue
        if action.kind == "I" and x.stage.embedding:  # torch skips the first stage's input pass: its W is a B
            waiting[stage] += 1
            continue
        if action.kind == "W" and not x.stage.embedding:
            # stage_backward_weight: the microbatch's graph and kept output gradients go, the stage's weight gradients
            # stay in param.grad (compute dtype; a second W adds into them) until its next pass's post-backward (no
            # FSDP hook runs in W)
            in_flight[stage] -= 1
            waiting[stage] -= 1
            pending[stage] = x.params * c
            if mb == m - 1:
                reduce(stage)
            continue
        if action.kind == "I":
            if x.stage.head:  # the loss backward; its saved log-softmax output stays until the pass ends (detach_)
                loss_moment = max(loss_moment, moment(("loss backward", mb, stage), 0, 0, x.loss_peak)
                                  + x.reserved_extra)
            input_pass(x, mb)
            waiting[stage] += 1
            continue
        convert(stage)
        loss_gone = -x.loss_saved if x.stage.head else 0
        if x.stage.head:
            loss_moment = max(loss_moment, moment(("loss backward", mb, stage), 0, 0, x.loss_peak) + x.reserved_extra)
            # the head's backward: the logits' gradient beside the head's new (compute-dtype) weight gradient
            moment(("head backward", mb, stage), 0, x.head_grad, x.logits - x.loss_saved)
        # without a dtype change (no mixed precision) autograd adds a later microbatch's gradients into the kept
        # ones in place; with one, the compute-dtype gradients wait beside the reduce-dtype sums until the unit's
        # post-backward
        first = backwards[stage] == 0
        for kind, acts, grads in cases[stage]["first" if first else "in place" if r == c else "later"]:
            moment((kind, mb, stage), acts, grads, loss_gone)
        root = x.params - x.stage.n_blocks * x.block_params
        if root:  # the stage root's post-backward, the microbatch's saved tensors gone (its input's gradient left)
            # first microbatch with mixed precision: the root's compute-dtype gradients and their reduce-dtype copy
            # (to_accumulated_grad_if_needed) beside the blocks' converted ones; later ones: the root's new
            # compute-dtype gradients (waiting, or made whole before the in-place add)
            grads = (x.params - root) * r + root * (c + r) if first and r != c else (0 if first else root * c)
            moment(("root post-backward", mb, stage), tokens_h - x.saved, grads,
                   -x.loss_saved - x.logits if x.stage.head else 0)
        if action.kind == "W":  # the first stage's weight pass: its whole backward
            waiting[stage] -= 1
        in_flight[stage] -= 1
        backwards[stage] += 1
        if mb == m - 1:
            reduce(stage)
    if logits_kept:  # the last stage's step returns its microbatches' logits concatenated (a copy beside them)
        moment(("merge of the logits", None, None), 0, 0, logits_kept)
    what, mb, stage = best[1]
    names = ("sharded_params", "optimizer_state", "sharded_grads", "unsharded_params", "unsharded_grads",
             "activations", "logits_and_loss", "collective_buffers")
    best = (best[0], what + (f" of microbatch {mb} on stage {stage}" if mb is not None else
                             f" of stage {stage}" if stage is not None else ""), _breakdown(**dict(zip(names, best[2]))))
    backward = breakdown = best[2]
    step = _breakdown(sharded_params=sharded_params, optimizer_state=optimizer_state,
                      sharded_grads=math.ceil(total_params * p / d), optimizer_temporaries=step_temporaries)
    peak_moment = best[1]
    if step.total_bytes > breakdown.total_bytes:
        breakdown, peak_moment = step, "optimizer step"
    description = "; ".join(f"stage {s}: {x.stage.describe()}, up to {most[s]} microbatch{'es' if most[s] > 1 else ''} "
                            "in flight" for s, x in pieces.items())
    return PipelineRankMemory(rank=rank, stages=tuple(pieces), description=description,
                              peak_allocated_bytes=breakdown.total_bytes,
                              peak_reserved_bytes=profile.reserved_bytes(max(breakdown.total_bytes, loss_moment)),
                              breakdown=breakdown, peak_moment=peak_moment,
                              phases={"backward": backward, "optimizer_step": step})


def pipeline_ranks(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int,
                   profile) -> tuple[PipelineRankMemory, ...]:
    """Every pipeline rank's memory (empty without PP)."""
    if config.pp == 1:
        return ()
    return tuple(rank_memory(model, training, config, d, r, profile) for r in range(config.pp))


def pipeline_estimate(model: ModelSpec, cluster, training: TrainingSpec, config: FsdpConfig, profile):
    """estimate_memory under pp > 1: the largest rank's figures as the headline (torchtitan reports the maximum
    across ranks), every rank in pipeline_ranks."""
    model = tensor_parallel.local_model(model, config)  # a TP rank's slice
    if config.cp > 1:
        training = dataclasses.replace(training, seq_len=training.seq_len // config.cp)
    ranks = pipeline_ranks(model, training, config, config.shard_group_size(cluster), profile)
    top = max(ranks, key=lambda x: x.peak_allocated_bytes)
    phase = "optimizer_step" if top.peak_moment == "optimizer step" else "backward"
    notes = tuple(activations.quirks(model, config.attention, training.seq_len)) + (
        f"pipeline rank {top.rank} ({top.description}) has the largest peak, at its {top.peak_moment}",) + (
        (f"{config.pp_schedule.value}: the split backward priced as torch runs it (the input pass keeps the graph and "
         "the output gradients of the linears and norms until the weight pass; checked on pp 2 without checkpointing"
         + ("; W's recomputes of each checkpointed block, one per parameter group, are not: up to 1.9x in the trace"
            if config.ac_every else "") + ", docs/accuracy.md)",) if config.pp_schedule.value in SPLIT_BACKWARD else ()) + (
        tuple(f"pp > 1 does not price {what} yet: priced as without it" for what, on in (
            ("CPU offload", config.offload), ("LoRA", training.finetune.value == "lora"),
            ("the FP8 all-gather", config.fp8_all_gather),) if on)
        + pipeline_techniques.moe_notes(model, config, config.shard_group_size(cluster))
        + (("TP with sequence parallel / CP inside a stage: a TP rank's slice of the model on s / cp tokens, the "
            "residual stream on s / tp (the rule traced at pp = 1); not traced under PP (TP without sequence parallel "
            "is: docs/accuracy.md)",)
           if config.cp > 1 or config.tp > 1 and config.sequence_parallel else ()))
    return MemoryEstimate(breakdown=top.breakdown, peak_phase=phase, phases=dict(top.phases),
                          peak_allocated_bytes=top.peak_allocated_bytes, peak_reserved_bytes=top.peak_reserved_bytes,
                          cpu_bytes_per_node=0, cpu_ram_capacity_bytes=cluster.cpu_ram_bytes_per_node, notes=notes,
                          peak_moment=f"{top.peak_moment} (pipeline rank {top.rank})", pipeline_ranks=ranks)
