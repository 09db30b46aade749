"""Calibration files: results.jsonl (one run per line) and profile.json (fitted coefficients).

Both are pydantic-validated at the edges (`extra="forbid"`, a `schema_version`), so a file from a newer
or older fsdp-plan, or one edited by hand into a shape we do not understand, fails with a message that
names the file, the line and the field, rather than planning with silently wrong numbers.

- results.jsonl is appended one line per run as each run ends (`append_record`: write, flush, fsync), so
  a crash, an OOM or a killed calibration loses at most the run in progress. A torn last line (the
  process died mid-write) is skipped with a warning when read; any other bad line is an error.
- profile.json is written whole, atomically (temp file in the same directory, fsync, os.replace).
- A profile carries the fingerprint of the cluster it was fitted on (device name, devices per node,
  nodes, torch and NCCL versions). `check_fingerprint` refuses a profile from another cluster unless
  forced; `check_profile_gpu` refuses one fitted on another GPU type for a plan.

No torch here: `fsdp-plan --profile FILE` loads profiles without paying for `import torch`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cost_models.profile import Profile
from cost_models.specs import (ActivationProfile, ActivationTerms, BackwardMoment, GpuSpec, ModelSpec, MoeSpec,
                                 SpecError)

SCHEMA_VERSION = 1
PROFILE_SCHEMA_VERSION = 3
# profile files this fsdp-plan reads: 2 lacks the mesh's rates (tp / ep_comm_efficiency), which were priced at 1.0
# when it was fitted, so it reads with them at 1.0
PROFILE_SCHEMA_VERSIONS_READ = (2, 3)
RESULTS_FILE = "results.jsonl"
PROFILE_FILE = "profile.json"


class StoreError(SpecError):
    """A calibration file is missing, malformed, from another schema version or from another cluster."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------------------ pieces

class Fingerprint(_Strict):
    """What makes measurements from one cluster differ from another's."""

    device_type: Literal["cuda", "cpu"]
    device_name: str              # torch.cuda.get_device_name(), or the CPU model for --device cpu
    devices_per_node: int
    n_nodes: int = 1
    torch_version: str
    nccl_version: str | None = None  # None on CPU (gloo)

    def describe(self) -> str:
        nccl = f", NCCL {self.nccl_version}" if self.nccl_version else ""
        return (f"{self.n_nodes} node(s) x {self.devices_per_node} x {self.device_name} "
                f"(torch {self.torch_version}{nccl})")

    def mismatches(self, other: "Fingerprint") -> list[str]:
        """Fields that differ, in words. Node count is not compared: a profile fitted on one node is
        meant to plan for many (the inter-node coefficient stays at its default until measured)."""
        out = []
        for name in ("device_type", "device_name", "devices_per_node", "torch_version", "nccl_version"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name} {a!r} here, {b!r} in the profile")
        return out


class Predicted(_Strict):
    """The cost model's figures for a run (per rank), with the profile in force when it was made."""

    step_s: float
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    exposed_comm_s: float
    compute_s: float
    tokens_per_s_per_gpu: float
    profile_source: str = ""


class PipelineRankPeak(_Strict):
    """One pipeline rank's measured peak with pp > 1: the largest of its data-parallel ranks' (the planner's
    MemoryEstimate.pipeline_ranks, rank for rank)."""

    pp_rank: int
    stages: list[int]                       # the stage indices it runs (torch's loop / v placement)
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved (None on CPU)
    peak_phase: str = "unknown"
    memory_breakdown: dict[str, int] = Field(default_factory=dict)


class Measured(_Strict):
    """What a run measured. Times are the slowest rank's; memory the largest rank's (pipeline_ranks: each
    pipeline rank's, with pp > 1)."""

    step_s: float                           # median step after warm-up (slowest rank per step), on step_clock
    step_s_all: list[float]                 # every measured step
    step_clock: Literal["wall", "process_cpu"] = "wall"  # process_cpu (--device cpu): the rank process's CPU
                                            # time (all its threads), which other processes on a shared host
                                            # cannot inflate; GPUs: wall clock after cuda.synchronize
    wall_step_s: float | None = None        # median wall-clock step (= step_s on GPUs)
    tokens_per_s_per_gpu: float
    peak_allocated_bytes: int | None = None  # torch.cuda.max_memory_allocated, or the tensor accountant on CPU
    peak_reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved (None on CPU)
    non_torch_bytes: int | None = None      # device memory outside PyTorch's allocator: context, NCCL
    memory_source: Literal["cuda_allocator", "memtrack", "none"]  # none: not measurable (see memory_note)
    memory_note: str = ""
    memory_breakdown: dict[str, int] = Field(default_factory=dict)
    peak_phase: str = "unknown"
    exposed_comm_s: float | None = None     # from a profiled step (GPU); None where not measurable
    loss: float | None = None               # last loss, a sanity check (NaN shows up here)
    pipeline_ranks: list[PipelineRankPeak] = Field(default_factory=list)  # pp > 1: one per pipeline rank, in order

    @model_validator(mode="after")
    def _largest_pipeline_rank(self):
        if self.pipeline_ranks:
            if [r.pp_rank for r in self.pipeline_ranks] != list(range(len(self.pipeline_ranks))):
                raise ValueError("pipeline_ranks must list pipeline ranks 0, 1, ... in order")
            if self.peak_allocated_bytes != max(r.peak_allocated_bytes for r in self.pipeline_ranks):
                raise ValueError("peak_allocated_bytes must be the largest pipeline rank's")
        return self


