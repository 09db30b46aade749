"""Activation formulas of the table's dense families (cost_models/activations.py) against the trace tier.

The full grid (10 configurations per family) is `benchmarks/memory_accuracy.py --families 2026 --arch qwen3
--arch gemma2 --arch gemma3 --arch olmo2 --arch phi2 --arch starcoder2`: median 0.03%, max 1.25% over 60
configurations. Here: one CI-sized configuration per family, each exercising its quirk, within 3% of the
trace; the formula pieces by hand; and one block of each family's preset against a traced block memory
profile on the preset's own shapes (recorded, one of them traced again), within 2%.
"""

from __future__ import annotations

import pytest

from cost_models import activation_notes
from cost_models import activations as A
from cost_models.specs import Attention
from planner.models import from_hf_config
from planner.models.resolve import load_preset, preset_hf_config

TOLERANCE = 0.03  # the target; the grid's worst row is 1.25%
_DIMS = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=704, vocab_size=6000, max_position_embeddings=8192, bos_token_id=0,
             eos_token_id=0, pad_token_id=0)
CONFIGS = {
    "qwen3": dict(model_type="qwen3", head_dim=64, **_DIMS),                     # q/k norms per head
    "gemma2": dict(model_type="gemma2", head_dim=64, sliding_window=256, **_DIMS),  # sandwich norms, softcaps,
    #                                                                              two eager masks
    "gemma3_text": dict(model_type="gemma3_text", head_dim=64, sliding_window=256, sliding_window_pattern=2,
                        **_DIMS),                                                # windowed SDPA on half the layers
    "olmo2": dict(model_type="olmo2", **_DIMS),                                  # post-norms, full-width q/k norms
    "phi": dict(model_type="phi", partial_rotary_factor=0.5, resid_pdrop=0.1,
                **{**_DIMS, "num_key_value_heads": 4}),                          # parallel block, dropout
    "starcoder2": dict(model_type="starcoder2", residual_dropout=0.1, embedding_dropout=0.1,
                       attention_dropout=0.1, **_DIMS),                          # LayerNorm, biases, dropout
}
RUNS = [
    ("qwen3", "sdpa", "none"), ("qwen3", "eager", "full"),
    ("gemma2", "eager", "none"), ("gemma2", "eager", "full"),
    ("gemma3_text", "sdpa", "full"), ("gemma3_text", "eager", "every-2"),
    ("olmo2", "sdpa", "none"), ("olmo2", "eager", "full"),
    ("phi", "eager", "none"), ("starcoder2", "eager", "none"),
]


@pytest.mark.parametrize("family, attention, ac", RUNS)
def test_estimate_within_tolerance_of_trace(family, attention, ac):
    pytest.importorskip("transformers")
    from planner.tracing import trace

    r = trace(dict(CONFIGS[family], _name_or_path=family), 8, precision="bf16", micro_batch=2, seq_len=1024,
              attention=attention, activation_checkpointing=ac)
    assert abs(r.relative_error) <= TOLERANCE, r.difference()


# -- the pieces, by hand (bf16: c = 2) --------------------------------------------------------------

def test_qk_norms_and_fp32_norms_by_hand():
    c, s = 2, 1024
    qwen3 = from_hf_config(CONFIGS["qwen3"])        # h 256, q 256, kv 128, 4 heads over 2
    llama = from_hf_config({**CONFIGS["qwen3"], "model_type": "llama"})
    # q_norm / k_norm: the fp32 upcast and the normalised tensor cast back, + fp32 statistics per head
    assert (A.block_bytes_per_token(qwen3, c, Attention.SDPA, s) - A.block_bytes_per_token(llama, c, Attention.SDPA, s)
            == (4 + c) * (256 + 128) + 4 * (4 + 2))
    olmo2 = from_hf_config(CONFIGS["olmo2"])
    # OLMo 2: the weight applied in fp32 (8 B per element, the block's 2 norms and the q/k norms), + stats
    plain = from_hf_config({**CONFIGS["olmo2"], "model_type": "llama"})
    assert (A.block_bytes_per_token(olmo2, c, Attention.SDPA, s) - A.block_bytes_per_token(plain, c, Attention.SDPA, s)
            == 2 * (8 - 4 - c) * 256 + 8 * (256 + 128) + 4 * 2)
    assert A.shared_bytes(olmo2, c, s) == 2 * s * 64 * 4  # fp32 cos/sin


def test_gemma2_softcaps_and_sandwich_norms_by_hand():
    c, s = 2, 1024
    g = from_hf_config(CONFIGS["gemma2"])
    assert g.attention_choices == ("eager", "flex") and g.attn_softcap and g.logit_softcap
    # eager probabilities per head and key: fp32 softmax, its cast back, the tanh output
    probs = 4 * s * (4 + c + c)
    # 4 fp32-weight norms + 2 pre-norm outputs; q, repeated k and v; P @ V's copy; the probabilities; MLP
    assert A.block_bytes_per_token(g, c, Attention.EAGER, s) == 4 * 8 * 256 + 2 * c * 256 + 3 * c * 256 + c * 256 \
        + probs + 4 * c * 704
    assert A.logits_bytes_per_token(g, c) == (0, 12 * 6000 + c * 6000)  # + the tanh output of the logits
    # two eager masks (full and sliding) kept under checkpointing; SDPA would keep one boolean (s, s)
    assert A.eager_mask_bytes(g, c, s, 2, Attention.EAGER) == 2 * 2 * s * s * c
    gemma3 = from_hf_config(CONFIGS["gemma3_text"])
    assert A.eager_mask_bytes(gemma3, c, s, 2, Attention.SDPA) == s * s


