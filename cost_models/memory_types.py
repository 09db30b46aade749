"""What the memory ledgers return and count with: the breakdown by category, an estimate, and parameters split the
way memory cares. Its own module so the ledgers (memory.py, expert_parallel.py, pipeline_memory.py) share them
without importing one another."""

from __future__ import annotations

from dataclasses import dataclass, fields

from . import dim0_padding, moe
from .identity_memo import IdentityMemo
from .model_spec import dense_block_spec
from .quick_init import quick_init
from .specs import ActivationTerms, Finetune, ModelSpec, Precision, TrainingSpec


@quick_init
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
    def total_bytes(self) -> int:  # the fields spelled out: the search sums tens of thousands of these
        return (self.sharded_params + self.unsharded_params + self.sharded_grads + self.unsharded_grads
                + self.optimizer_state + self.activations + self.logits_and_loss + self.optimizer_temporaries
                + self.collective_buffers)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in _BREAKDOWN_FIELDS}


_BREAKDOWN_FIELDS = tuple(f.name for f in fields(MemoryBreakdown))  # to_dict's keys, in the fields' order


@quick_init
@dataclass(frozen=True)
class MemoryEstimate:
    breakdown: MemoryBreakdown       # at the peak phase
    peak_phase: str                  # "backward" or "optimizer_step"
    phases: dict                     # phase name -> MemoryBreakdown, for both phases
    peak_allocated_bytes: int        # what torch.cuda.max_memory_allocated would show
    peak_reserved_bytes: int         # the allocator's reserved + outside_allocator: compared with the GPU's memory
    cpu_bytes_per_node: int          # CPU RAM the offloaded state needs on each node
    cpu_ram_capacity_bytes: int      # CPU RAM per node of the cluster (0 = unknown)
    notes: tuple[str, ...] = ()
    peak_moment: str = ""            # what runs at the peak: "loss backward", "backward of block 31", ...
    pipeline_ranks: tuple = ()       # pp > 1: each rank's PipelineRankMemory (cost_models/pipeline_rank_memory.py)
    host_ram: object = None          # HostRam (cost_models/host_ram.py): host RAM per node; set by evaluate()
    # the memory outside the caching allocator, term by term (outside_allocator.OutsideTerm), in peak_reserved_bytes
    outside_allocator: tuple = ()
    # reserved at the end of the first step, + outside_allocator_bytes: the step replay's first step alone
    # (step_allocations.step_replayed_reserved; 0 where the flat rule prices the reserved)
    first_step_reserved_bytes: int = 0

    @property
    def first_step_allocated_bytes(self) -> int:
        """The first step's allocated peak. torch's optimizers make their state lazily, in the first step() (Adam:
        torch/optim/adam.py _init_group, zeros_like for exp_avg and exp_avg_sq before the update): the first forward
        and backward run without it, and its optimizer step holds it beside the gradients and the foreach
        temporaries as every step does. So every moment but the step's lacks optimizer_state: at most the steady
        peak, lower by the state where a backward or forward moment leads."""
        step = self.phases.get("optimizer_step")
        others = [m.total_bytes - m.optimizer_state for k, m in self.phases.items() if k != "optimizer_step"]
        return max(others + [step.total_bytes if step is not None else 0])

    def first_step_dict(self) -> dict:
        """The first step against the steady one (the estimate's own peaks), for the JSON outputs."""
        return {"peak_allocated_bytes": self.first_step_allocated_bytes,
                "optimizer_state_bytes": self.phases["optimizer_step"].optimizer_state,
                **({"peak_reserved_bytes": self.first_step_reserved_bytes} if self.first_step_reserved_bytes else {})}

    @property
    def outside_allocator_bytes(self) -> int:
        return sum(t.bytes for t in self.outside_allocator)

    @property
    def allocator_reserved_bytes(self) -> int:
        """The caching allocator's reserved peak alone: what torch.cuda.max_memory_reserved shows, and what a
        published "reserved" figure (torchtitan's) is compared with; peak_reserved_bytes adds what lies outside."""
        return self.peak_reserved_bytes - self.outside_allocator_bytes


