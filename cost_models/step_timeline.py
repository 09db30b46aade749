"""The predicted step laid out in time: when each unit's forward, backward, recompute and collectives run.

A rendering of estimate_step_time's own terms (its `terms` dict), not a second overlap model: the compute
stream runs every unit's window back to back and waits, between windows, exactly what step_time.py prices as
exposed (docs/step_time.md, "Overlap"). Forward: the root's and the first block's all-gathers are exposed,
then block i's window hides block i+1's all-gather (issued when block i starts, FSDP2's prefetch). Backward:
each block's window hides one all-gather and one reduction, sent one after the other on the network (the model
adds them), then the last reduce-scatter and the root's are exposed; without backward prefetch a block's
all-gather runs before its backward, unhidden. TP's and CP's collectives sit in the block's window, their
exposed part after its compute; EP's all-to-alls are exposed. So the compute stream's busy time plus its waits
is step_s. Where the uniform per-block window is not a literal schedule (the first backward window prices a
reduction before any block has reduced, the last an all-gather with no block left; an MoE model's first sparse
block waits what a sparse block waits) the event says so in its args.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import tensor_parallel
from .profile import Profile
from .specs import ClusterSpec, FsdpConfig, ModelSpec, Sharding, SpecError, TrainingSpec
from .step_time import TimeBreakdown, estimate_step_time, root_memory_bytes_per_token
from .units import DTYPE_BYTES

COMPUTE, ALL_GATHER, REDUCE, TP, CP, EP, OFFLOAD = ("compute", "FSDP all-gather", "FSDP reduce-scatter", "TP",
                                                    "CP ring", "EP all-to-all", "offload copies")
TRACKS = (COMPUTE, ALL_GATHER, REDUCE, TP, CP, EP, OFFLOAD)
_SLOT = "the model's uniform per-block window prices this slot (cost_models/step_timeline.py)"


@dataclass(frozen=True)
class Span:
    track: str           # one of TRACKS
    name: str
    phase: str           # forward, backward, recompute, optimizer, overhead, communication
    start_s: float
    dur_s: float
    args: dict = field(default_factory=dict)
    rank: int = 0        # the pipeline rank whose streams run it (0 without PP)

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


@dataclass(frozen=True)
class StepTimeline:
    spans: tuple[Span, ...]
    time: TimeBreakdown
    reduce_name: str     # what the reduction track runs: reduce-scatter, + replica all-reduce (HSDP), all-reduce
    ranks: tuple[dict, ...] = ()  # PP: per pipeline rank, its stages, busy_s and bubble_s
    notes: dict = field(default_factory=dict)  # what the drawing folds or simplifies, for the file's metadata

    @property
    def end_s(self) -> float:
        return max(s.end_s for s in self.spans)


class _Lanes:
    """Spans per track; the compute stream's clock advances past each compute span and each wait."""

    def __init__(self):
        self.spans: list[Span] = []
        self.now = 0.0  # the compute stream
        self.micro_batch: int | None = None

    def _args(self, args: dict) -> dict:
        return args if self.micro_batch is None else {"micro_batch": self.micro_batch, **args}

    def compute(self, name: str, phase: str, dur_s: float, **args) -> None:
        if dur_s > 0:
            self.spans.append(Span(COMPUTE, name, phase, self.now, dur_s, self._args(args)))
            self.now += dur_s

    def comm(self, track: str, name: str, start_s: float, dur_s: float, **args) -> float:
        """A collective from start_s; returns its end."""
        if dur_s > 0:
            self.spans.append(Span(track, name, "communication", start_s, dur_s, self._args(args)))
        return start_s + dur_s

    def wait(self, dur_s: float) -> None:
        self.now += max(0.0, dur_s)


def uncovered_s(span: Span, busy: list[tuple[float, float]]) -> float:
    """Seconds of `span` outside the sorted, disjoint `busy` intervals: a collective's exposed part."""
    covered = sum(max(0.0, min(span.end_s, e) - max(span.start_s, s)) for s, e in busy)
    return max(0.0, span.dur_s - covered)


