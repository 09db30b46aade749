"""A pipeline rank's schedule replayed once per schedule shape, its moments kept as linear forms over the stages'
bytes (cost_models/pipeline_rank_memory.py prices them for one configuration).

What the replay holds at each moment (what torch and FSDP2 keep, pipeline_rank_memory's docstring) is a count of
each stage's pieces: microbatches in flight, between their input and weight pass, forwards run, gradients pending,
stages gathered or reduced. The counts follow torch's order of actions alone; the bytes they weigh differ per
configuration. So the order is replayed once per shape (schedule, pp, stages per rank, microbatches, the rank and its
stages' layout, whether the gradients change dtype, whether the shard group has more than one rank), each moment a
row of coefficients over `variables`' values, and a configuration's moments are one matrix product: the search's
candidates on one pipeline shape (activation checkpointing, tp, precision) share the replay. The first largest row
is the peak, as the replay in order would find it (a moment becomes the peak only above every earlier one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .pipeline_orders import active_stages, orders

# the rank's bytes that are not a stage's: its model states, the receive buffers, a microbatch's hidden states
GLOBALS = ("sharded_params", "optimizer_state", "buffers", "tokens_h")
# a stage's bytes (pipeline_stage_pieces.StagePieces and what the replay makes of them); then one variable per
# block's input-pass moment, then one per FSDP unit's shards reduced before it (stage root first)
STAGE_VARS = ("saved", "output", "loss_saved", "weight_inputs", "logits", "params_c", "params_r", "gathered",
              "shard", "loss_peak", "head_grad", "root_gathered", "block_gathered", "block_c", "block_r", "root_r",
              "rs_root", "rs_block", "rs_in_root", "rs_in_block", "root_grads_first", "root_grads_later",
              "first_backward_acts", "first_backward_grads", "first_post_acts", "first_post_grads",
              "later_backward_acts", "later_backward_grads", "later_post_acts", "later_post_grads")
_AT = {name: i for i, name in enumerate(STAGE_VARS)}
# a moment's parts: rows of Replay.parts, in pipeline_rank_memory._MOMENT_PARTS' order
SHARDED, GATHERED, GRADS, ACTS, LOSS, BUFFERS = 2, 3, 4, 5, 6, 7
# the stage variables the state holds, by part
HELD = ((ACTS, "saved"), (ACTS, "output"), (LOSS, "loss_saved"), (ACTS, "weight_inputs"), (LOSS, "logits"),
        (GRADS, "params_c"), (GRADS, "params_r"), (GATHERED, "gathered"), (SHARDED, "shard"))


def block_moments(x, r: int, c: int) -> dict:
    """The stage's block moments that can be largest, by case (first backward / later / later in place): for block j
    (j blocks above done) its backward and its post-backward (the block's whole compute-dtype gradient); the base
    state is the same for every block of one backward, so the largest sum decides."""
    out = {}
    for case in ("first", "in place" if r == c else "later"):  # the later backwards' case by the dtypes
        best: dict = {}  # by kind: the first option of the largest sum
        for j, (largest, in_place, post) in enumerate(x.blocks):
            acts, grads = in_place if case == "in place" else largest
            if case == "first":
                done = j * x.block_params * r + x.head_grad
            elif case == "in place":
                done = 0
            else:
                done = x.head_grad
            whole = 0 if case == "in place" else x.block_params * c
            for option in (("backward", acts, done + grads), ("post-backward of a block", post, done + whole)):
                top = best.get(option[0])
                if top is None or option[1] + option[2] > top[1] + top[2]:
                    best[option[0]] = option
        out[case] = list(best.values())
    return out


def stage_values(x, c: int, p: int, r: int, d: int) -> list[int]:
    """One stage's values of STAGE_VARS, its blocks' input-pass moments and its units' shards reduced before each."""
    root = x.params - x.stage.n_blocks * x.block_params
    assert root >= 0, "a stage's parameters hold its blocks'"
    cases = block_moments(x, r, c)
    moments = []
    for case in cases.values():
        for _, acts, grads in case or [(None, 0, 0)] * 2:
            moments += [acts, grads]
    # what FSDP2 shards, gathers and reduce-scatters: each unit's tensors dim-0 padded (x.root_padding / block_padding);
    # the gradients autograd makes and FSDP2 accumulates: the real ones
    padded_root, padded_block = root + x.root_padding if root else 0, x.block_params + x.block_padding
    groups = ([padded_root] if root else []) + [padded_block] * x.stage.n_blocks
    done, shards = 0, []
    for group in groups:
        shards.append(math.ceil(done * p / d))
        done += group
    grads, root_grads = x.params + x.grad_extra, root + x.grad_extra  # the elements the gradients hold
    return [x.saved, x.output, x.loss_saved, x.weight_inputs, x.logits, grads * c, grads * r, x.gathered,
            math.ceil(x.padded_params * p / d), x.loss_peak, x.head_grad, x.root_gathered, x.block_gathered,
            x.block_params * c, x.block_params * r, root_grads * r, math.ceil(padded_root * r / d),
            math.ceil(padded_block * r / d), (root_grads + padded_root - root) * r, padded_block * r,
            (x.params - root) * r + root_grads * (c + r), root_grads * c,
            *moments, *x.input_pass, *shards]


def stage_layout(x) -> tuple:
    """What of a stage the replay's order reads: its index, embedding, head, blocks, root, input-pass moments."""
    return (x.stage.index, x.stage.embedding, x.stage.head, x.stage.n_blocks,
            x.params > x.stage.n_blocks * x.block_params, len(x.input_pass))


@dataclass(frozen=True)
class Replay:
    """A rank's moments: each row's total (rows x variables), what each row is, and what makes its parts."""

    totals: np.ndarray
    whats: tuple          # (what, microbatch, stage) per row
    loss_rows: tuple      # the loss backwards' rows
    forwards: dict        # each stage's forwards (the logits kept: the last row, the merge, counts them)
    most: dict            # the most microbatches each stage holds at once
    slots: tuple          # (part, variable) of each count the state holds
    states: tuple         # each row's state: its counts
    extras: tuple         # each row's (part, variable, count) on top of its state

    def parts(self, row: int, values) -> list[int]:
        """The row's bytes by part (pipeline_rank_memory._MOMENT_PARTS' order) at these values."""
        values = values.tolist()
        out = [values[0], values[1]] + [0] * 6
        for (part, at), count in zip(self.slots, self.states[row]):
            out[part] += count * values[at]
        for part, at, count in self.extras[row]:
            out[part] += count * values[at]
        return out


@lru_cache(maxsize=256)
def replay(schedule, pp: int, v: int, m: int, rank: int, layout: tuple, same_dtype: bool, sharded: bool) -> Replay:
    """torch's order of actions on `rank` replayed over counts; layout: stage_layout of each of the rank's stages."""
    info = {st[0]: st for st in layout}
    offsets, n = {}, len(GLOBALS)
    for s, _, _, nb, root, nip in layout:
        offsets[s] = n
        n += len(STAGE_VARS) + nip + root + nb

    def ix(s: int, name: str) -> int:
        return offsets[s] + _AT[name]

    # what the state holds: a count of each variable it weighs (a stage's pieces, the buffers, an input gradient), each
    # in its part of the moment; the same counts, the same state (a stage off the head keeps no logits nor loss)
    slots = [(ACTS, GLOBALS.index("buffers")), (ACTS, GLOBALS.index("tokens_h"))]
    slot = {}
    for s, _, head, *_ in layout:
        for part, name in HELD:
            if head or name not in ("logits", "loss_saved"):
                slot[s, name] = len(slots)
                slots.append((part, ix(s, name)))
    held = [1] + [0] * (len(slots) - 1)
    tokens = 1  # its slot

    def hold(s: int, name: str, k: int) -> None:
        if (s, name) in slot:
            held[slot[s, name]] += k

    snapshots: list = []
    seen: dict = {}    # snapshot -> its index
    rows: list = []    # each moment's snapshot
    extras: list = []  # each row's (part, variable, count) on top of the snapshot
    whats, loss_rows = [], []
    gathered: set = set()
    reduced: set = set()
    backwards = {s: 0 for s in info}
    in_flight = {s: 0 for s in info}
    most = {s: 0 for s in info}
    forwards = {s: 0 for s in info}
    pending = {s: False for s in info}
    chained = {s: s + 1 in info for s in info}  # V-shape: a stage's output is the next stage's input, no copy

    def snapshot() -> tuple:
        state = tuple(held)
        if state not in seen:
            seen[state] = len(snapshots)
            snapshots.append(state)
        return state

    def moment(what: tuple, extra=()) -> None:
        rows.append(seen[snapshot()])
        if what[0] != "input pass" and what[2] is not None and chained[what[2]]:
            extra = [*extra, (ACTS, ix(what[2], "output"), 1)]
        extras.append(tuple(extra))
        whats.append(what)

    def fly(s: int, k: int) -> None:
        in_flight[s] += k
        hold(s, "saved", k)
        hold(s, "output", -k * chained[s])
        hold(s, "loss_saved", k)

    def wait(s: int, k: int) -> None:
        hold(s, "weight_inputs", k)
        hold(s, "logits", k)
        hold(s, "loss_saved", -k)

    def set_pending(s: int, on: bool) -> None:
        hold(s, "params_c", on - pending[s])
        pending[s] = on

    def backward_done(s: int) -> None:
        if not backwards[s] and s not in reduced:
            hold(s, "params_r", 1)
        backwards[s] += 1

    def gather(stages) -> None:
        for s in stages:
            if s not in gathered:
                gathered.add(s)
                hold(s, "gathered", 1)

    def reshard(s: int) -> None:
        if s in gathered:
            gathered.discard(s)
            hold(s, "gathered", -1)

    def convert(s: int) -> None:
        if pending[s]:
            set_pending(s, False)
            if not backwards[s]:
                backward_done(s)

    def reduce(s: int) -> None:
        """perform_reduce_grad: each unit (root first) copied into the reduce-scatter's input, then its output."""
        convert(s)
        _, _, _, nb, root, nip = info[s]
        done = [0, 0]      # units reduced so far: the root, blocks
        resharded = [0, 0]
        for i, is_root in enumerate([True] * root + [False] * nb):
            resharded[not is_root] += 1
            group = "root" if is_root else "block"
            for second in (False, True):
                gone = [done[0], done[1] + (second and not is_root)]
                extra = [(GRADS, ix(s, "root_r"), -gone[0]), (GRADS, ix(s, "block_r"), -gone[1]),
                         (GATHERED, ix(s, "root_gathered"), -resharded[0]),
                         (GATHERED, ix(s, "block_gathered"), -resharded[1]),
                         (SHARDED, offsets[s] + len(STAGE_VARS) + nip + i, 1)]
                if sharded:
                    extra.append((BUFFERS, ix(s, "rs_in_" + group), 1))
                    if second or is_root:
                        extra.append((BUFFERS, ix(s, "rs_" + group), 1))
                moment(("reduce-scatter", None, s), extra)
            done[not is_root] += 1
        reshard(s)
        if backwards[s]:
            hold(s, "params_r", -1)
        reduced.add(s)
        hold(s, "shard", 1)

    def input_pass(s: int, mb: int) -> None:
        had, fresh = pending[s], backwards[s] == 0
        for j in range(info[s][5]):
            extra = [(ACTS, offsets[s] + len(STAGE_VARS) + j, 1)]
            if had:
                extra += [(GRADS, ix(s, "block_c"), -j)] + ([(GRADS, ix(s, "block_r"), j)] if fresh else [])
            if info[s][2]:
                extra.append((LOSS, ix(s, "logits"), 1))
            moment(("input pass", mb, s), extra)
        convert(s)

    def loss_backward(s: int, mb: int) -> None:
        loss_rows.append(len(rows))
        moment(("loss backward", mb, s), [(LOSS, ix(s, "loss_peak"), 1)])

    def backward_moments(s: int, mb: int, first: bool) -> None:
        _, _, head, nb, root, _ = info[s]
        loss_gone = [(LOSS, ix(s, "loss_saved"), -1)] if head else []
        if head:
            loss_backward(s, mb)
            moment(("head backward", mb, s), [(GRADS, ix(s, "head_grad"), 1), (LOSS, ix(s, "logits"), 1),
                                              (LOSS, ix(s, "loss_saved"), -1)])
        case = "first" if first else "later"
        for kind, name in (("backward", "backward"), ("post-backward of a block", "post")):
            if nb:
                moment((kind, mb, s), [(ACTS, ix(s, f"{case}_{name}_acts"), 1),
                                       (GRADS, ix(s, f"{case}_{name}_grads"), 1)] + loss_gone)
        if root:
            extra = [(ACTS, GLOBALS.index("tokens_h"), 1), (ACTS, ix(s, "saved"), -1)]
            if first and not same_dtype:
                extra.append((GRADS, ix(s, "root_grads_first"), 1))
            elif not first:
                extra.append((GRADS, ix(s, "root_grads_later"), 1))
            if head:
                extra += [(LOSS, ix(s, "loss_saved"), -1), (LOSS, ix(s, "logits"), -1)]
            moment(("root post-backward", mb, s), extra)

    priced: set = set()

    def repeats(*key) -> bool:
        key = (*key, snapshot())
        if key in priced:
            return True
        priced.add(key)
        return False

    actions = orders(schedule, pp, v, m)[rank]
    kept_ahead = active_stages(schedule, pp, v, m, rank) if len(info) > 1 else ()
    sends = schedule.value == "1f1b"
    sent = 0
    for i, (s, kind, mb) in enumerate(actions):
        embedding = info[s][1]
        if kept_ahead and gathered != kept_ahead[i]:
            for t in gathered - kept_ahead[i]:
                reshard(t)
            gather(kept_ahead[i])
        if kind == "F":
            gather((s,))
            fly(s, 1)
            most[s] = max(most[s], in_flight[s])
            hold(s, "logits", 1)
            forwards[s] += 1
            continue
        if kind == "I" and embedding:
            wait(s, 1)
            continue
        if kind == "W" and not embedding:
            fly(s, -1)
            wait(s, -1)
            set_pending(s, True)
            if mb == m - 1:
                reduce(s)
            continue
        if kind == "I":
            if repeats("I", s, pending[s], backwards[s] == 0):
                convert(s)
            else:
                if info[s][2]:
                    loss_backward(s, mb)
                input_pass(s, mb)
            wait(s, 1)
            continue
        convert(s)
        first = backwards[s] == 0
        if not repeats(kind, s, first):
            backward_moments(s, mb, first)
        if kind == "W":
            wait(s, -1)
        fly(s, -1)
        backward_done(s)
        if mb == m - 1:
            reduce(s)
        if sends and not embedding:
            held[tokens] += 1 - sent
            sent = 1
    held[tokens] -= sent
    # the last stage's step returns its microbatches' logits concatenated (a copy beside them): the last row
    moment(("merge of the logits", None, None), [(LOSS, ix(s, "logits"), forwards[s]) for s in info])
    # each row's total: its state's counts and its extras on the variables
    totals = np.zeros((len(rows), n), np.int64)
    part, at = np.array(slots).T
    np.add.at(totals, (slice(None), at), np.array(snapshots, dtype=np.int64)[np.array(rows)])
    totals[:, :2] = 1
    flat = [(row, at, count) for row, extra in enumerate(extras) for _, at, count in extra]
    row, at, count = np.array(flat, dtype=np.int64).reshape(-1, 3).T
    np.add.at(totals, (row, at), count)
    return Replay(totals=totals, whats=tuple(whats), loss_rows=tuple(loss_rows), forwards=forwards, most=most,
                  slots=tuple(slots), states=tuple(snapshots[i] for i in rows), extras=tuple(extras))
