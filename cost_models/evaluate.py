"""Cost one candidate: memory, step time, and whether (and why not) it fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .feasibility import as_run, refusals
from .host_ram import Ways, gpu_outside_step_bytes, host_ram, host_ram_reason
from .memory import MemoryEstimate, estimate_memory
from .profile import Profile
from .quick_init import quick_init, replaced
from .specs import ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec
from .step_time import TimeBreakdown, estimate_step_time
from .units import GiB


@quick_init
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


def outside_step_gpu(memory: MemoryEstimate, profile: Profile, capacity_bytes: int) -> tuple[tuple, list[str]]:
    """(notes, reasons) of the moments outside the step (load, save, resume: host_ram.gpu_outside_step_bytes) whose
    allocated bytes pass the step's peak: a note each, and the reason it does not fit where its reserved bytes
    pass the GPU's: plan, estimate and check (with the ways its file loads and saves) all price them in evaluate."""
    notes, reasons = (), []
    for moment, allocated in gpu_outside_step_bytes(memory.host_ram, memory.phases["optimizer_step"]).items():
        if allocated <= memory.peak_allocated_bytes:
            continue
        notes += (f"the {moment} holds {allocated / GiB:.1f} GiB allocated per GPU, above the step's peak",)
        reserved = profile.reserved_bytes(allocated, memory.outside_allocator_bytes)
        if reserved > capacity_bytes:
            reasons.append(gpu_memory_reason(reserved, capacity_bytes, f"peak in the {moment}"))
    return notes, reasons


def step_peak_reason(memory: MemoryEstimate, capacity_bytes: int) -> str | None:
    """The reason the step's peak does not fit in GPU memory (None where it fits): its phase and largest term."""
    if memory.peak_reserved_bytes <= capacity_bytes:
        return None
    name, largest = max(memory.breakdown.to_dict().items(), key=lambda kv: kv[1])
    return gpu_memory_reason(memory.peak_reserved_bytes, capacity_bytes,
                             f"peak in {memory.peak_phase.replace('_', ' ')}; largest: {name} {largest / GiB:.1f} GiB")


def unsupported_reasons(cluster: ClusterSpec, config: FsdpConfig) -> list[str]:
    """Why a configuration cannot run at all on this cluster, whatever the memory (cost_models.feasibility)."""
    return [r.reason for r in refusals(cluster, config)]


def memory_verdict(memory: MemoryEstimate, profile: Profile, capacity_bytes: int, cpu_ram_bytes: int,
                   offload: bool) -> tuple[MemoryEstimate, list[str]]:
    """What the memory alone says of a candidate (its host RAM priced): the estimate with the notes of the moments
    outside the step, and why it does not fit - the step's peak, those moments, the CPU RAM offload needs or the
    host RAM per node. A search's candidates that differ only in what the memory does not read share it
    (planner/search/memo.py)."""
    reasons = []
    if (peak := step_peak_reason(memory, capacity_bytes)) is not None:
        reasons.append(peak)
    outside_notes, outside_reasons = outside_step_gpu(memory, profile, capacity_bytes)
    if outside_notes:
        memory = replaced(memory, notes=memory.notes + outside_notes)
    reasons += outside_reasons
    if offload and cpu_ram_bytes and memory.cpu_bytes_per_node > cpu_ram_bytes:
        reasons.append(f"CPU offload needs {memory.cpu_bytes_per_node / GiB:.0f} GiB of CPU RAM per node "
                       f"> {cpu_ram_bytes / GiB:.0f} GiB")
    elif host_ram_reason(memory.host_ram, cpu_ram_bytes):
        reasons.append(host_ram_reason(memory.host_ram, cpu_ram_bytes))
    return memory, reasons


def evaluate(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
             profile: Profile, memory: MemoryEstimate | None = None, ways: Ways | None = None,
             time: TimeBreakdown | None = None, refused: tuple[str, ...] | None = None,
             judged: tuple[MemoryEstimate, list[str]] | None = None) -> Evaluation:
    """Price `config` as FSDP runs it (feasibility.as_run: a reshard group equal to the shard group is the
    strategy's own resharding), with the reasons it cannot run or does not fit; memory: its estimate where the
    caller has it (planner/search/memo.py: priced once across knobs the memory does not read); ways: how the
    trainer loads and saves, and its FSDP API (host_ram.Ways; default: rank 0 loads, DCP saves, FSDP2); time: the
    step time, likewise; refused: unsupported_reasons of the configuration FSDP runs, likewise; judged:
    memory_verdict of the memory, likewise."""
    config = as_run(config, cluster)
    capacity = cluster.gpu.memory_bytes
    reasons = unsupported_reasons(cluster, config) if refused is None else list(refused)
    if judged is None:
        if memory is None:
            memory = estimate_memory(model, cluster, training, config, profile,
                                     fsdp1_adapter_units=ways is not None and ways.fsdp1_adapter_units)
        if memory.host_ram is None:  # host RAM per node: processes, offloaded state, loading and checkpoints
            memory = dataclasses.replace(memory, host_ram=host_ram(model, cluster, training, config,
                                                                   memory.cpu_bytes_per_node, ways or Ways()))
        judged = memory_verdict(memory, profile, capacity, cluster.cpu_ram_bytes_per_node, config.offload)
    memory = judged[0]
    reasons += judged[1]
    if time is None:  # under the trainer's FSDP API (its copies around the collectives: fsdp_copies.py)
        time = estimate_step_time(model, cluster, training, config, profile, fsdp2=ways is None or ways.fsdp2)
    return Evaluation(config=config, fits=not reasons, reasons=tuple(reasons), memory=memory, time=time,
                      capacity_bytes=capacity)