class RunError(_Strict):
    kind: Literal["oom", "timeout", "crash"]
    message: str
    rank: int | None = None
    returncode: int | None = None


class HostSpec(_Strict):
    """A CPU measured as if it were a GPU, so the GPU cost model can run on it (`--device cpu`).

    peak_flops are the matmul rates one rank reaches on one thread (torchrun sets OMP_NUM_THREADS=1) at
    the model's own matmul shape, all ranks running at once; hbm_bytes_per_s a copy's bandwidth per rank;
    bus_bytes_per_s the gloo all-gather bus bandwidth between the ranks of one node (loopback TCP).
    """

    name: str
    ranks: int
    peak_flops: dict[str, float]
    hbm_bytes_per_s: float
    bus_bytes_per_s: float
    memory_bytes: int

    def gpu_spec(self) -> GpuSpec:
        return GpuSpec(id="cpu", name=f"{self.name} (1 thread per rank)", memory_bytes=self.memory_bytes,
                       hbm_bytes_per_s=self.hbm_bytes_per_s, peak_flops=dict(self.peak_flops),
                       intra_node_bus_bytes_per_s=self.bus_bytes_per_s, pcie_bytes_per_s=self.hbm_bytes_per_s,
                       matmul_efficiency=1.0,  # peak_flops are measured matmul rates already
                       default_internode_gbit_per_s=self.bus_bytes_per_s * 8 / 1e9,
                       source="measured by fsdp-plan calibrate --device cpu (calibration/runner.py --probe)")


class HostProbe(_Strict):
    """DIR/host.json: the CPU measured once per calibration directory (reused by --resume)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    host: HostSpec
    hop_latency_s: float     # gloo per-hop latency (all-reduce of one float / 2(n-1))
    fingerprint: Fingerprint


class RunSetup(_Strict):
    """Everything needed to recompute a run's prediction with another profile (the fit does that)."""

    model: dict[str, Any]      # cost_models.specs.ModelSpec fields (the depth actually run)
    full_n_layers: int         # depth of the model the user asked for (--layers runs fewer)
    gpu: dict[str, Any]        # GpuSpec fields
    n_gpus: int                # ranks of the job (the emulated world size with --emulate-world-size)
    gpus_per_node: int
    internode_bytes_per_s: float
    training: dict[str, Any]   # TrainingSpec fields
    config: dict[str, Any]     # FsdpConfig.to_dict(): the FSDP knobs and the mesh's degrees tp, cp, ep, pp (records
                               # written before the mesh have none: 1, what those runs ran)
    fsdp_version: Literal[1, 2]
    device: Literal["cuda", "cpu"]
    emulated: bool = False     # rank 0 of n_gpus on a fake process group: no real communication
    steps: int
    warmup: int


class RunRecord(_Strict):
    """One line of results.jsonl: a run's setup, the prediction, and the measurement or the error."""

    schema_version: Literal[1] = SCHEMA_VERSION
    run_id: str
    model_name: str
    setup: RunSetup
    predicted: Predicted
    measured: Measured | None = None
    error: RunError | None = None
    fingerprint: Fingerprint | None = None
    wall_s: float = 0.0
    log: str = ""              # the run's log file, relative to the results directory

    @model_validator(mode="after")
    def _one_outcome(self):
        if (self.measured is None) == (self.error is None):
            raise ValueError("a run has exactly one of 'measured' and 'error'")
        return self

    @property
    def config(self) -> dict:
        return self.setup.config


class Coefficients(_Strict):
    """cost_models.profile.Profile's fields, one for one (a unit test keeps them in step)."""

    compute_efficiency: dict[str, float]
    intra_node_comm_efficiency: float
    inter_node_comm_efficiency: float
    intra_node_latency_s: float
    inter_node_latency_s: float
    microstep_overhead_s: float
    cuda_context_bytes: int
    fragmentation: float
    optimizer_hbm_efficiency: float
    cpu_optimizer_params_per_s: float
    pcie_efficiency: float
    default_gpu_matmul_efficiency: float
    matmul_half_dim: float
    default_attention_efficiency: float
    attention_efficiency: float
    attention_half_seq: float
    memory_bound_efficiency: float
    overlap_slowdown: float
    # schema 3: the mesh's collective rates (absent from a schema-2 file: 1.0, the pricing it was fitted under)
    tp_comm_efficiency: float = 1.0
    ep_comm_efficiency: float = 1.0

    @classmethod
    def of(cls, profile: Profile) -> "Coefficients":
        data = asdict(profile)
        data.pop("source")
        return cls(**data)


