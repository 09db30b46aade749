"""The calibration flow: plan -> run the top K (or one given config), one torchrun job each -> append each
run's record to DIR/results.jsonl as it ends -> fit the profile on every measured run there -> re-rank."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from calibration import launch as launching
from calibration import lock, store
from calibration.fit import Sample, fit_profile, sample_from_record, specs_from_setup
from cost_models.evaluate import Evaluation, evaluate
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.specs import Attention, ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec, parse_enum

from ..api import model_attention
from ..errors import PlannerError
from ..search import SearchSpace, describe, search
from ..trainers import narrow_space, trainer_named
from .host import ROOT, cpu_cluster, cpu_fingerprint, live_fingerprint, probe_host, runner_env
from .multinode import node_commands
from .pipelines import pipeline_refusal
from . import step_profile
from .progress import Progress
from .request import (CalibrationReport, CalibrationRequest, RunView, Target, nodes_and_per_node, resolve_target,
                      training_spec)

STARTUP_GUESS_S = 20.0       # torchrun + import torch + build, before the first step (progress estimate)


# ------------------------------------------------------------------------------------------ candidates

# torch's context_parallel dispatches only the CUDA SDPA kernels to its ring attention (shared/reference/pitfalls.md)
CP_NEEDS_CUDA = ("context parallelism's ring attention has no CPU path (torch's context_parallel dispatches only "
                 "CUDA SDPA kernels): calibrate cp > 1 on CUDA GPUs, or use --cp 1 with --device cpu")

# calibration.apply runs TP's collectives as DTensor issues them; torchtitan's async TP (inductor's micro-pipelined
# all-gather / reduce-scatter matmuls on symmetric memory, CUDA only) is not applied, so a run could not be what
# the plan priced
ASYNC_TP_NOT_APPLIED = ("async TP is not applied by the calibration runner (inductor's micro-pipelined TP on "
                        "symmetric memory, CUDA only): calibrate tp without async TP")


def _space(request: CalibrationRequest, spec: ModelSpec) -> SearchSpace:
    precisions = request.precisions or (["fp32"] if request.device == "cpu" else None)
    # The mesh as the plan command searches it: the runner applies TP and EP (calibration.apply, gloo on a CPU)
    # and CP on CUDA, so a run measures exactly the configuration it is fitted as. FSDP1 composes with no mesh.
    kwargs: dict = {"async_tp": (False,)}  # ASYNC_TP_NOT_APPLIED
    if request.fsdp_version == 1:
        kwargs.update(tp=1, cp=1, ep=1)
    elif request.device == "cpu":
        kwargs["cp"] = 1  # CP_NEEDS_CUDA
    if request.device == "cpu":
        kwargs["offload"] = (False,)  # "offload to the CPU" from a CPU measures nothing
    space = SearchSpace(precisions=tuple(parse_enum(Precision, p, "precision") for p in precisions) if precisions
                        else None, attention=parse_enum(Attention, model_attention(spec, request.attention), "attention"),
                        **kwargs)  # then what the runner, the planner's own FSDP code, runs (calibration/apply.py)
    return narrow_space(space, trainer_named("fsdp1" if request.fsdp_version == 1 else "fsdp2"))


def candidates(request: CalibrationRequest, target: Target, cluster: ClusterSpec, training: TrainingSpec,
               profile: Profile) -> list[FsdpConfig]:
    if request.config is not None:
        attention = model_attention(target.spec, request.attention)
        config = dataclasses.replace(request.config, attention=attention)
        _check_mesh(request, target, cluster, training, config)
        return [config]
    if request.top < 1:
        raise PlannerError("top", f"must be >= 1, got {request.top}")
    result = search(target.spec, cluster, training, profile, _space(request, target.spec))
    if not result.fitting:
        raise PlannerError("model", f"no configuration of {target.name} fits {cluster.n_gpus} x {cluster.gpu.name}: "
                                    "nothing to calibrate (run `fsdp-plan` for the nearest misses)")
    runnable = [e.config for e in result.fitting if pipeline_refusal(request, target, e.config) is None]
    return runnable[:request.top]


def _check_runnable(request: CalibrationRequest, config: FsdpConfig) -> None:
    if config.cp > 1 and request.device == "cpu":
        raise PlannerError("cp", CP_NEEDS_CUDA)
    if config.async_tp:
        raise PlannerError("async_tp", ASYNC_TP_NOT_APPLIED)
    if request.fsdp_version == 1 and config.model_parallel * config.ep > 1:
        raise PlannerError("fsdp_version", "FSDP1 composes with no device mesh: tp / cp / ep need --fsdp-version 2")


def _check_mesh(request: CalibrationRequest, target: Target, cluster: ClusterSpec, training: TrainingSpec,
                config: FsdpConfig) -> None:
    """The given configuration's mesh must be one the runner can apply here and the model and cluster allow: one
    line (PlannerError) otherwise."""
    _check_runnable(request, config)
    refused = pipeline_refusal(request, target, config)
    if refused:
        raise PlannerError(*refused)
    from cost_models.mesh_rules import mesh_refusals

    refused = mesh_refusals(target.run_spec, cluster, training, config)
    if refused:
        raise PlannerError(refused[0].field, f"{refused[0].reason}; {refused[0].fix}")


def _setup(request: CalibrationRequest, target: Target, cluster: ClusterSpec, training: TrainingSpec,
           config: FsdpConfig) -> store.RunSetup:
    return store.RunSetup(
        model=dataclasses.asdict(target.run_spec), full_n_layers=target.spec.n_layers,
        gpu=store.gpu_spec_dict(cluster.gpu), n_gpus=cluster.n_gpus, gpus_per_node=cluster.gpus_per_node,
        internode_bytes_per_s=cluster.internode_bytes_per_s, training=_training_dict(training),
        config=config.to_dict(), fsdp_version=request.fsdp_version, device=request.device,
        emulated=bool(request.emulate_world_size), steps=request.steps, warmup=request.warmup)


def _training_dict(training: TrainingSpec) -> dict:
    return {"seq_len": training.seq_len, "global_batch": training.global_batch,
            "optimizer": training.optimizer.value, "optimizer_impl": training.optimizer_impl.value,
            "finetune": training.finetune.value, "lora_rank": training.lora_rank, "lora_dropout": training.lora_dropout}


def _predicted(evaluation: Evaluation, profile: Profile) -> store.Predicted:
    t, m = evaluation.time, evaluation.memory
    return store.Predicted(step_s=t.step_s, peak_allocated_bytes=m.peak_allocated_bytes,
                           peak_reserved_bytes=m.peak_reserved_bytes, exposed_comm_s=t.exposed_comm_s,
                           compute_s=t.compute_s, tokens_per_s_per_gpu=t.tokens_per_s_per_gpu,
                           profile_source=profile.source)



# ------------------------------------------------------------------------------------------ the flow

def calibrate(request: CalibrationRequest, progress_stream=None) -> CalibrationReport:
    if request.device not in ("cuda", "cpu"):
        raise PlannerError("device", f"must be cuda or cpu, got {request.device!r}")
    if request.fsdp_version not in (1, 2):
        raise PlannerError("fsdp_version", f"must be 1 or 2, got {request.fsdp_version}")
    if request.steps < 1 or request.warmup < 0:
        raise PlannerError("steps", "need --steps >= 1 and --warmup >= 0")
    if request.emulate_world_size is not None and request.emulate_world_size < 2:
        raise PlannerError("emulate_world_size", f"must be >= 2, got {request.emulate_world_size}")
    training = training_spec(request)  # validates seq_len, optimizer, finetune before anything is written
    if request.config is not None:  # what the runner cannot apply here, before the CPU is probed
        _check_runnable(request, request.config)
    if request.finetune == "lora":
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise PlannerError("finetune", "LoRA runs add peft adapters: pip install 'fsdp-planner[lora]'")
    # Absolute once, here: the probe and every run start with cwd=ROOT (so `-m calibration.runner` imports
    # this checkout), where a relative --out would name another directory than the user's.
    out = Path(request.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with lock.hold(out, request.node_rank):  # one calibration per folder, until the report is made
        return _calibrate_in(request, out, training, progress_stream)


def _calibrate_in(request: CalibrationRequest, out: Path, training: TrainingSpec, progress_stream) -> CalibrationReport:
    """calibrate's work, with the --out folder locked."""
    results_path = out / store.RESULTS_FILE
    existing, torn = store.read_results(results_path)
    if existing and not request.resume:
        raise PlannerError("out", f"{results_path} already holds {len(existing)} run(s): pass --resume to skip "
                                  "them and add to it, or choose another --out")

    target = resolve_target(request)
    nodes, per_node = nodes_and_per_node(request)
    world = request.emulate_world_size or request.gpus
    if request.emulate_world_size and request.gpus != 1:
        raise PlannerError("emulate_world_size", "runs one process on one device: pass --gpus 1")
    progress = Progress(0, progress_stream)

    # starting profile and the "GPU" the cost model sees
    profile_file = store.load_profile_file(request.profile) if request.profile else None
    host = None
    if request.device == "cpu":
        ranks = 1 if request.emulate_world_size else per_node  # the processes that really run per host
        if profile_file is not None and profile_file.host is not None:
            host = profile_file.host
            if host.ranks != ranks and not request.force_profile:
                raise PlannerError("profile", f"{request.profile} was fitted with {host.ranks} ranks per host, this "
                                              f"calibration runs {ranks}; pass --force-profile to use it anyway")
            hop_latency = profile_file.coefficients.intra_node_latency_s
        else:
            dtypes = {"fp32"} | {parse_enum(Precision, p, "precision").compute_dtype for p in request.precisions or ()}
            if request.config is not None:
                dtypes.add(request.config.precision.compute_dtype)
            probe = probe_host(out, target, training, ranks, dtypes, timeout_s=request.timeout_s or 300,
                               node_rank=request.node_rank, progress=progress)
            host, hop_latency = probe.host, probe.hop_latency_s
        cluster = cpu_cluster(host, world, per_node)
    else:
        from ..hardware import make_cluster

        cluster = make_cluster(world, gpu=request.gpu, gpus_per_node=per_node, internode_gbps=request.internode_gbps)
    if profile_file is not None:
        store.check_profile_gpu(profile_file, cluster.gpu.id, request.profile, request.force_profile)
        if request.node_rank == 0:
            here = live_fingerprint(request, per_node, nodes) if request.device == "cuda" else \
                cpu_fingerprint(out, host, per_node)
            store.check_fingerprint(profile_file, here, request.profile, request.force_profile)
        base = profile_file.profile()
    elif request.device == "cpu":
        # No CUDA context and no caching allocator on a CPU: reserved = allocated.
        base = replace(DEFAULT_PROFILE, intra_node_latency_s=hop_latency, inter_node_latency_s=hop_latency,
                       cuda_context_bytes=0, fragmentation=0.0, source="defaults, CPU latency measured")
    else:
        base = DEFAULT_PROFILE

    configs = candidates(request, target, cluster, training, base)
    done = {r.run_id for r in existing}
    plans = []
    for config in configs:
        setup = _setup(request, target, cluster, training, config)
        plans.append((config, setup, store.run_id(setup)))
    todo = [p for p in plans if p[2] not in done]
    skipped = [p[2] for p in plans if p[2] in done]
    report_notes = [torn.note()] if torn is not None else []
    if torn is not None:  # a hard kill mid-write: the records before it stand, the next one must start a line
        store.drop_torn_line(torn)
        progress.note(torn.note())
    if skipped:
        progress.note(f"--resume: {len(skipped)} run(s) already in {results_path}, skipped")

    multi_node = nodes > 1 and not request.emulate_world_size
    try:
        rendezvous = launching.Rendezvous.parse(request.rdzv_endpoint) if request.rdzv_endpoint else None
    except ValueError as exc:
        raise PlannerError("rdzv_endpoint", str(exc)) from None
    launch = None if request.emulate_world_size else launching.Launch(
        nproc_per_node=per_node, nnodes=nodes, node_rank=request.node_rank, rendezvous=rendezvous)
    if multi_node and launch.rendezvous is None:
        raise PlannerError("rdzv_endpoint", f"{nodes} nodes need --rdzv-endpoint HOST:PORT (node 0's address and "
                                            "a free port)")
    commands: list[str] = []
    new_ids = []
    if multi_node and not request.launch:
        jobs = [(config, _job(request, out, target, config, setup, rid, position)[1])
                for position, (config, setup, rid) in enumerate(plans)]
        commands = node_commands(request.device, jobs, launch, nodes)
    else:
        progress.total = len(todo)
        for config, setup, rid in todo:
            evaluation = evaluate(target.run_spec, cluster, training, config, base)
            record = _run_one(request, out, target, config, setup, rid, evaluation, base, launch,
                              plans.index((config, setup, rid)), progress)
            if record is not None:
                store.append_record(results_path, record)
                new_ids.append(rid)

    return _conclude(request, out, target, cluster, training, base, host, profile_file, new_ids, skipped,
                     report_notes, commands, nodes)


