"""The predicted step of a pipeline plan (pp > 1) laid out in time, one set of streams per pipeline rank.

A rendering of the walk that prices the step (cost_models/pipeline_time.py's `walk`, run once by
estimate_step_time with its passes and sends recorded), not a second simulation. Per rank: the compute stream
runs the schedule's actions as the walk ran them ("F s3 mb5", "B ...", zero-bubble's and DualPipeV's split
backward as "I" and "W"); the p2p streams carry each cross-rank transfer a pass waited for (posted when the
sender's pass ended - GPipe / 1F1B: and the receiver's previous pass - arrived p2p_s later; transfers that overlap
on one rank, as DualPipeV's from both neighbours, on a second lane); FSDP's collectives
run once per step (PipelineStage syncs gradients only after a stage's last backward). Then the step's tail, the
same on every rank: what cost_models/pipeline_step.py adds to the schedule's critical path (the overlap
slowdown, FSDP2's copies, the micro-steps' overhead, offload copies, the optimizer step).

Where the model's accounting is not a literal schedule the drawing follows the model and says so in `notes`:
every rank starts the schedule when the slowest rank's exposed all-gather ends (pipeline_time adds the largest
delay once); TP's, CP's and EP's collectives inside a stage are folded into its passes (a pass lasts its compute
plus what they leave exposed, step_time.py's per-block prices); the tail is priced for the mean rank (compute
classes) and the largest (optimizer), drawn on each.
"""

from __future__ import annotations

from dataclasses import replace

from .pipeline import stages
from .profile import Profile
from .specs import ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec
from .step_time import estimate_step_time
from .step_timeline import ALL_GATHER, COMPUTE, OFFLOAD, REDUCE, Span, StepTimeline, reduction_name

P2P_SEND, P2P_RECV = "p2p send", "p2p recv"
TRACKS = (COMPUTE, P2P_SEND, P2P_RECV, ALL_GATHER, REDUCE, OFFLOAD)
PHASES = {"F": "forward", "B": "backward", "I": "backward (input gradients)", "W": "backward (weight gradients)"}
NOTES = {
    "mesh": "TP's, CP's and EP's collectives inside a stage are folded into its passes: a pass lasts its compute "
            "plus what they leave exposed (cost_models/step_time.py's per-block prices)",
    "all-gather": "each stage's all-gathers run back to back from the step's start, once per step (reshard after "
                  "forward off under PP); every rank starts the schedule when the most exposed rank's end "
                  "(cost_models/pipeline_time.py adds the largest delay once)",
    "reduce-scatter": "each stage's reduce-scatters start after its last backward (or W), one stage after another "
                      "on the rank's stream; the step's tail waits for the last of them on any rank",
    "tail": "the overlap slowdown, FSDP2's copies (the mean rank's), the micro-steps' overhead and the optimizer "
            "step (the largest rank's) are priced once for the step and drawn on every rank after the schedule",
    "bubble": "busy_s: the rank's schedule actions; bubble_s: the schedule's makespan without them (warm-up, "
              "cool-down, waits for transfers and for slower ranks); both without the step's tail",
}


