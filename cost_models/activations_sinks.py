"""Activation memory of gpt-oss's attention with sinks (eager: transformers has no fused kernel for it), per token.

Read from transformers 5's modeling_gpt_oss.py (eager_attention_forward) and listed tensor by tensor with
torch.autograd.graph.saved_tensors_hooks on a small gpt-oss block; c = bytes of the compute dtype, H heads,
q = H x head_dim, s the sequence.

- k and v are repeated per query head (repeat_kv), the scores matmul saves q and the repeated k (2 c q), P @ V
  the repeated v (c q) and the probabilities (a view of the softmax output).
- Each head's sink logit is concatenated to its scores: combined_logits is (b, H, s, s + 1); the max taken
  off it saves its int64 argmax (8H), the softmax - in the logits' dtype - its output, c H (s + 1).
- The output, transposed to (b, s, H, d), is copied for the o-projection (c q).
- Sliding-window layers compute the same full (s, s) scores under a banded mask: the same bytes.
"""

from __future__ import annotations

from .specs import ModelSpec

SINK_FAMILIES = {"gpt_oss"}


def has_sinks(model: ModelSpec) -> bool:
    return model.family in SINK_FAMILIES


def sink_attention_bytes(model: ModelSpec, c: int, seq_len: int) -> int:
    """Saved bytes per token of eager attention with sinks, its (normed) input aside."""
    H, q = model.n_heads, model.q_dim
    return 4 * c * q + 8 * H + c * H * (seq_len + 1)