def _job(request: CalibrationRequest, out: Path, target: Target, config: FsdpConfig, setup: store.RunSetup,
         rid: str, position: int) -> tuple[dict, Path]:
    run_dir = out / "runs" / rid
    fault = None
    if request.fault and request.fault.get("run") == position:
        fault = {k: v for k, v in request.fault.items() if k != "run"}
    job = {"run_id": rid, "model": target.job_model(), "config": config.to_dict(), "fsdp_version": setup.fsdp_version,
           "gpus_per_node": setup.gpus_per_node, "seq_len": setup.training["seq_len"],
           "optimizer": setup.training["optimizer"], "finetune": setup.training["finetune"],
           "optimizer_impl": setup.training.get("optimizer_impl", "foreach"),  # results written before it: foreach
           "lora_rank": setup.training["lora_rank"], "lora_dropout": setup.training.get("lora_dropout", 0.0),
           "steps": setup.steps, "warmup": setup.warmup,
           "device": setup.device, "emulate_world_size": request.emulate_world_size,
           "result_path": str(run_dir / "result.json"), "error_dir": str(run_dir / "errors"),
           "fault": fault, "measure_comm": True, "seed": 0,
           "torch_profile": str(step_profile.trace_path(run_dir)) if request.torch_profile else None}
    path = out / "jobs" / f"{rid}.json"
    store.write_atomic(path, json.dumps(job, indent=1) + "\n")
    return job, path


