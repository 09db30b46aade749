"""What a block's backward holds above the tensors it saved (activations.py prices those): the MLP's and the
attention's working sets at their backward's peak, and what the block has freed when its attention backward peaks
(the MLP branch runs its backward first). Per token of the rank, in bytes."""

from __future__ import annotations

from . import moe
from .activations import (PYTHON_OP_ACTIVATIONS, _FUSED_ROTARY_FAMILIES, _SEPARATE_QKV_FAMILIES, _attention_dropout,
                          _frozen_mlp, _mlp_bytes, _norm_bytes, _softmax_bytes, uses_s2_attention)
from .activations_mla import eager_v_and_output_bytes
from .kernels import EAGER as EAGER_KERNELS, Kernels
from .specs import Attention, Kernel, ModelSpec


def mlp_backward_working_bytes_per_token(model: ModelSpec, compute_bytes: int, lora: bool = False,
                                         kernels: Kernels = EAGER_KERNELS) -> int:
    """Bytes the MLP's backward holds above the block's saved tensors: the incoming gradient (c*h) and
    the gradients of fc2's input and of the activation's factors, minus fc2's freed input (which a
    frozen fc2, LoRA without MLP adapters, never saved; with an adapter, its lora_A's backward frees it before
    the activation's)."""
    if model.moe is not None:
        return moe.mlp_backward_working_bytes_per_token(model, compute_bytes, _frozen_mlp(model, lora))
    c, h, f = compute_bytes, model.hidden_size, model.ffn_hidden_size
    freed = 0 if _frozen_mlp(model, lora) else c * f
    if model.gated_mlp and kernels.swiglu is Kernel.LIGER:
        return c * h + c * f              # fc2's input gradient; Liger writes da, db into the saved gate, up
    if model.gated_mlp:
        return c * h + 3 * c * f - freed
    if model.activation in PYTHON_OP_ACTIVATIONS:
        return c * h + 2 * c * f          # two f-sized gradients of the Python-op chain at once
    return c * h + 2 * c * f - freed      # gradient of fc2's input and of the activation's input


def attention_backward_working_bytes_per_token(model: ModelSpec, compute_bytes: int, attention: Attention,
                                              seq_len: int) -> int:
    """Bytes the attention backward holds above what its block still keeps saved at that point.

    Fused kernels: the incoming gradient and the q, k, v gradients (small next to the MLP's). Eager: at
    the softmax backward, the gradient of the probabilities and the softmax's own gradient (both fp32 for
    Llama-style models, whose cast-back copy of the probabilities is freed by then: 8 - c bytes per
    score; 8 in fp32), plus the dropout's gradient when attention dropout is on."""
    c = compute_bytes
    q, kv = model.q_dim, model.kv_dim
    grads = c * model.hidden_size + c * (q + 2 * kv)
    if not uses_s2_attention(model, attention):
        return grads
    probs = model.n_heads * seq_len
    soft = _softmax_bytes(model, c)
    s2 = probs * (2 * soft - (c if soft != c else 0))
    if _attention_dropout(model):
        # compute-dtype softmax (GPT-2): the dropout's gradient too; an fp32 one: its 1-byte mask is freed too
        s2 += probs * c if soft == c else -probs
    return c * model.hidden_size + c * q + s2


def attention_freed_before_backward_bytes_per_token(model: ModelSpec, compute_bytes: int, lora: bool = False,
                                                    attention: Attention = Attention.SDPA, micro_batch: int = 1,
                                                    kernels: Kernels = EAGER_KERNELS) -> int:
    """What a block has freed when its attention backward peaks: the MLP branch runs its backward first
    (its ops were recorded last), freeing the MLP's saved tensors and the second norm's (a parallel
    block's second norm shares its input with the first: only its output goes; under LoRA without MLP adapters
    the MLP norm's output was never saved). Eager attention peaks at the softmax backward, after the o-projection's and
    P @ V's backward: see _eager_freed_before_softmax_backward."""
    c, h = compute_bytes, model.hidden_size
    norm_out = 0 if _frozen_mlp(model, lora) else c * h
    mlp, norm = _mlp_bytes(model, c, lora, kernels.fused_swiglu), _norm_bytes(model, c, lora, fused=kernels.fused_norm)
    if model.parallel_block:
        freed = mlp + (norm_out if model.family != "falcon" else 0)
    else:
        freed = mlp + norm + norm_out + (h if model.dropout else 0)
        if model.norm_layout in ("sandwich", "post"):
            freed += norm  # the norm after the attention, whose backward came first
        if model.norm_layout == "sandwich":
            freed += norm  # ... and the one after the MLP
    if attention is Attention.EAGER:
        freed += _eager_freed_before_softmax_backward(model, c, micro_batch)
    return freed


def _eager_freed_before_softmax_backward(model: ModelSpec, c: int, micro_batch: int) -> int:
    """The o-projection's input copy (c*q) and what P @ V alone kept of v: v itself for separate
    projections (c*q: repeated per head, or as wide under MHA); for a fused rotary projection the fused
    output (v is its view) unless v was copied to a contiguous tensor (then that copy, c*q); nothing for
    GPT-2, whose q and k are views of the same fused output. Families checked against the trace only."""
    q, kv = model.q_dim, model.kv_dim
    if model.kv_lora_rank:  # MLA: P @ V read v as a view of kv_b_proj's output (one sequence) or a copy of it
        return eager_v_and_output_bytes(model, c, micro_batch)
    if model.family in _SEPARATE_QKV_FAMILIES:
        return c * q + c * q
    if model.family in _FUSED_ROTARY_FAMILIES:
        copied = micro_batch > 1 or kv < q
        return c * q + (c * q if copied else c * (q + 2 * kv))
    if model.family == "gpt2":
        return c * q
    return 0
