"""Tensor parallelism: what one rank of a TP group holds and computes (Megatron-LM's plan as torchtitan and
transformers' base_model_tp_plan apply it; shared/reference/parallelism.md).

The Llama-style plan splits q/k/v, gate and up column-wise and o and down row-wise: each rank has
n_heads / tp heads (KV heads / tp, or one KV head replicated when there are fewer KV heads than ranks) and
ffn / tp of the MLP; norms (and a row-wise layer's bias) stay replicated. The embedding is split row-wise
over the vocabulary and the head column-wise; with loss parallel (torchtitan's default with sequence
parallel) the cross-entropy runs on vocab / tp logits per rank, without it (transformers' tp_plan,
`colwise_gather_output`) the logits are gathered to the full vocabulary. Routed experts are split over tp
only without expert parallelism (ep = 1); with ep > 1 EP borrows the TP ranks (torchtitan's etp = 1).

`local_model` gives the per-rank ModelSpec: the memory ledger and the operator-level step time then read the
per-rank parameters and the narrower matmuls as they read any model's.
"""

from __future__ import annotations

from dataclasses import replace

from .specs import FsdpConfig, ModelSpec


def _norm_params(model: ModelSpec) -> int:
    """A block's replicated parameters: its norms' weights (and q/k norms). LayerNorm's biases included."""
    from .operators import _n_norms  # the one count of a block's norms

    per_norm = 2 if model.norm == "layernorm" else 1
    qk = {"": 0, "head": 2 * model.head_dim, "full": model.q_dim + model.kv_dim}.get(model.qk_norm, 0)
    return _n_norms(model) * per_norm * model.hidden_size + qk


def local_kv_heads(model: ModelSpec, tp: int) -> int:
    """KV heads per rank: n_kv_heads / tp, or 1 (replicated) when tp exceeds them."""
    return max(1, model.n_kv_heads // tp)


def local_model(model: ModelSpec, config: FsdpConfig) -> ModelSpec:
    """The ModelSpec one rank of a TP group of config.tp holds (the model itself when tp = 1)."""
    tp = config.tp
    if tp == 1:
        return model
    kv_local = local_kv_heads(model, tp)
    replicated = _norm_params(model)
    moe = model.moe
    routed = (moe.n_experts * moe.expert_params + moe.router_params) if moe is not None else 0
    dense_part = model.block_params - replicated - routed
    # the extra KV heads each rank holds when they are replicated (k and v projections, head_dim x h each)
    kv_extra = 2 * (kv_local * tp - model.n_kv_heads) * model.head_dim * model.hidden_size // tp
    block = replicated + dense_part // tp + kv_extra
    local_moe = moe
    if moe is not None:
        experts_split = config.ep == 1  # with EP the TP ranks hold whole experts (etp = 1)
        local_moe = replace(
            moe,
            expert_ffn_size=moe.expert_ffn_size // tp if experts_split else moe.expert_ffn_size,
            expert_params=moe.expert_params // tp if experts_split else moe.expert_params,
            stacked_expert_tensors=tuple((n, e // tp) for n, e in moe.stacked_expert_tensors) if experts_split
            else moe.stacked_expert_tensors,
            shared_ffn_size=moe.shared_ffn_size // tp,
            shared_params=moe.shared_params // tp,
            dense_block_params=(_norm_params(model) + (moe.dense_block_params - _norm_params(model)) // tp)
            if moe.dense_block_params else 0,
            dense_ffn_size=moe.dense_ffn_size // tp,
        )
        block += moe.router_params + (moe.n_experts * local_moe.expert_params)
    return replace(
        model,
        n_heads=model.n_heads // tp,
        n_kv_heads=kv_local,
        ffn_hidden_size=max(1, model.ffn_hidden_size // tp),
        vocab_size=model.vocab_size // tp if config.sequence_parallel else model.vocab_size,
        block_params=block,
        embedding_params=model.embedding_params // tp,
        head_params=model.head_params // tp,
        moe=local_moe,
    )