def step_timeline(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
                  profile: Profile, fsdp2: bool = True) -> StepTimeline:
    """Every span of one optimizer step as estimate_step_time prices it (config: as evaluate runs it; fsdp2: the
    trainer's FSDP API)."""
    terms: dict = {}
    t = estimate_step_time(model, cluster, training, config, profile, terms, fsdp2=fsdp2)
    if "kinds" not in terms:  # pp > 1: cost_models/pipeline_time.py walks the stages instead
        raise SpecError("timeline", f"pp {config.pp}: cost_models/pipeline_timeline.py draws pipeline plans")
    local = tensor_parallel.local_model(model, config)
    L, nd, accum = local.n_layers, local.n_dense_layers, config.grad_accum
    tp_t, cp_t, a2a = terms["tp"], terms["cp"], terms["a2a_s"]
    ckpt_share = terms["ckpt_blocks"] / L
    # (count, forward AG, backward AG, reduction, forward window, backward window) per kind; dense blocks run first
    kinds = terms["kinds"]
    order = [kinds[-1]] * nd + [kinds[0]] * (L - nd)

    def mesh_exposed(i: int, backward: bool) -> tuple[float, float, float]:
        """(TP, CP, EP) seconds block i's window waits for the mesh's collectives (EP: sparse blocks only)."""
        ep = 2 * a2a * ((1 + ckpt_share) if backward else 1.0) if i >= nd else 0.0
        if backward:
            return tp_t.block_backward_exposed_s, cp_t.backward_exposed_s, ep
        return tp_t.block_forward_exposed_s, cp_t.forward_exposed_s, ep

    def window(lanes: _Lanes, i: int, backward: bool) -> float:
        """Block i's compute then its mesh waits; returns the window's start."""
        start, label = lanes.now, "backward" if backward else "forward"
        tp_exp, cp_exp, ep_s = mesh_exposed(i, backward)
        total = order[i][5] if backward else order[i][4]
        compute_s = total - tp_exp - cp_exp - ep_s
        if backward:
            recompute_s = terms["recompute_s"]
            lanes.compute(f"recompute block {i}", "recompute", recompute_s)
            lanes.compute(f"backward block {i}", "backward", compute_s - recompute_s)
        else:
            lanes.compute(f"forward block {i}", "forward", compute_s)
        tp_total = tp_t.block_backward_s if backward else tp_t.block_forward_s
        cp_total = cp_t.backward_s if backward else cp_t.forward_s
        end = lanes.now + tp_exp
        lanes.comm(TP, f"TP collectives block {i} {label}", end - tp_total, tp_total)
        end += cp_exp
        lanes.comm(CP, f"CP ring block {i} {label}", end - cp_total, cp_total)
        lanes.comm(EP, f"all-to-all block {i} {label}", end, ep_s, note="dispatch + combine" +
                   (", recompute's share included" if backward else ""))
        lanes.wait(tp_exp + cp_exp + ep_s)
        return start

    root_f, root_b = _root_compute(local, config, terms)
    reduce_name = reduction_name(config, cluster)
    lanes = _Lanes()
    for m in range(accum):
        lanes.micro_batch = m
        reducing = terms["sync_every_microstep"] or m == accum - 1
        # forward: the root's and block 0's all-gathers before anything runs
        end = lanes.comm(ALL_GATHER, "all-gather root", lanes.now, terms["root_ag"])
        end = lanes.comm(ALL_GATHER, "all-gather block 0", end, order[0][1])
        lanes.wait(end - lanes.now)
        for i in range(L):
            issued = window(lanes, i, False)
            if i + 1 < L:  # the next block's all-gather, hidden by this window; the model's wait before it
                a_f = order[i + 1][1]
                wait = max(0.0, a_f - order[i + 1][4])
                # a wait ends when the gather does; at an MoE model's first sparse block the model prices the wait
                # with a sparse window (not this dense one), so the drawn gather may start before this window
                note = {"note": "waits what a sparse block waits (step_time's kinds)"} if order[i + 1] != order[i] \
                    else {}
                lanes.comm(ALL_GATHER, f"all-gather block {i + 1}", lanes.now + wait - a_f if wait else issued,
                           a_f, **note)
                lanes.wait(wait)
        for name, dur in root_f:
            lanes.compute(name, "forward", dur)
        lanes.comm(TP, "TP root collectives", lanes.now + tp_t.root_exposed_s - tp_t.root_s, tp_t.root_s)
        lanes.wait(tp_t.root_exposed_s)
        for name, dur in root_b:
            lanes.compute(name, "backward", dur)
        # backward, last block first
        for k, i in enumerate(reversed(range(L))):
            _, _, a_b, rs, _, bwd = order[i]
            a_b = a_b if terms["gathers_in_backward"] else 0.0
            rs = rs if reducing else 0.0
            ag_name = f"all-gather block {i - 1}" if i > 0 else "all-gather"
            ag_args = {} if i > 0 else {"note": _SLOT}
            rs_name = f"{reduce_name} block {i + 1}" if k > 0 else reduce_name
            rs_args = {} if k > 0 else {"note": _SLOT}
            if config.backward_prefetch:
                end = lanes.comm(ALL_GATHER, ag_name, lanes.now, a_b, **ag_args)
                end = lanes.comm(REDUCE, rs_name, end, rs, **rs_args)
                window(lanes, i, True)
                lanes.wait(end - lanes.now)
            else:  # its own all-gather first, unhidden; the previous block's reduction beside its backward
                end = lanes.comm(ALL_GATHER, f"all-gather block {i}", lanes.now, a_b)
                lanes.wait(end - lanes.now)
                end = lanes.comm(REDUCE, rs_name, lanes.now, rs, **rs_args)
                window(lanes, i, True)
                lanes.wait(end - lanes.now)
        end = lanes.comm(REDUCE, f"{reduce_name} block 0", lanes.now, terms["last_rs"] if reducing else 0.0)
        end = lanes.comm(REDUCE, f"{reduce_name} root", end, terms["root_rs"],
                         **({} if reducing else {"note": "priced on this no_sync micro-step too (step_time.py)"}))
        lanes.wait(end - lanes.now)
        lanes.compute("micro-step overhead", "overhead", t.overhead_s / accum,
                      note="profile.microstep_overhead_s: launches, Python, the data loader's hand-off")
    lanes.micro_batch = None
    lanes.compute("overlap slowdown", "overhead", t.overlap_slowdown_s,
                  note="compute slowed by the NCCL kernels beside it (profile.overlap_slowdown x the hidden "
                       "communication), spread over the step; drawn here")
    end = lanes.comm(OFFLOAD, "offload copies (host <-> device)", lanes.now, t.offload_copy_s)
    lanes.wait(end - lanes.now)
    lanes.compute("optimizer step (CPU)" if config.offload else "optimizer step", "optimizer", t.optimizer_s)
    return StepTimeline(tuple(lanes.spans), t, reduce_name)


