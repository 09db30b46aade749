"""GPU memory of each pipeline rank: its stages' model states and the microbatches its schedule holds in flight,
torch's order of actions replayed (cost_models/pipeline_memory.py turns the ranks into the estimate).

What torch.distributed.pipelining and FSDP2 do in one schedule step (torch 2.13 schedules.py / stage.py,
torchtitan 0.3's FSDP policy under PP; checked against the trace tier, calibration/trace_pipeline.py,
docs/accuracy.md):
- model states: each stage's parameters (its blocks; the embedding on the first stage, the final norm and head on
  the last) sharded over dp_shard x cp with their optimizer state, each tensor padded to d x ceil(rows / d) rows in
  the shards, states, all-gathers and reduce-scatters (dim0_padding.py); gradients set to None between steps; under TP
  with sequence parallel the embedding's gradient is the whole table (tensor_parallel.embedding_grad_extra_params);
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
single-microbatch ledger's (cost_models/activations.py), as cost_models/memory.py uses them. The order is replayed
once per schedule shape over counts of these pieces (cost_models/pipeline_rank_replay.py); each configuration weighs
the moments with its own bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import optimizer_step, tensor_parallel
from .memory_types import MemoryBreakdown
from .pipeline import rank_stages
from .pipeline_rank_replay import replay, stage_layout, stage_values
from .pipeline_stage_pieces import shape_key, shaped_stage_pieces
from .quick_init import quick_init
from .specs import FsdpConfig, ModelSpec, TrainingSpec
from .units import DTYPE_BYTES


@quick_init
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
    stages_of = rank_stages(model, config, rank)
    pieces = {st.index: shaped_stage_pieces(model, training, config, st, shapes, d) for st in stages_of}
    total_params = sum(x.padded_params for x in pieces.values())  # the shards: dim-0 padded (dim0_padding.py)
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

    # the moments of torch's order on this rank, replayed once per schedule shape (pipeline_rank_replay.py), weighed
    # by this configuration's bytes: the first largest is the peak
    order = replay(config.pp_schedule, config.pp, config.pp_stages_per_rank, m, rank,
                   tuple(stage_layout(x) for x in pieces.values()), r == c, d > 1)
    values = [np.array([sharded_params, optimizer_state, buffers, tokens_h], dtype=np.int64)]
    for st in stages_of:
        key = ("values", shape_key(config, st))
        if key not in shapes:
            shapes[key] = np.array(stage_values(pieces[st.index], c, p, r, d), dtype=np.int64)
        values.append(shapes[key])
    values = np.concatenate(values)
    totals = np.einsum("ij,j->i", order.totals, values)  # order.totals @ values: numpy's int64 matmul is ~3x slower
    logits_kept = sum(n * pieces[s].logits for s, n in order.forwards.items())
    if not logits_kept:  # no merge of the logits off the last stage
        totals = totals[:-1]
    at = int(np.argmax(totals))
    what, mb, stage = order.whats[at]
    parts = order.parts(at, values)
    loss_moment = 0  # the loss backward's segments stay reserved once made (allocator.py), as in memory.py
    if order.loss_rows:
        head = next(x for x in pieces.values() if x.stage.head)
        loss_moment = max(0, int(totals[list(order.loss_rows)].max()) + head.reserved_extra)
    most = order.most
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
