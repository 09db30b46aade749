"""The predicted step as a Chrome trace-event file (`fsdp-plan explain --timeline FILE`), for Perfetto
(ui.perfetto.dev) and chrome://tracing.

Format: the Trace Event Format (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
a JSON object whose "traceEvents" holds "X" (complete) events with ts / dur in microseconds on a pid / tid, and
"M" (metadata) events naming the process and each thread. One thread per stream: the compute stream, then one
per collective stream (FSDP's all-gather and reduction, the mesh's TP / CP / EP when the plan has them, the
offload copies); the spans are cost_models.step_timeline's, so a collective's part outside the compute spans
(its args' exposed_us) is what step_time.py prices as exposed. A pipeline plan (pp > 1) draws one process per
pipeline rank (cost_models.pipeline_timeline: its schedule actions, p2p sends and receives, FSDP's once-per-step
collectives), its busy and bubble seconds in the process's labels and in otherData's "ranks".
"""

from __future__ import annotations

import json
from pathlib import Path

from cost_models.pipeline_timeline import P2P_RECV, P2P_SEND, pipeline_timeline
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.step_timeline import COMPUTE, REDUCE, TRACKS, StepTimeline, step_timeline, uncovered_s

from planner.api import Candidate
from planner.search.words import describe
from planner.trainers.table import TRAINERS

PID = 1
ORDER = TRACKS[:1] + (P2P_SEND, P2P_RECV) + TRACKS[1:]  # a rank's compute, then its sends, then its collectives


def trace_events(c: Candidate, profile: Profile = DEFAULT_PROFILE) -> dict:
    """The trace-event document of c's predicted optimizer step (`profile`: the one c was costed with)."""
    if c.config.pp > 1:  # FSDP2 only (torchtitan)
        drawn = pipeline_timeline(c.model, c.cluster, c.training, c.config, profile)
    else:  # under c's trainer's FSDP API, as c.time was priced
        drawn = step_timeline(c.model, c.cluster, c.training, c.config, profile,
                              fsdp2=TRAINERS[c.trainer].fsdp_version == 2)
    return timeline_document(drawn,
                             f"predicted step: {c.model.name}, {describe(c.config)}, {c.cluster.n_gpus} x "
                             f"{c.cluster.gpu.id}")


def timeline_document(tl: StepTimeline, title: str) -> dict:
    """One process (pid) per pipeline rank (one without PP), one thread per stream it uses."""
    names = {REDUCE: f"FSDP {tl.reduce_name}"}
    events: list[dict] = []
    ranks = tl.ranks or ({"rank": 0},)
    for info in ranks:
        r, pid = info["rank"], PID + info["rank"]
        spans = [s for s in tl.spans if s.rank == r]
        used = sorted({s.track for s in spans}, key=_track_order)
        tid = {track: i + 1 for i, track in enumerate(used)}
        if tl.ranks:
            stages = ", ".join(map(str, info["stages"]))
            events += [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                        "args": {"name": f"pipeline rank {r}: stages {stages}", "busy_s": info["busy_s"],
                                 "bubble_s": info["bubble_s"]}},
                       {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": r}},
                       {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                        "args": {"labels": f"busy {info['busy_s']:.4f} s, bubble {info['bubble_s']:.4f} s"}}]
        else:
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": title}})
        for track in used:
            events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid[track],
                        "args": {"name": names.get(track, track)}},
                       {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid[track],
                        "args": {"sort_index": tid[track]}}]
        busy = sorted((s.start_s, s.end_s) for s in spans if s.track == COMPUTE)  # back to back: disjoint
        for s in sorted(spans, key=lambda s: (tid[s.track], s.start_s)):
            args = dict(s.args)
            if s.track != COMPUTE:
                args["exposed_us"] = round(uncovered_s(s, busy) * 1e6, 6)  # float noise of the sums off
            events.append({"ph": "X", "name": s.name, "cat": s.phase, "pid": pid, "tid": tid[s.track],
                           "ts": s.start_s * 1e6, "dur": s.dur_s * 1e6, "args": args})
    t = tl.time
    other = {"source": "fsdp-planner's cost model (cost_models/step_time.py), not a measurement",
             "step_s": t.step_s, "compute_s": t.compute_s, "exposed_comm_s": t.exposed_comm_s,
             "total_comm_s": t.total_comm_s, "optimizer_s": t.optimizer_s}
    if tl.ranks:  # PP: the walk's per-rank figures and what the drawing folds
        other.update(title=title, pp_bubble_s=t.pp_bubble_s, pp_imbalance_s=t.pp_imbalance_s,
                     pp_comm_s=t.pp_comm_s, ranks=list(tl.ranks), notes=tl.notes)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _track_order(track: str) -> tuple[int, str]:
    """ORDER's place; a stream's extra lanes ("p2p recv #2") after it."""
    return ORDER.index(track.partition(" #")[0]), track


def write_timeline(c: Candidate, path: str, profile: Profile = DEFAULT_PROFILE) -> Path:
    out = Path(path)
    out.write_text(json.dumps(trace_events(c, profile)))
    return out