def pipeline_timeline(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
                      profile: Profile) -> StepTimeline:
    """Every span of one pipeline schedule step as estimate_step_time prices it (config: as evaluate runs it)."""
    terms: dict = {}
    t = estimate_step_time(model, cluster, training, config, profile, terms)
    pipe, passes = terms["pipeline"], terms["pipeline_passes"]
    timed, shift = pipe.walk, pipe.gather_exposed_s  # the schedule starts after the all-gathers' delay
    layout = stages(model, config)
    rank_of = {st.index: st.rank for st in layout}
    reduce_name = reduction_name(config, cluster)
    spans: list[Span] = []
    for r in range(config.pp):
        at = 0.0
        for st in (st for st in layout if st.rank == r):
            gather_s = passes[st.index].gather_s
            if gather_s > 0:
                spans.append(Span(ALL_GATHER, f"all-gather stage {st.index}", "communication", at, gather_s,
                                  {"stage": st.index, "units": st.describe()}, r))
            at += gather_s
    for a in timed.passes:
        spans.append(Span(COMPUTE, f"{a.kind} s{a.stage} mb{a.microbatch}", PHASES[a.kind], shift + a.start_s,
                          a.end_s - a.start_s, {"stage": a.stage, "microbatch": a.microbatch}, a.rank))
    p2p: list[Span] = []
    for s in timed.sends:
        what = "activations" if s.kind == "F" else "gradients"
        name = f"{what} s{s.src_stage} -> s{s.dst_stage} mb{s.microbatch}"
        args = {"microbatch": s.microbatch, "from_stage": s.src_stage, "to_stage": s.dst_stage}
        for track, rank, verb in ((P2P_SEND, rank_of[s.src_stage], "send"), (P2P_RECV, rank_of[s.dst_stage], "recv")):
            p2p.append(Span(track, f"{verb} {name}", "communication", shift + s.start_s, s.end_s - s.start_s,
                            args, rank))
    spans += _lanes(p2p)
    for st in layout:
        reduce_s = passes[st.index].reduce_s
        if reduce_s > 0:
            spans.append(Span(REDUCE, f"{reduce_name} stage {st.index}", "communication",
                              shift + pipe.reduce_start_s[st.index], reduce_s, {"stage": st.index}, st.rank))
    copies_s = terms["fsdp_copy_s"] / config.pp
    for r in range(config.pp):
        spans += _tail(t, copies_s, config, pipe.step_s, r)
    ranks = tuple({"rank": r, "stages": [st.index for st in layout if st.rank == r],
                   "busy_s": timed.rank_busy_s[r], "bubble_s": timed.step_s - timed.rank_busy_s[r]}
                  for r in range(config.pp))
    notes = {"schedule": config.pp_schedule.value, "pp": config.pp, "stages_per_rank": config.pp_stages_per_rank,
             "microbatches": config.pp_microbatches, "p2p_s": terms["pipeline_p2p_s"], **NOTES}
    return StepTimeline(tuple(spans), t, reduce_name, ranks, notes)


def _lanes(spans: list[Span]) -> list[Span]:
    """Transfers of one rank's stream that overlap in time (DualPipeV receives from both neighbours at once) on
    lanes "p2p recv", "p2p recv #2", ...: a trace viewer stacks a track's slices only when they nest."""
    out, ends = [], {}  # (rank, track) -> each lane's last end
    for s in sorted(spans, key=lambda s: (s.rank, s.track, s.start_s)):
        lanes = ends.setdefault((s.rank, s.track), [])
        lane = next((i for i, end in enumerate(lanes) if end <= s.start_s), len(lanes))
        lanes[lane:lane + 1] = [s.end_s]
        out.append(replace(s, track=s.track if lane == 0 else f"{s.track} #{lane + 1}"))
    return out


def _tail(t, copies_s: float, config: FsdpConfig, start_s: float, rank: int) -> list[Span]:
    """What the step adds after the schedule's critical path (cost_models/pipeline_step.py), on one rank."""
    out, now = [], start_s
    for name, phase, dur_s, note in (
            ("overlap slowdown", "overhead", t.overlap_slowdown_s, "compute slowed by the NCCL kernels beside it "
             "(profile.overlap_slowdown x the hidden communication), spread over the step; drawn here"),
            ("FSDP2 copy-in / copy-out", "overhead", copies_s, "the mean rank's, once per step (gathered all step)"),
            ("micro-step overhead", "overhead", t.overhead_s, f"profile.microstep_overhead_s x "
             f"{config.pp_microbatches} microbatches: launches, Python, the data loader's hand-off")):
        if dur_s > 0:
            out.append(Span(COMPUTE, name, phase, now, dur_s, {"note": note}, rank))
            now += dur_s
    if t.offload_copy_s > 0:
        out.append(Span(OFFLOAD, "offload copies (host <-> device)", "communication", now, t.offload_copy_s, {}, rank))
        now += t.offload_copy_s
    if t.optimizer_s > 0:
        out.append(Span(COMPUTE, "optimizer step (CPU)" if config.offload else "optimizer step", "optimizer", now,
                        t.optimizer_s, {"note": "the largest rank's parameters"}, rank))
    return out
