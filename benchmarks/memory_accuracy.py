"""Accuracy of the analytic memory model against the trace tier, over a grid of configurations.

    python benchmarks/memory_accuracy.py [--jobs 2] [--quick] [--json out.json] [--families 2026] [--profile-too]
                                         [--finetune lora [--lora-targets all-linear] [--lora-dropout 0.05]]
                                         [--expert-units] [--mesh] [--pp]

For every configuration: the analytic estimate (planner.api.estimate) and the trace (planner.tracing.trace:
the real FSDP2 training step on fake tensors, rank 0 of the real world size) of the same model, cluster and
FsdpConfig. Prints one row per configuration, the error per memory category, and the median and maximum
absolute relative error of the peak allocated memory ((estimate - trace) / trace). --finetune lora runs
the same grid as LoRA fine-tuning (rank 16 on the attention projections, peft, frozen base in the compute
dtype); --lora-targets all-linear puts the adapters on every block linear (the MLP's too); --lora-dropout p gives each
adapter peft's dropout (cost_models/lora_dropout.py).

The architectures are real Hugging Face model types with their real module code (transformers
from_config, no weights), scaled down in depth and width (4-8 layers, hidden 256-512) so the grid of 60
traces runs in about five minutes on 2 CPU cores. Scaling keeps what decides the memory's *shape*: grouped
vs full attention, gated vs plain MLP, norms, tied embeddings, vocabulary-to-hidden ratios of the same
order as the originals (so logits are a realistic share), dropout defaults, and the activation functions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Scaled-down configs of real architectures (HF config.json fields).
ARCHS: dict[str, dict] = {
    # Llama 3 style: grouped-query attention (8 query heads over 2 KV heads), SwiGLU, RMSNorm, V/h = 31.
    "llama3-gqa": {"model_type": "llama", "_name_or_path": "llama3-gqa", "hidden_size": 512,
                   "intermediate_size": 1792, "num_hidden_layers": 8, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "vocab_size": 16000, "max_position_embeddings": 8192,
                   "rope_theta": 500000.0},
    # Llama 2 style: full multi-head attention, V/h = 8 (Llama-2-7B: 32000 / 4096).
    "llama2-mha": {"model_type": "llama", "_name_or_path": "llama2-mha", "hidden_size": 512,
                   "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
                   "num_key_value_heads": 8, "vocab_size": 4000, "max_position_embeddings": 8192},
    # GPT-2: tied embeddings, learned positions, LayerNorm, gelu_new (Python ops), dropout 0.1 everywhere.
    "gpt2-tied": {"model_type": "gpt2", "_name_or_path": "gpt2-tied", "n_embd": 384, "n_layer": 8, "n_head": 6,
                  "vocab_size": 16384, "n_positions": 8192, "bos_token_id": 0, "eos_token_id": 0},
    # Qwen2: q/k/v biases, GQA, a large vocabulary tied to the embeddings (Qwen2-0.5B: V/h = 170).
    "qwen2-tied": {"model_type": "qwen2", "_name_or_path": "qwen2-tied", "hidden_size": 256,
                   "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 40000, "tie_word_embeddings": True,
                   "max_position_embeddings": 8192},
    # GPT-NeoX (Pythia): parallel attention + MLP residual, LayerNorm, partial rotary, fused qkv, gelu.
    "neox-parallel": {"model_type": "gpt_neox", "_name_or_path": "neox-parallel", "hidden_size": 512,
                      "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 8,
                      "vocab_size": 6400, "max_position_embeddings": 8192, "rotary_pct": 0.25},
    # Phi-3: fused qkv_proj and gate_up_proj, RMSNorm, full attention, V/h = 10.
    "phi3-fused": {"model_type": "phi3", "_name_or_path": "phi3-fused", "hidden_size": 384,
                   "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 6,
                   "num_key_value_heads": 6, "vocab_size": 4000, "max_position_embeddings": 8192,
                   "original_max_position_embeddings": 8192, "pad_token_id": 0, "bos_token_id": 1,
                   "eos_token_id": 2},
}

# Today's families (issue 9), scaled down the same way: dense and mixture-of-experts, each with the quirks
# that decide its memory (q/k norms, sandwich norms, soft-capping, alternating windows, MLA, shared experts,
# attention sinks). granite and llama4_text have no reader: the generic path prices them from a traced
# block memory profile. Fewer experts than ranks in most rows: FSDP2 pads the stacked expert tensors.
ARCHS_2026: dict[str, dict] = {
    "qwen3": {"model_type": "qwen3", "_name_or_path": "qwen3", "hidden_size": 256, "intermediate_size": 768,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
              "vocab_size": 30000, "tie_word_embeddings": False, "max_position_embeddings": 8192},
    "gemma2": {"model_type": "gemma2", "_name_or_path": "gemma2", "hidden_size": 256, "intermediate_size": 1024,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
               "vocab_size": 32000, "sliding_window": 512, "max_position_embeddings": 8192,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 64},
    "gemma3": {"model_type": "gemma3_text", "_name_or_path": "gemma3", "hidden_size": 256,
               "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32000, "sliding_window": 256,
               "max_position_embeddings": 8192, "query_pre_attn_scalar": 64},
    "olmo2": {"model_type": "olmo2", "_name_or_path": "olmo2", "hidden_size": 256, "intermediate_size": 704,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 10000,
              "max_position_embeddings": 8192},
    "phi2": {"model_type": "phi", "_name_or_path": "phi2", "hidden_size": 256, "intermediate_size": 1024,
             "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 5000, "partial_rotary_factor": 0.4,
             "max_position_embeddings": 8192, "resid_pdrop": 0.1},
    "starcoder2": {"model_type": "starcoder2", "_name_or_path": "starcoder2", "hidden_size": 256,
                   "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "vocab_size": 5000, "max_position_embeddings": 8192,
                   "sliding_window": None},
    "mixtral": {"model_type": "mixtral", "_name_or_path": "mixtral", "hidden_size": 256, "intermediate_size": 512,
                "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 8000,
                "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 8192,
                "sliding_window": None},
    "qwen3-moe": {"model_type": "qwen3_moe", "_name_or_path": "qwen3-moe", "hidden_size": 256,
                  "intermediate_size": 768, "moe_intermediate_size": 128, "num_hidden_layers": 4,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 15000,
                  "num_experts": 16, "num_experts_per_tok": 4, "max_position_embeddings": 8192},
    "qwen2-moe": {"model_type": "qwen2_moe", "_name_or_path": "qwen2-moe", "hidden_size": 256,
                  "intermediate_size": 768, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 512,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 15000,
                  "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 8192},
    "deepseek-v3": {"model_type": "deepseek_v3", "_name_or_path": "deepseek-v3", "hidden_size": 256,
                    "intermediate_size": 768, "moe_intermediate_size": 128, "num_hidden_layers": 4,
                    "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 12000,
                    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 96,
                    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
                    "max_position_embeddings": 8192, "rope_scaling": None},
    "gpt-oss": {"model_type": "gpt_oss", "_name_or_path": "gpt-oss", "hidden_size": 256, "intermediate_size": 256,
                "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
                "vocab_size": 20000, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 256,
                "max_position_embeddings": 8192, "rope_scaling": None},
    "granite": {"model_type": "granite", "_name_or_path": "granite", "hidden_size": 256, "intermediate_size": 704,
                "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 12000,
                "tie_word_embeddings": True, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0078125, "logits_scaling": 16.0, "max_position_embeddings": 8192},
    "llama4": {"model_type": "llama4_text", "_name_or_path": "llama4", "hidden_size": 256, "intermediate_size": 256,
               "intermediate_size_mlp": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 12000, "num_local_experts": 4,
               "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "max_position_embeddings": 8192},
}
GRIDS = {"classic": ARCHS, "2026": ARCHS_2026}

# Expert parallelism (issue 17): transformers' own EP path (ep_plan + AllToAllEP, calibration/expert_parallel.py)
# at the real world size, experts fully_shard-ed over efsdp = dp_shard x cp x tp / ep. 64 experts to reach ep 64.
EP_ARCHS: dict[str, dict] = {
    "qwen3-moe-64": {**ARCHS_2026["qwen3-moe"], "_name_or_path": "qwen3-moe-64", "num_experts": 64,
                     "num_experts_per_tok": 4},
    # a small vocabulary and 8 blocks, so a block's backward (the experts' moments) sets the peak, not the loss
    "qwen3-moe-blocks": {**ARCHS_2026["qwen3-moe"], "_name_or_path": "qwen3-moe-blocks", "vocab_size": 2000,
                         "num_hidden_layers": 8, "moe_intermediate_size": 256},
    "mixtral-blocks": {**ARCHS_2026["mixtral"], "_name_or_path": "mixtral-blocks", "vocab_size": 2000,
                       "num_hidden_layers": 8},
}


def ep_grid() -> list[dict]:
    """Expert-parallel rows of the mesh grid: ep 2-64, 4-1,024 GPUs, with and without checkpointing, every MoE
    family that has a transformers ep_plan (Llama 4 has none: its experts take every token)."""
    # (arch, ep, gpus, gpus per node, sharding, precision, checkpointing, micro-batch, seq)
    settings = [
        ("mixtral", 2, 8, 8, "FULL_SHARD", "bf16", "none", 2, 1024),
        ("mixtral", 4, 16, 8, "FULL_SHARD", "bf16", "full", 4, 1024),
        ("mixtral", 8, 64, 8, "FULL_SHARD", "bf16-pure", "every-2", 2, 2048),
        ("mixtral", 8, 1024, 8, "FULL_SHARD", "bf16", "full", 2, 2048),
        ("mixtral", 2, 32, 8, "HYBRID_SHARD", "bf16", "none", 1, 2048),
        ("mixtral", 4, 128, 8, "SHARD_GRAD_OP", "fp32", "every-2", 1, 1024),
        ("qwen3-moe", 2, 4, 4, "FULL_SHARD", "bf16", "none", 2, 2048),
        ("qwen3-moe", 4, 64, 8, "FULL_SHARD", "bf16", "full", 4, 1024),
        ("qwen3-moe", 8, 256, 8, "FULL_SHARD", "bf16-pure", "full", 2, 2048),
        ("qwen3-moe", 16, 16, 8, "FULL_SHARD", "bf16", "none", 1, 4096),
        ("qwen3-moe", 16, 1024, 8, "FULL_SHARD", "bf16", "every-2", 2, 1024),
        ("qwen3-moe", 4, 32, 8, "HYBRID_SHARD", "bf16", "full", 2, 2048),
        ("qwen3-moe-64", 32, 64, 8, "FULL_SHARD", "bf16", "none", 2, 1024),
        ("qwen3-moe-64", 64, 64, 8, "FULL_SHARD", "bf16", "full", 4, 1024),
        ("qwen3-moe-64", 64, 1024, 8, "FULL_SHARD", "bf16", "full", 2, 2048),
        ("qwen3-moe-64", 16, 512, 8, "FULL_SHARD", "bf16-pure", "every-2", 2, 1024),
        ("qwen3-moe-64", 8, 8, 8, "SHARD_GRAD_OP", "bf16", "none", 1, 2048),
        ("qwen2-moe", 2, 8, 8, "FULL_SHARD", "bf16", "none", 2, 1024),
        ("qwen2-moe", 8, 128, 8, "FULL_SHARD", "bf16", "full", 2, 2048),
        ("qwen2-moe", 4, 1024, 8, "FULL_SHARD", "bf16-pure", "every-2", 1, 2048),
        ("deepseek-v3", 2, 16, 8, "FULL_SHARD", "bf16", "none", 2, 1024),
        ("deepseek-v3", 8, 64, 8, "FULL_SHARD", "bf16", "full", 2, 2048),
        ("gpt-oss", 4, 8, 8, "FULL_SHARD", "bf16", "none", 2, 1024),
        ("gpt-oss", 8, 256, 8, "FULL_SHARD", "bf16", "full", 1, 2048),
        ("qwen3-moe-blocks", 4, 16, 8, "FULL_SHARD", "bf16", "none", 4, 2048),
        ("qwen3-moe-blocks", 16, 64, 8, "FULL_SHARD", "bf16", "every-2", 8, 1024),
        ("mixtral-blocks", 2, 8, 8, "FULL_SHARD", "bf16", "none", 4, 2048),
        ("mixtral-blocks", 8, 512, 8, "FULL_SHARD", "fp32", "full", 8, 1024),
    ]
    return [dict(arch=arch, ep=ep, gpus=gpus, gpus_per_node=per_node, sharding=sharding, precision=precision,
                 activation_checkpointing=ac, micro_batch=mb, seq_len=seq,
                 attention="eager" if {**ARCHS_2026, **EP_ARCHS}[arch]["model_type"] in EAGER_ONLY else "sdpa")
            for arch, ep, gpus, per_node, sharding, precision, ac, mb, seq in settings]

# Tensor parallelism (issue 17): calibration/tensor_parallel.py's plan (transformers' base_model_tp_plan) at the
# real world size, FSDP2 over dp_shard x cp. One arch of the Llama 3 shape with 8 KV heads so tp reaches 8 (the
# trace applies column-wise k/v, which needs kv_heads % tp == 0).
TP_ARCHS: dict[str, dict] = {
    "llama3-gqa8": {"model_type": "llama", "_name_or_path": "llama3-gqa8", "hidden_size": 512,
                    "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "vocab_size": 16000, "max_position_embeddings": 8192,
                    "rope_theta": 500000.0},
    # Qwen2 (q/k/v biases, column-wise with the bias split) and Starcoder2 (LayerNorm, biases, plain gelu MLP
    # c_fc / c_proj) with untied heads: transformers' tp_plan (no SP) cannot tie a replicated embedding.
    "qwen2-tp": {**ARCHS["qwen2-tied"], "_name_or_path": "qwen2-tp", "num_attention_heads": 8,
                 "num_key_value_heads": 4, "tie_word_embeddings": False},
    "starcoder2-untied": {**ARCHS_2026["starcoder2"], "_name_or_path": "starcoder2-untied", "num_key_value_heads": 4,
                          "tie_word_embeddings": False},
}


def tp_grid() -> list[dict]:
    """Tensor-parallel rows of the mesh grid: tp 2-8, with sequence parallel + loss parallel (torchtitan) and
    without (transformers' tp_plan: the head's logits gathered), with and without checkpointing, 8-256 GPUs,
    Llama 2 / Llama 3 shapes, Qwen2 (q/k/v biases), Qwen3 (q/k norms over head_dim, transformers'
    "replicated_with_grad_allreduce") and Starcoder2 (LayerNorm, biases, plain MLP, tied)."""
    # (arch, tp, sequence parallel, sharding, precision, checkpointing, attention, micro-batch, seq, gpus, per node)
    settings = [
        ("llama2-mha", 2, True, "FULL_SHARD", "bf16", "none", "sdpa", 2, 1024, 8, 8),
        ("llama2-mha", 2, False, "FULL_SHARD", "bf16", "full", "sdpa", 2, 1024, 16, 8),
        ("llama2-mha", 4, True, "FULL_SHARD", "bf16", "full", "sdpa", 4, 2048, 32, 8),
        ("llama2-mha", 4, False, "HYBRID_SHARD", "bf16", "none", "sdpa", 1, 2048, 32, 8),
        ("llama2-mha", 8, True, "FULL_SHARD", "bf16-pure", "none", "sdpa", 2, 2048, 64, 8),
        ("llama2-mha", 8, False, "FULL_SHARD", "fp32", "full", "sdpa", 1, 1024, 16, 8),
        ("llama2-mha", 8, True, "HYBRID_SHARD", "bf16", "every-2", "sdpa", 2, 1024, 64, 8),
        ("llama2-mha", 2, True, "SHARD_GRAD_OP", "fp32", "every-2", "sdpa", 1, 2048, 8, 8),
        ("llama2-mha", 4, True, "FULL_SHARD", "bf16", "none", "eager", 1, 1024, 16, 8),
        ("llama2-mha", 2, False, "NO_SHARD", "bf16", "none", "sdpa", 2, 512, 8, 8),
        ("llama2-mha", 8, True, "FULL_SHARD", "bf16", "full", "sdpa", 2, 2048, 256, 8),
        ("llama3-gqa8", 2, True, "FULL_SHARD", "bf16", "full", "sdpa", 2, 2048, 8, 8),
        ("llama3-gqa8", 4, True, "FULL_SHARD", "bf16", "none", "sdpa", 2, 1024, 16, 8),
        ("llama3-gqa8", 8, True, "FULL_SHARD", "bf16", "full", "sdpa", 4, 1024, 32, 8),
        ("llama3-gqa8", 8, False, "FULL_SHARD", "bf16", "none", "sdpa", 1, 2048, 64, 8),
        ("llama3-gqa8", 4, False, "HYBRID_SHARD_ZERO2", "bf16", "full", "sdpa", 2, 1024, 32, 8),
        ("llama3-gqa8", 2, True, "HYBRID_SHARD", "fp32", "none", "sdpa", 1, 1024, 16, 4),
        ("llama3-gqa8", 2, False, "FULL_SHARD", "bf16", "full", "eager", 2, 512, 8, 8),
        ("llama3-gqa", 2, True, "FULL_SHARD", "bf16", "none", "sdpa", 2, 2048, 16, 8),
        ("llama3-gqa", 2, False, "FULL_SHARD", "bf16", "full", "sdpa", 4, 1024, 8, 8),
        ("qwen2-tp", 2, True, "FULL_SHARD", "bf16", "full", "sdpa", 2, 2048, 8, 8),
        ("qwen2-tp", 4, False, "FULL_SHARD", "bf16", "none", "sdpa", 1, 2048, 32, 8),
        ("qwen2-tp", 4, True, "FULL_SHARD", "bf16", "none", "sdpa", 4, 1024, 64, 8),
        ("qwen3", 2, True, "FULL_SHARD", "bf16", "full", "sdpa", 2, 2048, 8, 8),
        ("qwen3", 2, False, "FULL_SHARD", "bf16", "none", "sdpa", 1, 2048, 32, 8),
        ("qwen3", 2, True, "HYBRID_SHARD", "bf16", "none", "sdpa", 4, 1024, 64, 8),
        ("starcoder2", 2, True, "FULL_SHARD", "bf16", "none", "sdpa", 2, 1024, 8, 8),
        ("starcoder2-untied", 4, False, "FULL_SHARD", "bf16", "full", "sdpa", 2, 2048, 16, 8),
        ("starcoder2-untied", 4, True, "HYBRID_SHARD", "bf16", "every-2", "sdpa", 2, 1024, 32, 8),
    ]
    return [dict(arch=arch, tp=tp, sequence_parallel=sp, sharding=sharding, precision=precision,
                 activation_checkpointing=ac, attention=attention, micro_batch=mb, seq_len=seq, gpus=gpus,
                 gpus_per_node=per_node)
            for arch, tp, sp, sharding, precision, ac, attention, mb, seq, gpus, per_node in settings]


def cp_grid() -> list[dict]:
    """Context-parallel rows of the mesh grid: cp 2-8 (torch's ring attention, load-balanced, reaching the CPU
    SDPA kernel through calibration/context_parallel.py), with and without checkpointing, alone and with tp 2
    (SP on and off), 8-128 GPUs. SDPA only: the ring replaces it."""
    # (arch, cp, tp, sequence parallel, sharding, precision, checkpointing, micro-batch, seq, gpus, per node)
    settings = [
        ("llama2-mha", 2, 1, True, "FULL_SHARD", "bf16", "none", 2, 2048, 8, 8),
        ("llama2-mha", 4, 1, True, "FULL_SHARD", "bf16", "full", 1, 4096, 16, 8),
        ("llama2-mha", 8, 1, True, "FULL_SHARD", "bf16", "every-2", 1, 4096, 64, 8),
        ("llama2-mha", 2, 2, True, "HYBRID_SHARD", "bf16", "none", 1, 2048, 32, 8),
        ("llama3-gqa8", 2, 2, True, "FULL_SHARD", "bf16", "full", 1, 2048, 16, 8),
        ("llama3-gqa8", 4, 2, False, "FULL_SHARD", "bf16", "none", 1, 2048, 64, 8),
        ("llama3-gqa8", 8, 1, True, "FULL_SHARD", "fp32", "full", 1, 4096, 128, 8),
        ("llama3-gqa", 2, 1, True, "SHARD_GRAD_OP", "bf16", "none", 2, 2048, 8, 8),
        ("llama3-gqa", 4, 1, True, "FULL_SHARD", "bf16-pure", "full", 2, 2048, 32, 8),
        ("qwen2-tp", 2, 2, True, "FULL_SHARD", "bf16", "none", 1, 2048, 8, 8),
    ]
    return [dict(arch=arch, cp=cp, tp=tp, sequence_parallel=sp, sharding=sharding, precision=precision,
                 activation_checkpointing=ac, attention="sdpa", micro_batch=mb, seq_len=seq, gpus=gpus,
                 gpus_per_node=per_node)
            for arch, cp, tp, sp, sharding, precision, ac, mb, seq, gpus, per_node in settings]


# The mesh grid (--mesh): each parallelism's rows (expert parallelism's ep_grid joins here).
MESH_ROW_SETS = (tp_grid, cp_grid, ep_grid)


def mesh_grid() -> list[dict]:
    return [row for rows in MESH_ROW_SETS for row in rows()]


def arch_config(name: str) -> dict:
    """The config.json of an architecture of any grid (every module-level *_ARCHS / ARCHS* dict)."""
    for key, archs in globals().items():
        if "ARCHS" in key and isinstance(archs, dict) and name in archs:
            return dict(archs[name])
    raise KeyError(f"no architecture {name!r} in any grid")


SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def grid(archs: dict[str, dict] = ARCHS) -> list[dict]:
    """10 configurations per architecture, cycling through every sharding strategy, precision,
    checkpointing mode and attention kernel, micro-batches 1-8, sequences 512-8192, 2-128 GPUs. A family
    that does not run SDPA in transformers (Gemma 2, gpt-oss) takes eager where the row says sdpa."""
    # (sharding, precision, checkpointing, attention, micro-batch, seq, gpus, gpus per node)
    settings = [
        ("FULL_SHARD", "bf16", "none", "sdpa", 2, 2048, 8, 8),
        ("SHARD_GRAD_OP", "fp32", "full", "sdpa", 4, 1024, 16, 8),
        ("NO_SHARD", "bf16-pure", "every-2", "eager", 1, 512, 2, 2),
        ("HYBRID_SHARD", "bf16", "full", "sdpa", 8, 4096, 64, 8),
        ("HYBRID_SHARD_ZERO2", "bf16-pure", "none", "eager", 2, 1024, 32, 4),
        ("FULL_SHARD", "fp32", "every-2", "eager", 1, 2048, 128, 8),
        ("FULL_SHARD", "bf16-pure", "full", "sdpa", 1, 8192, 4, 4),
        ("SHARD_GRAD_OP", "bf16", "none", "sdpa", 4, 512, 2, 2),
        ("NO_SHARD", "fp32", "full", "eager", 2, 1024, 4, 4),
        ("HYBRID_SHARD", "bf16", "every-2", "eager", 4, 2048, 16, 8),
    ]
    out = []
    for a, arch in enumerate(archs):
        for i in range(len(settings)):
            # Rotate the settings per architecture so every architecture meets every option.
            sharding, precision, ac, attention, mb, seq, gpus, per_node = settings[(i + a) % len(settings)]
            if attention == "sdpa" and archs[arch]["model_type"] in EAGER_ONLY:
                attention = "eager"
            out.append(dict(arch=arch, sharding=sharding, precision=precision, activation_checkpointing=ac,
                            attention=attention, micro_batch=mb, seq_len=seq, gpus=gpus, gpus_per_node=per_node))
    return out


EAGER_ONLY = {"gemma2", "gpt_oss"}  # transformers' model classes declare no SDPA support (_supports_sdpa)


def run_one(row: dict) -> dict:
    from planner.tracing import trace

    kwargs = {k: v for k, v in row.items() if k not in ("arch", "gpus", "profile_too", "edge_units")}
    t0 = time.perf_counter()
    try:
        r = (edge_units_trace if row.get("edge_units") else trace)(arch_config(row["arch"]), row["gpus"], **kwargs)
    except Exception as exc:  # noqa: BLE001 - a failed row is reported, the grid goes on
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    est = r.candidate.memory
    extra = {}
    if row.get("profile_too"):
        extra = _profile_path(r, dict({**ARCHS, **ARCHS_2026}[row["arch"]]))
    # reserved by the caching allocator alone: the trace's allocations replayed, the estimate's (its own replay where
    # cost_models/step_allocations.py runs, else the flat rule) and the flat rule (allocated x 1.05) it replaces
    from cost_models.memory import estimate_memory

    c = r.candidate
    flat = estimate_memory(c.model, c.cluster, c.training, c.config, r.profile).allocator_reserved_bytes
    extra.update(trace_reserved=r.replayed.peak_reserved_bytes if r.replayed is not None else None,
                 estimate_reserved=est.allocator_reserved_bytes, flat_reserved=flat)
    return {**row, **extra, "trace_peak": r.traced.peak_allocated_bytes, "estimate_peak": est.peak_allocated_bytes,
            "trace_phase": r.traced.peak_phase, "estimate_phase": est.peak_phase, "estimate_moment": est.peak_moment,
            "trace_breakdown": dict(r.traced.breakdown), "estimate_breakdown": est.breakdown.to_dict(),
            "relative_error": r.relative_error, "seconds": time.perf_counter() - t0}


def edge_units_trace(hf_config: dict, gpus: int, **kwargs):
    """planner.tracing.trace of the row with torchtitan 0.3's edge units (ModelSpec.edge_units: the embedding and
    [final norm, head] FSDP units of their own, cost_models/edge_units.py) on the default trainer's estimate, re-priced
    (torchtitan itself refuses LoRA: a row of what the estimate does with the spec; the trace wraps them so)."""
    from dataclasses import replace

    from planner.api import estimate, estimate_config
    from planner.tracing import trace_candidate
    from planner.trainers import DEFAULT_TRAINER, trainer_named

    c = estimate(hf_config, gpus, **kwargs)
    spec = replace(c.model, edge_units=True)
    if not spec.split_edge_units:
        raise ValueError(f"{spec.name}: tied embeddings, no edge units (ModelSpec.split_edge_units)")
    priced = estimate_config(spec, c.cluster, c.training, c.config, None, trainer_named(DEFAULT_TRAINER).host_ways())
    return trace_candidate(replace(priced, trainer=c.trainer), hf_config)


def _profile_path(report, hf_config: dict) -> dict:
    """The same configuration priced from a traced block memory profile instead of the family's formulas
    (what the generic path does for families without them)."""
    from planner.api import estimate_config
    from planner.models.block_profiles import with_block_profile

    c = report.candidate
    spec = c.model if c.model.activation_profile is not None else with_block_profile(
        c.model, hf_config, c.training.seq_len, attentions=(c.config.attention.value,))
    priced = estimate_config(spec, c.cluster, c.training, c.config).memory.peak_allocated_bytes
    return {"profile_peak": priced, "profile_error": priced / report.traced.peak_allocated_bytes - 1}


def run(rows: list[dict], jobs: int = 1, one=run_one) -> list[dict]:
    if jobs <= 1:
        return [one(r) for r in rows]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, rows))


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _mesh_label(row: dict) -> str:
    """' tp4', ' tp4 no-SP', ' ep8': the row's mesh degrees beside the architecture (nothing for FSDP only)."""
    parts = [f"{k}{row[k]}" for k in ("tp", "cp", "ep") if row.get(k, 1) > 1]
    if row.get("tp", 1) > 1 and row.get("sequence_parallel") is False:
        parts.append("no-SP")
    return "".join(f" {p}" for p in parts)


