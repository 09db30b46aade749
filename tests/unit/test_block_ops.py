"""calibration/block_ops.py: a block's operators counted in a traced forward and backward (fake tensors)."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from calibration.block_ops import _Counter
from calibration.block_profile import profile_block
from cost_models import operators
from planner.models.resolve import from_hf_config as spec_from_hf_config

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-5, "head_dim": 64, "tie_word_embeddings": False}


def test_counter_files_products_and_pointwise_bytes():
    # y = silu(x @ W^T) * 2: one product (n 32, k 16, 8 rows), silu reads 8x32 and writes 8x32 bf16, the
    # product with 2 the same; the reshape (a view) and the final .sum() metadata query move nothing extra
    with FakeTensorMode():
        x = torch.randn(8, 16, dtype=torch.bfloat16)
        w = torch.randn(32, 16, dtype=torch.bfloat16)
        counter = _Counter()
        counter.recording = "forward"
        with counter:
            y = torch.nn.functional.silu(x @ w.t()) * 2
            y.view(4, 64)
    assert counter.matmuls == [(32, 16, 8, 1)]
    assert counter.memory["forward"] == 2 * (8 * 32 * 2 + 8 * 32 * 2)


@pytest.fixture(scope="session")  # once per run: xdist may interleave modules, which re-ran module fixtures
def traced():
    terms, _ = profile_block(LLAMA, block_class="LlamaDecoderLayer", compute_dtype="bf16", attention="sdpa",
                             seq_len=128, hidden_size=256, vocab_size=512)
    return terms.operators


def test_traced_llama_block_has_the_formula_s_products_and_attention(traced):
    spec = spec_from_hf_config(LLAMA)
    formula = operators.block_ops(dataclasses.replace(spec, activation_profile=None), 2, 128)
    assert [(n, k, rows, count) for n, k, rows, count in traced.matmuls] == \
        [(m.n, m.k, 1.0, 1) for m in formula.matmuls]          # q, k, v, o, gate, up, down
    assert traced.attention_flops_per_token == formula.attention_flops_per_token == 4 * 256 * 64  # causal half
    assert traced.attention_reference_flops == 4 * 256 * 128


def test_formula_memory_bytes_against_the_trace(traced):
    # the formula's eager bytes (operators.py docstring) against what the traced kernels read and write:
    # forward within 10% (1.05x); backward within 5% (its norm and rotary coefficients come from this trace:
    # 0.79x before)
    spec = dataclasses.replace(spec_from_hf_config(LLAMA), activation_profile=None)
    formula = operators.block_ops(spec, 2, 128)
    fwd = sum(op.forward_bytes for op in formula.memory_ops)
    bwd = sum(op.backward_bytes for op in formula.memory_ops)
    assert fwd == pytest.approx(traced.memory_forward_bytes_per_token, rel=0.10)
    assert bwd == pytest.approx(traced.memory_backward_bytes_per_token, rel=0.05)


def test_gemma3_windowed_block_against_the_formula():
    # sandwich norms, q/k norms, a 64-token window under a 128-token sequence: transformers hands SDPA an
    # explicit mask, so the kernel computes all s keys (no causal half); products as the formula lists them
    cfg = {"model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 512, "max_position_embeddings": 512,
           "head_dim": 64, "sliding_window": 64, "sliding_window_pattern": 6}
    terms, _ = profile_block(cfg, block_class="Gemma3DecoderLayer", compute_dtype="bf16", attention="sdpa",
                             seq_len=128, hidden_size=256, vocab_size=512)
    traced = terms.operators
    formula = operators.block_ops(dataclasses.replace(spec_from_hf_config(cfg), activation_profile=None), 2, 128)
    assert [(n, k) for n, k, _, _ in traced.matmuls] == [(m.n, m.k) for m in formula.matmuls]
    assert traced.attention_flops_per_token == formula.attention_flops_per_token == 4 * 256 * 128
    assert sum(op.forward_bytes for op in formula.memory_ops) == pytest.approx(traced.memory_forward_bytes_per_token,
                                                                             rel=0.10)
    assert sum(op.backward_bytes for op in formula.memory_ops) == pytest.approx(traced.memory_backward_bytes_per_token,
                                                                              rel=0.10)
