"""Host RAM per node, by what holds it: the ranks' processes, the offloaded state, and the largest of loading,
checkpoint save and resume (cost_models/outside_step.py), for the ways the plan's trainer loads and saves.

The ways are chosen once for every candidate: rank 0 reads the pretrained weights and broadcasts them (what every
emitted dialect writes: cpu_ram_efficient_loading + sync_module_states, FSDP2's broadcast_from_rank0), and each
rank saves and resumes its own shard with DCP (SHARDED_STATE_DICT). The node figure is rank 0's node, the busiest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .fsdp1_adapters import AdapterUnits
from .outside_step import LoadWay, SaveWay, StateSizes, load_bytes, save_bytes
from .specs import ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec
from .units import GiB

# One rank's process with torch imported and its process group up, no model: 282 MB measured on CPU (gloo,
# docs/accuracy.md "Memory outside the step"). A CUDA process adds the CUDA context's host pages and any dataloader
# workers add their own: not counted (no GPU to measure them on), so this is a floor.
PROCESS_BYTES_PER_RANK = 282_000_000
PRETRAINED_DTYPE = "bf16"  # what published checkpoints hold (Llama, Qwen, Mistral, DeepSeek's non-FP8 releases)


@dataclass(frozen=True)
class Ways:
    """How a trainer (or a user's file) loads the weights, saves and resumes, under FSDP2 or FSDP1."""

    load: LoadWay = LoadWay.RANK0_BROADCAST
    save: SaveWay = SaveWay.DCP
    resume: LoadWay = LoadWay.META_DCP
    fsdp2: bool = True  # FSDP2, else FSDP1: its step's copies too (evaluate: step_time's fsdp2)
    # FSDP1's DCP state dict of the save / of the resume made on host (StateDictOptions(cpu_offload=True),
    # accelerate's offload_to_cpu=True), else on the GPU (get_state_dict's default): outside_step._fsdp1_dcp
    save_state_dict_on_host: bool = True
    resume_state_dict_on_host: bool = True
    # LoRA / QLoRA under FSDP1 with each adapter a unit of its own (fsdp1_adapters.AdapterUnits; None: inside its
    # block's): how the step runs rather than loads or saves, carried here as the trainer's: memory.estimate_memory's
    # fsdp1_adapter_units
    fsdp1_adapter_units: AdapterUnits | None = None


SAVE_WORDS = {SaveWay.DCP: "each rank writes its shard", SaveWay.DCP_ASYNC: "each rank stages its shard to host",
              SaveWay.FULL_RANK0: "rank 0 gathers the whole state",
              SaveWay.SAVE_PRETRAINED: "rank 0 gathers the params"}


@dataclass(frozen=True)
class HostRam:
    """Bytes of host RAM on the busiest node, by what holds them, and the ways that set them."""

    load_way: LoadWay
    save_way: SaveWay
    resume_way: LoadWay
    why: str
    process_bytes: int      # the ranks' processes
    offloaded_bytes: int    # CPU offload's params, grads and optimizer state (0 without offload), from the first step
    load_bytes: int         # reading the pretrained weights
    save_bytes: int         # one checkpoint save
    resume_bytes: int       # reading a checkpoint back, optimizer included
    save_gpu_bytes: int     # the save's transient on each GPU (a full gather's unit or tensor; 0 with DCP)
    load_gpu_bytes: int = 0     # loading's transient on each GPU (a broadcast tensor or unit, new local shards)
    resume_gpu_bytes: int = 0   # the resume's transient on each GPU (FSDP1's DCP: its gathers, the new states)

    @property
    def peak_bytes(self) -> int:
        """The phases run one at a time beside the processes; a save and a resume beside the offloaded state. Loading
        comes before it: the offloaded params' shards replace the loaded copies unit by unit as FSDP wraps, and the
        grads and optimizer state do not exist yet (with rank 0's broadcast, its full copy and the shards can meet:
        up to one more copy of the params, not counted)."""
        return self.process_bytes + max(self.load_bytes, self.offloaded_bytes + self.save_bytes,
                                        self.offloaded_bytes + self.resume_bytes)

    def to_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "process_bytes": self.process_bytes,
                "offloaded_bytes": self.offloaded_bytes, "load_bytes": self.load_bytes,
                "checkpoint_save_bytes": self.save_bytes, "resume_bytes": self.resume_bytes,
                "save_gpu_bytes": self.save_gpu_bytes, "load_gpu_bytes": self.load_gpu_bytes,
                "resume_gpu_bytes": self.resume_gpu_bytes, "load_way": self.load_way.value,
                "save_way": self.save_way.value, "resume_way": self.resume_way.value, "why": self.why}


