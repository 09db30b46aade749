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

from . import activation_notes, activations, optimizer_step, pipeline_techniques, tensor_parallel
from .memory_types import MemoryBreakdown, MemoryEstimate
from .outside_allocator import outside_allocator_terms
from .pipeline import rank_stages
from .pipeline_orders import active_stages, orders
from .pipeline_stage_pieces import StagePieces, shaped_stage_pieces
from .specs import FsdpConfig, ModelSpec, TrainingSpec
from .units import DTYPE_BYTES




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


def _breakdown(**parts) -> MemoryBreakdown:
    return MemoryBreakdown(**{k: int(v) for k, v in parts.items()})


def rank_memory(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int, rank: int,
                profile, outside_bytes: int, shapes: dict | None = None) -> PipelineRankMemory:
    """Pipeline rank `rank`'s peak (d: the FSDP shard group, dp_shard x cp): torch's order replayed; its reserved
    adds `outside_bytes` (outside_allocator.py: the busiest rank's, every rank priced with it); shapes: the stage
    pieces priced so far for this configuration (shaped_stage_pieces)."""
    precision = config.precision
    c, p = DTYPE_BYTES[precision.compute_dtype], DTYPE_BYTES[precision.param_dtype]
    r = DTYPE_BYTES[config.gradient_reduce_dtype]
    m = config.pp_microbatches
    shapes = {} if shapes is None else shapes
    pieces = {st.index: shaped_stage_pieces(model, training, config, st, shapes)
              for st in rank_stages(model, config, rank)}
    total_params = sum(x.params for x in pieces.values())
    opt_per_param = training.optimizer.state_bytes_per_param(precision.param_dtype)
    sharded_params = math.ceil(total_params * p / d)
    optimizer_state = math.ceil(total_params * opt_per_param / d)
    step_temporaries = optimizer_step.step_temporary_bytes(
        model, training, precision, d, total_params, embedding=any(x.stage.embedding for x in pieces.values()),
        head=any(x.stage.head for x in pieces.values()))
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
    # Schedule1F1B keeps the last backward's send ops (bwd_sends, holding the input gradient) in a local until the
    # next backward is done: from a non-first stage's first backward to the step's end one input gradient is alive
    sent = 0
    fixed = sharded_params + optimizer_state
    # what the state holds, by category, kept up to date by each change below rather than summed again at each moment
    # (a rank's replay prices ~400 moments): activations, logits and loss, the reduced stages' gradient shards,
    # gradients (unsharded or waiting), gathered parameters; integers, so the same bytes as the sums at each moment
    held = [buffers, 0, 0, 0, 0]
    # V-shape: a stage's output is the next stage's input (set_local_fwd_input), no copy
    chained = {s: x.output for s, x in pieces.items() if s + 1 in pieces}

    def fly(stage: int, n: int) -> None:
        """n microbatches more (or fewer) in flight on the stage."""
        x = pieces[stage]
        in_flight[stage] += n
        held[0] += n * (x.saved - chained.get(stage, 0))
        held[1] += n * x.loss_saved

    def wait(stage: int, n: int) -> None:
        """n microbatches more (or fewer) between their input pass and their weight pass."""
        x = pieces[stage]
        waiting[stage] += n
        held[0] += n * x.weight_inputs
        held[1] += n * (x.logits - x.loss_saved)

    def set_pending(stage: int, grads: int) -> None:
        held[3] += grads - pending[stage]
        pending[stage] = grads

    def backward_done(stage: int) -> None:
        """From its first backward on, a stage (until reduced) holds its reduce-dtype gradient sums."""
        if not backwards[stage] and stage not in reduced:
            held[3] += pieces[stage].params * r
        backwards[stage] += 1

    def gather(stages) -> None:
        for s in stages:
            if s not in gathered:
                gathered.add(s)
                held[4] += pieces[s].gathered

    def reshard(stage: int) -> None:
        if stage in gathered:
            gathered.discard(stage)
            held[4] -= pieces[stage].gathered

    def moment(what: tuple, acts_extra: int, grads_extra: int, logits_extra: int, params_extra: int = 0,
               buffers_extra: int = 0, sharded_extra: int = 0) -> int:
        acts, loss, sharded, acc, gathered_c = held
        if what[0] != "input pass":  # the running stage's own output is not yet the next stage's input
            acts += chained.get(what[2], 0)
        total = (fixed + sharded + sharded_extra + gathered_c + params_extra + acc + grads_extra + acts + acts_extra
                 + loss + logits_extra + buffers_extra)
        if total > best[0]:
            best[:] = [total, what, (sharded_params, optimizer_state, sharded + sharded_extra,
                                     gathered_c + params_extra, acc + grads_extra, acts + acts_extra,
                                     loss + logits_extra, buffers_extra)]
        return total

    def reduce(stage: int) -> None:
        """perform_reduce_grad after the stage's last backward: each FSDP unit (the stage root's params first, then
        the blocks) reshards, copies its accumulated gradients into the reduce-scatter input and gets its shard."""
        x = pieces[stage]
        convert(stage)
        root = x.params - x.stage.n_blocks * x.block_params
        done = done_c = 0  # parameters reduced so far, and their gathered bytes (resharded)
        for i, group in enumerate(([root] if root else []) + [x.block_params] * x.stage.n_blocks):
            done_c += x.root_gathered if root and i == 0 else x.block_gathered
            rs_in, rs_out = (group * r, math.ceil(group * r / d)) if d > 1 else (0, 0)
            shards = math.ceil(done * p / d)
            # foreach_reduce copies a block unit's gradients into the reduce-scatter input and frees them before it
            # allocates the output (the previous unit's input dropped first); the stage root's, reduced first, are still
            # there then (the trace's timeline: llama3.2-1b's 1,051 MB embedding gradient beside its input and output)
            kept = group if root and i == 0 else 0
            for gone in (done, done + group - kept):
                moment(("reduce-scatter", None, stage), 0, -gone * r, 0, -done_c,
                       rs_in + (rs_out if gone > done or kept else 0), shards)
            done += group
        reshard(stage)
        if backwards[stage]:
            held[3] -= x.params * r
        reduced.add(stage)
        held[2] += math.ceil(x.params * p / d)

    def convert(stage: int) -> None:
        """The stage's next pass's post-backwards (or the reduce) add a W's gradients into the reduce-dtype sums."""
        if pending[stage]:
            set_pending(stage, 0)
            if not backwards[stage]:
                backward_done(stage)

    def input_pass(x: StagePieces, mb: int) -> None:
        """A non-first stage's input pass: block by block (top first) its moment over everything held, each unit's
        post-backward converting the last weight pass's gradients once the unit is done."""
        had, fresh, unit = pending[x.stage.index], backwards[x.stage.index] == 0, x.block_params
        for j, acts in enumerate(x.input_pass):
            converted = -min(had, j * unit * c) + (j * unit * r if had and fresh else 0)
            moment(("input pass", mb, x.stage.index), acts, converted, x.logits if x.stage.head else 0)
        convert(x.stage.index)

    def block_moments(x: StagePieces) -> dict:
        """The stage's block moments that can be largest, by case (first backward / later / later in place): for
        block j (j blocks above done) its backward and its post-backward (the block's whole compute-dtype
        gradient); the base state is the same for every block of one backward, so the largest sum decides."""
        out = {}
        for case in ("first", "in place" if r == c else "later"):  # the later backwards' case by the dtypes
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

    def backward_moments(x: StagePieces, mb: int, first: bool) -> None:
        """A stage's backward (B, or the first stage's W): the loss's and the head's on the last stage, its blocks',
        its root's post-backward."""
        nonlocal loss_moment
        stage = x.stage.index
        loss_gone = -x.loss_saved if x.stage.head else 0
        if x.stage.head:
            loss_moment = max(loss_moment, moment(("loss backward", mb, stage), 0, 0, x.loss_peak) + x.reserved_extra)
            # the head's backward: the logits' gradient beside the head's new (compute-dtype) weight gradient
            moment(("head backward", mb, stage), 0, x.head_grad, x.logits - x.loss_saved)
        # without a dtype change (no mixed precision) autograd adds a later microbatch's gradients into the kept
        # ones in place; with one, the compute-dtype gradients wait beside the reduce-dtype sums until the unit's
        # post-backward
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

    priced: set = set()  # (pass, stage, its own state) + held, of the passes priced

    def repeats(*key) -> bool:
        """Whether a pass of this kind already ran on this very state: its moments would total the same again, and a
        moment becomes the peak only above every earlier one (1F1B's steady state repeats its passes)."""
        key = (*key, *held)
        if key in priced:
            return True
        priced.add(key)
        return False

    cases = {s: block_moments(x) for s, x in pieces.items()}
    actions = orders(config.pp_schedule, config.pp, config.pp_stages_per_rank, m)[rank]
    kept_ahead = active_stages(config.pp_schedule, config.pp, config.pp_stages_per_rank, m, rank) \
        if len(pieces) > 1 else ()
    sends = config.pp_schedule.value == "1f1b"
    # what an F adds (fly(stage, 1) and the logits it keeps), inlined in the hot path below (~4 actions per
    # microbatch and stage on every rank)
    flown = {s: (x.saved - chained.get(s, 0), x.loss_saved + x.logits) for s, x in pieces.items()}
    for i, (stage, kind, mb) in enumerate(actions):
        x = pieces[stage]
        # a multi-stage schedule's runtime keeps the next stages gathered, and only those
        if kept_ahead and gathered != kept_ahead[i]:
            for s in gathered - kept_ahead[i]:
                reshard(s)
            gather(kept_ahead[i])
        if kind == "F":  # gather((stage,)), fly(stage, 1), the logits kept
            if stage not in gathered:
                gather((stage,))
            in_flight[stage] += 1
            acts, kept = flown[stage]
            held[0] += acts
            held[1] += kept
            if in_flight[stage] > most[stage]:
                most[stage] = in_flight[stage]
            logits_kept += x.logits
            continue
        if kind == "I" and x.stage.embedding:  # torch skips the first stage's input pass: its W is a B
            wait(stage, 1)
            continue
        if kind == "W" and not x.stage.embedding:
            # stage_backward_weight: the microbatch's graph and kept output gradients go, the stage's weight gradients
            # stay in param.grad (compute dtype; a second W adds into them) until its next pass's post-backward (no
            # FSDP hook runs in W)
            fly(stage, -1)
            wait(stage, -1)
            set_pending(stage, x.params * c)
            if mb == m - 1:
                reduce(stage)
            continue
        if kind == "I":
            if repeats("I", stage, pending[stage], backwards[stage] == 0):
                convert(stage)
            else:
                if x.stage.head:  # the loss backward; its saved log-softmax output stays until the pass ends (detach_)
                    loss_moment = max(loss_moment, moment(("loss backward", mb, stage), 0, 0, x.loss_peak)
                                      + x.reserved_extra)
                input_pass(x, mb)
            wait(stage, 1)
            continue
        if pending[stage]:
            convert(stage)
        first = backwards[stage] == 0
        if not repeats(kind, stage, first):
            backward_moments(x, mb, first)
        if kind == "W":  # the first stage's weight pass: its whole backward
            wait(stage, -1)
        in_flight[stage] -= 1  # fly(stage, -1)
        held[0] -= flown[stage][0]
        held[1] -= x.loss_saved
        backward_done(stage)
        if mb == m - 1:
            reduce(stage)
        if sends and not x.stage.embedding:
            held[0] += tokens_h - sent
            sent = tokens_h
    held[0] -= sent  # waited and dropped when the schedule returns
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
                              peak_reserved_bytes=profile.reserved_bytes(max(breakdown.total_bytes, loss_moment),
                                                                         outside_bytes),
                              breakdown=breakdown, peak_moment=peak_moment,
                              phases={"backward": backward, "optimizer_step": step})