@quick_init
@dataclass(frozen=True)
class ParamCounts:
    """Parameters split the way memory cares: trainable (grads + optimizer) or frozen.

    Blocks count as the model's repeated (for MoE: sparse) block; dense_delta corrects the totals for an
    MoE model's leading dense blocks (their parameters minus as many sparse blocks')."""

    trainable_block: int
    frozen_block: int
    trainable_root: int
    frozen_root: int
    trainable_dense_delta: int = 0
    frozen_dense_delta: int = 0

    @classmethod
    def of(cls, model: ModelSpec, training: TrainingSpec, shard_group: int = 1, dim1: bool = False) -> "ParamCounts":
        """shard_group d > 1: every tensor padded to a multiple of d rows, as FSDP2 shards, gathers and
        reduce-scatters it: a sparse block's stacked experts (cost_models/moe.py; dim1: the expert matrices sharded
        on dim 1, unpadded), the dense ones and the root's (dim0_padding.py); d = 1: the real counts. Once per model,
        d, dim1 and what they read of training (a search's ledgers read them ~2 times each)."""
        return _COUNTS.get(model, (shard_group, dim1, training.finetune, training.lora_rank),
                           lambda: cls._of(model, training, shard_group, dim1))

    @classmethod
    def _of(cls, model: ModelSpec, training: TrainingSpec, d: int, dim1: bool) -> "ParamCounts":
        dense = dense_block_spec(model)  # an MoE's leading dense blocks (None: none)

        def base_padding(spec: ModelSpec) -> int:  # QLoRA's packed linears: (n / 2, 1) rows, padding < d, unpriced
            return 0 if training.quantized else dim0_padding.block_padding_elements(spec, d)

        block = moe.block_gathered_elements(model, d, dim1) + base_padding(model)
        delta = model.n_dense_layers * (model.moe.dense_block_params + base_padding(dense) - block) \
            if dense is not None else 0
        root = model.root_params + sum(dim0_padding.root_padding_elements(model, d))
        if training.finetune.adapters:
            rank = training.lora_rank  # all-linear: a dense block's MLP adapters apart
            adapter_padding = dim0_padding.adapter_padding_elements(model, rank, d)
            lora = model.lora_params_per_block(rank) + adapter_padding
            lora_delta = model.lora_dense_delta(rank) + (model.n_dense_layers * (
                dim0_padding.adapter_padding_elements(dense, rank, d) - adapter_padding) if dense is not None else 0)
            return cls(trainable_block=lora, frozen_block=block, trainable_root=0, frozen_root=root,
                       trainable_dense_delta=lora_delta, frozen_dense_delta=delta)
        return cls(block, 0, root, 0, trainable_dense_delta=delta)

    def trainable(self, n_layers: int) -> int:
        return n_layers * self.trainable_block + self.trainable_root + self.trainable_dense_delta

    def frozen(self, n_layers: int) -> int:
        return n_layers * self.frozen_block + self.frozen_root + self.frozen_dense_delta

    def block(self) -> int:
        return self.trainable_block + self.frozen_block

    def root(self) -> int:
        return self.trainable_root + self.frozen_root


_COUNTS = IdentityMemo(limit=1024)  # (model, d, dim1, finetune, rank) -> ParamCounts.of


def traced_block_terms(model: ModelSpec, precision: Precision, attention, lora: bool = False) -> ActivationTerms | None:
    """The block memory profile's terms for this compute dtype and attention (fp16 reuses bf16's: same
    widths), or None when the model is priced by the formulas; lora: the block's profile under LoRA."""
    profile = model.lora_activation_profile if lora else model.activation_profile
    if profile is None:
        return None
    dtype = "bf16" if precision.compute_dtype == "fp16" else precision.compute_dtype
    return profile.get(dtype, attention.value)