def state_sizes(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig) -> StateSizes:
    """The checkpoint's sizes for this configuration: one copy of the state over the ranks that share it (the
    GPUs over the replicas: shard group x tp x pp), LoRA's base in the compute dtype under mixed precision."""
    precision = config.precision
    frozen = precision.compute_dtype if precision.mixed else precision.param_dtype
    ranks = max(1, cluster.n_gpus // config.replicate_group_size(cluster))
    sizes = StateSizes.of(model, training, precision.param_dtype, ranks, frozen)
    # the pretrained weights are read as published (bf16; transformers 5 loads dtype="auto") and cast to the fp32
    # masters shard by shard: a full fine-tune's load is its bf16 model (adapters' bases are counted so already)
    pretrained = StateSizes.of(model, training, PRETRAINED_DTYPE, ranks, frozen).params_bytes
    return dataclasses.replace(sizes, pretrained_bytes=min(pretrained, sizes.params_bytes))


def host_ram(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
             offloaded_bytes: int, ways: Ways = Ways()) -> HostRam:
    """Host RAM per node for these ways (the defaults: rank 0 loads, DCP saves and resumes); offloaded_bytes per
    node (memory.py)."""
    load_way, save_way, resume_way, fsdp2 = ways.load, ways.save, ways.resume, ways.fsdp2
    sizes = state_sizes(model, cluster, training, config)
    n = cluster.gpus_per_node
    offloaded = config.offload  # offloaded state is host memory already: DCP writes it where it is
    loaded = load_bytes(load_way, sizes, fsdp2)
    save = save_bytes(save_way, sizes, fsdp2, offloaded=offloaded, host_state_dict=ways.save_state_dict_on_host)
    resumed = load_bytes(resume_way, sizes, fsdp2, optimizer=True,
                         host_state_dict=ways.resume_state_dict_on_host)
    # the other ways in the figures that tell them apart, the same under FSDP1 and FSDP2: what every rank reading
    # puts on a node, what a full state dict puts on rank 0, what async DCP stages on a node
    weights = sizes.pretrained_bytes or sizes.params_bytes
    others = {LoadWay.EVERY_RANK: n * weights, LoadWay.RANK0_BROADCAST: weights}
    saves = {SaveWay.DCP: save.node_bytes(n) if save_way is SaveWay.DCP else None,
             SaveWay.FULL_RANK0: sizes.state_bytes, SaveWay.DCP_ASYNC: n * sizes.shard(sizes.state_bytes)}
    why = (f"load {load_way.value}: {loaded.node_bytes(n) / GiB:.1f} GiB on rank 0's node ("
           + ", ".join(f"{w.value}: {b / GiB:.1f}" for w, b in others.items() if w is not load_way)
           + f"); save {save_way.value}, {SAVE_WORDS[save_way]}: {save.node_bytes(n) / GiB:.1f} GiB ("
           + ", ".join(f"{w.value}: {b / GiB:.1f}" for w, b in saves.items() if w is not save_way and b is not None)
           + f"); resume {resume_way.value}"
           + ("" if fsdp2 or resume_way is not LoadWay.META_DCP else
              f" through a state dict on {'host' if ways.resume_state_dict_on_host else 'the GPU'}: "
              f"{resumed.node_bytes(n) / GiB:.1f} GiB"))
    return HostRam(load_way, save_way, resume_way, why, process_bytes=n * PROCESS_BYTES_PER_RANK,
                   offloaded_bytes=offloaded_bytes, load_bytes=loaded.node_bytes(n), save_bytes=save.node_bytes(n),
                   resume_bytes=resumed.node_bytes(n), save_gpu_bytes=save.gpu_bytes,
                   load_gpu_bytes=loaded.gpu_bytes, resume_gpu_bytes=resumed.gpu_bytes)


def gpu_outside_step_bytes(host: HostRam, step) -> dict[str, int]:
    """Bytes allocated on each GPU at the moments outside the step whose way adds a device transient
    (outside_step.py), beside what is resident then (step: the ledger's optimizer_step phase, memory.py): loading
    beside the sharded params (nothing trained yet); a save beside the sharded params, grads and optimizer state; a
    resume beside the sharded params and optimizer state (torch's _init_optim_state makes the states and drops the
    grads before they are loaded into). The first optimizer step's allocated peak is that phase itself, in every
    estimate's peak already. Keys: "rank0-broadcast load", "dcp save", ..."""
    moments = {f"{host.load_way.value} load": (host.load_gpu_bytes, step.sharded_params),
               f"{host.save_way.value} save": (host.save_gpu_bytes,
                                               step.sharded_params + step.sharded_grads + step.optimizer_state),
               f"{host.resume_way.value} resume": (host.resume_gpu_bytes, step.sharded_params + step.optimizer_state)}
    return {name: resident + transient for name, (transient, resident) in moments.items() if transient}


def host_ram_fix(host: HostRam | None) -> str:
    """What lowers host RAM, for the ways in use: rank 0 loading and DCP saves only where the ways are not those."""
    fixes = []
    if host is None or host.load_way is LoadWay.EVERY_RANK:
        fixes.append("load on rank 0 only (cpu_ram_efficient_loading + sync_module_states)")
    if host is None or host.save_way in (SaveWay.FULL_RANK0, SaveWay.SAVE_PRETRAINED):
        fixes.append("save each rank's shard (state_dict_type SHARDED_STATE_DICT: DCP)")
    elif host.save_way is SaveWay.DCP_ASYNC:
        fixes.append("save synchronously (async DCP stages each rank's shard to host)")
    if fixes:
        return " and ".join(fixes)
    return ("more nodes (fewer ranks' shards and offloaded state on each), or no CPU offload: it already loads on "
            "rank 0 and saves each rank's shard with DCP")


def host_ram_reason(host: HostRam, capacity_bytes: int) -> str:
    """Why a candidate does not fit in host RAM ('' when it fits or the capacity is unknown)."""
    if not capacity_bytes or host.peak_bytes <= capacity_bytes:
        return ""
    phase = max((host.load_bytes, "loading"), (host.offloaded_bytes + host.save_bytes, "offloaded state + save"),
                (host.offloaded_bytes + host.resume_bytes, "offloaded state + resume"))
    return (f"needs {host.peak_bytes / GiB:.0f} GiB of host RAM per node > {capacity_bytes / GiB:.0f} GiB "
            f"({phase[1]} {phase[0] / GiB:.0f} GiB, processes {host.process_bytes / GiB:.1f} GiB)")
