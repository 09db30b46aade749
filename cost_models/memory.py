"""Per-rank GPU memory ledger for one FSDP configuration.

Model states follow the ZeRO/FSDP papers (formulas.md): stored params, gradients and optimizer state
are divided by the shard-group size d; compute-dtype copies of the units in flight are gathered whole.
Categories are named like PyTorch's FSDPMemTracker so traced and estimated figures line up.

The peak is the larger of two moments:
- backward: everything saved by the forward is alive, the loss backward makes fp32 logit gradients,
  the root unit's params and gradients stay gathered (FSDP2 does not reshard the root after forward),
  one block is gathered with its gradient and reduce-scatter buffer, and the next is prefetched;
- optimizer step: stored params, gradients, optimizer state and the step's temporaries.
Ignored: per-parameter padding to a multiple of d (at most d-1 elements per tensor), the embedding
gradient's sparse shape, allocator rounding to 512 bytes; reserved adds the profile's fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from . import activations
from .profile import Profile
from .specs import ClusterSpec, Finetune, FsdpConfig, ModelSpec, Optimizer, Precision, Sharding, TrainingSpec
from .units import DTYPE_BYTES

# Blocks whose compute-dtype params are gathered at once in FULL_SHARD: the current one and the
# prefetched next one (FSDP1's rate limiter allows two all-gathers in flight; FSDP2 prefetches one).
UNITS_IN_FLIGHT = 2
UNITS_IN_FLIGHT_UNLIMITED = 3  # limit_all_gathers=False lets the CPU run further ahead


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the peak moment, by category."""

    sharded_params: int = 0
    unsharded_params: int = 0
    sharded_grads: int = 0
    unsharded_grads: int = 0
    optimizer_state: int = 0
    activations: int = 0
    logits_and_loss: int = 0
    optimizer_temporaries: int = 0
    collective_buffers: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class MemoryEstimate:
    breakdown: MemoryBreakdown       # at the peak phase
    peak_phase: str                  # "backward" or "optimizer_step"
    phases: dict                     # phase name -> MemoryBreakdown, for both phases
    peak_allocated_bytes: int        # what torch.cuda.max_memory_allocated would show
    peak_reserved_bytes: int         # + fragmentation + CUDA context: compared with the GPU's memory
    cpu_bytes_per_node: int          # CPU RAM the offloaded state needs on each node
    cpu_ram_capacity_bytes: int      # CPU RAM per node of the cluster (0 = unknown)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParamCounts:
    """Parameters split the way memory cares: trainable (grads + optimizer) or frozen."""

    trainable_block: int
    frozen_block: int
    trainable_root: int
    frozen_root: int

    @classmethod
    def of(cls, model: ModelSpec, training: TrainingSpec) -> "ParamCounts":
        if training.finetune is Finetune.LORA:
            lora = model.lora_params_per_block(training.lora_rank)
            return cls(trainable_block=lora, frozen_block=model.block_params, trainable_root=0,
                       frozen_root=model.root_params)
        return cls(model.block_params, 0, model.root_params, 0)

    def trainable(self, n_layers: int) -> int:
        return n_layers * self.trainable_block + self.trainable_root

    def frozen(self, n_layers: int) -> int:
        return n_layers * self.frozen_block + self.frozen_root

    def block(self) -> int:
        return self.trainable_block + self.frozen_block

    def root(self) -> int:
        return self.trainable_root + self.frozen_root


def _shard(n_bytes: float, d: int) -> int:
    return math.ceil(n_bytes / d)