class FitSummary(_Strict):
    n_runs: int
    fitted: list[str]                # coefficient names the data determined; the rest kept their values
    step_error_before: float         # RMS of relative step-time errors with the starting profile
    step_error_after: float          # ... and with the fitted one
    notes: list[str] = Field(default_factory=list)
    identified: dict[str, float] = Field(default_factory=dict)  # coefficient -> relative standard error (<~10%)
    not_identified: list[str] = Field(default_factory=list)     # fitted but loosely determined by the runs


class ProfileFile(_Strict):
    # 2: the operator-level step time (compute_efficiency is relative to the GPU's large-GEMM rate)
    # 3: the mesh's collective rates (Coefficients.tp_comm_efficiency, ep_comm_efficiency); 2 still reads
    schema_version: Literal[2, 3] = PROFILE_SCHEMA_VERSION
    kind: Literal["fsdp-plan-profile"] = "fsdp-plan-profile"
    created: str
    fingerprint: Fingerprint
    gpu_id: str                      # the GPU spec the coefficients are relative to ("cpu": the host spec)
    host: HostSpec | None = None     # --device cpu: the measured CPU spec the coefficients refer to
    coefficients: Coefficients
    fit: FitSummary
    runs: list[str] = Field(default_factory=list)  # run ids the fit used

    def profile(self) -> Profile:
        return Profile(**self.coefficients.model_dump(), source=f"fitted ({self.fingerprint.describe()}, "
                                                                 f"{self.fit.n_runs} runs, {self.created})")


# ------------------------------------------------------------------------------------------ helpers

def run_id(setup: RunSetup) -> str:
    """Stable id of a run from what defines it (not from when it ran): --resume matches on it."""
    key = setup.model_dump(exclude={"gpu"})
    key["gpu"] = setup.gpu.get("id")
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, text: str) -> None:
    """Write the whole file or nothing: temp file beside it, fsync, os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def append_record(path: str | Path, record: RunRecord) -> None:
    """Append one run as one line, durably (flush + fsync) before returning. A file whose last record lacks
    its newline gets one first, so the two records stay two lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = record.model_dump_json() + "\n"
    with open(path, "a+b") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class TornLine:
    """The last line of a results.jsonl cut short: its writer was killed mid-write (append_record writes
    one line per run, so only the last line can be torn). `offset`: the bytes before it, all whole lines."""

    path: Path
    line: int
    offset: int
    size_bytes: int

    def note(self) -> str:
        return (f"{self.path}:{self.line}: skipped a torn last line ({self.size_bytes} bytes; a run was killed "
                "while writing its record), the runs before it are kept")


def drop_torn_line(torn: TornLine) -> None:
    """Cut the torn fragment off, so the next record appended starts a line of its own."""
    with open(torn.path, "r+b") as f:
        f.truncate(torn.offset)
        f.flush()
        os.fsync(f.fileno())


def _where(exc: ValidationError) -> str:
    e = exc.errors()[0]
    loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
    return f"{loc}: {e['msg']}"


def read_results(path: str | Path) -> tuple[list[RunRecord], TornLine | None]:
    """Every run in a results.jsonl, validated, and its torn last line if it has one (skipped: not JSON, not
    UTF-8, and no newline after it). Any other bad line is a StoreError naming it. A missing file is ([], None)."""
    path = Path(path)
    if not path.exists():
        return [], None
    data = path.read_bytes()
    lines = data.split(b"\n")
    records, torn, offset = [], None, 0
    for number, raw in enumerate(lines, 1):
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if number == len(lines):  # the last piece of a split has no newline after it
                torn = TornLine(path, number, start, len(raw))
                continue
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "invalid UTF-8"
            raise StoreError("results", f"{path}:{number} is not JSON: {why}") from None
        version = entry.get("schema_version") if isinstance(entry, dict) else None
        if version != SCHEMA_VERSION:
            raise StoreError("results", f"{path}:{number} has schema_version {version!r}; this fsdp-plan reads "
                                        f"{SCHEMA_VERSION}")
        try:
            records.append(RunRecord.model_validate(entry))
        except ValidationError as exc:
            raise StoreError("results", f"{path}:{number}: {_where(exc)}") from None
    return records, torn


