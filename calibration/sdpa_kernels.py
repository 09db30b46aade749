"""SDPA with a value head dim unlike the query/key one, saving what CUDA's fused kernel saves.

DeepSeek's latent attention (MLA) runs SDPA with q/k head dim 192 and v head dim 128. torch's CPU dispatcher
(aten/src/ATen/native/transformers/sdp_utils_cpp.cpp, check_head_dim_size_cpp) sends unequal head dims to
the math path, which upcasts to fp32 and saves the b x heads x s x s attention probabilities for backward.
On CUDA the flash kernel refuses them too (check_head_dim_size_flash), but the memory-efficient one takes
them (check_head_dim_size_mem_efficient: q and k equal, both dims a multiple of 8) and saves only
q, k, v, the output, the logsumexp (fp32, b x heads x s) and an RNG seed/offset
(derivatives.yaml, _scaled_dot_product_efficient_attention).

`sdpa_unequal_head_dims` computes the same attention with the CPU flash kernel on v zero-padded to the q/k
head dim, a group of heads at a time (the padded output columns are zero; the first dv are the attention output),
and saves exactly q, k, v, the output (dv wide) and the logsumexp - plus the mask when there is one, as the
CUDA kernel saves its attn_bias. Backward pads v, the output and its gradient as a group's temporaries (zero
columns add nothing to softmax's rowsum(dO * O) nor to dO v^T) and slices the value gradient back. The
output is laid out (b, s, heads, dv) as the CUDA kernels allocate it, so transformers' transpose(1, 2)
.contiguous() after SDPA is a view, as on a GPU.

Measured against the math path in tests/unit/test_sdpa_kernels.py (values, gradients, saved bytes); the CUDA
side is read from torch's sources (sdp_utils.cpp, attention.cu), not run here (no GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_MEM_EFFICIENT_ALIGNMENT = 8  # CUDA mem-efficient attention: head dims a multiple of 8 (sdp_utils.cpp)
# heads are run in this many groups: the padded temporaries are 1/8 of the whole (one head at a time made
# deepseek-v3's profile 7x slower on fake tensors: 128 heads x a dozen ops per attention call)
HEAD_GROUPS = 8
_emulating: list[int] = []  # the v head dim while the emulation runs (calibration.block_ops reads it)


def emulated_value_head_dim() -> int | None:
    """The real v head dim while an unequal-head-dims call runs, else None: its pads and copies are no GPU
    kernel's, and its CPU flash calls see v padded to the q/k dim (calibration/block_ops.py)."""
    return _emulating[-1] if _emulating else None


def takes_unequal_head_dims(query, key, value) -> bool:
    """Whether CUDA runs this call in the memory-efficient kernel while CPU would take the math path:
    4-D tensors, q/k head dim equal and unlike v's, both multiples of 8, the same heads in q, k and v (the
    memory-efficient kernel has no grouped-query support: with fewer k/v heads CUDA takes math too), not
    DTensors (context parallel's ring dispatches the aten kernels itself)."""
    from torch.distributed.tensor import DTensor

    tensors = (query, key, value)
    if any(isinstance(t, DTensor) for t in tensors) or any(t.dim() != 4 for t in tensors):
        return False
    dqk, dv = query.size(-1), value.size(-1)
    return (key.size(-1) == dqk != dv and dqk % _MEM_EFFICIENT_ALIGNMENT == 0 and dv % _MEM_EFFICIENT_ALIGNMENT == 0
            and query.size(1) == key.size(1) == value.size(1) and query.dtype in (torch.float32, torch.bfloat16,
                                                                                 torch.float16))


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t, (0, width - t.size(-1)))


def _head_groups(heads: int) -> list[slice]:
    size = -(-heads // HEAD_GROUPS)
    return [slice(start, min(start + size, heads)) for start in range(0, heads, size)]


def _heads(mask, group: slice):
    """The mask of a group of heads (a mask broadcast over heads is the same for each)."""
    return mask[:, group] if mask is not None and mask.dim() == 4 and mask.size(1) > 1 else mask


class _UnequalHeadDimsAttention(torch.autograd.Function):
    """A group of heads at a time, into outputs allocated whole: the padded temporaries are a group's, so
    the transients stay near CUDA's (its output and logsumexp forward; its three gradients backward)."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale):
        b, heads, s, width = query.shape
        dv = value.size(-1)
        out = query.new_empty(b, s, heads, dv).transpose(1, 2)  # (b, s, heads, dv) storage, as CUDA allocates
        logsumexp = query.new_empty(b, heads, s, dtype=torch.float32)
        _emulating.append(dv)
        try:
            for one in _head_groups(heads):
                padded_out, lse = _CPU_FLASH(query[:, one], key[:, one], _pad_to(value[:, one], width), 0.0,
                                             is_causal, attn_mask=_heads(attn_mask, one), scale=scale)
                out[:, one].copy_(padded_out[..., :dv])
                logsumexp[:, one].copy_(lse)
                del padded_out, lse
        finally:
            _emulating.pop()
        ctx.save_for_backward(query, key, value, out, logsumexp, attn_mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, logsumexp, attn_mask = ctx.saved_tensors
        width = query.size(-1)
        grads = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        _emulating.append(value.size(-1))
        try:
            for one in _head_groups(query.size(1)):
                head_grads = _CPU_FLASH_BACKWARD(
                    _pad_to(grad_out[:, one], width), query[:, one], key[:, one], _pad_to(value[:, one], width),
                    _pad_to(out[:, one], width), logsumexp[:, one], 0.0, ctx.is_causal,
                    attn_mask=_heads(attn_mask, one), scale=ctx.scale)
                for whole, part in zip(grads, head_grads):
                    whole[:, one].copy_(part[..., :whole.size(-1)])
                del head_grads
        finally:
            _emulating.pop()
        return *grads, None, None, None


def sdpa_unequal_head_dims(query, key, value, attn_mask=None, is_causal=False, scale=None) -> torch.Tensor:
    """scaled_dot_product_attention (dropout 0) for q/k head dim != v head dim, saving what CUDA saves.
    A boolean mask becomes an additive one in the query's dtype first, as SDPA does on both devices
    (attention.cpp, convert_boolean_attn_mask): the kernels take that."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        attn_mask = attn_mask.to(query.dtype)
    return _UnequalHeadDimsAttention.apply(query, key, value, attn_mask, is_causal, scale)
