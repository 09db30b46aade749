"""`fsdp-plan calibrate`: plan -> run the top K (or one given config) under torchrun -> fit -> re-rank.

    from planner.calibrating import CalibrationRequest, calibrate
    report = calibrate(CalibrationRequest(model="llama3-8b", gpus=8, top=3, out_dir="calib"))
    report.best                      # the config that trained fastest, as a planner Candidate
    report.profile_path              # DIR/profile.json, for `fsdp-plan --profile`

Each run is its own torchrun job (calibration.launch) of calibration.runner; its line goes to
DIR/results.jsonl as soon as it ends, measured or failed. The fit (calibration.fit) uses every measured
run in the file, so `--resume` with a larger --top extends a calibration.

--device cpu runs the same FSDP code on gloo, one thread per rank. The cost model has no CPU in its GPU
catalog, so the CPU is measured first (calibration.runner --probe: matmul FLOP/s at the model's shape
per dtype, copy bandwidth, gloo bus bandwidth and latency; DIR/host.json) and used as the "GPU". The
fitted coefficients are then fractions of those measured rates on this host: they calibrate the
machinery (and test it), they say nothing about a GPU.

torch is imported only where a model must be built in this process (a user factory) or a CUDA
fingerprint taken; launching and fitting need neither.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from calibration import launch as launching
from calibration import store
from calibration.fit import Fit, Sample, fit_profile, sample_from_record, specs_from_setup
from cost_models.evaluate import Evaluation, evaluate
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.specs import (Attention, ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec, parse_enum)
from cost_models.units import GiB, MiB

from .api import model_attention
from .errors import PlannerError
from .report import training_line
from .search import SearchSpace, search
from .search import describe as search_describe

ROOT = Path(__file__).resolve().parents[1]
STARTUP_GUESS_S = 20.0       # torchrun + import torch + build, before the first step (progress estimate)
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


# ------------------------------------------------------------------------------------------ request

@dataclass
class CalibrationRequest:
    """One calibration. Field names are the CLI flags (--top -> top)."""

    out_dir: str
    gpus: int
    model: str | None = None             # preset, config.json, or a directory holding one
    factory: str | None = None           # "pkg.module:function" returning the nn.Module (called with n_layers=L)
    device: str = "cuda"                 # cuda | cpu
    gpu: str = "a100-80gb"               # catalog id of the GPUs (cuda)
    gpus_per_node: int | None = None
    nodes: int | None = None
    internode_gbps: float | None = None
    seq_len: int = 2048
    global_batch: int | None = None
    optimizer: str = "adamw"
    finetune: str = "full"               # full | lora (peft adapters on the attention projections)
    lora_rank: int = 16
    precisions: list[str] | None = None
    attention: str | None = None         # None: the model's first choice (sdpa, or eager where it refuses sdpa)
    top: int = 3
    config: FsdpConfig | None = None     # run exactly this configuration instead of the top K
    steps: int = 10
    warmup: int = 3
    fsdp_version: int = 2
    layers: int | None = None            # run a depth-reduced copy, extrapolate per block
    emulate_world_size: int | None = None
    profile: str | None = None           # predict with this profile.json
    force_profile: bool = False
    fit: bool = True
    resume: bool = False
    timeout_s: float | None = None       # per run; default from the predicted step time
    launch: bool = True                  # multi-node: False prints the per-node commands
    rdzv_endpoint: str | None = None     # HOST:PORT of node 0 (multi-node)
    node_rank: int = 0
    fault: dict | None = None            # testing: {"run": i, "rank": r, "step": s, "kind": exit|hang|oom|raise}


@dataclass
class Target:
    """The model to run: its spec at full depth and at the depth actually run, and how to build it."""

    name: str
    spec: ModelSpec
    run_spec: ModelSpec
    source: str                          # reference | hf | factory
    hf_config: dict | None = None
    factory: str | None = None

    @property
    def reduced(self) -> bool:
        return self.run_spec.n_layers != self.spec.n_layers

    def job_model(self) -> dict:
        hf = None
        if self.hf_config is not None:
            hf = dict(self.hf_config)
            for key in _LAYER_KEYS:
                if key in hf:
                    hf[key] = self.run_spec.n_layers
        return {"source": self.source, "spec": dataclasses.asdict(self.run_spec), "hf_config": hf,
                "factory": self.factory, "block_class": self.run_spec.block_class,
                "n_layers": self.run_spec.n_layers if self.reduced else None}


@dataclass
class RunView:
    """A results.jsonl record with the cost model's predictions before and after the fit."""

    record: store.RunRecord
    config: FsdpConfig
    after: Evaluation | None = None              # prediction with the fitted (or given) profile
    extrapolated_step_s: float | None = None     # --layers: measured + the model's cost of the missing blocks
    extrapolated_peak_bytes: int | None = None

    @property
    def measured(self) -> store.Measured | None:
        return self.record.measured