def read_records(path: str | Path) -> list[RunRecord]:
    """Every run in a results.jsonl (read_results), warning about a torn last line."""
    records, torn = read_results(path)
    if torn is not None:
        warnings.warn(torn.note())
    return records


def write_profile(path: str | Path, profile_file: ProfileFile) -> None:
    write_atomic(path, profile_file.model_dump_json(indent=2) + "\n")


def load_profile_file(path: str | Path) -> ProfileFile:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError("profile", f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError("profile", f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise StoreError("profile", f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, dict) or data.get("kind") != "fsdp-plan-profile":
        raise StoreError("profile", f"{path} is not an fsdp-plan profile (written by `fsdp-plan calibrate`)")
    if data.get("schema_version") not in PROFILE_SCHEMA_VERSIONS_READ:
        readable = " or ".join(str(v) for v in PROFILE_SCHEMA_VERSIONS_READ)
        raise StoreError("profile", f"{path} has schema_version {data.get('schema_version')!r}; this fsdp-plan "
                                    f"reads {readable}: calibrate again")
    if data.get("schema_version") == 2 and isinstance(data.get("coefficients"), dict):
        for name in ("tp_comm_efficiency", "ep_comm_efficiency"):  # not in schema 2: a mesh field there is an error
            if name in data["coefficients"]:
                raise StoreError("profile", f"{path}: coefficients.{name} is not a schema_version 2 field")
    try:
        return ProfileFile.model_validate(data)
    except ValidationError as exc:
        raise StoreError("profile", f"{path}: {_where(exc)}") from None


def check_profile_gpu(profile_file: ProfileFile, gpu_id: str, path: str | Path = "profile",
                      force: bool = False) -> None:
    """A plan for GPU type `gpu_id` may use the profile only if it was fitted on that GPU type."""
    if force or profile_file.gpu_id == gpu_id:
        return
    raise StoreError("profile", f"{path} was fitted on {profile_file.gpu_id} ({profile_file.fingerprint.describe()}), "
                                f"this plan is for {gpu_id}; its coefficients would mislead. Calibrate on this "
                                "cluster, or pass --force-profile to use it anyway")


def check_fingerprint(profile_file: ProfileFile, here: Fingerprint, path: str | Path = "profile",
                      force: bool = False) -> None:
    """Refuse a profile fitted on another cluster (device, devices per node, torch, NCCL) unless forced."""
    diffs = here.mismatches(profile_file.fingerprint)
    if diffs and not force:
        raise StoreError("profile", f"{path} comes from another cluster ({'; '.join(diffs)}). Calibrate here, "
                                    "or pass --force-profile to use it anyway")


def load_profile(path: str | Path, *, gpu_id: str | None = None, force: bool = False) -> Profile:
    """The cost-model Profile in a profile.json, checked against the plan's GPU type when given."""
    pf = load_profile_file(path)
    if gpu_id is not None:
        check_profile_gpu(pf, gpu_id, path, force)
    return pf.profile()


def gpu_spec_dict(gpu: GpuSpec) -> dict:
    return {f.name: getattr(gpu, f.name) for f in fields(gpu)}


def _activation_terms(terms: dict) -> ActivationTerms:
    dense = terms.get("dense")
    return ActivationTerms(**{**terms, "backward_moments": tuple(BackwardMoment(**m) for m in terms.get("backward_moments", ())),
                              "checkpoint_held": tuple(terms.get("checkpoint_held", (0.0, 0.0, 0.0, 0.0))),
                              "dense": _activation_terms(dense) if dense is not None else None})


def model_spec_from_dict(data: dict) -> ModelSpec:
    """The ModelSpec of its dataclasses.asdict() form (a job file's spec, a stored run's setup.model): the
    JSON lists back to tuples and the nested MoeSpec / ActivationProfile back to dataclasses."""
    fields_ = dict(data)
    fields_["lora_target_shapes"] = tuple(tuple(x) for x in fields_.get("lora_target_shapes", ()))
    if "attention_choices" in fields_:
        fields_["attention_choices"] = tuple(fields_["attention_choices"])
    if fields_.get("moe") is not None:
        moe = dict(fields_["moe"])
        moe["stacked_expert_tensors"] = tuple(tuple(x) for x in moe.get("stacked_expert_tensors", ()))
        moe["dense_layers"] = tuple(moe.get("dense_layers", ()))
        fields_["moe"] = MoeSpec(**moe)
    if fields_.get("activation_profile") is not None:
        profile = dict(fields_["activation_profile"])
        profile["terms"] = tuple((dtype, attention, _activation_terms(terms))
                                 for dtype, attention, terms in profile.get("terms", ()))
        fields_["activation_profile"] = ActivationProfile(**profile)
    return ModelSpec(**fields_)


def cpu_name() -> str:
    """The host CPU's model name (a CPU run's device name in its fingerprint)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"
