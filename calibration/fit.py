"""Fit the cost model's efficiency coefficients to measured runs (scipy least squares).

Step time. The unknowns are the Profile coefficients of the operator-level step time (kernel_time.py)
the runs can inform:
- compute_efficiency[dtype] for each compute dtype that was run (the matmuls' achieved fraction of the
  GPU's large-GEMM rate);
- with two runs or more: microstep_overhead_s (a fixed cost per micro-step), memory_bound_efficiency
  (the pointwise kernels' fraction of HBM bandwidth), attention_efficiency (a scale on the catalog's
  flash-kernel figure) and matmul_half_dim (the matmul efficiency curve: x0 of the shape factor
  prod x / (x + x0), which runs of different micro-batches or widths tell apart from compute_efficiency);
- intra_node_comm_efficiency / inter_node_comm_efficiency, when a run communicated on that tier (runs
  under --emulate-world-size have no real communication and do not inform them), and with two such runs
  overlap_slowdown (compute slowed beside NCCL), with three the tier's per-hop latency;
- the mesh's rates (MESH_RATES): tp_comm_efficiency when a run's TP collectives really ran (tp > 1, not
  emulated), ep_comm_efficiency when its EP all-to-alls did (ep > 1 on a mixture-of-experts model). Each is a
  multiplier on the bus bandwidth of the tier its group spans (cost_models/profile.py), so it is told apart
  from the tier's own efficiency by runs whose TP (EP) share of the step differs from their FSDP share: runs at
  several tp, or beside data-parallel-only runs. They join whenever a run informs them, and are kept only where
  the runs identify them (below); otherwise they stay at their starting value (1.0: the tier's rate).
Which of them the runs identified is reported, not assumed: from the fit's Jacobian (the data and the
weak prior), each coefficient's standard error in log space; one within IDENTIFIED_LOG_ERROR (about
+-10%) is identified, the others stayed near their starting values (Fit.identified / not_identified).
For each set of values the full cost model (cost_models.step_time) predicts every run; the fit
minimises the squared log-ratios predicted/measured (relative errors, so a 2 s and a 0.2 s run weigh
the same), plus a weak pull (weight PRIOR_WEIGHT) of each coefficient's log towards its starting
value. The pull only matters where the runs do not determine a coefficient, e.g. two runs and three
unknowns: that coefficient then stays near its published default instead of drifting to a bound.

Memory. The allocated peak has no free coefficient (it is a ledger of tensors, checked in the report).
What sits above it is fitted directly from the GPU runs: fragmentation = median(max reserved / max
allocated - 1), cuda_context_bytes = median(device memory used outside PyTorch's allocator). CPU runs
measure neither, so both keep their values.

No torch: this runs in the planner process on results read back from results.jsonl.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from cost_models.evaluate import evaluate
from cost_models.profile import Profile
from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec, ModelSpec, TrainingSpec
from cost_models.step_time import TimeBreakdown, estimate_step_time

from .spec_dicts import model_spec_from_dict

PRIOR_WEIGHT = 1e-3
IDENTIFIED_LOG_ERROR = 0.1   # a coefficient known to about +-10% counts as identified by the runs
# The noise the identification assumes on each run's log step time (repeat-to-repeat spread of short runs).
RUN_LOG_NOISE = 0.02
_BOUNDS = {  # (low, high) of each fitted coefficient
    "compute_efficiency": (1e-3, 2.0),  # > 1 possible on CPU, where "peak" is a measured matmul rate
    "microstep_overhead_s": (1e-6, 10.0),
    "intra_node_comm_efficiency": (1e-3, 10.0),
    "inter_node_comm_efficiency": (1e-3, 10.0),
    "memory_bound_efficiency": (1e-3, 4.0),
    "attention_efficiency": (1e-3, 10.0),
    "matmul_half_dim": (1.0, 8192.0),
    "overlap_slowdown": (1e-4, 5.0),
    "tp_comm_efficiency": (1e-3, 10.0),
    "ep_comm_efficiency": (1e-3, 10.0),
    "intra_node_latency_s": (1e-8, 1e-2),
    "inter_node_latency_s": (1e-8, 1e-2),
}


@dataclass(frozen=True)
class Sample:
    """One measured run, with everything the cost model needs to predict it."""

    run_id: str
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    config: FsdpConfig
    step_s: float
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    non_torch_bytes: int | None = None
    emulated: bool = False


def specs_from_setup(setup) -> tuple[ModelSpec, ClusterSpec, TrainingSpec, FsdpConfig]:
    """The cost-model specs of a stored run (calibration.store.RunSetup)."""
    gpu = GpuSpec(**setup.gpu)
    cluster = ClusterSpec(gpu=gpu, n_gpus=setup.n_gpus, gpus_per_node=setup.gpus_per_node,
                          internode_bytes_per_s=setup.internode_bytes_per_s)
    config = dict(setup.config)
    config["ac_every"] = config.pop("activation_checkpointing")
    return model_spec_from_dict(setup.model), cluster, TrainingSpec(**setup.training), FsdpConfig(**config)


def sample_from_record(record) -> Sample:
    model, cluster, training, config = specs_from_setup(record.setup)
    m = record.measured
    return Sample(run_id=record.run_id, model=model, cluster=cluster, training=training, config=config,
                  step_s=m.step_s, peak_allocated_bytes=m.peak_allocated_bytes,
                  peak_reserved_bytes=m.peak_reserved_bytes, non_torch_bytes=m.non_torch_bytes,
                  emulated=record.setup.emulated)


def predicted_step_s(sample: Sample, profile: Profile) -> float:
    """The step the run should have measured: emulated runs did no real communication."""
    t = estimate_step_time(sample.model, sample.cluster, sample.training, sample.config, profile)
    return t.step_s - t.exposed_comm_s - t.overlap_slowdown_s if sample.emulated else t.step_s


def step_time(sample: Sample, profile: Profile) -> TimeBreakdown:
    return estimate_step_time(sample.model, sample.cluster, sample.training, sample.config, profile)


def _communicates(sample: Sample) -> tuple[bool, bool]:
    """(intra-node, inter-node) tiers this run's collectives used."""
    if sample.emulated or sample.cluster.n_gpus == 1:
        return False, False
    c, cl = sample.config, sample.cluster
    d, replicas = c.shard_group_size(cl), c.replicate_group_size(cl)
    intra = 1 < d <= cl.gpus_per_node or (replicas > 1 and cl.n_nodes == 1)
    inter = cl.n_nodes > 1 and (d > cl.gpus_per_node or replicas > 1)
    return intra, inter