@dataclass
class CalibrationReport:
    request: CalibrationRequest
    target: Target
    cluster: ClusterSpec
    training: TrainingSpec
    runs: list[RunView]                  # every run in results.jsonl of this model and cluster
    new_run_ids: list[str]
    skipped_run_ids: list[str]
    fit: Fit | None
    profile_path: Path | None
    profile: Profile                     # the fitted profile, or the one predictions were made with
    starting_profile: Profile
    host: store.HostSpec | None = None
    best: object | None = None           # planner.api.Candidate of the fastest measured config
    notes: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)  # multi-node without --launch: what to run

    @property
    def ranked(self) -> list[RunView]:
        ok = [r for r in self.runs if r.measured is not None]
        return sorted(ok, key=lambda r: -r.measured.tokens_per_s_per_gpu)


# ------------------------------------------------------------------------------------------ resolving

def resolve_target(request: CalibrationRequest) -> Target:
    from .models import hf_config_of, resolve_model

    if request.factory:
        spec = _factory_spec(request.factory)
        source, hf, name = "factory", None, request.factory
    elif request.model:
        spec = resolve_model(request.model)
        hf = hf_config_of(request.model)
        name = spec.name
        is_preset = hf is not None and not os.path.exists(str(request.model))
        source = "reference" if (is_preset and spec.family == "llama") else "hf"
        if source == "reference":
            hf = None
    else:
        raise PlannerError("model", "missing: pass --model (preset or config.json) or --factory pkg.module:function")
    run_spec = spec
    if request.layers is not None:
        if request.layers < 1:
            raise PlannerError("layers", f"must be >= 1, got {request.layers}")
        if request.layers < spec.n_layers:
            run_spec = replace(spec, n_layers=request.layers)
    return Target(name=name, spec=spec, run_spec=run_spec, source=source, hf_config=hf, factory=request.factory)


def _factory_spec(factory: str) -> ModelSpec:
    """Build the user's model with parameters on meta, read its spec (a `.spec` ModelSpec if it has one)."""
    from calibration.runner import build

    from .models import from_module

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `pkg.module` relative to where the user runs, as `python -m` does
    try:
        module = build({"source": "factory", "factory": factory}, "sdpa")
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise PlannerError("factory", f"cannot build {factory!r}: {exc}") from None
    spec = getattr(module, "spec", None)
    return spec if isinstance(spec, ModelSpec) else from_module(module, name=factory)


def _training(request: CalibrationRequest) -> TrainingSpec:
    return TrainingSpec(seq_len=request.seq_len, global_batch=request.global_batch, optimizer=request.optimizer,
                        finetune=request.finetune, lora_rank=request.lora_rank)


def _nodes_and_per_node(request: CalibrationRequest) -> tuple[int, int]:
    world = request.emulate_world_size or request.gpus
    if request.nodes:
        if world % request.nodes:
            raise PlannerError("nodes", f"--gpus {world} is not a multiple of --nodes {request.nodes}")
        per_node = world // request.nodes
        if request.gpus_per_node and request.gpus_per_node != per_node:
            raise PlannerError("gpus_per_node", f"{request.gpus_per_node} disagrees with --gpus {world} / --nodes "
                                                f"{request.nodes} = {per_node}")
        return request.nodes, per_node
    per_node = request.gpus_per_node or (world if request.device == "cpu" else min(world, 8))
    if world % per_node:
        raise PlannerError("gpus_per_node", f"--gpus {world} is not a multiple of --gpus-per-node {per_node}")
    return world // per_node, per_node


def cpu_cluster(host: store.HostSpec, n_ranks: int, per_node: int) -> ClusterSpec:
    return ClusterSpec(gpu=host.gpu_spec(), n_gpus=n_ranks, gpus_per_node=per_node,
                       internode_bytes_per_s=host.bus_bytes_per_s)


