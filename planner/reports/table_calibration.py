"""A calibration report for people (tables of predicted against measured, the fit, the re-ranking) and
for scripts (JSON). Beside planner/reports/table.py, whose unit formatting and training line it shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tabulate import tabulate

from cost_models.units import GiB, MiB

from planner.reports.table import training_line
from planner.search.words import describe

if TYPE_CHECKING:
    from planner.calibrating import CalibrationReport


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def _pct(predicted: float | None, measured: float | None) -> str:
    if predicted is None or not measured:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.0f}%"


def calibration_text(report: CalibrationReport) -> str:
    from planner.emit import recommendation_text

    c = report.cluster
    t = report.target
    size = f"{t.spec.n_params / 1e9:.2f}B" if t.spec.n_params >= 1e9 else f"{t.spec.n_params / 1e6:.2f}M"
    lines = [f"{t.name}: {size} parameters, {t.spec.n_layers} x {t.spec.block_class}"
             + (f" (runs use {t.run_spec.n_layers} blocks)" if t.reduced else ""),
             f"cluster: {c.n_gpus} x {c.gpu.name}, {c.gpus_per_node} per node; FSDP{report.request.fsdp_version}",
             training_line(report.training), ""]
    if report.commands:
        lines += ["Multi-node: run each run's command on its node, in order (the job files must be visible there).",
                  "Or run this same fsdp-plan calibrate command on every node with --launch --node-rank N (node 0",
                  "records results.jsonl and fits), or print a SLURM script that does so with --emit slurm.", "",
                  *report.commands]
        return "\n".join(lines)
    fitted = report.fit is not None
    rows = []
    for i, v in enumerate(report.runs, 1):
        r, p = v.record, v.record.predicted
        if r.measured is None:
            rows.append([i, describe(v.config, compact=True), f"{r.error.kind.upper()}", f"{p.step_s:.3f}", "-", "-", "-", "-",
                         _bytes(p.peak_allocated_bytes), "-", "-", "-"])
            continue
        m = r.measured
        after = v.after.time.step_s if fitted else None
        rows.append([i, describe(v.config, compact=True), "ok", f"{p.step_s:.3f}", f"{m.step_s:.3f}", _pct(p.step_s, m.step_s),
                     f"{after:.3f}" if after is not None else "-", _pct(after, m.step_s),
                     _bytes(p.peak_allocated_bytes), _bytes(m.peak_allocated_bytes),
                     _pct(p.peak_allocated_bytes, m.peak_allocated_bytes), f"{m.tokens_per_s_per_gpu:,.0f}"])
    headers = ["#", "config", "status", "pred step s", "meas step s", "err", "fitted step s", "err",
               "pred peak", "meas peak", "err", "meas tok/s/GPU"]
    lines += ["Predicted vs measured (step: median after warm-up, slowest rank; peak: allocated, largest rank):",
              tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True), ""]
    failed = [(i, v) for i, v in enumerate(report.runs, 1) if v.record.error is not None]
    for i, v in failed:
        e = v.record.error
        who = f" rank {e.rank}" if e.rank is not None else ""
        lines.append(f"#{i} {e.kind}{who}: {e.message[:300]}  (log: {Path(report.request.out_dir) / v.record.log})")
    for i, v in enumerate(report.runs, 1):
        if v.measured is not None and v.measured.memory_source == "none":
            lines.append(f"#{i}: {v.measured.memory_note}")
    if failed:
        lines.append("")
    lines += _phase_lines(report)
    if report.fit is not None:
        f = report.fit
        p = report.profile
        eff = ", ".join(f"{k} {v:.3f}" for k, v in sorted(p.compute_efficiency.items()))
        lines += [f"Fit ({len(f.per_run)} measured runs; fitted: {', '.join(f.fitted) or 'nothing'}):",
                  f"  compute efficiency {eff}; micro-step overhead {p.microstep_overhead_s * 1e3:.2f} ms; "
                  f"comm efficiency intra {p.intra_node_comm_efficiency:.3f}, inter {p.inter_node_comm_efficiency:.3f}; "
                  f"fragmentation {p.fragmentation:.3f}; context {_bytes(p.cuda_context_bytes)}",
                  f"  memory-bound efficiency {p.memory_bound_efficiency:.3f}, attention x{p.attention_efficiency:.3f}, "
                  f"overlap slowdown {p.overlap_slowdown:.3f}",
                  f"  identified by the runs: " + (", ".join(f"{k} (+-{100 * v:.0f}%)" for k, v in f.identified.items())
                                                    or "none") + (f"; loosely determined: {', '.join(f.not_identified)}"
                                                                  if f.not_identified else ""),
                  f"  step-time error (RMS): {100 * f.step_error_before:.0f}% with the starting profile, "
                  f"{100 * f.step_error_after:.0f}% fitted",
                  *[f"  note: {n}" for n in f.notes],
                  f"  profile: {report.profile_path}  (use: fsdp-plan ... --profile {report.profile_path})", ""]
    ranked = report.ranked
    if ranked:
        rows = []
        for i, v in enumerate(ranked, 1):
            m = v.measured
            row = [i, describe(v.config, compact=True), f"{m.tokens_per_s_per_gpu:,.0f}", f"{m.step_s:.3f}",
                   _bytes(m.peak_allocated_bytes if m.peak_reserved_bytes is None else m.peak_reserved_bytes)]
            if t.reduced:
                row += [f"{v.extrapolated_step_s:.3f}" if v.extrapolated_step_s else "-",
                        _bytes(v.extrapolated_peak_bytes)]
            rows.append(row)
        headers = ["rank", "config", "tok/s/GPU", "step s", "peak"]
        if t.reduced:
            headers += [f"step s at {t.spec.n_layers} blocks (extrap.)", "peak (extrap.)"]
        lines += ["Re-ranked by measured throughput:",
                  tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True), ""]
    lines += [f"note: {n}" for n in report.notes]
    if report.best is not None:
        lines += ["", recommendation_text(report.best)]
    return "\n".join(lines)


def _phase_lines(report: CalibrationReport) -> list[str]:
    """Predicted against measured per phase for the runs with a torch.profiler trace (calibrate --torch-profile):
    the trace's marked forward / backward / optimizer ranges against the same cut of the predicted timeline
    (cost_models.step_timeline.phase_seconds) with the profile the fit left (or the one given)."""
    from calibration.fit import specs_from_setup
    from cost_models.step_timeline import phase_seconds, step_timeline

    from planner.calibrating.step_profile import PHASES, read_phase_seconds, trace_path

    rows, traces = [], []
    for i, v in enumerate(report.runs, 1):
        path = trace_path(Path(report.request.out_dir) / "runs" / v.record.run_id)
        measured = read_phase_seconds(path) if v.measured is not None and v.after is not None else {}
        if not measured or v.after.config.pp > 1:
            continue
        spec, _, training, _ = specs_from_setup(v.record.setup)
        predicted = phase_seconds(step_timeline(spec, report.cluster, training, v.after.config, report.profile))
        pred_total, meas_total = sum(predicted.values()), sum(measured.values())
        rows.append([i, describe(v.config, compact=True)] + [
            f"{predicted[p]:.3f}/{measured[p]:.3f} {100 * predicted[p] / pred_total:.0f}%/"
            f"{100 * measured[p] / meas_total:.0f}%" if p in measured else "-" for p in PHASES]
            + [f"x{meas_total / v.measured.wall_step_s:.1f}" if v.measured.wall_step_s else "-"])
        traces.append(f"  #{i}: {path}")
    if not rows:
        return []
    by = "the fitted profile" if report.fit is not None else "the starting profile"
    return [f"Per phase: predicted ({by}) / measured s, then each one's share of the step. Measured:",
            "one more step under torch.profiler, wall clock, which the profiler's cost per op and a shared host",
            "slow (last column: its phases against the timed steps' median wall time; shares compare better):",
            tabulate(rows, headers=["#", "config", *PHASES, "profiled/timed"], tablefmt="simple",
                     disable_numparse=True),
            "torch.profiler traces (open in ui.perfetto.dev):", *traces, ""]


def calibration_json(report: CalibrationReport) -> str:
    return json.dumps({
        "model": report.target.name,
        "runs": [json.loads(v.record.model_dump_json()) | {
            "fitted_step_s": v.after.time.step_s if v.after else None,
            "extrapolated_step_s": v.extrapolated_step_s, "extrapolated_peak_bytes": v.extrapolated_peak_bytes}
            for v in report.runs],
        "new_runs": report.new_run_ids,
        "skipped_runs": report.skipped_run_ids,
        "fit": None if report.fit is None else {
            "fitted": report.fit.fitted, "step_error_before": report.fit.step_error_before,
            "step_error_after": report.fit.step_error_after, "notes": report.fit.notes,
            "identified": report.fit.identified, "not_identified": report.fit.not_identified},
        "profile_path": str(report.profile_path) if report.profile_path else None,
        "ranked": [v.record.run_id for v in report.ranked],
        "best": report.best.config.to_dict() if report.best is not None else None,
        "notes": report.notes,
        "commands": report.commands,
    }, indent=2)

