"""What a calibration is asked (CalibrationRequest), the model it runs (Target, resolved from --model or
--factory), the node layout, and the report it answers with (RunView, CalibrationReport)."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from calibration import store
from calibration.fit import Fit
from cost_models.evaluate import Evaluation
from cost_models.profile import Profile
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec

from ..errors import PlannerError
from ..request import ClusterRequest, TrainingRequest, knob

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_CLUSTER = ("gpus", "gpus_per_node", "gpu", "internode_gbps", "gpu_memory", "intra_node_gb_per_s", "pcie_gb_per_s",
            "cpu_ram_per_node")
_TRAINING = ("seq_len", "global_batch", "optimizer", "optimizer_impl", "finetune", "lora_rank", "lora_dropout",
             "lora_targets", "quant", "double_quant", "quant_storage", "routing_imbalance")


@dataclass
class CalibrationRequest:
    """One calibration: the cluster and training groups of planner.request (given whole or by their knobs'
    names, CalibrationRequest(out_dir, gpus=8, seq_len=512): request.gpus reads request.cluster.gpus), and the
    calibration's own knobs, declared here with their flags (planner/cli/calibrate.py generates its options)."""

    out_dir: str = knob("calibration", "--out", help="Directory for results.jsonl, profile.json, logs")
    cluster: ClusterRequest = field(default_factory=ClusterRequest)
    training: TrainingRequest = field(default_factory=TrainingRequest)
    model: str | None = None             # preset, config.json, or a directory holding one (Request's --model)
    factory: str | None = knob(None, "--factory", help="pkg.module:function building the nn.Module (called with "
                               "n_layers=L under --layers)")
    device: str = knob("cuda", "--device", help="cuda (NCCL) or cpu (gloo, one thread per rank)")
    nodes: int | None = knob(None, "--nodes", help="Nodes (multi-node: with --rdzv-endpoint)")
    precisions: list[str] | None = None  # SearchRequest's --precision
    attention: str | None = None         # None: the model's first choice (sdpa, or eager where it refuses sdpa)
    top: int = knob(3, "--top", help="Run the K best planned candidates (default 3)")
    config: FsdpConfig | None = None     # run exactly this configuration instead of the top K
    steps: int = knob(10, "--steps", help="Timed steps per run")
    warmup: int = knob(3, "--warmup", help="Untimed steps first")
    fsdp_version: int = knob(2, "--fsdp-version", help="1 (FullyShardedDataParallel) or 2 (fully_shard)")
    layers: int | None = knob(None, "--layers", help="Run L blocks, extrapolate per block")  # extrapolated per block
    emulate_world_size: int | None = knob(None, "--emulate-world-size", help="One device runs rank 0 of an N-rank "
                                          "job (fake process group)")
    profile: str | None = knob(None, "--profile", help="Predict with this profile.json")
    force_profile: bool = knob(False, "--force-profile", help="Use a profile from another cluster")
    fit: bool = knob(True, "--fit/--no-fit", help="Refit the profile from the measured runs")
    resume: bool = knob(False, "--resume", help="Skip runs already in DIR/results.jsonl")
    timeout_s: float | None = knob(None, "--timeout", help="Seconds per run before its process group is killed "
                                   "(default: 600 + 10x the predicted steps)")
    launch: bool = knob(True, "--launch", help="Multi-node: run this node's part (else print)")  # False: print them
    rdzv_endpoint: str | None = knob(None, "--rdzv-endpoint", help="HOST:PORT of node 0")
    node_rank: int = knob(0, "--node-rank", help="This node's rank (with --launch)")
    torch_profile: bool = knob(False, "--torch-profile", help="Save a torch.profiler trace (Chrome JSON) of one "
                               "more step per run beside its result")
    fault: dict | None = None            # testing: {"run": i, "rank": r, "step": s, "kind": exit|hang|oom|raise}

    def __getattr__(self, name: str):
        """The groups' knobs by name (request.gpus, request.seq_len)."""
        group = "cluster" if name in _CLUSTER else "training" if name in _TRAINING else None
        if group is None or group not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__[group], name)


def _routed_init(generated):
    """CalibrationRequest(out_dir, gpus=8, seq_len=512, ...): the groups' knobs routed into them, over the
    groups given whole (cluster=, training=)."""

    def __init__(self, out_dir: str = "calibration", gpus: int | None = None, **kwargs):
        cluster = {k: kwargs.pop(k) for k in _CLUSTER if k in kwargs}
        training = {k: kwargs.pop(k) for k in _TRAINING if k in kwargs}
        if gpus is not None:
            cluster["gpus"] = gpus
        generated(self, out_dir, cluster=replace(kwargs.pop("cluster", None) or ClusterRequest(), **cluster),
                  training=replace(kwargs.pop("training", None) or TrainingRequest(), **training), **kwargs)

    __init__.__doc__ = _routed_init.__doc__
    return __init__


CalibrationRequest.__init__ = _routed_init(CalibrationRequest.__init__)


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
    from ..models import hf_config_of, resolve_model
    from ..models.resolve import names_preset
    from ..request.resolve import with_lora_targets

    if request.factory:
        spec = _factory_spec(request.factory)
        source, hf, name = "factory", None, request.factory
    elif request.model:
        spec = resolve_model(request.model)
        hf = hf_config_of(request.model)
        name = spec.name
        is_preset = names_preset(request.model)  # not a config path nor a hub id: the spec is the preset's
        source = "reference" if (is_preset and spec.family == "llama") else "hf"
        if source == "reference":
            hf = None
    else:
        raise PlannerError("model", "missing: pass --model (preset or config.json) or --factory pkg.module:function")
    spec = with_lora_targets(spec, request.training)
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

    from ..models import from_module

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `pkg.module` relative to where the user runs, as `python -m` does
    try:
        module = build({"source": "factory", "factory": factory}, "sdpa")
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise PlannerError("factory", f"cannot build {factory!r}: {exc}") from None
    spec = getattr(module, "spec", None)
    return spec if isinstance(spec, ModelSpec) else from_module(module, name=factory)


def training_spec(request: CalibrationRequest) -> TrainingSpec:
    """The runs' training, validated (seq_len, optimizer, finetune) before anything is written."""
    training = request.training.spec()
    if training.quantized:  # the runner builds the reference / HF model unquantized: it would measure plain LoRA
        raise PlannerError("finetune", "calibrate runs full and lora, not qlora (its runs build no bitsandbytes "
                                       "4-bit base); QLoRA's memory is the estimate's, checked against real CPU runs "
                                       "in tests/distributed/test_torchrun_qlora.py")
    return training


def nodes_and_per_node(request: CalibrationRequest) -> tuple[int, int]:
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