def _reserved_columns(r: dict) -> list[str]:
    """The allocator's reserved MiB: the trace's replay, the flat rule and the estimate, each error against the trace."""
    trace = r.get("trace_reserved")
    if not trace:
        return ["", "", "", "", ""]
    return [_mib(trace), _mib(r["flat_reserved"]), f"{100 * (r['flat_reserved'] / trace - 1):+.1f}%",
            _mib(r["estimate_reserved"]), f"{100 * (r['estimate_reserved'] / trace - 1):+.1f}%"]


def summarize(results: list[dict]) -> str:
    from tabulate import tabulate

    ok = [r for r in results if "error" not in r]
    rows = [[i + 1, r["arch"] + _mesh_label(r), r["sharding"], r["precision"], r["activation_checkpointing"],
             r["attention"],
             r["micro_batch"], r["seq_len"], f"{r['gpus']}/{r['gpus_per_node']}", _mib(r["trace_peak"]),
             _mib(r["estimate_peak"]), f"{100 * r['relative_error']:+.1f}%", r["trace_phase"], r["estimate_moment"]]
            + _reserved_columns(r) + ([f"{100 * r['profile_error']:+.1f}%"] if "profile_error" in r else [])
            for i, r in enumerate(ok)]
    lines = ["Per configuration (MiB per rank; error = (estimate - trace) / trace of the peak allocated):",
             tabulate(rows, headers=["#", "arch", "sharding", "precision", "ckpt", "attn", "mb", "seq", "gpus/node",
                                     "trace", "estimate", "error", "trace peak in", "estimated peak moment",
                                     "reserved: trace", "flat", "error", "estimate", "error", "profile error"],
                      tablefmt="simple", disable_numparse=True), ""]
    keys = list(ok[0]["trace_breakdown"]) if ok else []
    cat_rows = []
    for k in keys:
        diffs = [(r["estimate_breakdown"].get(k, 0) - r["trace_breakdown"].get(k, 0)) / r["trace_peak"] for r in ok]
        cat_rows.append([k, f"{100 * statistics.median(abs(d) for d in diffs):.2f}%",
                         f"{100 * max(abs(d) for d in diffs):.2f}%",
                         f"{100 * statistics.mean(diffs):+.2f}%"])
    lines += ["Per category at each side's own peak (estimate - trace, as a share of the traced peak):",
              tabulate(cat_rows, headers=["category", "median |diff|", "max |diff|", "mean diff"], tablefmt="simple",
                       disable_numparse=True), ""]
    errors = [abs(r["relative_error"]) for r in ok]
    if errors:
        worst = max(ok, key=lambda r: abs(r["relative_error"]))
        lines.append(f"peak allocated, |estimate - trace| / trace over {len(ok)} configurations: "
                     f"median {100 * statistics.median(errors):.2f}%, max {100 * max(errors):.2f}% "
                     f"(#{ok.index(worst) + 1} {worst['arch']}{_mesh_label(worst)} {worst['sharding']} "
                     f"{worst['precision']})")
        lines.append(f"phase of the peak agrees in {sum(r['trace_phase'] == r['estimate_phase'] for r in ok)} of {len(ok)}")
        replayed = [r for r in ok if r.get("trace_reserved")]
        for key, label in (("flat_reserved", "flat rule"), ("estimate_reserved", "estimate")):
            gaps = [abs(r[key] / r["trace_reserved"] - 1) for r in replayed]
            if gaps:
                lines.append(f"allocator reserved, |{label} - trace's replay| / trace's replay over {len(gaps)}: "
                             f"median {100 * statistics.median(gaps):.1f}%, max {100 * max(gaps):.1f}%")
        profiled = [r for r in ok if "profile_error" in r]
        if profiled:
            p_errors = [abs(r["profile_error"]) for r in profiled]
            gaps = [abs(r["profile_peak"] / r["estimate_peak"] - 1) for r in profiled]
            lines.append(f"priced from a traced block profile instead: |profile - trace| / trace median "
                         f"{100 * statistics.median(p_errors):.2f}%, max {100 * max(p_errors):.2f}%; "
                         f"|profile - estimate| / estimate median {100 * statistics.median(gaps):.2f}%, "
                         f"max {100 * max(gaps):.2f}%")
    for r in results:
        if "error" in r:
            lines.append(f"FAILED {r['arch']}{_mesh_label(r)} {r['sharding']} {r['precision']}: {r['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="parallel trace processes (default 2)")
    parser.add_argument("--quick", action="store_true", help="first configuration of each architecture only")
    parser.add_argument("--arch", action="append", help="only these architectures (repeatable)")
    parser.add_argument("--families", choices=tuple(GRIDS), default="classic",
                        help="classic: the 2019-2023 families (default); 2026: today's dense and MoE families")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--finetune", choices=("full", "lora"), default="full", help="full (default) or lora")
    parser.add_argument("--profile-too", action="store_true",
                        help="also price each configuration from a traced block memory profile (the generic path)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="with --finetune lora: peft's lora_dropout")
    parser.add_argument("--lora-targets", choices=("attention", "all-linear"), default="attention",
                        help="with --finetune lora: the linears the adapters are on")
    parser.add_argument("--mesh", action="store_true",
                        help="the mesh grid instead (mesh_grid: tensor-parallel rows, tp 2-8 with and without SP; "
                             "context-parallel rows, cp 2-8; expert-parallel rows)")
    parser.add_argument("--only", choices=("tp", "cp", "ep"), action="append",
                        help="with --mesh: only the rows with this degree > 1 (repeatable)")
    parser.add_argument("--expert-units", action="store_true",
                        help="MoE architectures' FULL_SHARD / HYBRID_SHARD rows only, with the experts as FSDP units")
    parser.add_argument("--edge-units", action="store_true",
                        help="torchtitan 0.3's embedding and [final norm, head] FSDP units (untied architectures, "
                             "sharded rows; with --finetune lora: the LoRA walk's edge units)")
    parser.add_argument("--pp", action="store_true",
                        help="the pipeline grid instead (benchmarks/memory_accuracy_pp.py: every pipeline rank)")
    args = parser.parse_args(argv)
    if args.pp:
        from benchmarks.memory_accuracy_pp import pp_grid, run_pp_one, summarize_pp

        t0 = time.perf_counter()
        results = run(pp_grid(), args.jobs, run_pp_one)
        print(summarize_pp(results))
        print(f"\n{len(results)} configurations in {time.perf_counter() - t0:.0f} s with {args.jobs} job(s)")
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return
    rows = mesh_grid() if args.mesh else grid(GRIDS[args.families])
    if args.only:
        rows = [r for r in rows if any(r.get(k, 1) > 1 for k in args.only)]
    if args.expert_units:
        archs = {**ARCHS, **ARCHS_2026}
        rows = [{**r, "expert_units": True} for r in rows if r["sharding"] in ("FULL_SHARD", "HYBRID_SHARD")
                and any(k in archs[r["arch"]] for k in ("num_local_experts", "num_experts", "n_routed_experts"))]
    if args.edge_units:  # untied heads only (ModelSpec.split_edge_units), sharded over more than one rank
        tied = lambda a: arch_config(a).get("tie_word_embeddings", arch_config(a)["model_type"] == "gpt2")  # noqa: E731
        rows = [{**r, "edge_units": True} for r in rows if r["sharding"] != "NO_SHARD" and not tied(r["arch"])]
    if args.finetune == "lora":
        rows = [{**r, "finetune": "lora", "lora_rank": args.lora_rank,
                 **({"lora_targets": args.lora_targets} if args.lora_targets != "attention" else {}),
                 **({"lora_dropout": args.lora_dropout} if args.lora_dropout else {})} for r in rows]
    if args.arch:
        rows = [r for r in rows if r["arch"] in args.arch]
    if args.profile_too:
        rows = [{**r, "profile_too": True} for r in rows]
    if args.quick:
        rows = [r for i, r in enumerate(rows) if i % 10 == 0]
    t0 = time.perf_counter()
    results = run(rows, args.jobs)
    print(summarize(results))
    print(f"\n{len(rows)} traces in {time.perf_counter() - t0:.0f} s with {args.jobs} job(s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    from calibration.hash_seed import pin_hash_seed

    pin_hash_seed()  # the traced allocation order follows the hash seed (calibration/hash_seed.py)
    main()
