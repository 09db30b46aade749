"""A plain FSDP step's ordered allocations and frees (pp = 1), for the caching allocator replay (issue 27 item 1).

    replay_step(model, training, config, d)                       # caching_allocator.ReplayResult, two steps
    step_replayed_reserved(memory, model, cluster, training, config, profile)   # a pp = 1 MemoryEstimate, replayed

The walk itself: step_walk.StepWalk, with the mixins below ahead of it; a checkpointed Llama block (full fine-tuning,
SDPA; 16-bit compute with TP and sequence parallel, 16-bit or fp32 without TP) op by op, tp_block_events.py.

Where it runs (replays(config)): every dense pp = 1 configuration - FSDP, HSDP (its all-reduce adds no tensor), a
shard group of one rank (one_rank_events.py), CPU offload (offload_events.py), CP (s / cp tokens; the ring's buffers
not in StagePieces: the ledger's allocated peak is the floor), TP with and without sequence parallel (the rank's
slice; with SP a checkpointed Llama block op by op, tp_block_events.py, loss parallel's tensors and the embedding's
whole-table gradient; without it the head's gathered logits: walk == ledger on the 27 TP rows of memory_accuracy.py
--mesh --only tp and llama3-8b's TP grid but fp32 / eager blocks at every-2 / selective-op, -0.4 .. +0.6%), kernel
knobs (kernels.memory_kernels: the blocks' tensors through StagePieces, the loss kernel's own, loss_kernel_events.py;
llama3-8b on 8 x h100-80gb: walk == ledger in every eager, chunked-loss and TE RMSNorm config, Liger's 14 of 48 off
by -1.2 .. +2.0%), torchtitan 0.3's edge units (edge_unit_events.py, lora_edge_events.py), LoRA / QLoRA (lora_events.py;
docs/accuracy.md, "LoRA's step"), TP with CP (walk == ledger in all 96 of llama3-8b's TP x CP configurations at 8,192
tokens, 92 at 2,048; the misses fp32 without checkpointing, +0.8%, as TP alone at s / cp tokens), a
traced block profile (profile_events.py: its saved bytes, checkpoint-held inputs and backward moment;
docs/accuracy.md, "TP with CP, and traced block profiles"), MoE (moe_events.py: a sparse block's own tensors, dense
blocks, dim-0 padding; docs/accuracy.md, "MoE's step replayed"), every tensor's dim-0 padding (dim0_padding_events.py),
experts as units of their own and expert parallelism
(expert_unit_events.py: each block's experts a unit over efsdp; docs/accuracy.md, "2026-12-07 night: expert
parallelism replayed"). A block's gradients alive at its backward's moment are made before its working set, the rest
at its post-backward. MoE's dense blocks under LoRA: lora_dense_events.py. Flat where the ledger has pieces
StagePieces lacks or the walk does not yet match it: experts on dim 1, expert units (EP among them) with CPU offload,
EP with LoRA (moe_events.moe_flat_reason; LoRA's expert units and padded experts: lora_expert_unit_events.py), LoRA with
FSDP1's adapter units.
"""

from __future__ import annotations

import dataclasses

from .caching_allocator import AllocatorSettings, ReplayResult, replay
from .dim0_padding_events import Dim0PaddingWalk
from .expert_unit_events import ExpertUnitsWalk
from .lora_dense_events import LoraDenseBlocksWalk
from .lora_edge_events import LoraEdgeUnitsWalk
from .lora_events import LoraWalk, lora_flat_reason
from .lora_expert_unit_events import LoraExpertUnitsWalk, LoraSparseBlocksWalk
from .memory_types import MemoryEstimate
from .moe_events import MoeWalk, moe_flat_reason
from .offload_events import OffloadWalk
from .one_rank_events import OneRankWalk
from .profile_events import ProfileWalk
from .score_events import EagerScoresWalk
from .pipeline_memory import rank_inputs
from .replay_notes import replay_notes
from .specs import FsdpConfig, ModelSpec, TrainingSpec
from .step_walk import StepWalk


def replays(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int,
            adapter_units: bool = False) -> str | None:
    """Why a pp = 1 configuration keeps the flat rule (module docstring), or None where its step is replayed
    (adapter_units: FSDP1's, each LoRA adapter a unit of its own: fsdp1_adapters.py)."""
    why = [(moe := moe_flat_reason(model, training, config, d), moe),
           (lora := lora_flat_reason(model, training, adapter_units), lora)]
    return next((reason for cond, reason in why if cond), None)


def replay_step(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int,
                settings: AllocatorSettings = AllocatorSettings(), snapshots: bool = False) -> ReplayResult:
    """Two training steps of a pp = 1 rank (model: the rank's slice, training: its tokens; d: the shard group);
    reserved_at_cuts: at the first step's end (its optimizer state made in its step)."""
    events, first = step_events(model, training, config, d)
    return replay(events, settings, snapshots=snapshots, cuts=(first,))


def step_events(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int) -> tuple[list[tuple], int]:
    """Two steps' events, and how many of them are the first step's."""
    walk = (_LoraStepWalk if training.finetune.adapters else _FullStepWalk)(model, training, config, d, 0)
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


class _FullStepWalk(ExpertUnitsWalk, OffloadWalk, OneRankWalk, Dim0PaddingWalk, MoeWalk, ProfileWalk,
                    EagerScoresWalk, StepWalk):
    """The walk step_events runs for full fine-tuning."""


class _LoraStepWalk(LoraExpertUnitsWalk, OffloadWalk, OneRankWalk, LoraEdgeUnitsWalk, Dim0PaddingWalk,
                    LoraSparseBlocksWalk, LoraDenseBlocksWalk, LoraWalk, EagerScoresWalk, StepWalk):
    """The walk step_events runs under LoRA and QLoRA."""


def step_replayed_reserved(memory: MemoryEstimate, model: ModelSpec, cluster, training: TrainingSpec,
                           config: FsdpConfig, profile, settings: AllocatorSettings | None = None,
                           adapter_units: bool = False) -> MemoryEstimate:
    """A pp = 1 estimate (memory.estimate_memory) with its reserved peak from the replay of its step under the
    config's alloc_conf, + the memory outside the allocator, in place of allocated x (1 + fragmentation); never below
    the ledger's allocated peak. Run for the candidates reported, not inside the search (a Llama 3.1 8B step: ~0.3 s).
    Whether it fits stays the flat rule's, as for pipelines: under memory pressure c10's malloc frees cached blocks,
    then every unused segment, and retries cudaMalloc before an out-of-memory error (pipeline_allocations.
    replayed_reserved), so the replay is the reserved a run shows with room to spare - the figure to compare with
    torch.cuda.max_memory_reserved - and a replay above the GPU is a warning note (slower steps), not a refusal."""
    d = config.shard_group_size(cluster)
    if config.pp > 1 or replays(model, training, config, d, adapter_units) is not None:
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