def estimate_memory(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
                    profile: Profile) -> MemoryEstimate:
    L = model.n_layers
    d = config.shard_group_size(cluster)
    precision = config.precision
    c = DTYPE_BYTES[precision.compute_dtype]        # gathered params, activations, compute grads
    p = DTYPE_BYTES[precision.param_dtype]          # stored params and their gradients
    r = DTYPE_BYTES[precision.reduce_dtype]         # reduce-scatter / all-reduce buffers
    frozen_p = c if precision.mixed else p          # frozen (LoRA base) weights are kept in compute dtype
    counts = ParamCounts.of(model, training)
    trainable, frozen = counts.trainable(L), counts.frozen(L)
    opt_per_param = training.optimizer.state_bytes_per_param(precision.param_dtype)

    # --- model states, sharded over d (on the CPU with offload) -------------------------------------
    sharded_params = _shard(trainable * p + frozen * frozen_p, d)
    sharded_grads = _shard(trainable * p, d)
    optimizer_state = _shard(trainable * opt_per_param, d)
    # foreach Adam/AdamW makes an fp32 list as large as one state (sqrt of exp_avg_sq), SGD none.
    step_temporaries = _shard(trainable * p, d) if training.optimizer is not Optimizer.SGD else 0
    if precision is Precision.FP16:
        step_temporaries += 4 * 1024  # ShardedGradScaler: found-inf flags and the scale, per device

    # --- gathered compute-dtype params during forward/backward ----------------------------------------
    block_c = counts.block() * c
    root_c = counts.root() * c
    if d == 1 and not precision.mixed:
        unsharded_params = 0  # the stored params are the compute params: nothing extra is gathered
    elif config.sharding in (Sharding.SHARD_GRAD_OP, Sharding.HYBRID_SHARD_ZERO2):
        unsharded_params = L * block_c + root_c  # kept gathered from forward until backward
    else:
        in_flight = UNITS_IN_FLIGHT if config.limit_all_gathers else UNITS_IN_FLIGHT_UNLIMITED
        unsharded_params = min(L, in_flight) * block_c + root_c

    # --- gradients in backward: the root's stay gathered until the end, one block's in flight --------
    unsharded_grads = (counts.trainable_root + counts.trainable_block) * c
    collective_buffers = counts.trainable_block * r  # reduce-scatter input of the block in flight
    if d > 1:
        collective_buffers += block_c  # all-gather output of the prefetched block before copy-out
    accumulating = config.grad_accum > 1
    if config.sharding is Sharding.NO_SHARD:
        grads_in_backward = trainable * p  # full gradients, all-reduced in buckets
    else:
        grads_in_backward = sharded_grads if accumulating else 0  # sharded grads of earlier micro-steps

    # --- activations ------------------------------------------------------------------------------------
    tokens = config.micro_batch * training.seq_len
    full_block = activations.block_bytes_per_token(model, c, config.attention, training.seq_len)
    ckpt_block = activations.checkpointed_block_bytes_per_token(model, c)
    if config.ac_every:
        # Blocks 0, K, 2K, ... keep only their input. Backward runs from the last block down, so when the
        # highest checkpointed block re-runs its forward, the full blocks above it are already freed.
        n_ckpt = math.ceil(L / config.ac_every)
        saved_per_token = n_ckpt * ckpt_block + (L - n_ckpt) * full_block
        last_ckpt = config.ac_every * ((L - 1) // config.ac_every)
        freed_above = (L - 1 - last_ckpt) * full_block
        recompute_per_token = max(0, full_block - ckpt_block - freed_above)
    else:
        saved_per_token = L * full_block
        recompute_per_token = 0
    saved_per_token += activations.root_bytes_per_token(model, c)
    activation_bytes = tokens * (saved_per_token + recompute_per_token)
    logits_kept, logits_peak = activations.logits_bytes_per_token(model, c)

    offload = config.offload
    gpu_states = 0 if offload else 1
    # Two backward moments: the loss backward (fp32 logit gradients), and the first block's backward
    # (logits' gradients freed, one block's grads and buffers and the recompute in flight).
    at_loss = tokens * (saved_per_token + logits_peak)
    at_first_block = activation_bytes + tokens * logits_kept + unsharded_grads + collective_buffers
    backward = MemoryBreakdown(
        sharded_params=gpu_states * sharded_params,
        unsharded_params=unsharded_params,
        sharded_grads=gpu_states * grads_in_backward,
        unsharded_grads=unsharded_grads if at_first_block >= at_loss else counts.trainable_root * c,
        optimizer_state=gpu_states * optimizer_state,
        activations=activation_bytes if at_first_block >= at_loss else tokens * saved_per_token,
        logits_and_loss=tokens * (logits_kept if at_first_block >= at_loss else logits_peak),
        collective_buffers=collective_buffers if at_first_block >= at_loss else 0,
    )
    step = MemoryBreakdown(
        sharded_params=gpu_states * sharded_params,
        sharded_grads=gpu_states * (trainable * p if config.sharding is Sharding.NO_SHARD else sharded_grads),
        optimizer_state=gpu_states * optimizer_state,
        optimizer_temporaries=gpu_states * step_temporaries,
    )
    if backward.total_bytes >= step.total_bytes:
        breakdown, phase = backward, "backward"
    else:
        breakdown, phase = step, "optimizer_step"
    peak_allocated = breakdown.total_bytes
    peak_reserved = int(peak_allocated * (1 + profile.fragmentation)) + profile.cuda_context_bytes
    cpu_per_rank = (sharded_params + sharded_grads + optimizer_state + step_temporaries) if offload else 0
    return MemoryEstimate(
        breakdown=breakdown,
        peak_phase=phase,
        phases={"backward": backward, "optimizer_step": step},
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        cpu_bytes_per_node=cpu_per_rank * cluster.gpus_per_node,
        cpu_ram_capacity_bytes=cluster.cpu_ram_bytes_per_node,
        notes=tuple(activations.quirks(model, config.attention)),
    )
