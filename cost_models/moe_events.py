"""The step walk's MoE blocks at pp = 1 (step_allocations' walks; a mixin ahead of StepWalk): a sparse block's
parameters as the model holds them, so that its gradients are made as the memory ledger's MoE moments hold them.

A block's activations, working sets and backward moments are the pipeline walk's (pipeline_stage_pieces.py: the
MoE MLP's moments from moe.backward_moments, as memory.py picks them); what changes at pp = 1 is the block's
tensors. pipeline_allocations.param_tensors cuts a sparse block as a dense one (one expert's gate, up and down, the
other experts as one lump), so at a backward moment the gradients the ledger counts (the stacked down projection's
at the experts' activation backward, every routed expert's at the up projection's, the whole MLP's and the
o-projection's at the attention's) did not fit its tensors: the walk made ~1 GB less than the ledger on Mixtral 8x7B
(fp32, micro-batch 2). Here the block is q, k, v, o, the router and the stacked expert tensors (transformers 5's
grouped_mm experts: gate_up_proj (E, 2f, h), down_proj (E, h, f)), then the norms, the shared experts and the rest
(Qwen3's q / k norms, biases): StepWalk.transient makes the first seven's gradients in reverse (down, gate_up,
router, o, v, k, q), then the others' in reverse, each that fits the moment's bytes - the ledger's order.

Padding (memory.py's ParamCounts at shard group d): FSDP2 shards a tensor on dim 0 in ceil(rows / d) rows a rank, so
the tensors of few rows (the stacked experts and the router, E rows; Qwen2-MoE's 1 x h shared-expert gate) are padded
to d x ceil(rows / d): their shards, optimizer states, all-gather outputs (the unsharded storage, as the ledger counts
it), reduce-scatter inputs and sharded gradients are the padded sizes, their gradients (StepWalk.grad_bytes) and the
optimizer's foreach temporaries over the padded shards (step_temporary_bytes of the ledger's trainable elements).

Dense blocks (DeepSeek's leading first_k_dense_replace, Llama 4's interleaved): a dense model's tensors
(pipeline_allocations.param_tensors of moe.dense_block_spec) and, not checkpointed, the dense block's own saved bytes
(memory_shape's full_dense), as the ledger's ParamCounts and saved_below hold them; their moments the MoE block's, as
memory.py's formulas take them. DeepSeek's MLA attention is not q / kv_dim x h: moe_block_tensors gives its four
tensors the elements the block's count leaves.
Experts as FSDP units of their own, with expert parallelism or without: expert_unit_events.py, ahead of this.
Under LoRA the dense blocks are lora_dense_events.py's. Not here (step_allocations.replays keeps the flat rule,
moe_flat_reason): experts sharded on dim 1, and expert units with CPU offload or EP with LoRA (LoRA's padded sparse
blocks and its expert units without EP: lora_expert_unit_events.py).
"""

from __future__ import annotations

import dataclasses

from .memory_shape import ledger_shape
from .model_spec import dense_block_spec
from .moe import _is_matrix, rows_per_rank, small_dim0_tensors
from .pipeline_allocations import param_tensors


def moe_flat_reason(model, training, config, d: int) -> str | None:
    """Why an MoE step keeps the flat rule (step_allocations.replays), or None (dense, or walked here)."""
    moe = model.moe
    if moe is None:
        return None
    if (config.ep > 1 or config.expert_units) and (config.offload or training.finetune.adapters and config.ep > 1):
        # (expert_unit_events.py walks them for full fine-tuning, lora_expert_unit_events.py under LoRA without EP;
        # LoRA with EP is refused, mesh_rules "mesh-with-lora", and QLoRA on an MoE, qlora.py)
        return "MoE experts as units of their own (expert parallelism) with LoRA or CPU offload"
    if config.ep <= 1 and config.expert_shard_dim:  # (with EP: on dim 0)
        return "MoE experts sharded on dim 1"
    return None


def _stacked_groups(model) -> list[list[tuple[int, int]]]:
    """The stacked expert tensors ((rows, per row)) grouped as moe_block_tensors makes them: gate_up before down
    (transformers' order), each matrix with the stacked bias after it (gpt-oss's): one tensor, its gradient made with
    the matrix's (the ledger's moments count them together)."""
    groups: list[list[tuple[int, int]]] = []
    for t in model.moe.stacked_expert_tensors:
        if _is_matrix(model, t) or not groups:
            groups.append([])
        groups[-1].append(t)
    return groups


def expert_indices(model) -> range:
    """The stacked experts' indices among moe_block_tensors' (after q, k, v, o and the router)."""
    return range(5, 5 + len(_stacked_groups(model)))


