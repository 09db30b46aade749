"""Small Hugging Face configs of today's dense and mixture-of-experts families (2 blocks, width 64, a
512-token vocabulary): quick to build, trace and run on 2 CPU ranks, and each keeps what sets its family
apart - the sliding-window layers (a 32-token window, shorter than the 64-token test sequences, so their
masks are built), Gemma's soft-capping and sandwich norms, gpt-oss's attention sinks and biased experts,
DeepSeek-V3's latent attention and dense first block, Qwen2-MoE's shared expert.

Widths are multiples of 16 bytes in every dtype the tests use: torch._grouped_mm (the experts kernel)
needs 16-byte strides.
"""

from __future__ import annotations

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES: dict[str, dict] = {
    "qwen3": dict(model_type="qwen3", head_dim=16, **COMMON),
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=32, **COMMON),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, sliding_window=32,
                        layer_types=["sliding_attention", "full_attention"], **COMMON),
    "olmo2": dict(model_type="olmo2", **COMMON),
    "phi": dict(model_type="phi", partial_rotary_factor=0.5, **COMMON),
    "starcoder2": dict(model_type="starcoder2", sliding_window=32, **COMMON),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **COMMON),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, **EXPERTS, **COMMON),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, shared_expert_intermediate_size=64, **EXPERTS,
                      **COMMON),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=4, n_group=1, topk_group=1,
                        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **EXPERTS, **COMMON),
    "gpt_oss": dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=32, layer_types=["sliding_attention", "full_attention"], **COMMON),
}
MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss")
