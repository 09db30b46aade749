"""The declarative families (planner/models/family_table.py, moe_families.py) and their presets.

Reference counts are sum(p.numel()) of AutoModelForCausalLM.from_config on the meta device (nothing is
allocated, so full-size presets build in seconds). Published totals are checked with a stated tolerance
where a model card gives one; each discrepancy is explained where it is asserted.
"""

from __future__ import annotations

import json

import pytest

from planner.errors import PlannerError
from planner.models import from_hf_config, from_module, list_presets, load_preset, preset_hf_config, preset_source
from planner.models.family_table import FAMILIES
from planner.models.moe_families import MOE_FAMILIES
from tests.doctor.cli_run import cli_process

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def build_on_meta(cfg: dict):
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def blocks_of(model, class_name: str) -> list:
    return [m for m in model.modules() if type(m).__name__ == class_name]


# Small configs with odd sizes; keys left out take transformers' defaults (head_dim, kv heads, tying).
_DIMS = dict(vocab_size=101, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, intermediate_size=70)
_MOE = dict(vocab_size=101, hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
_MLA = dict(vocab_size=101, hidden_size=40, num_hidden_layers=3, num_attention_heads=4, intermediate_size=56,
            n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_group=2, topk_group=1)
FAMILY_CONFIGS = {
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=10, **_DIMS),
    "qwen3-default-headdim-bias-tied": dict(model_type="qwen3", num_key_value_heads=3, attention_bias=True,
                                            tie_word_embeddings=True, **_DIMS),
    "gemma": dict(model_type="gemma", num_key_value_heads=1, head_dim=12, hidden_act="gelu", **_DIMS),
    "gemma-default-headdim-untied": dict(model_type="gemma", num_key_value_heads=6, tie_word_embeddings=False,
                                         **_DIMS),
    "gemma2": dict(model_type="gemma2", num_key_value_heads=2, head_dim=16, **_DIMS),
    "gemma2-bias": dict(model_type="gemma2", num_key_value_heads=3, attention_bias=True, sliding_window=8,
                        **_DIMS),
    "gemma3_text": dict(model_type="gemma3_text", num_key_value_heads=2, head_dim=16, sliding_window=8,
                        sliding_window_pattern=2, **_DIMS),
    "gemma3_text-softcap-default-headdim": dict(model_type="gemma3_text", num_key_value_heads=3,
                                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **_DIMS),
    "olmo2": dict(model_type="olmo2", num_key_value_heads=2, **_DIMS),
    "olmo2-mha-bias-tied": dict(model_type="olmo2", attention_bias=True, tie_word_embeddings=True, **_DIMS),
    "phi": dict(model_type="phi", **_DIMS, partial_rotary_factor=0.4, resid_pdrop=0.1),
    "phi-gqa-qk-layernorm-tied": dict(model_type="phi", num_key_value_heads=2, qk_layernorm=True,
                                      tie_word_embeddings=True, **_DIMS),
    "starcoder2": dict(model_type="starcoder2", num_key_value_heads=2, sliding_window=16, **_DIMS),
    "starcoder2-nobias-untied-mha": dict(model_type="starcoder2", num_key_value_heads=6, use_bias=False,
                                         tie_word_embeddings=False, **_DIMS),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=30, **_MOE),
    "mixtral-tied-window": dict(model_type="mixtral", num_local_experts=3, num_experts_per_tok=1, intermediate_size=22,
                                tie_word_embeddings=True, sliding_window=32, **_MOE),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                      shared_expert_intermediate_size=26, intermediate_size=50, **_MOE),
    "qwen2_moe-sparse-step-only-layers-nobias": dict(model_type="qwen2_moe", num_experts=5, num_experts_per_tok=3,
                                                     moe_intermediate_size=12, intermediate_size=50,
                                                     decoder_sparse_step=2, mlp_only_layers=[2], qkv_bias=False,
                                                     **{**_MOE, "num_hidden_layers": 4}),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                      head_dim=12, **_MOE),
    "qwen3_moe-dense-first-tied": dict(model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2,
                                       moe_intermediate_size=12, intermediate_size=44, mlp_only_layers=[0],
                                       tie_word_embeddings=True, **_MOE),
    "deepseek_v3": dict(model_type="deepseek_v3", q_lora_rank=20, n_shared_experts=1, first_k_dense_replace=1,
                        num_key_value_heads=4, **_MLA),
    "deepseek_v3-no-q-lora-2-shared-bias": dict(model_type="deepseek_v3", q_lora_rank=None, n_shared_experts=2,
                                                first_k_dense_replace=2, attention_bias=True,
                                                num_key_value_heads=4, **_MLA),
    "deepseek_v2-lite-style": dict(model_type="deepseek_v2", q_lora_rank=None, n_shared_experts=2,
                                   first_k_dense_replace=1, topk_method="greedy", **_MLA),
    "deepseek_v2-q-lora-mlp-bias": dict(model_type="deepseek_v2", q_lora_rank=20, n_shared_experts=1,
                                        mlp_bias=True, attention_bias=True, **_MLA),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, intermediate_size=18,
                    head_dim=8, sliding_window=16, **_MOE),
    "gpt_oss-nobias-default-headdim": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                                           intermediate_size=18, attention_bias=False, **_MOE),
}
FAMILY_CONFIGS = {key: {**cfg, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
                  for key, cfg in FAMILY_CONFIGS.items()}
NEW_TYPES = {"qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "phi", "starcoder2", "mixtral", "qwen2_moe",
             "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"}


def test_every_new_type_has_small_configs():
    assert {c["model_type"] for c in FAMILY_CONFIGS.values()} == NEW_TYPES
    assert NEW_TYPES <= set(FAMILIES) | set(MOE_FAMILIES)


def _check_counts(spec, model):
    assert spec.n_params == numel(model)
    blocks = blocks_of(model, spec.block_class)
    assert spec.n_layers == len(blocks)
    sizes = sorted({numel(b) for b in blocks})
    dense = spec.n_dense_layers
    if dense:
        assert sizes == sorted({spec.block_params, spec.moe.dense_block_params})
        assert sum(1 for b in blocks if numel(b) == spec.moe.dense_block_params) == dense
    else:
        assert sizes == [spec.block_params]
    assert spec.root_params == numel(model) - sum(numel(b) for b in blocks)


@pytest.mark.parametrize("key", FAMILY_CONFIGS)
def test_counts_match_transformers_exactly(key):
    cfg = FAMILY_CONFIGS[key]
    spec = from_hf_config(cfg)
    model = build_on_meta(cfg)
    _check_counts(spec, model)
    assert spec.tied_embeddings == (numel(model.get_output_embeddings()) == 0 or
                                    model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    # The built model read back as an nn.Module gives the same spec.
    assert from_module(model, name=spec.name) == spec


@pytest.mark.parametrize("key", [k for k, c in FAMILY_CONFIGS.items() if c["model_type"] in MOE_FAMILIES])
def test_moe_shapes_match_the_stacked_expert_tensors(key):
    """MoeSpec against the real module: the stacked tensors' (dim 0, elements per expert), the router, the
    shared experts, and what one token visits."""
    cfg = FAMILY_CONFIGS[key]
    spec = from_hf_config(cfg)
    moe = spec.moe
    model = build_on_meta(cfg)
    sparse = next(b for b in blocks_of(model, spec.block_class) if hasattr(b.mlp, "experts"))
    stacked = tuple((p.shape[0], p[0].numel()) for p in sparse.mlp.experts.parameters())
    assert stacked == moe.stacked_expert_tensors
    assert all(n == moe.n_experts for n, _ in stacked)
    assert moe.expert_params == sum(per for _, per in stacked)
    router = getattr(sparse.mlp, "gate", None) or sparse.mlp.router
    assert moe.router_params == numel(router)
    shared = [m for name, m in sparse.mlp.named_children() if name.startswith("shared_expert")]
    assert moe.shared_params == sum(numel(m) for m in shared)
    assert moe.experts_per_token == cfg["num_experts_per_tok"]
    assert spec.active_params == spec.n_params - (spec.n_layers - spec.n_dense_layers) * (
        moe.n_experts - moe.experts_per_token) * moe.expert_params


# -- per-family switches ---------------------------------------------------------------------------

def test_family_quirk_fields():
    gemma2 = from_hf_config(FAMILY_CONFIGS["gemma2"])
    # Gemma2PreTrainedModel: _supports_sdpa = False; flex (_supports_flex_attn) last for its window
    assert gemma2.attention_choices == ("eager", "flex")
    assert (gemma2.attn_softcap, gemma2.logit_softcap) == (True, True)  # Gemma2Config's defaults 50 / 30
    assert (gemma2.sliding_window, gemma2.full_attention_layers) == (4096, 1)  # layers 0, 2 local; 1 global
    assert (gemma2.norm, gemma2.norm_layout, gemma2.tied_embeddings) == ("rmsnorm_fp32", "sandwich", True)
    assert gemma2.activation == "gelu_tanh"
    gemma3 = from_hf_config(FAMILY_CONFIGS["gemma3_text"])
    assert gemma3.attention_choices == ("sdpa", "eager", "flex") and not gemma3.attn_softcap
    assert not gemma3.logit_softcap
    assert (gemma3.sliding_window, gemma3.full_attention_layers, gemma3.qk_norm) == (8, 1, "head")
    capped = from_hf_config(FAMILY_CONFIGS["gemma3_text-softcap-default-headdim"])
    assert capped.attention_choices == ("eager", "flex") and capped.head_dim == 256
    assert from_hf_config(FAMILY_CONFIGS["gemma"]).activation == "gelu_tanh"  # GemmaConfig rewrites "gelu"
    olmo2 = from_hf_config(FAMILY_CONFIGS["olmo2"])
    assert (olmo2.norm_layout, olmo2.qk_norm, olmo2.norm) == ("post", "full", "rmsnorm_fp32")
    qwen3 = from_hf_config(FAMILY_CONFIGS["qwen3-default-headdim-bias-tied"])
    assert qwen3.head_dim == 128 and qwen3.qk_norm == "head"  # Qwen3Config's head_dim default, not h / heads
    phi = from_hf_config(FAMILY_CONFIGS["phi"])
    assert phi.parallel_block and phi.dropout and phi.norm == "layernorm" and phi.activation == "gelu_new"
    assert phi.qk_norm == "" and from_hf_config(FAMILY_CONFIGS["phi-gqa-qk-layernorm-tied"]).qk_norm == "head"
    assert from_hf_config(FAMILY_CONFIGS["starcoder2"]).sliding_window == 16
    oss = from_hf_config(FAMILY_CONFIGS["gpt_oss"])
    assert oss.attention_choices == ("flex", "eager") and (oss.sliding_window, oss.full_attention_layers) == (16, 1)
    ds = from_hf_config(FAMILY_CONFIGS["deepseek_v3"])
    assert (ds.n_heads, ds.n_kv_heads, ds.head_dim) == (4, 4, 12)  # qk_nope + qk_rope per head
    assert ds.lora_target_shapes == ((40, 20), (20, 48), (40, 20), (16, 56), (24, 40))


def test_qwen_sliding_window_only_with_use_sliding_window():
    base = dict(FAMILY_CONFIGS["qwen3"], num_hidden_layers=6)
    assert from_hf_config(base).sliding_window == 0
    windowed = from_hf_config({**base, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 4})
    assert (windowed.sliding_window, windowed.full_attention_layers) == (64, 4)


# -- presets ---------------------------------------------------------------------------------------

NEW_PRESETS = ["llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "llama3.2-1b", "llama3.2-3b", "llama3.3-70b",
               "qwen2.5-7b", "qwen2.5-72b", "qwen3-8b", "qwen3-32b", "gemma2-9b", "gemma2-27b", "gemma3-12b",
               "gemma3-27b", "olmo2-7b", "olmo2-13b", "phi-2", "phi-4", "starcoder2-15b", "mixtral-8x7b",
               "mixtral-8x22b", "qwen2-moe-a2.7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v2-lite",
               "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b"]


def test_new_presets_exist_and_cite_their_config():
    assert set(NEW_PRESETS) <= set(list_presets())
    for name in NEW_PRESETS:
        assert "config.json" in preset_source(name), name


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_preset_counts_match_transformers_exactly(name):
    spec = load_preset(name)
    model = build_on_meta(preset_hf_config(name))
    _check_counts(spec, model)


# Published totals (model cards / papers), in parameters, with the tolerance each is checked to and the
# reason for any gap. Our counts are what transformers builds from the config (no vision towers, no MTP).
PUBLISHED = {
    "llama3.1-8b": (8_030_261_248, 0),          # HF model card, exact
    "llama3.1-70b": (70_553_706_496, 0),        # HF model card, exact
    "llama3.1-405b": (405_853_388_800, 0),      # HF model card, exact
    "llama3.2-1b": (1_235_814_400, 0),          # HF safetensors total (tied embeddings), exact
    "llama3.2-3b": (3_212_749_824, 0),          # HF safetensors total (tied embeddings), exact
    "llama3.3-70b": (70_553_706_496, 0),        # same architecture as 3.1 70B
    "qwen2.5-7b": (7.61e9, 0.005),              # Qwen2.5 card: 7.61B
    "qwen2.5-72b": (72.7e9, 0.005),             # Qwen2.5 card: 72.7B
    "qwen3-8b": (8.2e9, 0.002),                 # Qwen3 card: 8.2B (ours 8.19B)
    "qwen3-32b": (32.8e9, 0.005),               # Qwen3 card: 32.8B
    "gemma2-9b": (9_241_705_984, 0),            # HF safetensors total, exact
    "gemma2-27b": (27_227_128_320, 0),          # HF safetensors total, exact
    # Gemma 3 cards count the SigLIP vision tower (~0.42B) too; the text model transformers builds from
    # text_config is that much smaller: 12B card -> 11.77B, 27B card -> 27.01B.
    "gemma3-12b": (12.19e9 - 0.42e9, 0.01),
    "gemma3-27b": (27.43e9 - 0.42e9, 0.01),
    "olmo2-7b": (7.30e9, 0.005),                # OLMo 2 card: 7.30B (HF: 7.3B)
    "olmo2-13b": (13.7e9, 0.005),               # OLMo 2 card: 13.7B
    "phi-2": (2.78e9, 0.005),                   # Phi-2 card: 2.7B; HF safetensors 2.78B
    "phi-4": (14.66e9, 0.005),                  # Phi-4 card: 14B; the Hub's count 14.7B
    # StarCoder2 paper: "15B"; the Hub: 16B. Our preset unties the head as we recall the 15B config.json
    # (the 3B and 7B tie theirs, and their Hub counts 3.03B / 7.17B only match tied): 15.96B; were it tied,
    # 15.66B - still within the paper's rounding, so this test cannot tell the two apart.
    "starcoder2-15b": (15.96e9, 0.005),
    "mixtral-8x7b": (46.7e9, 0.002),            # Mistral: 46.7B total
    "mixtral-8x22b": (141e9, 0.005),            # Mistral: 141B total
    "qwen2-moe-a2.7b": (14.3e9, 0.005),         # Qwen1.5-MoE card: 14.3B total
    "qwen3-30b-a3b": (30.5e9, 0.005),           # Qwen3 card: 30.5B total
    "qwen3-235b-a22b": (235e9, 0.005),          # Qwen3 card: 235B total
    "deepseek-v2-lite": (15.7e9, 0.005),        # DeepSeek-V2-Lite card: 15.7B total
    # DeepSeek-V3 card: 671B main model + 14B multi-token-prediction module (685B on the Hub); transformers
    # does not build the MTP layer, so we compare with 671B.
    "deepseek-v3": (671e9, 0.002),
    "gpt-oss-20b": (20.91e9, 0.005),            # gpt-oss model card: 20.91B total (21B)
    "gpt-oss-120b": (116.83e9, 0.005),          # gpt-oss model card: 116.83B total (117B)
}
# Active parameters per token (MoE) as published: (figure, tolerance, whether the figure counts the input
# embedding table). Mistral and Qwen count every parameter a token touches, embeddings included; DeepSeek
# and OpenAI leave the input embedding out (a lookup, no FLOPs): gpt-oss's card matches that to 0.1%.
PUBLISHED_ACTIVE = {
    "mixtral-8x7b": (12.9e9, 0.005, True),      # Mistral: 12.9B active (ours 12.88B)
    "mixtral-8x22b": (39e9, 0.01, True),        # Mistral: 39B active (ours 39.15B)
    "qwen2-moe-a2.7b": (2.7e9, 0.005, True),    # Qwen1.5-MoE card: 2.7B activated (ours 2.69B)
    "qwen3-30b-a3b": (3.3e9, 0.02, True),       # Qwen3 card: 3.3B activated (ours 3.35B: the card rounds down)
    "qwen3-235b-a22b": (22e9, 0.01, True),      # Qwen3 card: 22B activated (ours 22.19B)
    "deepseek-v2-lite": (2.4e9, 0.025, False),  # card: 2.4B activated (ours 2.45B without the input embedding;
    #                                             2.66B with it: the card rounds 2.45 down)
    "deepseek-v3": (37e9, 0.015, False),        # paper: 37B activated (ours 36.63B without the input embedding,
    #                                             37.55B with it)
    "gpt-oss-20b": (3.61e9, 0.002, False),      # gpt-oss card: 3.61B active (ours 3.608B)
    "gpt-oss-120b": (5.13e9, 0.002, False),     # gpt-oss card: 5.13B active (ours 5.133B)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_totals_near_published(name):
    published, rel = PUBLISHED[name]
    assert load_preset(name).n_params == pytest.approx(published, rel=rel, abs=0)


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_moe_active_params_near_published(name):
    published, rel, with_embedding = PUBLISHED_ACTIVE[name]
    spec = load_preset(name)
    active = spec.active_params - (0 if with_embedding else spec.embedding_params)
    assert active == pytest.approx(published, rel=rel)


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, missing", [
    ("qwen3", "intermediate_size"), ("gemma2", "hidden_size"), ("mixtral", "num_local_experts"),
    ("qwen3_moe", "moe_intermediate_size"), ("deepseek_v3", "n_routed_experts"), ("gpt_oss", "num_experts_per_tok"),
])
def test_missing_required_field_is_a_one_line_planner_error(key, missing):
    cfg = {k: v for k, v in FAMILY_CONFIGS[key].items() if k != missing}
    with pytest.raises(PlannerError) as err:
        from_hf_config(cfg)
    assert missing in str(err.value) and "\n" not in str(err.value) and err.value.field == "model"


def test_cli_names_the_missing_field_and_exits_2(tmp_path):
    cfg = {k: v for k, v in FAMILY_CONFIGS["qwen3_moe"].items() if k != "num_experts_per_tok"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = cli_process(["--model", str(path), "--gpus", "8"])
    assert r.returncode == 2, r.stderr
    assert "num_experts_per_tok" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_top_k_above_the_experts_is_a_planner_error():
    with pytest.raises(PlannerError, match="experts_per_token"):
        from_hf_config({**FAMILY_CONFIGS["mixtral"], "num_experts_per_tok": 9})
