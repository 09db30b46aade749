"""Pipeline-parallel step time: one schedule step of m microbatches over pp ranks holding V stages each.

The step is the critical path of the schedule's own order (cost_models/pipeline_orders.py, torch's), walked by
an event simulation: each rank runs its actions in order; a stage's forward waits for the previous stage's
forward of that microbatch, its backward for the next stage's input gradient (the last stage's for its own
forward, the loss being computed there), a W (zero-bubble's weight gradient) for its I; an edge between ranks
adds the stage-to-stage transfer. torch posts sends and receives asynchronously on NCCL's stream: the multi-stage
runtime (interleaved, zero bubble, DualPipeV) posts a receive ahead of the pass that needs it, so a transfer costs
the step only where its receiver waits for it (warm-up and cool-down, once per boundary); GPipe and 1F1B post it
after the rank's previous pass (batched with that pass's send), so each cross-rank pass waits for one transfer
after its predecessor on the rank ends - every microbatch pays it there. With equal
stages this gives the textbook bubble, (p - 1) / (m + p - 1) of the step for GPipe and 1F1B and (p - 1) /
(V m + p - 1) for interleaved 1F1B (Narayanan et al. 2021 and SC21; shared/reference/parallelism.md); unequal
stages (the first holds the embedding, the last the final norm, head and loss) set their own pace.

Per stage and microbatch the forward and backward are the blocks' own (step_time's per-block prices: TP, CP and
EP inside, recompute in backward) plus the root's pieces on the end stages. Zero-bubble and DualPipeV split a
backward into I (input gradients: the attention and memory-bound backward, the recompute, the input-gradient
products) and W (the weight-gradient products: half of each trained matmul's backward, assumed to run at the
fused backward's rate; torch runs W as a second autograd call).

FSDP inside a stage (torchtitan: reshard_after_forward=False under PP; torch's PipelineStage turns gradient sync
and resharding off until the REDUCE_GRAD after a stage's last backward): each stage all-gathers once per step and
reduce-scatters once. The all-gathers of a rank other than the first run while it waits for its first input
(NCCL waits hold the stream, not the CPU, so FSDP issues them at once); the first rank exposes its first unit's
and whatever each block's gather outlasts the previous block's forward of one microbatch. The reduce-scatters
(with HSDP's all-reduce) run on their own stream after each stage's last backward: what outlasts a rank's
remaining work ends the step later. Ignored: NCCL's per-peer ordering beyond that (a send waits for its receiver's
post: in 1F1B's steady state the batched send + receive pairs of two neighbours meet at the same moment, which the
rule above already prices), stragglers, the optimizer's cross-rank gradient-norm all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from . import comm
from .pipeline import stage_rank, stages
from .pipeline_orders import orders
from .quick_init import quick_init
from .profile import Profile
from .schedules import Schedule
from .specs import ClusterSpec, FsdpConfig, ModelSpec


@quick_init
@dataclass(frozen=True)
class StagePass:
    """One stage's seconds for one microbatch, and its FSDP collectives once per step."""

    forward_s: float
    backward_s: float          # input and weight gradients, recompute included
    weight_s: float            # of backward_s: the weight-gradient products (zero-bubble's W)
    gather_s: float = 0.0      # FSDP all-gathers of the stage's units, back to back
    first_gather_exposed_s: float = 0.0  # of them, exposed when the stage starts the step (the first rank)
    reduce_s: float = 0.0      # reduce-scatters (and HSDP all-reduce) after its last backward


class Pass(NamedTuple):
    """One action as the walk ran it (cost_models/pipeline_timeline.py draws them)."""

    rank: int
    stage: int
    kind: str          # F, B, I, W
    microbatch: int
    start_s: float
    end_s: float


class Send(NamedTuple):
    """A stage-to-stage transfer between ranks that a pass waited for: activations forward (kind F), input
    gradients backward (B, I)."""

    src_stage: int
    dst_stage: int
    kind: str          # the receiving pass's
    microbatch: int
    start_s: float     # posted: the sender's pass ended (GPipe / 1F1B: and the receiver's previous pass)
    end_s: float       # arrived, p2p_s later


@dataclass(frozen=True)
class Walk:
    step_s: float                       # the schedule's makespan
    rank_busy_s: tuple[float, ...]      # each rank's compute time in the step
    rank_first_start_s: tuple[float, ...]
    stage_last_backward_s: tuple[float, ...]  # when each stage's last backward (or W) ends
    passes: tuple[Pass, ...] = ()       # every action, as run: the spans a timeline draws
    sends: tuple[Send, ...] = ()


_KINDS = ("F", "B", "I", "W")


