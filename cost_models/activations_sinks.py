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


def sink_score_widths(model: ModelSpec, c: int, seq_len: int) -> tuple[list[int], list[int], list[int], dict]:
    """Eager attention with sinks' (s, s) tensors per token, as score_events.score_widths lays them out (saved,
    working, held, held_frees: made index -> the held index freed as it is made), read off eager_attention_forward
    (transformers 5 modeling_gpt_oss.py:239-253) and its trace on a small gpt-oss (aten ops): forward, the matmul's
    scores (bmm), * scaling (mul; bmm's freed), + mask (add; mul's freed), cat with the sinks (s x (s + 1)), minus its
    max (sub; cat's freed), then the softmax in their dtype (its output saved; the slice a view, dropout at p = 0 and
    .to(c) no copies), after which the add's and sub's are freed. Backward: P @ V's gradient (bmm, s x s),
    slice_backward's and _softmax_backward_data's (s x (s + 1)), the max's scatter: two s x (s + 1) gradients at once
    beside the softmax's (the ledger's working set holds two: activations_backward)."""
    scores, sink_scores = c * model.n_heads * seq_len, c * model.n_heads * (seq_len + 1)
    held = [scores] * 3 + [sink_scores] * 2
    return [sink_scores], [sink_scores] * 2, held, {1: 0, 2: 1, 4: 3}