def test_alternating_windows_charge_only_the_windowed_layers():
    c, s = 2, 1024
    g3 = from_hf_config(CONFIGS["gemma3_text"])     # 4 layers, 2 of them windowed (256 < 1024)
    full = from_hf_config({**CONFIGS["gemma3_text"], "sliding_window": None})
    per_windowed_layer = s * c + 2 * c * (256 - 128)  # the (s, s) mask row and k, v repeated per query head
    assert (A.block_bytes_per_token(g3, c, Attention.SDPA, s) - A.block_bytes_per_token(full, c, Attention.SDPA, s)
            == per_windowed_layer * 2 // 4)


def test_phi_attention_dropout_is_its_own_key():
    phi = from_hf_config(CONFIGS["phi"])  # resid_pdrop 0.1, attention_dropout 0
    assert phi.dropout and phi.attention_dropout is False
    assert from_hf_config({**CONFIGS["phi"], "attention_dropout": 0.1}).attention_dropout


# -- the formulas against a traced block memory profile of the presets, on their own shapes (issue 19 item 5) ----

# (preset, attention, seq_len, a, q): one block's saved bytes per token = a + q x seq_len in a traced profile (bf16,
# the preset's first attention), made by `python benchmarks/formula_vs_profile.py PRESET...` on 2026-12-02 (torch
# 2.13.0, transformers 5.24.0, ~1 min a preset). Mistral and StarCoder2 window at 4,096 = the sequence: their
# profile's q is the mask's (the fit's shorter point has none); the formula counted it only for longer sequences
# until then (0.9074 / 0.8586 of the profile).
TRACED_BLOCKS = [
    ("llama3.2-1b", "sdpa", 4096, 108680.0, 0.0), ("llama3-8b", "sdpa", 4096, 200840.0, 0.0),
    ("mistral-7b", "sdpa", 4096, 180360.0, 10.0), ("qwen2.5-7b", "sdpa", 4096, 225400.0, 0.0),
    ("qwen3-8b", "sdpa", 4096, 215336.0, 0.0), ("gemma3-12b", "sdpa", 4096, 341850.7, 1.667),
    ("gemma2-9b", "eager", 4096, 276496.0, 128.0), ("olmo2-7b", "sdpa", 4096, 268432.0, 0.0),
    ("phi-2", "sdpa", 4096, 143492.0, 0.0), ("phi-4", "sdpa", 4096, 274088.0, 0.0),
    ("starcoder2-15b", "sdpa", 4096, 155848.0, 15.0), ("mixtral-8x7b", "sdpa", 4096, 348412.0, 0.0),
    ("qwen2-moe-a2.7b", "sdpa", 4096, 176578.0, 0.0), ("qwen3-30b-a3b", "sdpa", 4096, 194636.0, 0.0),
]
PROFILE_TOLERANCE = 0.02  # the issue's 2% rule; measured at most 0.005% (8 B per token: the norms' statistics)


@pytest.mark.parametrize("preset, attention, seq_len, a, q", TRACED_BLOCKS, ids=[t[0] for t in TRACED_BLOCKS])
def test_formula_against_the_traced_profile_of_the_preset(preset, attention, seq_len, a, q):
    spec = load_preset(preset)
    assert spec.attention_choices[0] == attention and spec.priced_by == "formula"
    formula = A.block_bytes_per_token(spec, 2, Attention(attention), seq_len)
    assert formula == pytest.approx(a + q * seq_len, rel=PROFILE_TOLERANCE)


def test_one_recorded_profile_traced_again():
    """llama3.2-1b's recorded a, traced again at 256 tokens (SDPA keeps nothing that grows with the keys: the same
    per-token bytes as at 4,096, and a trace of seconds)."""
    pytest.importorskip("transformers")
    from planner.models.block_profiles import profile_key, trace_profile

    spec, hf_config = load_preset("llama3.2-1b"), preset_hf_config("llama3.2-1b")
    terms = trace_profile(spec, hf_config, "bf16", "sdpa", 256,
                          profile_key(hf_config, "bf16", "sdpa", 256)).terms.activation_terms()
    recorded = next(t for t in TRACED_BLOCKS if t[0] == "llama3.2-1b")
    assert terms.saved_per_token == pytest.approx(recorded[3], rel=1e-6)
    assert terms.saved_per_token_per_seq == pytest.approx(recorded[4], abs=1e-6)


def test_a_window_as_long_as_the_sequence_masks():
    """transformers hands SDPA a window mask from kv_length >= window on (masking_utils), so a 2-layer Mistral at
    512 tokens with window 512 saves the (s, s) mask and the repeated k and v per layer; the formula counted them
    only for a longer sequence: -5.07% here then, -0.03% now."""
    pytest.importorskip("transformers")
    from planner.tracing import trace

    cfg = {"model_type": "mistral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "sliding_window": 512}
    r = trace(cfg, gpus=2, precision="bf16", seq_len=512)
    assert abs(r.relative_error) < 0.005, r.difference()
    notes = activation_notes.quirks(r.candidate.model, Attention.SDPA, 512)
    assert notes[0].startswith("sliding window 512 <= sequence 512")
