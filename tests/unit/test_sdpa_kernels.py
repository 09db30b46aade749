"""SDPA with unequal q/k and v head dims (DeepSeek MLA) under the trace's kernel choices
(calibration/sdpa_kernels.py via calibration.gpu_run_choices.cuda_kernel_choices).

Against torch's math path (what CPU runs without the swap, the reference): outputs and gradients to 1e-5 in
fp32, causal and with a mask. Saved bytes of one call, by saved_tensors_hooks: exactly q + k + v + out +
logsumexp (+ the mask), what CUDA's memory-efficient kernel saves (derivatives.yaml), where the math path
saves 4 s^2 bytes per head more. A traced full-width deepseek-v2-lite block (calibration.block_profile's
measurement, fake tensors): its saved bytes per token are the same at two sequence lengths.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from calibration.sdpa_kernels import takes_unequal_head_dims
from calibration.gpu_run_choices import cuda_kernel_choices

# small MLA-like shapes (DeepSeek: 192 / 128), multiples of 8; 10 heads run in groups of 2 (HEAD_GROUPS 8)
B, HEADS, S, DQK, DV = 2, 10, 16, 24, 16


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, HEADS, S, DQK), (B, HEADS, S, DQK), (B, HEADS, S, DV))
    return [torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True) for shape in shapes]


def _run(swapped: bool, **kwargs):
    q, k, v = _inputs()
    grad_out = torch.randn(B, HEADS, S, DV, generator=torch.Generator().manual_seed(1))
    if swapped:
        with cuda_kernel_choices():
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    else:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _mask():
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    causal[:, 0] = True  # every row sees something
    causal[5, 2] = False  # not just causal
    return causal


@pytest.mark.parametrize("kwargs", [{"is_causal": True}, {"is_causal": False}, {"attn_mask": "bool"},
                                    {"attn_mask": "float"}, {"attn_mask": "per-head"},
                                    {"is_causal": True, "scale": 0.3},
                                    {"is_causal": True, "dropout_p": 0.1}],
                         ids=["causal", "full", "bool-mask", "float-mask", "per-head-mask", "scale", "dropout-dropped"])
def test_outputs_and_gradients_equal_the_math_path(kwargs):
    kwargs = dict(kwargs)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = _mask()
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.zeros(S, S).masked_fill(~_mask(), float("-inf")) + 0.25 * torch.eye(S)
    elif kwargs.get("attn_mask") == "per-head":  # (b, heads, s, s): each group of heads gets its own slice
        kwargs["attn_mask"] = torch.randn(B, HEADS, S, S, generator=torch.Generator().manual_seed(2))
    reference_kwargs = {**kwargs, "dropout_p": 0.0}  # the swap runs dropout 0, as before (cuda_kernel_choices)
    for ours, reference in zip(_run(True, **kwargs), _run(False, **reference_kwargs)):
        assert ours.shape == reference.shape
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def _saved_bytes(swapped: bool, **kwargs) -> tuple[int, str]:
    """Bytes of the distinct storages autograd saves in one call, and the grad_fn's name."""
    q, k, v = _inputs(torch.bfloat16)
    storages = {}

    def pack(t):
        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if swapped:
            with cuda_kernel_choices():
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return sum(storages.values()), out.grad_fn.name()


def test_saved_bytes_are_q_k_v_out_and_logsumexp():
    qkv_out = 2 * B * HEADS * S * (DQK + DQK + DV + DV)  # bf16
    logsumexp = 4 * B * HEADS * S  # fp32, (b, heads, s)
    saved, _ = _saved_bytes(True, is_causal=True)
    assert saved == qkv_out + logsumexp == 52_480
    mask = _mask()
    # + the mask, made additive in bf16 (2 s^2 bytes) as both devices' SDPA does: CUDA saves it as attn_bias
    assert _saved_bytes(True, attn_mask=mask)[0] == qkv_out + logsumexp + 2 * S * S
    # without the swap CPU runs the math path: the fp32 probabilities, b x heads x s x s, among what it saves
    math_saved, name = _saved_bytes(False, is_causal=True)
    assert name != "UnequalHeadDimsAttentionBackward" and math_saved >= saved + 4 * B * HEADS * S * S


