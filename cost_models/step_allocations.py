"""A plain FSDP step's ordered allocations and frees (pp = 1), for the caching allocator replay (issue 27 item 1).

    replay_step(model, training, config, d)                       # caching_allocator.ReplayResult, two steps
    step_replayed_reserved(memory, model, cluster, training, config, profile)   # a pp = 1 MemoryEstimate, replayed

A step without a pipeline is a one-stage pipeline whose microbatches (gradient accumulation) run forward then
backward one after another: pipeline_allocations._RankWalk writes the tensors (the same StagePieces, parameters per
tensor, activations cut into the model's widths, the loss's events, the optimizer's foreach temporaries), and this
walk gives it FSDP2's hooks around each unit (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, torch 2.13),
where a pipeline stage stays gathered for the step:
- the root (embedding, final norm, head) unsharded at each microbatch's forward and kept to its post-backward
  (FSDP2 never reshards the root after forward);
- a block's pre-forward all-gathers it (input on the default stream, output on the copy-in stream, copied out into
  its unsharded parameters; the previous unit's all-gather output freed once this unit is copied out) and its
  post-forward reshards it (FULL_SHARD; SHARD_GRAD_OP keeps it gathered to its backward; reshard_after_forward=N
  keeps an N-way shard);
- backward: the root's pre-backward prefetches the last block; a block's pre-backward copies it out and prefetches
  the block below; its post-backward frees the previous unit's reduce-scatter input (FSDP2 keeps it until the next
  reduce-scatter), writes its own (reduce dtype, default stream) from the compute-dtype gradients, the output on the
  reduce-scatter stream (the sharded gradient at the first microbatch; later ones added into it and freed), and
  reshards;
- the logits freed in forward (the loop drops the model output before backward: loss_memory.loss_events).

Where it runs (replays(config)): every dense pp = 1 configuration with a shard group of more than one rank - FSDP
and HSDP (HSDP's all-reduce on the reduce-scatter output adds no tensor here) and CP (s / cp tokens; the ring's
buffers are not in StagePieces: the ledger's allocated peak is the floor). The flat rule stays where the ledger
has pieces StagePieces lacks: TP (loss parallel's tensors: the walk's loss is the eager one on the rank's vocabulary
slice, 1,003 MiB allocated where the ledger and the trace hold 1,315 on memory_accuracy.py's qwen2-tp row), MoE and
EP (the experts' units, padding and dispatch buffers), LoRA / QLoRA (frozen weights without gradients, packed 4-bit
weights), CPU offload (gradients and states on the host), a shard group of one rank (no collectives), models priced
from a traced block profile, and kernel knobs (Liger, Transformer Engine,
torchtitan 0.3's chunked loss: the walk writes the eager ops' tensors; the B200 row of frontier_accuracy.py, chunked
loss, replayed as eager reserved 48.9 GiB where 33.7 is published).
"""

from __future__ import annotations

import dataclasses
import math

from . import kernels
from .caching_allocator import AllocatorSettings, ReplayResult, replay
from .memory_types import MemoryEstimate
from .pipeline_allocations import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, _RankWalk, replay_notes
from .pipeline_memory import rank_inputs
from .specs import FsdpConfig, ModelSpec, Sharding, TrainingSpec


def replays(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int) -> str | None:
    """Why a pp = 1 configuration keeps the flat rule (module docstring), or None where its step is replayed."""
    why = [(model.moe is not None or config.ep > 1, "MoE / expert parallelism"),
           (training.finetune.adapters or training.quantized, "adapters (LoRA / QLoRA)"),
           (config.tp > 1, "tensor parallelism"), (config.offload, "CPU offload"),
           (d <= 1, "a shard group of one rank"),
           (kernels.memory_kernels(config) != kernels.EAGER, "kernels (Liger, Transformer Engine, the chunked loss)"),
           (model.activation_profile is not None, "a traced block profile")]
    return next((reason for cond, reason in why if cond), None)