def _probe_host(out_dir: Path, target: Target, training: TrainingSpec, ranks: int, dtypes: set[str],
                timeout_s: float, node_rank: int = 0, progress: "Progress | None" = None) -> store.HostProbe:
    """DIR/host.json, measured now unless an earlier probe there covers these dtypes. Other nodes of a
    multi-node CPU calibration wait for node 0's (same candidates on every node need the same "GPU")."""
    path = out_dir / "host.json"
    if node_rank:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise PlannerError("out", f"no {path} from node 0 after {timeout_s:.0f} s: --out must be a "
                                          "directory every node sees")
            time.sleep(1.0)
        return store.HostProbe.model_validate_json(path.read_text())
    if path.exists():
        probe = store.HostProbe.model_validate_json(path.read_text())
        if dtypes <= {d for d, v in probe.host.peak_flops.items() if v > 0} and probe.host.ranks == ranks:
            return probe
    if progress:
        progress.note("measuring the CPU (matmul FLOP/s, memory and gloo bandwidth) ...")
    spec = target.run_spec
    shape = (2 * training.seq_len, spec.hidden_size, spec.ffn_hidden_size)
    argv = launching.Launch(nproc_per_node=ranks).torchrun_args() + [
        "-m", "calibration.runner", "--probe", "--shape", ",".join(map(str, shape)), "--dtypes", ",".join(sorted(dtypes)),
        "--block-bytes", str(4 * spec.block_params), "--out", str(out_dir / "probe.json")]
    outcome = launching.run_job(argv, timeout_s=timeout_s, result_path=out_dir / "probe.json",
                                error_dir=out_dir / "logs" / "probe-errors", log_path=out_dir / "logs" / "probe.log",
                                env=_env(), cwd=ROOT)
    if outcome.status != "ok":
        raise PlannerError("device", f"measuring the CPU failed ({outcome.status}): {outcome.message}; see "
                                     f"{out_dir / 'logs' / 'probe.log'}")
    probe = store.HostProbe.model_validate(outcome.result)
    store.write_atomic(path, probe.model_dump_json(indent=2) + "\n")
    if progress:
        host = probe.host
        progress.note(f"  {host.name}: {host.peak_flops['fp32'] / 1e9:.1f} GFLOP/s fp32 per rank, gloo "
                      f"{host.bus_bytes_per_s / 1e9:.2f} GB/s bus, {probe.hop_latency_s * 1e6:.0f} us per hop")
    return probe