MESH_RATES = ("tp_comm_efficiency", "ep_comm_efficiency")


def _mesh_communicates(sample: Sample) -> tuple[bool, bool]:
    """(TP, EP): whether this run's TP collectives / EP all-to-alls really ran (a group of 2+ ranks on a real
    process group; an emulated run's collectives return at once)."""
    if sample.emulated or sample.cluster.n_gpus == 1:
        return False, False
    c = sample.config
    return c.tp > 1, c.ep > 1 and sample.model.moe is not None


@dataclass
class Fit:
    profile: Profile
    fitted: list[str]
    step_error_before: float          # RMS relative step-time error with the starting profile
    step_error_after: float
    per_run: list[dict] = field(default_factory=list)  # run_id, measured, before, after
    notes: list[str] = field(default_factory=list)
    identified: dict[str, float] = field(default_factory=dict)   # coefficient -> relative standard error
    not_identified: list[str] = field(default_factory=list)      # fitted, but the runs barely moved them


def _rms_rel(pairs) -> float:
    errors = [(p - m) / m for p, m in pairs]
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0


def _unknowns(samples: list[Sample]) -> tuple[list[str], list[str], list[str]]:
    """(base, mesh, extra): the unknowns fitted whenever runs inform them; the mesh's rates, fitted whenever runs
    inform them and kept only where the runs identify them; the operator-level ones, fitted only with more runs
    than unknowns and kept only where the runs identify them (fit_profile)."""
    names = [f"compute_efficiency:{d}" for d in sorted({s.config.precision.compute_dtype for s in samples})]
    extra = []
    if len(samples) >= 2:
        names.append("microstep_overhead_s")
        extra += ["memory_bound_efficiency", "attention_efficiency", "matmul_half_dim"]
    tiers = [_communicates(s) for s in samples]
    for k, tier in enumerate(("intra_node", "inter_node")):
        n_runs = sum(1 for t in tiers if t[k])
        if n_runs:
            names.append(f"{tier}_comm_efficiency")
        if n_runs >= 3:
            extra.append(f"{tier}_latency_s")
    if sum(1 for t in tiers if any(t)) >= 2:
        extra.append("overlap_slowdown")
    mesh = [_mesh_communicates(s) for s in samples]
    mesh_names = [name for k, name in enumerate(MESH_RATES) if any(m[k] for m in mesh)]
    return names, mesh_names, extra