def pipeline_ranks(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int,
                   profile, outside_bytes: int) -> tuple[PipelineRankMemory, ...]:
    """Every pipeline rank's memory (empty without PP)."""
    if config.pp == 1:
        return ()
    shapes: dict = {}  # the ranks' stages share their pieces by shape
    return tuple(rank_memory(model, training, config, d, r, profile, outside_bytes, shapes) for r in range(config.pp))


def rank_inputs(model: ModelSpec, training: TrainingSpec, config: FsdpConfig) -> tuple[ModelSpec, TrainingSpec]:
    """What one pipeline rank runs: a TP rank's slice of the model on s / cp tokens."""
    if config.cp > 1:
        training = dataclasses.replace(training, seq_len=training.seq_len // config.cp)
    return tensor_parallel.local_model(model, config), training


def pipeline_outside_terms(model: ModelSpec, cluster, training: TrainingSpec, config: FsdpConfig, profile) -> tuple:
    """The memory outside the allocator of a pipeline configuration (outside_allocator.py; async TP's workspace on
    a CP rank's s / cp tokens)."""
    if config.cp > 1:
        training = dataclasses.replace(training, seq_len=training.seq_len // config.cp)
    return outside_allocator_terms(cluster, config, profile, model, training)


def with_outside_terms(memory: MemoryEstimate, terms: tuple) -> MemoryEstimate:
    """`memory` with these outside-the-allocator terms in place of its own: every reserved figure shifted by the
    difference (the search's memo reuses a pipeline's rank replays across Float8 and async TP, which change only
    these terms)."""
    delta = sum(t.bytes for t in terms) - memory.outside_allocator_bytes
    ranks = tuple(dataclasses.replace(r, peak_reserved_bytes=r.peak_reserved_bytes + delta)
                  for r in memory.pipeline_ranks)
    return dataclasses.replace(memory, peak_reserved_bytes=memory.peak_reserved_bytes + delta, pipeline_ranks=ranks,
                               outside_allocator=tuple(terms))


def pipeline_estimate(model: ModelSpec, cluster, training: TrainingSpec, config: FsdpConfig, profile):
    """estimate_memory under pp > 1: the largest rank's figures as the headline (torchtitan reports the maximum
    across ranks), every rank in pipeline_ranks."""
    outside = pipeline_outside_terms(model, cluster, training, config, profile)
    model, training = rank_inputs(model, training, config)
    ranks = pipeline_ranks(model, training, config, config.shard_group_size(cluster), profile,
                           sum(t.bytes for t in outside))
    top = max(ranks, key=lambda x: x.peak_allocated_bytes)
    phase = "optimizer_step" if top.peak_moment == "optimizer step" else "backward"
    notes = tuple(activation_notes.quirks(model, config.attention, training.seq_len)) + (
        f"pipeline rank {top.rank} ({top.description}) has the largest peak, at its {top.peak_moment}",) + (
        (f"{config.pp_schedule.value}: the split backward priced as torch runs it (the input pass keeps the graph and "
         "the output gradients of the linears and norms until the weight pass; checked on pp 2 without checkpointing"
         + ("; W's recomputes of each checkpointed block, one per parameter group, are not: up to 1.9x in the trace"
            if config.ac_every else "") + ", docs/accuracy.md)",) if config.pp_schedule.split_backward else ()) + (
        tuple(f"pp > 1 does not price {what} yet: priced as without it" for what, on in (
            ("CPU offload", config.offload), ("LoRA", training.finetune.value == "lora")) if on)
        + pipeline_techniques.moe_notes(model, config, config.shard_group_size(cluster))
        + (("TP with sequence parallel / CP inside a stage: a TP rank's slice of the model on s / cp tokens, the "
            "residual stream on s / tp (the rule traced at pp = 1); not traced under PP (TP without sequence parallel "
            "is: docs/accuracy.md)",)
           if config.cp > 1 or config.tp > 1 and config.sequence_parallel else ()))
    return MemoryEstimate(breakdown=top.breakdown, peak_phase=phase, phases=dict(top.phases),
                          peak_allocated_bytes=top.peak_allocated_bytes, peak_reserved_bytes=top.peak_reserved_bytes,
                          cpu_bytes_per_node=0, cpu_ram_capacity_bytes=cluster.cpu_ram_bytes_per_node, notes=notes,
                          peak_moment=f"{top.peak_moment} (pipeline rank {top.rank})", pipeline_ranks=ranks,
                          outside_allocator=outside)
