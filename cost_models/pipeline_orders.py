"""Each pipeline rank's compute actions in one schedule step, in the order torch runs them.

A plain-Python port of torch.distributed.pipelining.schedules (torch 2.13) `_get_pipeline_order` of
ScheduleGPipe and Schedule1F1B and `_calculate_single_rank_operations` of ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble and ScheduleDualPipeV, without the idle slots (None) torch pads them with: the
step's timing comes from the dependencies (cost_models/pipeline_time.py), not from the slots. cost_models never
imports torch; tests/golden/test_pipeline_rows.py compares every order with torch's own pipeline_order.

Kinds: F forward, B full backward (input and weight gradients), I backward of the input only, W backward of the
weights only (zero-bubble's split). DualPipeV's OVERLAP_F_B actions are listed as their sub-actions (F, then B):
torch's runtime runs them one after the other unless a custom function is registered for OVERLAP_F_B.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from typing import NamedTuple

from .schedules import Schedule


class Action(NamedTuple):
    stage: int
    kind: str       # F, B, I, W
    microbatch: int


@lru_cache(maxsize=256)
def orders(schedule: Schedule, pp: int, stages_per_rank: int, microbatches: int) -> dict[int, tuple[Action, ...]]:
    """rank -> its actions in execution order (cached: the search walks the same shapes many times)."""
    return {r: tuple(a) for r, a in _orders(schedule, pp, stages_per_rank, microbatches).items()}


def _orders(schedule: Schedule, pp: int, stages_per_rank: int, microbatches: int) -> dict[int, list[Action]]:
    m, v = microbatches, stages_per_rank
    if schedule is Schedule.GPIPE:
        return {r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(pp)}
    if schedule is Schedule.ONE_F_ONE_B:
        return {r: _one_f_one_b(r, pp, m) for r in range(pp)}
    if schedule is Schedule.DUALPIPEV:
        return {r: _dualpipev(r, pp, m) for r in range(pp)}
    zero_bubble = schedule is Schedule.ZERO_BUBBLE
    return {r: _interleaved(r, pp, v, m, zero_bubble) for r in range(pp)}


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    """Schedule1F1B: p - 1 - rank warm-up forwards, then one forward and one backward, then the rest backward."""
    warmup = min(m, pp - 1 - rank)
    out = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(warmup, m):
        out += [Action(rank, "F", i), Action(rank, "B", i - warmup)]
    return out + [Action(rank, "B", i) for i in range(m - warmup, m)]


def _interleaved(rank: int, pp: int, v: int, m: int, zero_bubble: bool) -> list[Action]:
    """ScheduleInterleaved1F1B (warm-up 2 per hop from the last rank) and ScheduleInterleavedZeroBubble (ZB1P: 1
    per hop, backward split into I and W, a W after each I once rank's 1F1B microbatches have run)."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    total = m * v
    fwd_mb, bwd_mb, w_mb = defaultdict(int), defaultdict(int), defaultdict(int)
    backward_steps: list[int] = []
    out: list[Action] = []
    b_kind = "I" if zero_bubble else "B"

    def forward_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    def take(counter, stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1

    def weight() -> None:
        stage = backward_stage(backward_steps[sum(w_mb.values())])  # the oldest backward without its W
        out.append(Action(stage, "W", take(w_mb, stage)))

    for step in range(warmup + total):
        if step < total:
            stage = forward_stage(step)
            out.append(Action(stage, "F", take(fwd_mb, stage)))
        if step >= warmup:
            stage = backward_stage(step)
            out.append(Action(stage, b_kind, take(bwd_mb, stage)))
            backward_steps.append(step)
            if zero_bubble and step - warmup >= rank:  # after rank's num_1f1b_microbatches
                weight()
    while zero_bubble and sum(w_mb.values()) < len(backward_steps):
        weight()
    return out


def _dualpipev(rank: int, pp: int, m: int) -> list[Action]:
    """ScheduleDualPipeV: rank r holds stages r and 2 pp - 1 - r; eight phases (F0, F0F1, I1W1F1, the
    overlapped F0B1-F1B0 main phase, B1-F1B0, B1B0 with zero bubble in its second half, W0B0, W0)."""
    s0, s1 = rank, 2 * pp - 1 - rank
    counters: dict[tuple[int, str], int] = defaultdict(int)
    weights: list[tuple[int, int]] = []
    out: list[Action] = []

    def add(stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        out.append(Action(stage, kind, counters[key]))
        if kind == "B":  # a full backward counts as its input and its weight pass
            counters[(stage, "I")] += 1
            counters[(stage, "W")] += 1
            return
        if kind == "I":
            weights.append((stage, counters[key]))
        counters[key] += 1

    def add_weight() -> None:
        if weights:
            stage, mb = weights.pop(0)
            out.append(Action(stage, "W", mb))
            counters[(stage, "W")] += 1

    for _ in range((pp - rank - 1) * 2):
        add(s0, "F")
    for _ in range(rank + 1):
        add(s0, "F")
        add(s1, "F")
    for _ in range(pp - rank - 1):
        add(s1, "I")
        add_weight()
        add(s1, "F")
    for _ in range(m - 2 * pp + rank + 1):
        add(s0, "F")
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    for _ in range(pp - rank - 1):
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    zb = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zb = True
        add(s1, "I" if zb else "B")
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zb = True
        add(s0, "I" if zb else "B")
    for _ in range(pp - rank - 1):
        add_weight()
        add(s0, "I" if zb else "B")
    for _ in range(rank + 1):
        add_weight()
    return out


MAX_ACTIVE_STAGES = 3  # torch's _add_unshard_reshard default (schedules.py): the stages a rank keeps unsharded


@lru_cache(maxsize=1024)
def active_stages(schedule: Schedule, pp: int, stages_per_rank: int, microbatches: int,
                  rank: int) -> tuple[frozenset[int], ...]:
    """Before each of rank `rank`'s actions (orders()), the stages torch's multi-stage runtime keeps unsharded: the
    next MAX_ACTIVE_STAGES distinct stages to compute from that action on (_add_unshard_reshard reshards the others,
    and unshards these ahead of their use, which the estimate does not price). Matters with more than three stages
    a rank. One pass from the end (a rank of V = 2 never sees three distinct stages, so a forward scan per action
    would read the whole rest of the order: 0.23 s of a 405B pp 16 candidate's 0.73 s), cached per schedule shape
    like orders() (a search replays each shape for many configurations)."""
    ahead: list[int] = []  # the next distinct stages, nearest first
    out: list[frozenset[int]] = []
    for action in reversed(orders(schedule, pp, stages_per_rank, microbatches)[rank]):
        ahead = [action.stage] + [s for s in ahead if s != action.stage][:MAX_ACTIVE_STAGES - 1]
        out.append(frozenset(ahead))
    return tuple(out[::-1])