def test_the_swap_takes_only_what_cuda_runs_fused():
    q, k, v = (torch.empty(1, 4, 8, d) for d in (192, 192, 128))
    assert takes_unequal_head_dims(q, k, v)
    assert not takes_unequal_head_dims(q, k, torch.empty(1, 4, 8, 192))  # equal: CPU flash already runs
    # fewer k/v heads (GQA): CUDA's memory-efficient kernel refuses grouped queries, math runs there too
    assert not takes_unequal_head_dims(q, torch.empty(1, 2, 8, 192), torch.empty(1, 2, 8, 128))
    assert not takes_unequal_head_dims(q, k, torch.empty(1, 4, 8, 100))  # not a multiple of 8


def test_under_activation_checkpointing_the_recompute_matches():
    from torch.utils.checkpoint import checkpoint

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = _inputs()
    with cuda_kernel_choices():
        out = checkpoint(attention, q, k, v, use_reentrant=False)
        out.sum().backward()
    q2, k2, v2 = _inputs()
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q2, k2, v2, is_causal=True).sum().backward()
    for ours, ref in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@functools.cache
def _deepseek_v2_lite_saved_bytes(seq_lens: tuple[int, ...]) -> tuple[float, ...]:
    """Steady-state saved bytes of a full-width deepseek-v2-lite block (bf16, sdpa), one sequence at each
    length, as calibration.block_profile measures them on fake tensors (its model, its _measure)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from calibration.block_profile import _blocks, _measure, _reduced_config, profiled_layers
    from calibration.build import build_model
    from calibration.gpu_run_choices import _grouped_mm_shapes_any_dtype, _real_run_masking
    from planner.models.resolve import load_preset, preset_hf_config

    spec, hf_config = load_preset("deepseek-v2-lite"), preset_hf_config("deepseek-v2-lite")
    n_dense = spec.moe.first_sparse_layer
    config = _reduced_config(hf_config, profiled_layers(hf_config, n_dense))
    saved = []
    with _real_run_masking(True), _grouped_mm_shapes_any_dtype(), FakeTensorMode():
        model = build_model(None, config, attention="sdpa", device="cpu", dtype=torch.bfloat16)
        model.train()
        blocks = _blocks(model, spec.block_class)
        for s in seq_lens:
            (block_saved, _), _ = _measure(model, blocks, n_dense, spec.vocab_size, 1, s, 2 * spec.hidden_size * s)
            saved.append(block_saved)
    return tuple(saved)


def test_a_traced_deepseek_block_saves_no_s_by_s_term():
    """saved = k + a s + q s^2 through three lengths: q, the bytes per token per key position, was 64 or more
    on the math path (16 heads x fp32 probabilities); now the per-token bytes do not grow with s."""
    pytest.importorskip("transformers")
    import numpy as np

    lengths = (128, 256, 512)
    saved = _deepseek_v2_lite_saved_bytes(lengths)
    k, a, q = np.linalg.solve(np.array([[1.0, s, s * s] for s in lengths]), np.array(saved))
    # measured 2026-12-02: q 64.0 -> 0.0 (16 heads x 4 B, as the math path's fp32 probabilities predict),
    # a 221,668 -> 209,444 B per token (the math path's fp32 upcasts of q, k, v gone too), k 524,544 both
    assert abs(q) < 0.01  # bytes per token per key position
    assert saved[2] / 512 <= saved[0] / 128  # per token: no growth (the constant k spreads thinner)


def test_the_operator_inventory_sees_one_attention_kernel():
    """calibration.block_ops files the call as CUDA's kernel: 2 b H s s (Dqk + Dv) FLOPs, half of it causal
    (20% less than 4 b H s s Dqk, what the padded v would give), and none of the emulation's pads and copies."""
    from calibration.block_ops import _Counter

    q, k, v = _inputs(torch.bfloat16)
    counter = _Counter()
    with cuda_kernel_choices(), counter:
        counter.recording = "forward"
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        counter.recording = None
        grad_out = torch.ones_like(out)
        counter.recording = "backward"
        out.backward(grad_out)
    assert counter.attention_flops == 2 * B * HEADS * S * S * (DQK + DV) / 2 == 204_800
    # the MFU reference, 4 q_dim s_k per token, from which cost_models/operators.py reads the traced s_k
    assert counter.attention_reference == 4 * B * HEADS * S * S * DQK == 491_520
    assert counter.memory["forward"] == 0 and counter.memory["backward"] == 0