def replay_step(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int,
                settings: AllocatorSettings = AllocatorSettings(), snapshots: bool = False) -> ReplayResult:
    """Two training steps of a pp = 1 rank (model: the rank's slice, training: its tokens; d: the shard group);
    reserved_at_cuts: at the first step's end (its optimizer state made in its step)."""
    events, first = step_events(model, training, config, d)
    return replay(events, settings, snapshots=snapshots, cuts=(first,))


def step_events(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int) -> tuple[list[tuple], int]:
    """Two steps' events, and how many of them are the first step's."""
    walk = _StepWalk(model, training, config, d, 0)
    walk.step(first=True)
    first = len(walk.events)
    walk.step(first=False)
    return walk.events, first


def step_replay(model: ModelSpec, cluster, training: TrainingSpec, config: FsdpConfig,
                settings: AllocatorSettings | None = None, snapshots: bool = True) -> ReplayResult:
    """The replay step_replayed_reserved runs, from the whole model's specs (settings None: the config's)."""
    local, training = rank_inputs(model, training, config)
    settings = config.allocator_settings if settings is None else settings
    return replay_step(local, training, config, config.shard_group_size(cluster), settings, snapshots)


class _StepWalk(_RankWalk):
    """A pp = 1 rank: microbatch after microbatch, FSDP2's unshard / reshard / reduce-scatter around each unit."""

    keeps_logits = False

    def __init__(self, model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int, rank: int):
        super().__init__(model, training, config, d, rank)
        self.m = config.grad_accum
        self.stage = next(iter(self.pieces))
        self.keeps_gathered = config.sharding in (Sharding.SHARD_GRAD_OP, Sharding.HYBRID_SHARD_ZERO2)
        self.partial = 0 if self.keeps_gathered else config.reshard_after_forward  # an N-way shard kept
        self.pending: tuple | None = None   # the last all-gather output, freed once the next unit is copied out
        self.prefetched: set[int] = set()   # units whose all-gather was issued ahead (backward prefetch)
        self.rs_in: tuple | None = None     # the last reduce-scatter input, freed at the next post-backward
        self.has_grad: set[int] = set()     # units holding their sharded gradient this step
        self.gathered_units: set[int] = set()
        self.partials: set[int] = set()     # units keeping an N-way shard from forward to backward

    def all_gather(self, u: int) -> None:
        s = self.stage
        size = sum(self.unsharded(s, u))
        self.alloc(("all_gather_in", s, u), math.ceil(size / self.d))
        self.alloc(("all_gather", s, u), size, ALL_GATHER_STREAM)
        self.free(("all_gather_in", s, u))
        self.prefetched.add(u)

    def unshard(self, u: int) -> None:
        """Wait for the unit's all-gather (issued now unless prefetched), copy it out, free the previous output."""
        if u in self.gathered_units:
            return
        s = self.stage
        if u not in self.prefetched:
            self.all_gather(u)
        self.prefetched.discard(u)
        if u in self.partials:
            self.free(("partial", s, u))
            self.partials.discard(u)
        for i, size in enumerate(self.unsharded(s, u)):
            self.alloc(("unsharded", s, u, i), size)
        self.gathered_units.add(u)
        if self.pending is not None:
            self.free(self.pending)
        self.pending = ("all_gather", s, u)

    def reshard_unit(self, u: int) -> None:
        s = self.stage
        for i in range(len(self.units[s][u])):
            self.free(("unsharded", s, u, i))
        self.gathered_units.discard(u)

    def pre_forward(self, s: int, u: int) -> None:
        self.unshard(u)

    def post_forward(self, s: int, u: int) -> None:
        if self.keeps_gathered:
            return
        self.reshard_unit(u)
        if self.partial:
            self.alloc(("partial", s, u), math.ceil(sum(self.unsharded(s, u)) / self.partial))
            self.partials.add(u)

    def pre_backward(self, s: int, u: int) -> None:
        self.unshard(u)
        below = u - 1
        if below >= self.root_units(s) and below not in self.gathered_units:
            self.all_gather(below)

    def weight_grads(self, s: int, u: int) -> None:
        """The unit's compute-dtype gradients, then its post-backward: reduce-scatter and reshard."""
        unit = self.units[s][u]
        for i, n in enumerate(unit):
            self.alloc(("wgrad", s, u, i), n * self.c)
        if self.rs_in is not None:
            self.free(self.rs_in)
        self.rs_in = ("rs_in", s, u)
        self.alloc(self.rs_in, sum(unit) * self.r)
        for i in range(len(unit)):
            self.free(("wgrad", s, u, i))
        size = math.ceil(sum(unit) * self.r / self.d)
        if u in self.has_grad:  # a later microbatch: added into the sharded gradient in place, then freed
            self.alloc(("new_grad", s, u), size, REDUCE_SCATTER_STREAM)
            self.free(("new_grad", s, u))
        else:
            self.alloc(("sharded_grad", s, u), size, REDUCE_SCATTER_STREAM)
            self.has_grad.add(u)
        self.reshard_unit(u)

    def step(self, first: bool) -> None:
        s, x = self.stage, self.pieces[self.stage]
        root = self.root_units(s)
        for mb in range(self.m):
            if root:
                self.unshard(0)
            self.forward_pass(x, mb)
            if self.pending is not None:  # the root's post-forward frees the last all-gather output
                self.free(self.pending)
                self.pending = None
            last = len(self.units[s]) - 1
            if last >= root and last not in self.gathered_units:  # the root's pre-backward prefetches the last block
                self.all_gather(last)
            self.backward_pass(x, mb)
            if self.pending is not None:
                self.free(self.pending)
                self.pending = None
            if self.rs_in is not None:  # the final callback waits for the last reduce-scatter
                self.free(self.rs_in)
                self.rs_in = None
        self.has_grad.clear()
        self.optimizer_step(first)