def _timeout(request: CalibrationRequest, evaluation: Evaluation) -> float:
    if request.timeout_s:
        return request.timeout_s
    # Startup (building a large model and its first all-gathers) plus 10x the predicted steps.
    return 600.0 + 10 * (request.warmup + request.steps + 2) * evaluation.time.step_s


def _run_one(request, out, target, config, setup, rid, evaluation, base, launch, position,
             progress) -> store.RunRecord | None:
    """Launch one run, wait for its end, and make its results.jsonl record (None on nodes other than 0)."""
    job, job_path = _job(request, out, target, config, setup, rid, position)
    if launch is not None and launch.rendezvous is not None:  # a fresh port per run: no TIME_WAIT clashes
        launch = replace(launch, rendezvous=replace(launch.rendezvous, port=launch.rendezvous.port + position))
    argv = launching.runner_command(launch, job_path)
    expected = STARTUP_GUESS_S + (request.warmup + request.steps) * evaluation.time.step_s
    progress.start(describe(config, compact=True), expected)
    log_rel = Path("runs") / rid / "log.txt"
    outcome = launching.run_job(argv, timeout_s=_timeout(request, evaluation), result_path=Path(job["result_path"]),
                                error_dir=Path(job["error_dir"]), log_path=out / log_rel, env=runner_env(),
                                cwd=ROOT)
    if request.node_rank != 0 and launch is not None and launch.nnodes > 1:
        progress.end(f"{outcome.status} (node {request.node_rank}: node 0 records the result)")
        return None
    common = dict(run_id=rid, model_name=target.name, setup=setup, predicted=_predicted(evaluation, base),
                  wall_s=outcome.wall_s, log=str(log_rel))
    if outcome.status == "ok":
        measured = store.Measured.model_validate(outcome.result["measured"])
        record = store.RunRecord(**common, measured=measured,
                                 fingerprint=store.Fingerprint.model_validate(outcome.result["fingerprint"]))
        progress.end(f"ok: step {measured.step_s:.3f} s (predicted {evaluation.time.step_s:.3f} s), "
                     f"{measured.tokens_per_s_per_gpu:,.0f} tok/s/GPU, {outcome.wall_s:.0f} s")
    else:
        error = store.RunError(kind=outcome.status, message=outcome.message or "unknown failure", rank=outcome.rank,
                               returncode=outcome.returncode)
        record = store.RunRecord(**common, error=error)
        who = f" (rank {outcome.rank})" if outcome.rank is not None else ""
        progress.end(f"{outcome.status.upper()}{who}: {error.message[:200]}  [log: {out / log_rel}]")
    return record



