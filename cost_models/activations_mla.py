"""Activation memory of DeepSeek's multi-head latent attention (MLA) and of its router, per token.

Read from transformers 5's modeling_deepseek_v3.py / modeling_deepseek_v2.py and listed tensor by tensor with
torch.autograd.graph.saved_tensors_hooks on small V2 / V3 blocks (the trace tier's kernel choices); c = bytes
of the compute dtype, H heads, d_qk = qk_nope + qk_rope (ModelSpec.head_dim), d_v the value head width,
r_q / r_kv the q / kv ranks (ModelSpec.q_lora_rank, kv_lora_rank).

- q: q_a_proj -> q_a_layernorm -> q_b_proj. The norm (an RMSNorm over r_q) saves what an RMSNorm saves and
  its fp32 statistics (4 B); q_b_proj saves the norm's output (c r_q). V2-Lite's plain q_proj reads the
  block's normed input: nothing new.
- kv: kv_a_proj_with_mqa -> kv_a_layernorm (over r_kv, the same as q's) -> kv_b_proj, which saves the norm's
  output (c r_kv) and writes H x (qk_nope + d_v): k_nope and v are views of it. The rotary part (q's last
  qk_rope columns, k's shared qk_rope) multiplies by cos / sin, which need no gradient: only the tables are
  saved, once per sequence (the profile's checkpoint_held measures them; no per-token term). q and k are then
  new (b, H, s, d_qk) tensors (cat, and a copy into new_empty).
- SDPA: unequal head dims (192 / 128 for V3) go to CUDA's memory-efficient kernel (calibration/sdpa_kernels.py
  emulates it on CPU), which saves q, k, v (the kv_b_proj output it views), the output (b, s, H, d_v: the
  o-projection reads it as is) and the fp32 logsumexp (4H).
- Eager: q and k for the scores (2 c H d_qk), the fp32 softmax (4 H s) and its cast back (c H s, P @ V's
  input; none in fp32), v (its kv_b_proj output with one sequence; with more, bmm copies v alone, c H d_v)
  and the output copied for the o-projection (c H d_v). DeepSeek's configs train without attention dropout.
- Router (DeepSeek's TopkRouter, beyond what cost_models/moe.py counts for a softmax router - scores 4E, top-k
  ids 8k, renormalised weights 4k + 4): F.linear on an fp32 copy of its input (4h; none in fp32), saved for the
  weight's gradient alone, so not when the router is frozen (LoRA without MLP targets: torch's mm backward keeps
  mat1 only where mat2 requires grad, tools/autograd/derivatives.yaml `mm`); group-limited routing
  saves each group's top-2 ids (V3's sigmoid: 16 B a group) or max id (V2's group_limited_greedy: 8 B), the
  kept groups' ids (8 B each) and the boolean expert mask (E B).
"""

from __future__ import annotations

from collections.abc import Callable

from .specs import Attention, ModelSpec

NORM_STATS_BYTES = 4  # an RMSNorm's fp32 rsqrt per token, saved for backward


def is_latent(model: ModelSpec) -> bool:
    return model.kv_lora_rank > 0


def latent_attention_bytes(model: ModelSpec, c: int, attention: Attention, seq_len: int, micro_batch: int,
                           norm_bytes: Callable[[int], int]) -> int:
    """Saved bytes per token of MLA, its (normed) input aside; norm_bytes(width): what the model's RMSNorm
    saves over that width (activations._norm_bytes: frozen under LoRA)."""
    H, d_qk, d_v = model.n_heads, model.head_dim, model.v_head_dim
    kv_b_out = c * H * (d_qk - model.qk_rope_head_dim + d_v)
    saved = norm_bytes(model.kv_lora_rank) + NORM_STATS_BYTES + c * model.kv_lora_rank
    if model.q_lora_rank:
        saved += norm_bytes(model.q_lora_rank) + NORM_STATS_BYTES + c * model.q_lora_rank
    saved += 2 * c * H * d_qk                                   # q and k, as the attention reads them
    if attention is Attention.EAGER:
        probs = (4 + (c if c != 4 else 0)) * H * seq_len       # fp32 softmax and its cast back
        return saved + probs + eager_v_and_output_bytes(model, c, micro_batch)
    return saved + kv_b_out + c * H * d_v + 4 * H               # v's kv_b_proj output, the output, logsumexp


def eager_v_and_output_bytes(model: ModelSpec, c: int, micro_batch: int) -> int:
    """What eager MLA saves per token for P @ V and the o-projection: v (a view of kv_b_proj's output, kept whole,
    with one sequence; with more, bmm's copy of v alone, c H d_v) and the output copied for the o-projection (c H d_v).
    Both go before the softmax backward (activations_backward._eager_freed_before_softmax_backward)."""
    H, d_v = model.n_heads, model.v_head_dim
    kv_b_out = c * H * (model.head_dim - model.qk_rope_head_dim + d_v)
    return (kv_b_out if micro_batch == 1 else c * H * d_v) + c * H * d_v


def router_extra_bytes(model: ModelSpec, c: int, router_trains: bool = True) -> int:
    """What DeepSeek's router saves per token beyond a softmax router (cost_models/moe.py); in fp32 its input
    is already fp32 (no copy), and a frozen router (router_trains False) saves no input."""
    moe = model.moe
    if moe is None:
        return 0
    extra = 4 * model.hidden_size if moe.fp32_router_input and c != 4 and router_trains else 0
    if moe.router_groups:
        per_group = 16 if moe.router_kind == "sigmoid" else 8
        extra += per_group * moe.router_groups + 8 * moe.router_topk_groups + moe.n_experts
    return extra
