"""FlexAttention as a GPU training run executes it, runnable on CPU and on fake tensors (trace tier, block profiles).

torch 2.13 refuses FlexAttention's backward on CPU (torch/nn/attention/flex_attention.py, _validate_device), and
transformers' flex path refuses gpt-oss' sinks there (integrations/flex_attention.py: it asks for the logsumexp only
off CPU). The kernel itself is device-free: the flex_attention / flex_attention_backward higher-order ops
(torch/_higher_order_ops/flex_attention.py) run a dense math implementation on CPU tensors (scores as temporaries),
and a shape-only one on fake tensors. `CompiledFlexAttention` calls them and saves for backward what the compiled
kernel saves - q, k, v, the output, the fp32 logsumexp and the block mask's tensors: the forward graph AOTAutograd's
min-cut partitioner (torch.compile's) keeps for flex_attention_backward, listed on CPU in
tests/unit/test_attention_flex.py - not FlexAttentionAutogradOp's eager set, which also keeps max_scores.

`flex_attention_forward` is transformers 5.24's flex_attention_forward (integrations/flex_attention.py) for
training: enable_gqa when the query heads are a power of two (else k and v repeated), the score_mod (soft-capping,
a score mask), and gpt-oss' sinks applied through the logsumexp afterwards, in the same ops - with the kernel above
in place of the compiled flex_attention and the logsumexp asked for on every device. `use_flex()` registers it,
with transformers' own block-mask builder (masking_utils.flex_attention_mask), as the attention implementation
FLEX_IMPLEMENTATION, which calibration.build gives a model built with attention "flex".
"""

from __future__ import annotations

import math

import torch

FLEX_IMPLEMENTATION = "planner_flex"  # the name registered in transformers' AttentionInterface


def _kernel_options(query, key, value) -> dict:
    from torch.nn.attention.flex_attention import _apply_kernel_options

    options = _apply_kernel_options(query, key, value, True, None, None)  # the logsumexp on every device
    return options


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _output_like(query, value):
    """The kernel's output: (b, heads, s, d_v) laid out in the query's stride order (flex_attention's
    _permute_strides), allocated once."""
    shape = (*query.shape[:3], value.size(-1))
    strides, step = [0] * 4, 1
    for dim in sorted(range(4), key=lambda i: query.stride(i)):  # innermost first
        strides[dim], step = step, step * shape[dim]
    return query.new_empty_strided(shape, strides)


class CompiledFlexAttention(torch.autograd.Function):
    """flex_attention(q, k, v, score_mod, block_mask) -> (out, logsumexp in log2 units, as the HOP returns it),
    saving what the compiled kernel saves. Fake tensors: the kernel's outputs and, backward, its gradients and
    its fp32 delta (rowsum(dO * O), b x heads x s) allocated as the Triton kernels allocate them; real tensors:
    torch's dense implementations (sdpa_dense, sdpa_dense_backward), whose s x s temporaries a GPU never holds."""

    @staticmethod
    def forward(ctx, query, key, value, score_mod, block_mask: tuple, scale: float, *mask_tensors):
        ctx.block_mask, ctx.scale = block_mask, scale
        ctx.mask_slots = [i for i, t in enumerate(block_mask) if isinstance(t, torch.Tensor)]
        if _is_fake(query):
            out = _output_like(query, value)
            logsumexp = query.new_empty(query.shape[:3], dtype=torch.float32)
            ctx.graphs = ctx.options = None
        else:
            from torch._higher_order_ops.flex_attention import create_fw_bw_graph, sdpa_dense

            example = (query.new_zeros((), requires_grad=True),
                       *(query.new_zeros((), dtype=torch.int) for _ in range(4)))
            with torch.enable_grad():
                ctx.graphs = create_fw_bw_graph(score_mod, example, ())
            ctx.options = _kernel_options(query, key, value)
            out, logsumexp, _ = sdpa_dense(query, key, value, ctx.graphs[0], block_mask, scale, ctx.options, (), ())
        ctx.save_for_backward(query, key, value, out, logsumexp, *mask_tensors)
        return out, logsumexp

    @staticmethod
    def backward(ctx, grad_out, grad_logsumexp):
        query, key, value, out, logsumexp, *mask_tensors = ctx.saved_tensors
        if _is_fake(query):
            delta = logsumexp.new_empty(logsumexp.shape)
            grads = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
            del delta
        else:
            from torch._higher_order_ops.flex_attention import sdpa_dense_backward

            block_mask = list(ctx.block_mask)
            for slot, tensor in zip(ctx.mask_slots, mask_tensors):
                block_mask[slot] = tensor
            grad_out = grad_out if grad_out is not None else torch.zeros_like(out)
            grad_logsumexp = grad_logsumexp if grad_logsumexp is not None else torch.zeros_like(logsumexp)
            *grads, _ = sdpa_dense_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, *ctx.graphs,
                                            tuple(block_mask), ctx.scale, ctx.options, (), ())
        return *grads, None, None, None, *(None for _ in mask_tensors)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale: float | None = None):
    """(out, logsumexp in natural-log units) of the compiled kernel (GQA: fewer k / v heads read as they are)."""
    from torch.nn.attention.flex_attention import _create_empty_block_mask, _identity

    block_mask = block_mask if block_mask is not None else _create_empty_block_mask(query, key)
    scale = scale if scale is not None else 1.0 / math.sqrt(query.size(-1))
    as_tuple = block_mask.as_tuple()
    tensors = [t for t in as_tuple if isinstance(t, torch.Tensor)]
    out, lse = CompiledFlexAttention.apply(query, key, value, score_mod or _identity, as_tuple, scale, *tensors)
    return out, lse * math.log(2.0)  # the Triton kernel's log2 statistics (flex_attention's _finalize_outputs)