@lru_cache(maxsize=64)
def _walk_plan(schedule: Schedule, pp: int, v: int, m: int, n_stages: int) -> tuple[tuple, ...]:
    """Every action of one step in an order that runs each after the pass it waits for (the ranks in turn, each
    as far as its inputs allow), with what walk() reads of it, precomputed once per shape (the search walks the
    same shape for every candidate): (rank, stage, kind index in _KINDS, microbatch, the index in this order of
    the pass it waits for or -1 (the first stage's forward), whether that pass ran on another rank, is the rank's
    first action, ends a backward (B or W)). The times follow from these dependencies alone, whatever the order."""
    rank_of = [stage_rank(s, pp, schedule) for s in range(n_stages)]
    todo = orders(schedule, pp, v, m)
    done: dict[tuple[int, str, int], int] = {}
    at = [0] * pp
    plan: list[tuple] = []

    def waits_for(stage: int, kind: str, mb: int) -> tuple[int, int] | None:
        """(index of the pass this action waits for, that pass's stage), None: not run yet."""
        if kind == "F":
            return (-1, stage) if stage == 0 else _ran(done.get((stage - 1, "F", mb)), stage - 1)
        if kind == "W":
            return _ran(done.get((stage, "I", mb)), stage)
        if stage == n_stages - 1:
            return _ran(done.get((stage, "F", mb)), stage)
        return _ran(done.get((stage + 1, "G", mb)), stage + 1)  # the next stage's input gradient (B or I)

    remaining = sum(len(a) for a in todo.values())
    while remaining:
        progressed = False
        for r in range(pp):
            acts = todo[r]
            while at[r] < len(acts):
                stage, kind, mb = acts[at[r]]
                dep = waits_for(stage, kind, mb)
                if dep is None:
                    break
                i = len(plan)
                plan.append((r, stage, _KINDS.index(kind), mb, dep[0], dep[0] >= 0 and rank_of[dep[1]] != r,
                             at[r] == 0, kind in ("B", "W")))
                done[(stage, kind, mb)] = i
                if kind in ("B", "I"):
                    done[(stage, "G", mb)] = i
                at[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule.value} order deadlocks (pp {pp}, V {v}, m {m})")
    return tuple(plan)


def _ran(index: int | None, stage: int) -> tuple[int, int] | None:
    return None if index is None else (index, stage)


def walk(schedule: Schedule, pp: int, v: int, m: int, passes: tuple[StagePass, ...], p2p_s: float,
         record: bool = False) -> Walk:
    """Event simulation of one schedule step (module docstring); record: keep every pass and send (a timeline's
    spans; off in the search, where they would only cost time)."""
    compute_s = tuple((p.forward_s, p.backward_s, p.weight_s) for p in passes)  # all the walk reads of a stage
    if record:
        return _walk(schedule, pp, v, m, compute_s, p2p_s, True)
    return _walk_unrecorded(schedule, pp, v, m, compute_s, p2p_s)


@lru_cache(maxsize=1024)
def _walk_unrecorded(schedule: Schedule, pp: int, v: int, m: int, compute_s: tuple[tuple[float, float, float], ...],
                     p2p_s: float) -> Walk:
    """walk() without its spans, once per shape and stage seconds: the search's candidates that differ in FSDP
    knobs alone (the strategy, the reduce dtype: each stage's collectives, which the walk does not read) walk
    the same step."""
    return _walk(schedule, pp, v, m, compute_s, p2p_s, False)


def _walk(schedule: Schedule, pp: int, v: int, m: int, compute_s: tuple[tuple[float, float, float], ...],
          p2p_s: float, record: bool) -> Walk:
    """walk() from each stage's (forward, backward, weight-gradient) seconds."""
    n_stages = len(compute_s)
    plan = _walk_plan(schedule, pp, v, m, n_stages)
    durations = [(f, b, b - w, w) for f, b, w in compute_s]  # seconds per stage and kind, as _KINDS orders them
    end_s = [0.0] * len(plan)
    free = [0.0] * pp
    first = [0.0] * pp
    busy = [0.0] * pp
    last_bwd = [0.0] * n_stages
    ran: list[Pass] = []
    sends: list[Send] = []
    # GPipe and 1F1B (torch's PipelineScheduleSingle) post a receive after the rank's previous compute, behind its
    # sends on NCCL's stream: the transfer starts when both the sender's and the receiver's previous passes end.
    # The multi-stage runtime posts receives ahead (where the sender's send is), so only the sender's end counts.
    late = schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
    # `b if b > a else a` is max(a, b) to the bit (ties and NaN alike), without the call
    for i, (r, stage, kind, mb, dep, cross, opens, backward) in enumerate(plan):
        t = end_s[dep] if dep >= 0 else 0.0
        idle = free[r]
        if cross:
            t = ((idle if idle > t else t) if late else t) + p2p_s
            if record:
                sends.append(Send(stage - 1 if kind == 0 else stage + 1, stage, _KINDS[kind], mb, t - p2p_s, t))
        dur = durations[stage][kind]
        start = t if t > idle else idle
        free[r] = end = start + dur
        end_s[i] = end
        if record:
            ran.append(Pass(r, stage, _KINDS[kind], mb, start, end))
        if opens:
            first[r] = start
        busy[r] += dur
        if backward and end > last_bwd[stage]:
            last_bwd[stage] = end
    return Walk(max(free), tuple(busy), tuple(first), tuple(last_bwd), tuple(ran), tuple(sends))


