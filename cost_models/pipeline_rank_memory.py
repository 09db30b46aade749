"""GPU memory of each pipeline rank: its stages' model states and the microbatches its schedule holds in flight,
torch's order of actions replayed (cost_models/pipeline_memory.py turns the ranks into the estimate).

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

import math
from dataclasses import dataclass, field

from . import optimizer_step, tensor_parallel
from .memory_types import MemoryBreakdown
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


# the categories of a moment's parts, in moment()'s order
_MOMENT_PARTS = ("sharded_params", "optimizer_state", "sharded_grads", "unsharded_params", "unsharded_grads",
                 "activations", "logits_and_loss", "collective_buffers")


def _breakdown(**parts) -> MemoryBreakdown:
    return MemoryBreakdown(**{k: int(v) for k, v in parts.items()})


def rank_memory(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int, rank: int,
                profile, outside_bytes: int, shapes: dict | None = None) -> PipelineRankMemory:
    """Pipeline rank `rank`'s peak (d: the FSDP shard group, dp_shard x cp): torch's order replayed; its reserved
    adds `outside_bytes` (outside_allocator.py: the busiest rank's, every rank priced with it); shapes: the stage
    pieces priced so far for this configuration (shaped_stage_pieces)."""
    precision = config.precision
    c = DTYPE_BYTES[precision.compute_dtype]
    p = DTYPE_BYTES[precision.param_dtype]
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
        model, training, precision, d, total_params,
        embedding=any(x.stage.embedding for x in pieces.values()),
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
    best: list = [-1, None, None]  # the largest moment so far: total, (what, microbatch, stage), the breakdown's parts
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
            parts = (sharded_params, optimizer_state, sharded + sharded_extra, gathered_c + params_extra,
                     acc + grads_extra, acts + acts_extra, loss + logits_extra, buffers_extra)
            best[:] = [total, what, parts]
        return total

    def reduce(stage: int) -> None:
        """perform_reduce_grad after the stage's last backward: each FSDP unit (the stage root's params first, then
        the blocks) reshards, copies its accumulated gradients into the reduce-scatter input and gets its shard."""
        x = pieces[stage]
        convert(stage)
        root = x.params - x.stage.n_blocks * x.block_params
        done = 0    # parameters reduced so far
        done_c = 0  # their gathered bytes (resharded)
        groups = ([root] if root else []) + [x.block_params] * x.stage.n_blocks
        for i, group in enumerate(groups):
            done_c += x.root_gathered if root and i == 0 else x.block_gathered
            rs_in = rs_out = 0  # the reduce-scatter's input and output (none on one rank)
            if d > 1:
                rs_in = group * r
                rs_out = math.ceil(group * r / d)
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
        had = pending[x.stage.index]
        fresh = backwards[x.stage.index] == 0
        unit = x.block_params
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
                if case == "first":
                    done = j * x.block_params * r + x.head_grad
                elif case == "in place":
                    done = 0
                else:
                    done = x.head_grad
                whole = 0 if case == "in place" else x.block_params * c
                options += [("backward", acts, done + grads), ("post-backward of a block", post, done + whole)]
            out[case] = [max((o for o in options if o[0] == kind), key=lambda o: o[1] + o[2])
                         for kind in ("backward", "post-backward of a block") if options]
        return out

    def loss_backward(x: StagePieces, mb: int) -> None:
        """The last stage's loss backward: its moment, and with what the allocator strands above it, the least
        it leaves reserved."""
        nonlocal loss_moment
        total = moment(("loss backward", mb, x.stage.index), 0, 0, x.loss_peak)
        loss_moment = max(loss_moment, total + x.reserved_extra)

    def backward_moments(x: StagePieces, mb: int, first: bool) -> None:
        """A stage's backward (B, or the first stage's W): the loss's and the head's on the last stage, its blocks',
        its root's post-backward."""
        stage = x.stage.index
        loss_gone = -x.loss_saved if x.stage.head else 0
        if x.stage.head:
            loss_backward(x, mb)
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
            if first and r != c:
                grads = (x.params - root) * r + root * (c + r)
            elif first:
                grads = 0
            else:
                grads = root * c
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
    kept_ahead = ()
    if len(pieces) > 1:
        kept_ahead = active_stages(config.pp_schedule, config.pp, config.pp_stages_per_rank, m, rank)
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
                if x.stage.head:  # its saved log-softmax output stays until the pass ends (detach_)
                    loss_backward(x, mb)
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
    _, (what, mb, stage), parts = best
    if mb is not None:
        what += f" of microbatch {mb} on stage {stage}"
    elif stage is not None:
        what += f" of stage {stage}"
    backward = _breakdown(**dict(zip(_MOMENT_PARTS, parts)))
    step = _breakdown(sharded_params=sharded_params, optimizer_state=optimizer_state,
                      sharded_grads=math.ceil(total_params * p / d), optimizer_temporaries=step_temporaries)
    breakdown, peak_moment = backward, what
    if step.total_bytes > backward.total_bytes:
        breakdown, peak_moment = step, "optimizer step"
    stages = []
    for s, x in pieces.items():
        plural = "es" if most[s] > 1 else ""
        stages.append(f"stage {s}: {x.stage.describe()}, up to {most[s]} microbatch{plural} in flight")
    reserved = profile.reserved_bytes(max(breakdown.total_bytes, loss_moment), outside_bytes)
    return PipelineRankMemory(rank=rank, stages=tuple(pieces), description="; ".join(stages),
                              peak_allocated_bytes=breakdown.total_bytes, peak_reserved_bytes=reserved,
                              breakdown=breakdown, peak_moment=peak_moment,
                              phases={"backward": backward, "optimizer_step": step})


def pipeline_ranks(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int,
                   profile, outside_bytes: int) -> tuple[PipelineRankMemory, ...]:
    """Every pipeline rank's memory (empty without PP)."""
    if config.pp == 1:
        return ()
    shapes: dict = {}  # the ranks' stages share their pieces by shape
    return tuple(rank_memory(model, training, config, d, r, profile, outside_bytes, shapes) for r in range(config.pp))
