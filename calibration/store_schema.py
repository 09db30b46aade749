"""The shapes of the calibration files (calibration/store.py reads and writes them): a results.jsonl line
(RunRecord: setup, prediction, measurement or error, fingerprint) and profile.json (ProfileFile: fitted
coefficients, the fit's summary, the cluster's fingerprint), pydantic models with extra="forbid" and the schema
versions. No torch here."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cost_models.profile import Profile
from cost_models.specs import GpuSpec, SpecError

SCHEMA_VERSION = 1
PROFILE_SCHEMA_VERSION = 5
# profile files this fsdp-plan reads: 2 lacks the mesh's rates (tp / ep_comm_efficiency), which were priced at 1.0
# when it was fitted, so it reads with them at 1.0; 2 and 3 always hold a cuda_context_bytes (measured, or the old
# flat 0.75 GiB default), read as a measured figure that replaces the context and NCCL terms; 2 to 4 hold
# cpu_optimizer_params_per_s, a flat CPU optimizer rate no fit set (the host's CPUs price it now: ClusterSpec.host_cpu),
# dropped on reading, and lack host_memory_efficiency (its default)
PROFILE_SCHEMA_VERSIONS_READ = (2, 3, 4, 5)
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
    cuda_context_bytes: int | None   # schema 4: null = not measured, priced term by term (outside_allocator.py)
    fragmentation: float
    optimizer_hbm_efficiency: float
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
    # schema 5: the host memory bandwidth's share the CPU optimizer step reaches (cost_models/host_optimizer.py)
    host_memory_efficiency: float = 0.8

    @classmethod
    def of(cls, profile: Profile) -> "Coefficients":
        data = asdict(profile)
        data.pop("source")
        data.pop("outside_allocator")  # a run's --outside-allocator overrides, not a fitted coefficient
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
    # 4: cuda_context_bytes may be null (not measured: the memory outside the allocator priced term by term)
    # 5: host_memory_efficiency in place of cpu_optimizer_params_per_s (the CPU step from the host's CPUs)
    schema_version: Literal[2, 3, 4, 5] = PROFILE_SCHEMA_VERSION
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