@dataclass(frozen=True)
class PipelineTime:
    step_s: float         # makespan with the stage-to-stage transfers and FSDP's once-per-step collectives
    bubble_s: float       # warm-up and cool-down: the makespan without transfers over m x the slowest rank
    imbalance_s: float    # m x (slowest rank - mean rank) per microbatch
    p2p_exposed_s: float  # what the transfers add to the makespan
    p2p_total_s: float    # every transfer of the step, hidden or not (per rank, the mean)
    fsdp_exposed_s: float  # FSDP's all-gathers before the first forwards and reduce-scatters after the last
    mean_rank_s: float    # per microbatch, the mean rank's stage work
    slowest_rank: int
    rank_busy_s: tuple[float, ...]
    # what cost_models/pipeline_timeline.py draws: the timed walk (its passes and sends, when recorded), the
    # all-gathers' delay before the schedule starts (of fsdp_exposed_s), each stage's reduce-scatters' start
    gather_exposed_s: float = 0.0
    walk: Walk | None = None
    reduce_start_s: tuple[float, ...] = ()


def pipeline_time(model: ModelSpec, config: FsdpConfig, passes: tuple[StagePass, ...], p2p_s: float,
                  record: bool = False) -> PipelineTime:
    """Price one schedule step of config's pipeline from its stages' passes (one per stage, model order); record:
    keep the timed walk's passes and sends in .walk (what cost_models/pipeline_timeline.py draws)."""
    pp, v, m = config.pp, config.pp_stages_per_rank, config.pp_microbatches
    layout = stages(model, config)
    schedule = config.pp_schedule
    timed = walk(schedule, pp, v, m, passes, p2p_s, record)
    bare = walk(schedule, pp, v, m, passes, 0.0) if p2p_s else timed
    per_rank = [0.0] * pp
    for s in layout:
        per_rank[s.rank] += passes[s.index].forward_s + passes[s.index].backward_s
    slowest = max(range(pp), key=per_rank.__getitem__)
    mean = sum(per_rank) / pp
    # FSDP: the all-gathers before each rank's first forward, the reduce-scatters after each stage's last backward
    gather_delay = 0.0
    for r in range(pp):
        own = [s for s in layout if s.rank == r]
        head = passes[own[0].index]
        exposed = head.first_gather_exposed_s if r == 0 else max(0.0, head.gather_s - timed.rank_first_start_s[r])
        gather_delay = max(gather_delay, exposed)
    end = timed.step_s
    reduce_start = [0.0] * len(passes)
    for r in range(pp):
        stream = 0.0
        for s in sorted((s for s in layout if s.rank == r), key=lambda s: timed.stage_last_backward_s[s.index]):
            reduce_start[s.index] = max(stream, timed.stage_last_backward_s[s.index])
            stream = reduce_start[s.index] + passes[s.index].reduce_s
        end = max(end, stream)
    reduce_delay = end - timed.step_s
    transfers = 2 * m * (pp * v - 1) * p2p_s  # each boundary: activations forward, gradients backward
    return PipelineTime(
        step_s=timed.step_s + gather_delay + reduce_delay,
        bubble_s=bare.step_s - m * per_rank[slowest],
        imbalance_s=m * (per_rank[slowest] - mean),
        p2p_exposed_s=timed.step_s - bare.step_s,
        p2p_total_s=transfers / pp,
        fsdp_exposed_s=gather_delay + reduce_delay,
        mean_rank_s=mean,
        slowest_rank=slowest,
        rank_busy_s=timed.rank_busy_s,
        gather_exposed_s=gather_delay,
        walk=timed,
        reduce_start_s=tuple(reduce_start),
    )


@dataclass(frozen=True)
class BlockCost:
    """One kind of block (an MoE model's leading dense blocks are another), one microbatch, as step_time prices it."""

    count: int            # blocks of this kind in the model (dense ones lead)
    forward_s: float      # compute + what TP / CP / EP leave exposed + Float8's weight casts
    backward_s: float     # recompute included
    weight_s: float       # of backward_s: the weight-gradient products
    gather_s: float       # its FSDP all-gather
    reduce_s: float       # its reduce-scatter (+ HSDP all-reduce)


