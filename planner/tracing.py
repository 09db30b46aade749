"""trace(): the trace tier beside the analytic estimate, and --verify-top for a plan.

    from planner.tracing import trace
    t = trace("llama2-7b", gpus=8, precision="bf16", micro_batch=2)
    t.traced.peak_allocated_bytes, t.candidate.memory.peak_allocated_bytes, t.to_dict()["difference"]

Arguments are exactly those of planner.api.estimate. torch, transformers and calibration are imported
inside the functions: `import planner` stays free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.evaluate import gpu_memory_reason
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.specs import ModelSpec
from cost_models.units import GiB

from .api import Candidate, Plan, estimate
from .errors import PlannerError
from .progress import progress
from planner.reports.table import training_line

RESERVED_FROM = ("replay", "flat")
INSTALL_HINT = "the trace tier needs transformers for Hugging Face models: pip install 'fsdp-planner[trace]'"


@dataclass
class TraceReport:
    """The traced per-rank memory of one configuration, with the analytic estimate of the same one."""

    candidate: Candidate        # the analytic estimate (config, cluster, time)
    traced: object              # calibration.trace.TraceResult
    profile: Profile
    # "replay": the traced allocations replayed through the caching allocator model, + the memory outside the
    # allocator (the estimate's terms, cost_models/outside_allocator.py);
    # "flat": the traced allocated peak x (1 + fragmentation) + the same outside terms, as the estimate adds
    reserved_from: str = "replay"
    alloc_conf: str = ""        # PYTORCH_CUDA_ALLOC_CONF the replay follows (max_split_size_mb, expandable_segments)

    def __post_init__(self):
        _check_reserved_from(self.reserved_from)
        self.replayed = self.traced.replay(_allocator_settings(self.alloc_conf))

    @property
    def flat_reserved_bytes(self) -> int:
        """Traced allocated peak plus the same fragmentation and memory outside the allocator the estimate adds."""
        return self.profile.reserved_bytes(self.traced.peak_allocated_bytes, self.outside_allocator_bytes)

    @property
    def outside_allocator_bytes(self) -> int:
        """The estimate's memory outside the caching allocator (a trace records the allocator's tensors only)."""
        return self.candidate.memory.outside_allocator_bytes

    @property
    def replay_reserved_bytes(self) -> int | None:
        """The replay's peak reserved (cost_models/caching_allocator.py) + the memory outside the allocator; None
        where the trace recorded no allocation sequence."""
        return None if self.replayed is None else self.replayed.peak_reserved_bytes + self.outside_allocator_bytes

    @property
    def reserved_source(self) -> str:
        return "replay" if self.reserved_from == "replay" and self.replay_reserved_bytes is not None else "flat"

    @property
    def peak_reserved_bytes(self) -> int:
        return self.replay_reserved_bytes if self.reserved_source == "replay" else self.flat_reserved_bytes

    @property
    def fits(self) -> bool:
        return self.peak_reserved_bytes <= self.candidate.cluster.gpu.memory_bytes

    @property
    def relative_error(self) -> float:
        """(estimate - trace) / trace of the peak allocated bytes."""
        return self.candidate.memory.peak_allocated_bytes / self.traced.peak_allocated_bytes - 1

    def difference(self) -> dict:
        est = self.candidate.memory
        traced = self.traced
        est_b = est.breakdown.to_dict()
        keys = list(dict.fromkeys([*est_b, *traced.breakdown]))
        return {
            "peak_allocated_bytes": est.peak_allocated_bytes - traced.peak_allocated_bytes,
            "peak_allocated_relative": round(self.relative_error, 4),
            "peak_phase": {"analytic": est.peak_phase, "trace": traced.peak_phase},
            "breakdown": {k: est_b.get(k, 0) - traced.breakdown.get(k, 0) for k in keys},
        }

    def to_dict(self) -> dict:
        """estimate's JSON shape with the traced memory, "source": "trace", the analytic memory beside it
        and the difference (analytic - trace). Step time is the analytic model's: the trace measures memory."""
        c = self.candidate
        analytic = c.to_dict()
        traced = self.traced
        reasons = [] if self.fits else [gpu_memory_reason(
            self.peak_reserved_bytes, c.cluster.gpu.memory_bytes, f"peak in {traced.peak_phase.replace('_', ' ')}",
            prefix="traced peak ")]
        return {
            "model": c.model.summary_dict(),
            "source": "trace",
            "config": analytic["config"],
            "fits": self.fits,
            "reasons": reasons,
            "memory": {
                "peak_allocated_bytes": traced.peak_allocated_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes,
                "peak_reserved_flat_bytes": self.flat_reserved_bytes,
                "outside_allocator_bytes": self.outside_allocator_bytes,
                "reserved_from": self.reserved_source,
                "peak_phase": traced.peak_phase,
                "breakdown": dict(traced.breakdown),
                "cpu_bytes_per_node": 0,
                "notes": list(traced.notes),
            },
            "time": analytic["time"],
            "fsdp_kwargs": analytic["fsdp_kwargs"],
            "fully_shard_kwargs": analytic["fully_shard_kwargs"],
            "trace": {k: v for k, v in traced.to_dict().items() if k not in ("peak_allocated_bytes", "breakdown",
                                                                            "peak_phase", "notes")},
            "analytic": {"source": "analytic", "fits": c.fits, "reasons": list(c.reasons),
                         "memory": {**analytic["memory"], "peak_moment": c.memory.peak_moment}},
            "difference": self.difference(),
        }