def reduction_name(config: FsdpConfig, cluster: ClusterSpec) -> str:
    """What FSDP's gradient reduction runs: reduce-scatter, with HSDP's replica all-reduce, or NO_SHARD's all-reduce."""
    if config.sharding is Sharding.NO_SHARD:
        return "all-reduce"
    return "reduce-scatter + replica all-reduce" if config.replicate_group_size(cluster) > 1 else "reduce-scatter"


def phase_seconds(tl: StepTimeline) -> dict[str, float]:
    """{"forward", "backward", "optimizer"} seconds of the predicted step, cut as the runner's profiled phases are
    (calibration/profile_step.py): a micro-step's forward from its start (its first all-gather) to its first
    backward compute, its backward from there to its last reduction, summed over micro-steps; the optimizer step.
    Overheads, the overlap slowdown and offload copies are in none of them."""
    seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    micro: dict[int, list[Span]] = {}
    for s in tl.spans:
        if s.phase == "optimizer":
            seconds["optimizer"] += s.dur_s
        elif "micro_batch" in s.args and s.phase != "overhead":
            micro.setdefault(s.args["micro_batch"], []).append(s)
    for spans in micro.values():
        start, end = min(s.start_s for s in spans), max(s.end_s for s in spans)
        cut = min(s.start_s for s in spans if s.track == COMPUTE and s.phase in ("backward", "recompute"))
        seconds["forward"] += cut - start
        seconds["backward"] += end - cut
    return seconds


def _root_compute(local: ModelSpec, config: FsdpConfig, terms: dict):
    """(forward, backward) named compute seconds of the root per micro-step: the head (one forward, two backward
    products), the root's memory-bound chains by pass, FSDP's copies, Float8's weight casts, TP's root copies."""
    chains = root_memory_bytes_per_token(local, config, DTYPE_BYTES[config.precision.compute_dtype])
    fwd_bytes, bwd_bytes = sum(f for _, f, _ in chains), sum(b for _, _, b in chains)
    share_f = fwd_bytes / (fwd_bytes + bwd_bytes) if fwd_bytes + bwd_bytes else 0.0
    mem = terms["root_memory_s"]
    forward = [("head forward", terms["head_s"] / 3), ("root forward (embedding, final norm, loss)", mem * share_f)]
    backward = [("head backward", 2 * terms["head_s"] / 3), ("root backward (loss, final norm, embedding)",
                                                            mem * (1 - share_f)),
                ("FSDP's copies around its collectives, every unit", terms["fsdp_copy_s"]),
                ("Float8 weight casts, every block", terms["weight_casts_s"]),
                ("TP root copies", terms["tp"].root_copy_s)]
    return forward, backward
