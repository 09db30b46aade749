"""The step walk's MoE blocks at pp = 1 (step_allocations' walks; a mixin ahead of _StepWalk): a sparse block's
parameters as the model holds them, so that its gradients are made as the memory ledger's MoE moments hold them.

A block's activations, working sets and backward moments are the pipeline walk's (pipeline_stage_pieces.py: the
MoE MLP's moments from moe.backward_moments, as memory.py picks them); what changes at pp = 1 is the block's
tensors. pipeline_allocations.param_tensors cuts a sparse block as a dense one (one expert's gate, up and down, the
other experts as one lump), so at a backward moment the gradients the ledger counts (the stacked down projection's
at the experts' activation backward, every routed expert's at the up projection's, the whole MLP's and the
o-projection's at the attention's) did not fit its tensors: the walk made ~1 GB less than the ledger on Mixtral 8x7B
(fp32, micro-batch 2). Here the block is q, k, v, o, the router and the stacked expert tensors (transformers 5's
grouped_mm experts: gate_up_proj (E, 2f, h), down_proj (E, h, f)), then the norms, the shared experts and the rest
(Qwen3's q / k norms, biases): _StepWalk.transient makes the first seven's gradients in reverse (down, gate_up,
router, o, v, k, q), then the others' in reverse, each that fits the moment's bytes - the ledger's order.

Not here (step_allocations.replays keeps the flat rule): leading dense blocks (DeepSeek's first_k_dense_replace),
stacked experts padded on dim 0 (E not a multiple of the shard group), experts as FSDP units of their own and
expert parallelism.
"""

from __future__ import annotations

from .moe import _is_matrix


def moe_flat_reason(model, config, d: int) -> str | None:
    """Why an MoE step keeps the flat rule (step_allocations.replays), or None (dense, or walked here)."""
    moe = model.moe
    if moe is None and config.ep <= 1:
        return None
    if config.ep > 1:
        return "expert parallelism"
    if moe.n_dense_layers:
        return "MoE with leading dense blocks"
    if d > 1 and moe.n_experts % d and not config.expert_shard_dim:
        return "MoE experts padded on dim 0"
    if config.expert_units or config.expert_shard_dim:
        return "MoE experts as units of their own / sharded on dim 1"
    return None


def moe_block_tensors(model, block_params: int) -> list[int]:
    """A sparse block's parameter tensors (elements), in the order _StepWalk.transient reads (module docstring)."""
    moe, h = model.moe, model.hidden_size
    # the stacked matrices, gate_up before down (transformers' order), each with the stacked bias after it (gpt-oss's):
    # one tensor, its gradient made with the matrix's (the ledger's moments count them together)
    matrices = []
    for rows, per_row in moe.stacked_expert_tensors:
        if _is_matrix(model, (rows, per_row)) or not matrices:
            matrices.append(0)
        matrices[-1] += rows * per_row
    attention = [model.q_dim * h, model.kv_dim * h, model.kv_dim * h, model.q_dim * h]
    shared = [moe.shared_params] if moe.shared_params else []
    tensors = attention + [moe.router_params] + matrices + [h, h] + shared
    rest = block_params - sum(tensors)
    return tensors + ([rest] if rest > 0 else [])


class MoeWalk:
    """_RankWalk's _units for a sparse model (dense: theirs)."""

    def _units(self, x) -> list[list[int]]:
        if self.model.moe is None:
            return super()._units(x)
        root = x.params - x.stage.n_blocks * x.block_params
        return ([[root]] if root else []) + [moe_block_tensors(self.model, x.block_params)] * x.stage.n_blocks