def _env() -> dict:
    """Ranks import calibration/ from this installation and a --factory module from the current directory
    (as `python -m` would); one thread each (torchrun's default)."""
    paths = [str(ROOT), os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _live_fingerprint(request: CalibrationRequest, per_node: int, nodes: int) -> store.Fingerprint:
    """This cluster's fingerprint, taken in a short subprocess (so this process never holds a CUDA context
    that would sit on GPU 0 during the runs)."""
    code = ("import json, torch; from calibration.runner import fingerprint; "
            f"print(json.dumps(fingerprint(torch.device({request.device!r}), {per_node}, {nodes})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **_env()},
                          cwd=ROOT, timeout=300)
    if proc.returncode:
        raise PlannerError("device", f"cannot read this machine's fingerprint: {proc.stderr.strip()[-300:]}")
    return store.Fingerprint.model_validate_json(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ candidates

def _space(request: CalibrationRequest, spec: ModelSpec) -> SearchSpace:
    precisions = request.precisions or (["fp32"] if request.device == "cpu" else None)
    kwargs = {}
    if request.device == "cpu":
        kwargs["offload"] = (False,)  # "offload to the CPU" from a CPU measures nothing
    return SearchSpace(precisions=tuple(parse_enum(Precision, p, "precision") for p in precisions) if precisions else None,
                       attention=parse_enum(Attention, model_attention(spec, request.attention), "attention"),
                       **kwargs)


def candidates(request: CalibrationRequest, target: Target, cluster: ClusterSpec, training: TrainingSpec,
               profile: Profile) -> list[FsdpConfig]:
    if request.config is not None:
        attention = model_attention(target.spec, request.attention)
        return [dataclasses.replace(request.config, attention=attention)]
    if request.top < 1:
        raise PlannerError("top", f"must be >= 1, got {request.top}")
    result = search(target.spec, cluster, training, profile, _space(request, target.spec))
    if not result.fitting:
        raise PlannerError("model", f"no configuration of {target.name} fits {cluster.n_gpus} x {cluster.gpu.name}: "
                                    "nothing to calibrate (run `fsdp-plan` for the nearest misses)")
    return [e.config for e in result.fitting[:request.top]]


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
            "optimizer": training.optimizer.value, "finetune": training.finetune.value,
            "lora_rank": training.lora_rank}


def _predicted(evaluation: Evaluation, profile: Profile) -> store.Predicted:
    t, m = evaluation.time, evaluation.memory
    return store.Predicted(step_s=t.step_s, peak_allocated_bytes=m.peak_allocated_bytes,
                           peak_reserved_bytes=m.peak_reserved_bytes, exposed_comm_s=t.exposed_comm_s,
                           compute_s=t.compute_s, tokens_per_s_per_gpu=t.tokens_per_s_per_gpu,
                           profile_source=profile.source)


# ------------------------------------------------------------------------------------------ progress

class Progress:
    """One line per event on stderr; on a terminal, a bar that ticks every second with the time left."""

    def __init__(self, total: int, stream=None):
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.durations: list[float] = []
        self.label, self.started, self.expected = "", 0.0, 0.0
        self._stop = threading.Event()
        self._thread = None
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def _eta(self) -> float:
        per_run = sum(self.durations) / len(self.durations) if self.durations else self.expected
        running = max(0.0, per_run - (time.monotonic() - self.started)) if self.label else 0.0
        return running + per_run * max(0, self.total - self.done - (1 if self.label else 0))

    def _line(self) -> str:
        width = 20
        filled = int(width * self.done / max(1, self.total))
        bar = "=" * filled + (">" if self.done < self.total else "") + " " * (width - filled - 1)
        elapsed = time.monotonic() - self.started if self.label else 0.0
        current = f"run {self.done + 1}/{self.total}: {self.label}, {elapsed:.0f} s" if self.label else "done"
        return f"[{bar[:width]}] {current}; ~{self._eta():.0f} s left"

    def start(self, label: str, expected_s: float) -> None:
        self.label, self.started, self.expected = label, time.monotonic(), expected_s
        if self.tty:
            self._stop.clear()
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        else:
            print(self._line(), file=self.stream, flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            print("\r" + self._line() + "   ", end="", file=self.stream, flush=True)

    def end(self, message: str) -> None:
        if self._thread:
            self._stop.set()
            self._thread.join()
            print("\r" + " " * 100 + "\r", end="", file=self.stream)
        self.durations.append(time.monotonic() - self.started)
        self.done += 1
        self.label = ""
        print(f"  {message}", file=self.stream, flush=True)

    def note(self, message: str) -> None:
        print(message, file=self.stream, flush=True)


def describe(config: FsdpConfig) -> str:
    return search_describe(config, compact=True)


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
    training = _training(request)  # validates seq_len, optimizer, finetune before anything is written
    if request.finetune == "lora":
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise PlannerError("finetune", "LoRA runs add peft adapters: pip install 'fsdp-planner[lora]'")
    # Absolute once, here: the probe and every run start with cwd=ROOT (so `-m calibration.runner` imports
    # this checkout), where a relative --out would name another directory than the user's.
    out = Path(request.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / store.RESULTS_FILE
    existing, torn = store.read_results(results_path)
    if existing and not request.resume:
        raise PlannerError("out", f"{results_path} already holds {len(existing)} run(s): pass --resume to skip "
                                  "them and add to it, or choose another --out")

    target = resolve_target(request)
    nodes, per_node = _nodes_and_per_node(request)
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
            probe = _probe_host(out, target, training, ranks, dtypes, timeout_s=request.timeout_s or 300,
                                node_rank=request.node_rank, progress=progress)
            host, hop_latency = probe.host, probe.hop_latency_s
        cluster = cpu_cluster(host, world, per_node)
    else:
        from .hardware import make_cluster

        cluster = make_cluster(world, gpu=request.gpu, gpus_per_node=per_node, internode_gbps=request.internode_gbps)
    if profile_file is not None:
        store.check_profile_gpu(profile_file, cluster.gpu.id, request.profile, request.force_profile)
        if request.node_rank == 0:
            here = _live_fingerprint(request, per_node, nodes) if request.device == "cuda" else \
                _cpu_fingerprint(out, host, per_node)
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
        commands = _node_commands(request, out, target, plans, launch, nodes)
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


def _cpu_fingerprint(out: Path, host: store.HostSpec, per_node: int) -> store.Fingerprint:
    probe_path = out / "host.json"
    if probe_path.exists():
        return store.HostProbe.model_validate_json(probe_path.read_text()).fingerprint
    from importlib.metadata import version

    return store.Fingerprint(device_type="cpu", device_name=store.cpu_name(), devices_per_node=per_node,
                             torch_version=version("torch"))


def _job(request: CalibrationRequest, out: Path, target: Target, config: FsdpConfig, setup: store.RunSetup,
         rid: str, position: int) -> tuple[dict, Path]:
    run_dir = out / "runs" / rid
    fault = None
    if request.fault and request.fault.get("run") == position:
        fault = {k: v for k, v in request.fault.items() if k != "run"}
    job = {"run_id": rid, "model": target.job_model(), "config": config.to_dict(), "fsdp_version": setup.fsdp_version,
           "gpus_per_node": setup.gpus_per_node, "seq_len": setup.training["seq_len"],
           "optimizer": setup.training["optimizer"], "finetune": setup.training["finetune"],
           "lora_rank": setup.training["lora_rank"], "steps": setup.steps, "warmup": setup.warmup,
           "device": setup.device, "emulate_world_size": request.emulate_world_size,
           "result_path": str(run_dir / "result.json"), "error_dir": str(run_dir / "errors"),
           "fault": fault, "measure_comm": True, "seed": 0}
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
    progress.start(describe(config), expected)
    log_rel = Path("runs") / rid / "log.txt"
    outcome = launching.run_job(argv, timeout_s=_timeout(request, evaluation), result_path=Path(job["result_path"]),
                                error_dir=Path(job["error_dir"]), log_path=out / log_rel, env=_env(), cwd=ROOT)
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


def _node_commands(request, out, target, plans, launch, nodes) -> list[str]:
    """Multi-node without --launch: the per-node torchrun command of each run, and the one-liner that runs
    them all (with bookkeeping) on each node."""
    lines = []
    for position, (config, setup, rid) in enumerate(plans):
        _, job_path = _job(request, out, target, config, setup, rid, position)
        lines.append(f"# run {position + 1}/{len(plans)}: {describe(config)}")
        for node in range(nodes):
            run_launch = replace(launch, python=None,
                                 rendezvous=replace(launch.rendezvous, port=launch.rendezvous.port + position))
            argv = launching.runner_command(run_launch, job_path, node_rank=node)
            lines.append(f"#   node {node}:")
            lines.append(launching.shell_line(argv, {"OMP_NUM_THREADS": 1} if request.device == "cpu" else None))
    return lines


# ------------------------------------------------------------------------------------------ fit + report

def _conclude(request, out, target, cluster, training, base, host, profile_file, new_ids, skipped, notes, commands,
              nodes) -> CalibrationReport:
    from .api import Candidate

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


# ------------------------------------------------------------------------------------------ rendering

def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def _pct(predicted: float | None, measured: float | None) -> str:
    if predicted is None or not measured:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.0f}%"


def render(report: CalibrationReport) -> str:
    from tabulate import tabulate

    from .emit import recommendation_text

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
            rows.append([i, describe(v.config), f"{r.error.kind.upper()}", f"{p.step_s:.3f}", "-", "-", "-", "-",
                         _bytes(p.peak_allocated_bytes), "-", "-", "-"])
            continue
        m = r.measured
        after = v.after.time.step_s if fitted else None
        rows.append([i, describe(v.config), "ok", f"{p.step_s:.3f}", f"{m.step_s:.3f}", _pct(p.step_s, m.step_s),
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
            row = [i, describe(v.config), f"{m.tokens_per_s_per_gpu:,.0f}", f"{m.step_s:.3f}",
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


def report_json(report: CalibrationReport) -> dict:
    return {
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
    }


def slurm_script(request: CalibrationRequest, argv: list[str]) -> str:
    """sbatch script: one task per node, each running this calibration with --launch and its node rank;
    node 0's address is the rendezvous. DIR must be on a filesystem every node sees."""
    nodes, per_node = _nodes_and_per_node(request)
    args = [a for a in argv]
    drop_with_value = {"--emit", "--rdzv-endpoint", "--node-rank"}
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in drop_with_value:
            skip = True
            continue
        if a.split("=", 1)[0] in drop_with_value or a in ("--launch", "--no-launch"):
            continue
        kept.append(a)
    command = " ".join(shlex.quote(a) for a in ["fsdp-plan", "calibrate", *kept])
    gres = f"#SBATCH --gpus-per-node={per_node}" if request.device == "cuda" else f"#SBATCH --cpus-per-task={per_node}"
    return "\n".join([
        "#!/bin/bash",
        f"# fsdp-plan calibrate on {nodes} node(s) x {per_node}: every node runs the same calibration, node 0",
        f"# records {Path(request.out_dir) / store.RESULTS_FILE} and fits {Path(request.out_dir) / store.PROFILE_FILE}.",
        "#SBATCH --job-name=fsdp-calibrate",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        gres,
        "#SBATCH --exclusive",
        "set -euo pipefail",
        "head_node=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        "export HEAD_NODE=\"$head_node\" OMP_NUM_THREADS=1",
        "# one task per node; each expands its own $SLURM_NODEID",
        "srun --kill-on-bad-exit=0 bash -c " + shlex.quote(
            f'{command} --launch --node-rank "$SLURM_NODEID" --rdzv-endpoint "$HEAD_NODE:29500"'),
    ]) + "\n"


__all__ = ["CalibrationRequest", "CalibrationReport", "calibrate", "render", "report_json", "slurm_script"]