# ------------------------------------------------------------------------------------------ fit + report

def _conclude(request, out, target, cluster, training, base, host, profile_file, new_ids, skipped, notes, commands,
              nodes) -> CalibrationReport:
    from ..api import Candidate

    records = [r for r in store.read_records(out / store.RESULTS_FILE)
               if r.model_name == target.name and r.setup.gpu.get("id") == cluster.gpu.id
               and r.setup.n_gpus == cluster.n_gpus and r.setup.device == request.device]
    measured = [r for r in records if r.measured is not None]
    fit = None
    profile = base
    profile_path = None
    follower = nodes > 1 and request.node_rank != 0
    if follower:
        notes.append(f"node {request.node_rank}: node 0 records results.jsonl, fits and reports")
    elif request.fit and measured and not commands:
        samples = [_sample_with_cluster(r, cluster) for r in measured]
        fit = fit_profile(samples, base, source=f"fitted by fsdp-plan calibrate ({len(samples)} runs)")
        profile = fit.profile
        fingerprint = measured[-1].fingerprint or store.Fingerprint(
            device_type=request.device, device_name=cluster.gpu.name, devices_per_node=cluster.gpus_per_node,
            torch_version="unknown")
        profile_path = out / store.PROFILE_FILE
        pf = store.ProfileFile(
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"), fingerprint=fingerprint,
            gpu_id=cluster.gpu.id, host=host, coefficients=store.Coefficients.of(profile),
            fit=store.FitSummary(n_runs=len(samples), fitted=fit.fitted, step_error_before=fit.step_error_before,
                                 step_error_after=fit.step_error_after, notes=fit.notes, identified=fit.identified,
                                 not_identified=fit.not_identified),
            runs=[r.run_id for r in measured])
        store.write_profile(profile_path, pf)
    elif not request.fit:
        notes.append("--no-fit: measured only; predictions use the starting profile")
    elif not measured and not commands:
        notes.append("no run measured: nothing to fit")

    views = []
    for r in records:
        spec, run_cluster, run_training, config = specs_from_setup(r.setup)
        view = RunView(record=r, config=config, after=evaluate(spec, cluster, run_training, config, profile))
        if r.measured is not None and r.setup.model["n_layers"] != r.setup.full_n_layers:
            full = replace(spec, n_layers=r.setup.full_n_layers)
            full_eval = evaluate(full, cluster, run_training, config, profile)
            view.extrapolated_step_s = r.measured.step_s + full_eval.time.step_s - view.after.time.step_s
            if r.measured.peak_allocated_bytes is not None:
                view.extrapolated_peak_bytes = int(r.measured.peak_allocated_bytes + full_eval.memory.peak_allocated_bytes
                                                   - view.after.memory.peak_allocated_bytes)
        views.append(view)
    if target.reduced:
        notes.append(f"--layers {target.run_spec.n_layers}: ran {target.run_spec.n_layers} of {target.spec.n_layers} "
                     "blocks; full-depth figures are extrapolated per block (measured + the fitted model's cost of "
                     "the missing blocks)")
    if request.emulate_world_size:
        notes.append(f"--emulate-world-size {request.emulate_world_size}: rank 0 of {request.emulate_world_size} "
                     "on a fake process group; measured steps have no communication, the cost model adds it")
    if request.device == "cpu":
        notes.append("--device cpu: the 'GPU' is this CPU as measured (host.json); fitted efficiencies are "
                     "fractions of those measured rates, not of any GPU's. Step times are each rank's process "
                     "CPU time (a shared host's other processes inflate wall time); wall times are in "
                     "results.jsonl")
    else:
        names = {r.fingerprint.device_name for r in measured if r.fingerprint is not None}
        family = cluster.gpu.id.split("-")[0].lower()  # "h100" of "h100-80gb"
        strangers = sorted(n for n in names if family not in n.lower())
        if strangers:
            notes.append(f"the runs ran on {', '.join(strangers)} but were planned for --gpu {cluster.gpu.id}: the "
                         "fitted efficiencies are relative to the wrong peak figures; pass the right --gpu")

    report = CalibrationReport(request=request, target=target, cluster=cluster, training=training, runs=views,
                               new_run_ids=new_ids, skipped_run_ids=skipped, fit=fit, profile_path=profile_path,
                               profile=profile, starting_profile=base, host=host, notes=notes, commands=commands)
    ranked = report.ranked
    if ranked:
        best = ranked[0].config
        report.best = Candidate(evaluate(target.spec, cluster, training, best, profile), target.spec, cluster, training)
    return report


def _sample_with_cluster(record: store.RunRecord, cluster: ClusterSpec) -> Sample:
    """The record's sample, costed on this calibration's "GPU" (a CPU re-probed on --resume is the same
    host; its stored spec and this one differ only by measurement noise)."""
    s = sample_from_record(record)
    return replace(s, cluster=replace(s.cluster, gpu=cluster.gpu))