def _check_reserved_from(reserved_from: str) -> None:
    if reserved_from not in RESERVED_FROM:
        raise PlannerError("reserved_from", f"{reserved_from!r}; choose {' or '.join(RESERVED_FROM)}")


def _allocator_settings(alloc_conf: str):
    from cost_models.caching_allocator import AllocatorSettings

    try:
        return AllocatorSettings.parse(alloc_conf)
    except ValueError as exc:
        raise PlannerError("alloc_conf", str(exc)) from None


def _hf_config(model) -> dict | None:
    from .models import hf_config_of

    if isinstance(model, ModelSpec):
        return None
    return hf_config_of(model)


def trace_candidate(candidate: Candidate, hf_config: dict | None, profile: Profile | None = None,
                    reserved_from: str = "replay") -> TraceReport:
    """Trace the configuration of an analytic Candidate (same model, cluster, training); reserved_from:
    TraceReport's; the replay runs under the candidate's alloc_conf."""
    from calibration.trace import TraceError, trace_memory

    spec = candidate.model
    if hf_config is None and spec.family != "llama":
        raise PlannerError("model", f"{spec.name}: no Hugging Face config to build it from and the reference "
                                    "implementation covers the llama family only; pass a preset or config.json")
    kernel = next((k for k in ("norm_kernel", "rope_kernel", "swiglu_kernel", "loss_kernel")
                   if getattr(candidate.config, k).value != "eager"), None)
    if kernel is not None:  # tests/unit/test_kernels_memory.py checks the kernels against CPU runs instead
        raise PlannerError(kernel, "the trace runs the model's own eager ops, not Liger / Transformer Engine kernels "
                                   "or torchtitan's chunked loss: trace with eager kernels")
    try:
        with progress(f"tracing {spec.name} on {candidate.cluster.n_gpus} fake ranks"):
            if candidate.config.pp > 1:  # a trace per pipeline rank; the largest leads, as the estimate's headline
                from calibration.trace_pipeline import trace_pipeline

                traced = max(trace_pipeline(spec, candidate.config, n_gpus=candidate.cluster.n_gpus,
                                            gpus_per_node=candidate.cluster.gpus_per_node,
                                            seq_len=candidate.training.seq_len, optimizer=candidate.training.optimizer,
                                            hf_config=hf_config, finetune=candidate.training.finetune,
                                            optimizer_impl=candidate.training.optimizer_impl),
                             key=lambda t: t.peak_allocated_bytes)
            else:
                traced = trace_memory(spec, candidate.config, n_gpus=candidate.cluster.n_gpus,
                                      gpus_per_node=candidate.cluster.gpus_per_node,
                                      seq_len=candidate.training.seq_len, optimizer=candidate.training.optimizer,
                                      hf_config=hf_config, finetune=candidate.training.finetune,
                                      lora_rank=candidate.training.lora_rank,
                                      lora_dropout=candidate.training.lora_dropout,
                                      routing_imbalance=candidate.training.routing_imbalance,
                                      optimizer_impl=candidate.training.optimizer_impl)
    except TraceError as exc:
        raise PlannerError("trace", str(exc)) from None
    return TraceReport(candidate=candidate, traced=traced, profile=profile or DEFAULT_PROFILE,
                       reserved_from=reserved_from, alloc_conf=candidate.config.alloc_conf)