def moe_block_tensors(model, block_params: int, d: int = 1) -> list[int]:
    """A sparse block's parameter tensors (elements), in the order StepWalk.transient reads (module docstring);
    d > 1: as FSDP2 shards them, the tensors of few rows on dim 0 (stacked experts, router, Qwen's shared-expert
    gate) padded to d x ceil(rows / d) rows (moe.small_dim0_tensors: the ledger's padding)."""
    moe, h = model.moe, model.hidden_size

    def rows(n: int, per_row: int) -> int:
        return d * rows_per_rank(n, d) * per_row

    matrices = [sum(rows(n, per_row) for n, per_row in group) for group in _stacked_groups(model)]
    attention = [model.q_dim * h, model.kv_dim * h, model.kv_dim * h, model.q_dim * h]
    router = rows(moe.n_experts, moe.router_params // moe.n_experts) if moe.router_params else 0
    gate = rows(1, h) - h if (1, h) in small_dim0_tensors(model) else 0  # padded rows of the shared-expert gate
    shared = [moe.shared_params + gate] if moe.shared_params else []
    # attention of other shapes (DeepSeek's MLA: low-rank q and kv projections) in four tensors of its elements
    budget = block_params - moe.router_params - sum(n * per_row for n, per_row in moe.stacked_expert_tensors) \
        - 2 * h - moe.shared_params
    if sum(attention) > budget > 0:
        attention = [max(1, a * budget // sum(attention)) for a in attention]
    tensors = attention + [router] + matrices + [h, h] + shared  # (the matrices at expert_indices)
    rest = block_params - sum(moe_block_tensors(model, block_params)[:len(tensors)] if d > 1 else tensors)  # unpadded
    return tensors + ([rest] if rest > 0 else [])


class DenseBlocks:
    """A dense block's unit and saved bytes among sparse ones (`dense`: the model's dense block indices), and the
    all-gather output of a block of tensors of its own (unsharded), shared by MoeWalk and
    lora_dense_events.LoraDenseBlocksWalk."""

    def dense_saved(self, shape) -> None:
        """A dense block keeps its own saved tensors (shape: a memory_shape.LedgerShape, its full_dense; checkpointed:
        its input, as any block)."""
        x = self.pieces[self.stage]
        dense = [x.stage.first_block + j in self.dense and not x.checkpointed[j] for j in range(x.stage.n_blocks)]
        self.saved_less([(shape.full - shape.full_dense) * own for own in dense])

    def saved_less(self, less: list[int]) -> None:
        """Each block's kept saved bytes per token less `less` (one a block), the stage's saved bytes with them."""
        s = self.stage
        x = self.pieces[s]
        self.pieces[s] = dataclasses.replace(x, kept=tuple(k - n for k, n in zip(x.kept, less)),
                                             saved=x.saved - self.tokens * sum(less))

    def block_unit(self, s: int, u) -> int | None:
        """The model index of the block unit u is, or None (the root, an edge unit, an experts unit)."""
        return u - self.root_units(s) + self.pieces[s].stage.first_block \
            if isinstance(u, int) and u >= self.root_units(s) else None

    def sparse_unit(self, s: int, u) -> bool:
        """Whether unit u is a sparse block's (not the root's, an edge or experts unit's, nor a dense block's)."""
        return self.block_unit(s, u) not in (None, *self.dense)

    def unsharded(self, s: int, u) -> list[int]:
        """A block unit of tensors of its own (gathers_own_tensors: padded, a dense block's) gathers them in the
        compute dtype (memory.py's block_c; gathered(i): block_c + dense_delta x c); else StagePieces.block_gathered
        over its tensors (a dense model's block, an unpadded sparse one's)."""
        if not self.gathers_own_tensors(s, u):
            return super().unsharded(s, u)
        return [n * self.c for n in self.units[s][u]]


class MoeWalk(DenseBlocks):
    """_RankWalk's _units for a sparse model (dense: theirs); with padded shards (d > 1), the padded tensors'
    shards, all-gathers, reduce-scatters and optimizer states beside the real gradients."""

    def _units(self, x) -> list[list[int]]:
        if self.model.moe is None:
            return super()._units(x)
        model = self.model
        root = x.params - x.stage.n_blocks * x.block_params
        self.real_block = moe_block_tensors(model, x.block_params)
        self.dense = model.dense_block_indices()  # a dense block's tensors as a dense model's (pipeline_allocations)
        self.real_dense = param_tensors(dense_block_spec(model), model.moe.dense_block_params) if self.dense else []
        sparse = moe_block_tensors(model, x.block_params, self.d)
        return ([[root]] if root else []) + [self.real_dense if x.stage.first_block + j in self.dense else sparse
                                             for j in range(x.stage.n_blocks)]

    def __init__(self, model, training, config, d: int, rank: int):
        super().__init__(model, training, config, d, rank)
        s = self.stage
        x = self.pieces[s]
        # a sparse block's unit (padded; EP's experts scaled: expert_unit_events) beyond its parameters
        sparse = [unit for j, unit in enumerate(self.units[s][self.root_units(s):])
                  if model.moe is not None and x.stage.first_block + j not in self.dense]
        self.padding = sum(sparse[0]) - x.block_params if sparse else 0
        total = sum(sum(unit) for unit in self.units[s])
        if model.moe is not None and total != x.params:
            # the optimizer step's temporaries over the padded shards and the dense blocks (the ledger's trainable)
            self.pieces[s] = dataclasses.replace(x, params=total)
        if model.moe is not None:
            self.ledger_saved(model, training, config)

    def ledger_saved(self, model, training, config) -> None:
        """The blocks' saved bytes as the ledger holds them: a dense block's own (expert_unit_events: the EP view's)."""
        if self.dense:
            self.dense_saved(ledger_shape(model, training, config, None, False))

    def own_block(self, s: int, u) -> int | None:
        """The model index of block unit u where its tensors are its own (padded, or a dense block's), else None."""
        i = self.block_unit(s, u) if self.model.moe is not None else None
        return i if i is not None and (self.padding or i in self.dense) else None

    def grad_bytes(self, s: int, u) -> list[int]:
        i = self.own_block(s, u)
        if i is None:
            return super().grad_bytes(s, u)
        return [n * self.c for n in (self.real_dense if i in self.dense else self.real_block)]

    def gathers_own_tensors(self, s: int, u) -> bool:
        """A padded or dense block's all-gather output and unsharded storage: its tensors (DenseBlocks.unsharded)."""
        return self.own_block(s, u) is not None