def _repeat_kv(hidden, n_rep: int):
    if n_rep == 1:
        return hidden
    b, heads, s, d = hidden.shape
    return hidden[:, :, None, :, :].expand(b, heads, n_rep, s, d).reshape(b, heads * n_rep, s, d)


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None,
                           position_bias=None, **kwargs):
    """transformers' flex_attention_forward (training), the kernel above in place of the compiled one; on a GPU
    (a calibration run) transformers' own, with the compiled kernel."""
    from torch.nn.attention.flex_attention import BlockMask

    if query.device.type == "cuda":
        from transformers.integrations.flex_attention import flex_attention_forward as compiled_forward

        return compiled_forward(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap,
                                s_aux=s_aux, position_bias=position_bias, **kwargs)

    if kwargs.get("dropout", 0.0) > 0:
        raise ValueError("`flex_attention` does not support `dropout`")
    block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
    score_mask = None if block_mask is not None else attention_mask
    if score_mask is not None:
        score_mask = score_mask[:, :, :, : key.shape[-2]]

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if score_mask is not None:
            score = score + score_mask[batch_idx][0][q_idx][kv_idx]
        if position_bias is not None:
            score = score + position_bias[batch_idx, head_idx, q_idx, kv_idx]
        return score

    heads = query.shape[1]
    if heads & (heads - 1):  # not a power of two: transformers repeats k and v (no enable_gqa)
        key, value = _repeat_kv(key, heads // key.shape[1]), _repeat_kv(value, heads // value.shape[1])
    plain = softcap is None and score_mask is None and position_bias is None
    attention_output, lse = flex_attention(query, key, value, None if plain else score_mod, block_mask, scaling)
    lse = lse.to(value.dtype)
    if s_aux is not None:  # the sinks, renormalised through the logsumexp (transformers' own ops)
        batch_size, num_heads, seq_len_q, _ = attention_output.shape
        sinks = s_aux.view(1, -1, 1, 1).expand(batch_size, num_heads, seq_len_q, 1)
        lse_expanded = lse.unsqueeze(-1)
        combined_lse = torch.logsumexp(torch.cat([lse_expanded, sinks], dim=-1), dim=-1, keepdim=True)
        renorm_factor = torch.exp(lse_expanded - combined_lse)
        attention_output = attention_output * renorm_factor
        attention_output = attention_output.to(query.dtype)
    attention_output = attention_output.transpose(1, 2).contiguous()
    return attention_output, lse


def use_flex() -> str:
    """Register flex_attention_forward and transformers' block-mask builder; the implementation's name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask

    AttentionInterface.register(FLEX_IMPLEMENTATION, flex_attention_forward)
    AttentionMaskInterface.register(FLEX_IMPLEMENTATION, flex_attention_mask)
    return FLEX_IMPLEMENTATION