def require_trace_dependencies(hf_config: dict | None) -> None:
    """PlannerError with the install command when the trace tier cannot import what it needs."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PlannerError("trace", "the trace tier needs torch: pip install 'fsdp-planner[trace]'") from None
    if hf_config is not None:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise PlannerError("trace", INSTALL_HINT) from None


def trace(model, gpus: int, *, profile: Profile | None = None, reserved_from: str = "replay",
          **kwargs) -> TraceReport:
    """Trace one explicit configuration; arguments are those of planner.api.estimate (alloc_conf, e.g.
    "expandable_segments:True", the allocator settings the reserved replay runs under), and TraceReport's
    reserved_from ("replay" or "flat")."""
    if _is_module(model):
        raise PlannerError("model", "the trace tier builds the model itself: pass a preset name, a config.json "
                                    "or its dict, not an nn.Module")
    _check_reserved_from(reserved_from)
    hf_config = _hf_config(model)
    require_trace_dependencies(hf_config)
    candidate = estimate(model, gpus, profile=profile, **kwargs)
    return trace_candidate(candidate, hf_config, profile, reserved_from)


def _is_module(obj) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


# ---------------------------------------------------------------- --verify-top K

@dataclass
class Verification:
    """Whether the trace tier confirms that a planned candidate fits."""

    rank: int                              # 1-based position in the plan
    confirmed: bool
    traced_peak_allocated_bytes: int | None
    traced_peak_reserved_bytes: int | None
    relative_error: float | None           # analytic vs trace, peak allocated
    reason: str = ""                       # why not confirmed (or not traced)

    def to_dict(self) -> dict:
        return {"confirmed": self.confirmed, "traced_peak_allocated_bytes": self.traced_peak_allocated_bytes,
                "traced_peak_reserved_bytes": self.traced_peak_reserved_bytes,
                "analytic_vs_trace": None if self.relative_error is None else round(self.relative_error, 4),
                "reason": self.reason}

    @property
    def label(self) -> str:
        if self.traced_peak_allocated_bytes is None:
            return "not traced"
        return "confirmed" if self.confirmed else "NOT confirmed"


def verify_top(plan: Plan, k: int, model_arg, profile: Profile | None = None) -> list[Verification]:
    """Trace the top k candidates of a plan; each is confirmed when its traced peak reserved (TraceReport's
    peak_reserved_bytes) fits the GPU. A candidate the trace tier cannot run
    (offload, LoRA, an untraceable model) is marked "not traced" with the reason."""
    hf_config = _hf_config(model_arg)
    require_trace_dependencies(hf_config)
    out = []
    for i, candidate in enumerate(plan.candidates[:k]):
        try:
            report = trace_candidate(candidate, hf_config, profile)
        except PlannerError as exc:
            out.append(Verification(i + 1, False, None, None, None, str(exc)))
            continue
        reason = "" if report.fits else report.to_dict()["reasons"][0]
        out.append(Verification(i + 1, report.fits, report.traced.peak_allocated_bytes, report.peak_reserved_bytes,
                                report.relative_error, reason))
    return out


def verification_table(verifications: list[Verification]) -> str:
    from tabulate import tabulate

    rows = [[v.rank, v.label,
             "" if v.traced_peak_reserved_bytes is None else f"{v.traced_peak_reserved_bytes / GiB:.1f}",
             "" if v.relative_error is None else f"{100 * v.relative_error:+.1f}%", v.reason]
            for v in verifications]
    return tabulate(rows, headers=["#", "trace", "traced peak GiB", "estimate vs trace", "reason"],
                    tablefmt="simple", disable_numparse=True)


def report_text(r: TraceReport) -> str:
    """Table form of `fsdp-plan trace`: traced and analytic memory side by side, by category."""
    from tabulate import tabulate

    c = r.candidate
    traced = r.traced
    est = c.memory
    est_b = est.breakdown.to_dict()
    keys = list(dict.fromkeys([*est_b, *traced.breakdown]))
    rows = [[k, f"{traced.breakdown.get(k, 0) / GiB:.2f}", f"{est_b.get(k, 0) / GiB:.2f}",
             f"{(est_b.get(k, 0) - traced.breakdown.get(k, 0)) / GiB:+.2f}"] for k in keys]
    rows.append(["peak allocated", f"{traced.peak_allocated_bytes / GiB:.2f}", f"{est.peak_allocated_bytes / GiB:.2f}",
                 f"{(est.peak_allocated_bytes - traced.peak_allocated_bytes) / GiB:+.2f} "
                 f"({100 * r.relative_error:+.1f}%)"])
    if r.replay_reserved_bytes is not None:
        rows.append(["peak reserved (allocator replay + context)", f"{r.replay_reserved_bytes / GiB:.2f}", "", ""])
    rows.append(["peak reserved (+context, fragmentation)", f"{r.flat_reserved_bytes / GiB:.2f}",
                 f"{est.peak_reserved_bytes / GiB:.2f}", ""])
    lines = [
        f"{c.model.name} ({c.model.n_params / 1e9:.2f}B) on {c.cluster.n_gpus} x {c.cluster.gpu.id}, traced as rank 0 "
        f"of {traced.world_size} (shard group {traced.shard_group_size}, {traced.builder} model, "
        f"{traced.seconds:.1f} s): " + ", ".join(f"{k}={v}" for k, v in c.config.to_dict().items()),
        training_line(c.training),
        "",
        f"Memory per GPU (GiB): trace peak in {traced.peak_phase.replace('_', ' ')}, "
        f"estimate peak in {est.peak_moment or est.peak_phase.replace('_', ' ')}",
        tabulate(rows, headers=["category", "trace", "estimate", "estimate - trace"], tablefmt="simple",
                 disable_numparse=True),
        "",
        "fits (traced): yes" if r.fits else "fits (traced): NO - " + r.to_dict()["reasons"][0],
    ]
    if r.replayed is not None:
        from cost_models.caching_allocator import pool_words

        lines.append(f"allocator replay at its reserved peak: {'; '.join(pool_words(r.replayed.segments_at_peak))}")
    lines += [f"note: {n}" for n in (*traced.notes, *est.notes)]
    return "\n".join(lines)


def verified_plan_json(plan: Plan, top: int, verifications: list[Verification]) -> str:
    """The plan's JSON with a "verification" object on each traced candidate."""
    import json

    shown = max(top, max((v.rank for v in verifications), default=0))
    d = plan.to_dict(shown)
    for v in verifications:
        if v.rank <= len(d["candidates"]) and plan.candidates:
            d["candidates"][v.rank - 1]["verification"] = v.to_dict()
    d["verified_top"] = len(verifications)
    return json.dumps(d, indent=2)


def verified_plan_text(plan: Plan, top: int, verifications: list[Verification], wide: bool = False) -> str:
    from planner.reports.table import plan_text

    shown = max(top, max((v.rank for v in verifications), default=0))
    text = plan_text(plan, shown, wide)
    if not plan.candidates:
        return text + "\n\nNothing fits: no candidate to verify with the trace tier."
    return (text + f"\n\nTrace tier check of the top {len(verifications)} (real FSDP2 step on fake tensors; "
            "confirmed = the traced step's peak reserved, its allocations replayed through the caching allocator, + "
            "context fits the GPU):\n" + verification_table(verifications))
