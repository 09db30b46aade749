"""verl 0.9.1's Ulysses all-to-alls around the attention (models/transformers/monkey_patch.py
_ulysses_flash_attention_forward, utils/ulysses.py): q, k, v (1, s/sp, heads, d) go to (1, s, heads/sp, d) before
flash attention (k, v repeated sp // KV heads times first when sp > KV heads: repeat_kv), its output back after.

One all_to_all_tensor allocates beside its input: tensor_split(...).contiguous() copies (a head split of
(1, s, h, d) is strided: one input's bytes; a sequence split at batch 1, verl's remove-padding, is views), the
output list (one input's bytes; NCCL's list all_to_all sends and receives from them, no staging) and the torch.cat
(one input's bytes), which alone outlives the call. SeqAllToAll saves nothing (ctx keeps the group and dims); its
backward is the reverse all-to-all. Measured on 2 gloo ranks with verl's own functions (/tmp/iss28u/a2a.py, storage
tracking per dispatched op): gather_seq_scatter_heads on HF's transposed q peaks 3.00 input, 1.00 after;
gather_heads_scatter_seq on flash's contiguous output 2.00 / 1.00; saved tensors 0.

When the transients are extra over what the planner counts:
- a no-grad forward (the log-probs): the output all-to-all's cat is the attention's largest moment (residual,
  normed input, q / k / v before the all-to-all, held by transformers' attention frame, and after, held by
  _ulysses_flash_attention_forward, the output and its all-to-all). rl_actor.forward_only_bytes bounds a block
  by what it would save for backward; the moment adds only where it exceeds that bound (Qwen2.5-7B: 54,272 B
  per token against 239,728: nothing).
- the update: the forward's and recompute's attention moment comes and goes before the block's MLP backward,
  the ledger's peak; the backward's all-to-alls (3 x the output's gradient at most) sit in the attention
  backward, far below it. What stays is what flash attention saves: k, v after the all-to-all, repeated, so
  2 (repeats - 1) x KV dim more per token and layer than the ledger's SDPA k, v (every layer; checkpointed:
  the recomputed block's)."""

from __future__ import annotations

from .model_spec import ModelSpec


def kv_repeats(model: ModelSpec, sp: int) -> int:
    """repeat_kv's factor in _ulysses_flash_attention_forward: max(sp // KV heads, 1)."""
    return max(sp // model.n_kv_heads, 1)


def all_to_all_bytes(input_bytes: int, head_split: bool) -> int:
    """Bytes one all_to_all_tensor holds beside its input at its torch.cat: split copies, output list, cat."""
    return (2 + head_split) * input_bytes


def attention_moment_bytes_per_token(model: ModelSpec, c: int, sp: int) -> int:
    """A no-grad block at the output all-to-all's cat, per local token: residual and normed input, q / k / v
    before and after the all-to-all (k, v repeated), the attention output and its all-to-all (a sequence split)."""
    h, q, kv = model.hidden_size, model.q_dim, model.kv_dim
    before, after = q + 2 * kv, q + 2 * kv_repeats(model, sp) * kv
    return c * (2 * h + before + after + q) + all_to_all_bytes(c * q, head_split=False)


def forward_only_extra_bytes(model: ModelSpec, tokens: int, c: int, sp: int, bound_per_token: int) -> int:
    """What the attention moment adds over a forward-only bound of bound_per_token (0 without Ulysses)."""
    if sp <= 1:
        return 0
    return tokens * max(0, attention_moment_bytes_per_token(model, c, sp) - bound_per_token)


def saved_surplus_bytes_per_token(model: ModelSpec, c: int, sp: int) -> int:
    """Per token and layer, flash attention's saved k, v after the all-to-all over the ledger's k, v."""
    return 2 * c * (kv_repeats(model, sp) - 1) * model.kv_dim if sp > 1 else 0