def _log_errors(jacobian) -> list[float]:
    """Standard error of each unknown's log from the least-squares Jacobian of the residuals (the runs' log
    errors and the prior's pull alike, in units of RUN_LOG_NOISE): sqrt of the diagonal of (J^T J)^-1."""
    import numpy as np

    j = np.array(jacobian, dtype=float) / RUN_LOG_NOISE
    return [float(math.sqrt(max(v, 0.0))) for v in np.diag(np.linalg.pinv(j.T @ j))]


def _get(profile: Profile, name: str) -> float:
    if name.startswith("compute_efficiency:"):
        return profile.efficiency(name.split(":", 1)[1])
    return getattr(profile, name)


def _with(profile: Profile, values: dict[str, float]) -> Profile:
    eff = dict(profile.compute_efficiency)
    changes = {}
    for name, value in values.items():
        if name.startswith("compute_efficiency:"):
            eff[name.split(":", 1)[1]] = value
        else:
            changes[name] = value
    return replace(profile, compute_efficiency=eff, **changes)


def _bounds(name: str) -> tuple[float, float]:
    return _BOUNDS[name.split(":", 1)[0]]


def fit_profile(samples: list[Sample], base: Profile, source: str = "fitted") -> Fit:
    """Coefficients that best explain the measured runs, starting from (and pulled weakly towards) base."""
    import numpy as np
    from scipy.optimize import least_squares

    if not samples:
        return Fit(base, [], 0.0, 0.0, notes=["no measured run: nothing to fit"])
    base_names, mesh_names, extra = _unknowns(samples)
    measured = np.array([s.step_s for s in samples])

    def solve(names: list[str]):
        start = np.array([math.log(min(max(_get(base, n), _bounds(n)[0] * 1.01), _bounds(n)[1] * 0.99))
                          for n in names])
        low = np.array([math.log(_bounds(n)[0]) for n in names])
        high = np.array([math.log(_bounds(n)[1]) for n in names])

        def residuals(x):
            profile = _with(base, dict(zip(names, np.exp(x))))
            predicted = np.array([predicted_step_s(s, profile) for s in samples])
            return np.concatenate([np.log(predicted / measured), PRIOR_WEIGHT * (x - start)])

        return least_squares(residuals, start, bounds=(low, high), x_scale=1.0, method="trf")

    # The operator-level coefficients join only with more runs than unknowns, and stay only where the runs
    # identify them: an unidentified one would trade against the others instead of keeping its default.
    # Backward elimination: drop the least determined of them and refit, while one is not identified and
    # the smaller model still explains the runs within their noise. The mesh's rates join whenever a run
    # informs them and take part in the same elimination, but leave whenever they are not identified (their
    # default is the tier's own rate, which the other coefficients are fitted to), explained or not.
    base_names = base_names + mesh_names
    names = base_names + extra if len(samples) > len(base_names) + len(extra) else base_names
    result = solve(names)
    while True:
        errors = dict(zip(names, _log_errors(result.jac)))
        loose = [n for n in names if n in extra + mesh_names and errors[n] > IDENTIFIED_LOG_ERROR]
        if not loose:
            break
        worst = max(loose, key=errors.get)
        smaller = [n for n in names if n != worst]
        reduced = solve(smaller)
        if worst in extra and float(np.sqrt(np.mean(reduced.fun[:len(samples)] ** 2))) > RUN_LOG_NOISE:
            loose_mesh = [n for n in loose if n in mesh_names]
            if not loose_mesh:
                break
            smaller = [n for n in names if n != max(loose_mesh, key=errors.get)]
            reduced = solve(smaller)
        names, result = smaller, reduced
    dropped = [n for n in mesh_names + extra if n not in names]
    values = dict(zip(names, (float(v) for v in np.exp(result.x))))
    notes = []
    for name, value in values.items():
        lo, hi = _bounds(name)
        if value <= lo * 1.05 or value >= hi * 0.95:
            notes.append(f"{name} ended at its bound ({value:.3g}): the runs barely constrain it")
    if dropped:
        notes.append(f"kept at their starting values (the runs do not identify them): {', '.join(dropped)}")
    if len(samples) < len(names):
        notes.append(f"{len(samples)} runs for {len(names)} unknowns: the weakly determined ones stay near "
                     "their starting values")
    else:
        # Runs that differ only in ways some coefficients affect alike (say, all with one micro-step of the
        # same size: compute efficiency and per-micro-step overhead move every run together) leave those
        # coefficients tied: the data's Jacobian has fewer independent directions than unknowns.
        data_jac = result.jac[:len(samples)]
        singular = np.linalg.svd(data_jac, compute_uv=False)
        rank = int(np.sum(singular > 1e-3 * singular[0])) if singular.size and singular[0] > 0 else 0
        if rank < len(names):
            notes.append(f"the runs determine {rank} independent combination(s) of the {len(names)} unknowns; the "
                         "rest stay near their starting values (vary micro-batch, accumulation or checkpointing "
                         "across runs to separate them)")

    # memory above the allocated peak (GPU runs only)
    memory = {}
    ratios = [s.peak_reserved_bytes / s.peak_allocated_bytes - 1 for s in samples
              if s.peak_reserved_bytes and s.peak_allocated_bytes]
    if ratios:
        memory["fragmentation"] = max(0.0, statistics.median(ratios))
    outside = [s.non_torch_bytes for s in samples if s.non_torch_bytes is not None]
    if outside:
        memory["cuda_context_bytes"] = int(statistics.median(outside))
    fitted_profile = replace(_with(base, values), **memory, source=source)
    label = {n: n.replace(":", "[") + "]" if ":" in n else n for n in names}
    identified = {label[n]: math.exp(errors[n]) - 1 for n in names if errors[n] <= IDENTIFIED_LOG_ERROR}
    not_identified = [label[n] for n in names if errors[n] > IDENTIFIED_LOG_ERROR]

    per_run = []
    for s in samples:
        before, after = predicted_step_s(s, base), predicted_step_s(s, fitted_profile)
        per_run.append({"run_id": s.run_id, "measured_step_s": s.step_s, "before_step_s": before,
                        "after_step_s": after})
    return Fit(
        profile=fitted_profile,
        fitted=[label[n] for n in names] + list(memory),
        step_error_before=_rms_rel((r["before_step_s"], r["measured_step_s"]) for r in per_run),
        step_error_after=_rms_rel((r["after_step_s"], r["measured_step_s"]) for r in per_run),
        per_run=per_run,
        notes=notes,
        identified=identified,
        not_identified=not_identified,
    )


def predict(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig, profile: Profile):
    """The cost model's evaluation of one configuration (memory, time, fits)."""
    return evaluate(model, cluster, training, config, profile)
