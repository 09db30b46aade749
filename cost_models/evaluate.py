"""Cost one candidate: memory, step time, and whether (and why not) it fits."""

from __future__ import annotations

from dataclasses import dataclass

from .memory import MemoryEstimate, estimate_memory
from .profile import Profile
from .specs import ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec
from .step_time import TimeBreakdown, estimate_step_time
from .units import GiB


@dataclass(frozen=True)
class Evaluation:
    config: FsdpConfig
    fits: bool
    reasons: tuple[str, ...]   # why it does not fit (empty when it fits)
    memory: MemoryEstimate
    time: TimeBreakdown
    capacity_bytes: int        # the GPU's memory

    @property
    def headroom_bytes(self) -> int:
        """GPU memory left at the peak; negative when it does not fit."""
        return self.capacity_bytes - self.memory.peak_reserved_bytes


def gpu_memory_reason(reserved_bytes: int, capacity_bytes: int, detail: str, prefix: str = "") -> str:
    """The reason a candidate does not fit in GPU memory (the doctor and the trace tier word it alike)."""
    return f"{prefix}needs {reserved_bytes / GiB:.1f} GiB per GPU > {capacity_bytes / GiB:.1f} GiB ({detail})"


def unsupported_reasons(cluster: ClusterSpec, config: FsdpConfig) -> list[str]:
    """Configurations that cannot run at all on this cluster, whatever the memory."""
    reasons = []
    dtype = config.precision.compute_dtype
    if not cluster.gpu.supports(dtype):
        supported = ", ".join(k for k, v in cluster.gpu.peak_flops.items() if v)
        reasons.append(f"{cluster.gpu.id} has no {dtype} support (supported: {supported})")
    if config.float8 and not cluster.gpu.supports("fp8"):
        reasons.append(f"{cluster.gpu.id} has no FP8 tensor cores: Float8 linears need Hopper, Ada, Blackwell or "
                       "CDNA 3/4")
    if config.float8 and dtype != "bf16":
        reasons.append(f"Float8 linears (torchao) run with bf16 compute, not {config.precision.value}")
    d = config.shard_group_size(cluster)
    if config.reshard_after_forward and (d % config.reshard_after_forward or config.reshard_after_forward >= d):
        reasons.append(f"reshard_after_forward={config.reshard_after_forward} must divide the shard group ({d} "
                       "ranks) and be smaller than it")
    if config.sharding.is_hybrid and cluster.n_gpus % cluster.gpus_per_node:
        reasons.append(f"{config.sharding.value} needs gpus ({cluster.n_gpus}) divisible by gpus_per_node "
                       f"({cluster.gpus_per_node})")
    return reasons


def evaluate(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
             profile: Profile) -> Evaluation:
    memory = estimate_memory(model, cluster, training, config, profile)
    time = estimate_step_time(model, cluster, training, config, profile)
    reasons = unsupported_reasons(cluster, config)
    capacity = cluster.gpu.memory_bytes
    if memory.peak_reserved_bytes > capacity:
        b = memory.breakdown
        largest = max(b.to_dict().items(), key=lambda kv: kv[1])
        reasons.append(gpu_memory_reason(memory.peak_reserved_bytes, capacity,
                                         f"peak in {memory.peak_phase.replace('_', ' ')}; largest: {largest[0]} "
                                         f"{largest[1] / GiB:.1f} GiB"))
    ram = cluster.cpu_ram_bytes_per_node
    if config.offload and ram and memory.cpu_bytes_per_node > ram:
        reasons.append(f"CPU offload needs {memory.cpu_bytes_per_node / GiB:.0f} GiB of CPU RAM per node "
                       f"> {ram / GiB:.0f} GiB")
    return Evaluation(config=config, fits=not reasons, reasons=tuple(reasons), memory=memory, time=time,
                      capacity_bytes=capacity)
