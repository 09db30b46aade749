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

Experts as FSDP units of their own, with expert parallelism or without: expert_unit_events.py, ahead of this.
Not here (step_allocations.replays keeps the flat rule, moe_flat_reason): dense blocks (DeepSeek's leading, Llama 4's
interleaved), LoRA with padded experts (LoraWalk's own units, unpadded), experts sharded on dim 1, and expert units
(EP among them) with LoRA or CPU offload.
"""

from __future__ import annotations

import dataclasses

from .moe import _is_matrix, block_gathered_elements, rows_per_rank, small_dim0_tensors


def moe_flat_reason(model, training, config, d: int) -> str | None:
    """Why an MoE step keeps the flat rule (step_allocations.replays), or None (dense, or walked here)."""
    moe = model.moe
    if moe is None:
        return None
    if moe.n_dense_layers:
        return "MoE with dense blocks"  # leading (DeepSeek's first_k_dense_replace) or interleaved (Llama 4)
    if (config.ep > 1 or config.expert_units) and (training.finetune.adapters or config.offload):
        # (expert_unit_events.py walks them for full fine-tuning on the device)
        return "MoE experts as units of their own (expert parallelism) with LoRA or CPU offload"
    if training.finetune.adapters and d > 1 and block_gathered_elements(model, d) != model.block_params:
        return "LoRA with MoE experts padded on dim 0"  # (LoraWalk's units: unpadded)
    if config.ep <= 1 and config.expert_shard_dim:  # (with EP: on dim 0)
        return "MoE experts sharded on dim 1"
    return None


def stacked_matrices(model) -> int:
    """How many tensors moe_block_tensors makes of the stacked experts (each matrix with its stacked bias)."""
    return sum(1 for i, t in enumerate(model.moe.stacked_expert_tensors) if i == 0 or _is_matrix(model, t))


def moe_block_tensors(model, block_params: int, d: int = 1) -> list[int]:
    """A sparse block's parameter tensors (elements), in the order StepWalk.transient reads (module docstring);
    d > 1: as FSDP2 shards them, the tensors of few rows on dim 0 (stacked experts, router, Qwen's shared-expert
    gate) padded to d x ceil(rows / d) rows (moe.small_dim0_tensors: the ledger's padding)."""
    moe, h = model.moe, model.hidden_size

    def rows(n: int, per_row: int) -> int:
        return d * rows_per_rank(n, d) * per_row

    # the stacked matrices, gate_up before down (transformers' order), each with the stacked bias after it (gpt-oss's):
    # one tensor, its gradient made with the matrix's (the ledger's moments count them together)
    matrices = []
    for n, per_row in moe.stacked_expert_tensors:
        if _is_matrix(model, (n, per_row)) or not matrices:
            matrices.append(0)
        matrices[-1] += rows(n, per_row)
    attention = [model.q_dim * h, model.kv_dim * h, model.kv_dim * h, model.q_dim * h]
    router = rows(moe.n_experts, moe.router_params // moe.n_experts) if moe.router_params else 0
    gate = rows(1, h) - h if (1, h) in small_dim0_tensors(model) else 0  # padded rows of the shared-expert gate
    shared = [moe.shared_params + gate] if moe.shared_params else []
    tensors = attention + [router] + matrices + [h, h] + shared
    rest = block_params - sum(moe_block_tensors(model, block_params)[:len(tensors)] if d > 1 else tensors)  # unpadded
    return tensors + ([rest] if rest > 0 else [])


class MoeWalk:
    """_RankWalk's _units for a sparse model (dense: theirs); with padded shards (d > 1), the padded tensors'
    shards, all-gathers, reduce-scatters and optimizer states beside the real gradients."""

    def _units(self, x) -> list[list[int]]:
        if self.model.moe is None:
            return super()._units(x)
        root = x.params - x.stage.n_blocks * x.block_params
        self.real_block = moe_block_tensors(self.model, x.block_params)
        return ([[root]] if root else []) + [moe_block_tensors(self.model, x.block_params, self.d)] * x.stage.n_blocks

    def __init__(self, model, training, config, d: int, rank: int):
        super().__init__(model, training, config, d, rank)
        x = self.pieces[self.stage]
        self.padding = 0 if model.moe is None else sum(self.units[self.stage][-1]) - x.block_params
        if self.padding:  # the optimizer step's temporaries over the padded shards (the ledger's trainable)
            self.pieces[self.stage] = dataclasses.replace(x, params=x.params + x.stage.n_blocks * self.padding)

    def padded_block(self, s: int, u) -> bool:
        return self.padding and not isinstance(u, str) and u >= self.root_units(s)

    def grad_bytes(self, s: int, u) -> list[int]:
        return [n * self.c for n in self.real_block] if self.padded_block(s, u) else super().grad_bytes(s, u)

    def unsharded(self, s: int, u) -> list[int]:
        """A padded block's all-gather output and unsharded storage: the padded tensors (memory.py's block_c)."""
        return [n * self.c for n in self.units[s][u]] if self.padded_block(s, u) else super().unsharded(s, u)
