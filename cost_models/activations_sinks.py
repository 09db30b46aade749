"""Activation memory of gpt-oss's attention with sinks, per token: eager, or FlexAttention with the sinks applied
to its output through the logsumexp (transformers has no SDPA path for sinks: GptOss' _supports_sdpa = False).

Eager: read from transformers 5's modeling_gpt_oss.py (eager_attention_forward) and listed tensor by tensor with
torch.autograd.graph.saved_tensors_hooks on a small gpt-oss block; c = bytes of the compute dtype, H heads,
q = H x head_dim, s the sequence.

- k and v are repeated per query head (repeat_kv), the scores matmul saves q and the repeated k (2 c q), P @ V
  the repeated v (c q) and the probabilities (a view of the softmax output).
- Each head's sink logit is concatenated to its scores: combined_logits is (b, H, s, s + 1); the max taken
  off it saves its int64 argmax (8H), the softmax - in the logits' dtype - its output, c H (s + 1).
- The output, transposed to (b, s, H, d), is copied for the o-projection (c q).
- Sliding-window layers compute the same full (s, s) scores under a banded mask: the same bytes.

FlexAttention: transformers 5's integrations/flex_attention.py (flex_attention_forward) runs the compiled kernel
with enable_gqa (64 heads: a power of two) and return_aux lse, then, because a sink is no score_mod (it needs the
whole row), renormalises the output eagerly: lse.to(c), cat([lse, sink]) (b, H, s, 2), logsumexp of it, exp of
the difference, a multiply. Saved: the kernel's q, k, v, out and fp32 logsumexp (attention_flex.py:
c (q + 2 kv) + c q + 4H); logsumexp's input and result (2cH + cH) and exp's result (cH) - the multiply saves out
(already saved) and that factor; the renormalised output, transposed and copied for the o-projection (c q). No
s x s term, windowed or not (the window is the block mask's sparsity).
"""

from __future__ import annotations

from . import attention_flex
from .specs import Attention, ModelSpec

SINK_FAMILIES = {"gpt_oss"}


def has_sinks(model: ModelSpec) -> bool:
    return model.family in SINK_FAMILIES


def sink_attention_bytes(model: ModelSpec, c: int, seq_len: int, attention: Attention = Attention.EAGER) -> int:
    """Saved bytes per token of attention with sinks (eager or flex), its (normed) input aside."""
    H, q = model.n_heads, model.q_dim
    if attention is Attention.FLEX:
        kernel = attention_flex.kernel_saved_bytes_per_token(c, q, model.kv_dim, H)
        return kernel + 4 * c * H + c * q
    return 4 * c * q + 8 * H + c * H * (seq_len + 1)