@dataclass(frozen=True)
class RootCost:
    """The root's pieces per microbatch: the embedding on the first stage, final norm + head + loss on the last."""

    embedding_forward_s: float
    embedding_backward_s: float
    head_forward_s: float
    head_backward_s: float
    head_weight_s: float
    embedding_gather_s: float
    embedding_reduce_s: float
    head_gather_s: float
    head_reduce_s: float


def stage_passes(model: ModelSpec, config: FsdpConfig, kinds: tuple[BlockCost, ...], root: RootCost
                 ) -> tuple[StagePass, ...]:
    """Each stage's StagePass from its blocks (cost_models/pipeline.py's split) and its share of the root."""
    sparse, dense = kinds[0], (kinds[1] if len(kinds) > 1 else kinds[0])
    n_dense = dense.count if len(kinds) > 1 else 0
    out = []
    for st in stages(model, config):
        nd = max(0, min(st.first_block + st.n_blocks, n_dense) - st.first_block)
        mine = [(nd, dense), (st.n_blocks - nd, sparse)]
        f = sum(n * k.forward_s for n, k in mine)
        b = sum(n * k.backward_s for n, k in mine)
        w = sum(n * k.weight_s for n, k in mine)
        gather = sum(n * k.gather_s for n, k in mine)
        reduce = sum(n * k.reduce_s for n, k in mine)
        lead = dense if nd else sparse
        # the first unit's gather, then each block's as far as it outlasts the block before (one microbatch)
        exposed = lead.gather_s + sum(n * max(0.0, k.gather_s - k.forward_s) for n, k in mine) \
            - max(0.0, lead.gather_s - lead.forward_s) if st.n_blocks else 0.0
        if st.embedding:
            f, b = f + root.embedding_forward_s, b + root.embedding_backward_s
            gather, reduce = gather + root.embedding_gather_s, reduce + root.embedding_reduce_s
            exposed += root.embedding_gather_s
        if st.head:
            f, b, w = f + root.head_forward_s, b + root.head_backward_s, w + root.head_weight_s
            gather, reduce = gather + root.head_gather_s, reduce + root.head_reduce_s
        out.append(StagePass(f, b, w, gather, exposed, reduce))
    return tuple(out)


def p2p_seconds(model: ModelSpec, config: FsdpConfig, cluster: ClusterSpec, profile: Profile, tokens: int,
                c: int) -> float:
    """One stage boundary's send of one microbatch: micro_batch x s / cp x hidden x c bytes (/ tp under sequence
    parallel, each TP rank sending its slice), activations forward or gradients backward. pp is the outermost
    mesh dim: a stage's neighbour is tp x cp x dp ranks away, on another node once those fill one, every GPU of
    the node sending at once over its share of the node's network."""
    inner = cluster.n_gpus // config.pp
    tokens_sent = tokens // config.tp if config.tp > 1 and config.sequence_parallel else tokens
    tier = comm.Tier.for_group(cluster, profile, spans_nodes=inner >= cluster.fast_tier_gpus,
                               groups_sharing_nics=min(inner, cluster.gpus_per_node))
    return tier.latency_s + tokens_sent * model.hidden_size * c / tier.bus_bytes_per_s


def largest_rank_params(model: ModelSpec, config: FsdpConfig, counts) -> tuple[int, int]:
    """(trainable, frozen) elements of the pipeline rank holding the most (memory.ParamCounts `counts`): its
    stages' blocks, the embedding on the first stage's rank, the head and final norm on the last's."""
    nd = model.n_dense_layers
    per_dense = ((counts.trainable_dense_delta // nd, counts.frozen_dense_delta // nd) if nd else (0, 0))
    emb = model.embedding_params / max(1, model.root_params)
    ranks: dict[int, list[float]] = {}
    for st in stages(model, config):
        dense = max(0, min(st.first_block + st.n_blocks, nd) - st.first_block)
        t, f = ranks.setdefault(st.rank, [0.0, 0.0])
        t += st.n_blocks * counts.trainable_block + dense * per_dense[0]
        f += st.n_blocks * counts.frozen_block + dense * per_dense[1]
        share = (emb if st.embedding else 0.0) + ((1 - emb) if st.head else 0.0)
        ranks[st.rank] = [t + share * counts.trainable_root, f + share * counts.frozen_root]
    t, f = max(ranks.values())
    return int(t), int(f)


def textbook_bubble_fraction(schedule: Schedule, pp: int, v: int, m: int) -> float:
    """The bubble's share of the step with equal stages and no transfers: (p - 1) / (m + p - 1) for GPipe and
    1F1B, (p - 1) / (V m + p - 1) for interleaved 1F1B (Narayanan et al. 2021, SC21). Zero-bubble and DualPipeV
    have no closed form here: walk() prices them from their orders."""
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        return (pp - 1) / (m + pp - 1)
    if schedule is Schedule.INTERLEAVED_1F1B:
        return (pp - 1) / (v * m + pp - 1)
    raise ValueError(f"no textbook bubble for {schedule.value}")