def step_replayed_reserved(memory: MemoryEstimate, model: ModelSpec, cluster, training: TrainingSpec,
                           config: FsdpConfig, profile, settings: AllocatorSettings | None = None) -> MemoryEstimate:
    """A pp = 1 estimate (memory.estimate_memory) with its reserved peak from the replay of its step under the
    config's alloc_conf, + the memory outside the allocator, in place of allocated x (1 + fragmentation); never below
    the ledger's allocated peak. Run for the candidates reported, not inside the search (a Llama 3.1 8B step: ~0.3 s).
    Whether it fits stays the flat rule's, as for pipelines: under memory pressure c10's malloc frees cached blocks,
    then every unused segment, and retries cudaMalloc before an out-of-memory error (pipeline_allocations.
    replayed_reserved), so the replay is the reserved a run shows with room to spare - the figure to compare with
    torch.cuda.max_memory_reserved - and a replay above the GPU is a warning note (slower steps), not a refusal."""
    d = config.shard_group_size(cluster)
    if config.pp > 1 or replays(model, training, config, d) is not None:
        return memory
    settings = config.allocator_settings if settings is None else settings
    replayed = step_replay(model, cluster, training, config, settings, snapshots=False)
    reserved = memory.outside_allocator_bytes + max(memory.peak_allocated_bytes, replayed.peak_reserved_bytes)
    # at the first step's end (its optimizer state made in its step, after the forward's segments are cached): what
    # the second step's forward adds to it is the rest of the reserved peak
    first = memory.outside_allocator_bytes + max(memory.first_step_allocated_bytes, replayed.reserved_at_cuts[0])
    notes = replay_notes(memory, reserved, ": the step's allocations", settings, profile, cluster.gpu.memory_bytes)
    # first: the estimate's own notes (evaluate's outside the step among them) follow it
    return dataclasses.replace(memory, peak_reserved_bytes=reserved, notes=notes + memory.notes,
                               first_step_reserved_bytes=first)
