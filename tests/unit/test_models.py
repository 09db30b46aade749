"""planner.models: exact parameter counts against transformers, presets, errors, nn.Module input.

Reference counts are `sum(p.numel() for p in model.parameters())` of the transformers model built on
the meta device (nothing allocated), which counts tied weights once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.specs import ModelSpec
from planner.errors import ModelNotFound, PlannerError, UnsupportedModel
from planner.models import (
    block_classes_of,
    from_hf_config,
    from_module,
    hf_config_of,
    list_presets,
    load_preset,
    preset_hf_config,
    resolve_model,
    supported_model_types,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
nn = torch.nn


def build_on_meta(cfg: dict):
    """The transformers model for an HF config dict, on the meta device."""
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        if cfg["model_type"] == "bert":
            return transformers.BertForMaskedLM(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def first_block(model, class_name: str):
    return next(m for m in model.modules() if type(m).__name__ == class_name)


# Small configs with odd sizes: every supported model_type, GQA where it exists, biases and tying
# both ways, and each type's quirks. Keys left out on purpose take transformers' defaults.
_LLAMA = dict(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=70)
_NEOX = dict(vocab_size=97, hidden_size=40, num_hidden_layers=2, num_attention_heads=5, intermediate_size=72)
_OPT = dict(vocab_size=103, hidden_size=40, num_hidden_layers=2, num_attention_heads=5, ffn_dim=66,
            max_position_embeddings=33)
_FALCON = dict(vocab_size=99, hidden_size=48, num_hidden_layers=2, num_attention_heads=6)
_BERT = dict(vocab_size=101, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40,
             max_position_embeddings=17, type_vocab_size=3)
SMALL_CONFIGS = {
    "llama-gqa": dict(model_type="llama", num_key_value_heads=2, **_LLAMA),
    "llama-bias-tied-headdim": dict(model_type="llama", num_key_value_heads=3, attention_bias=True, mlp_bias=True,
                                    tie_word_embeddings=True, head_dim=12, **_LLAMA),
    "mistral-gqa-headdim": dict(model_type="mistral", num_key_value_heads=2, head_dim=10, **_LLAMA),
    "mistral-tied-mha": dict(model_type="mistral", num_key_value_heads=6, tie_word_embeddings=True, **_LLAMA),
    "qwen2-gqa-tied": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True, **_LLAMA),
    "qwen2-untied": dict(model_type="qwen2", num_key_value_heads=3, **_LLAMA),
    "phi3-gqa": dict(model_type="phi3", num_key_value_heads=2, **_LLAMA),
    "phi3-tied-headdim": dict(model_type="phi3", num_key_value_heads=3, head_dim=14, tie_word_embeddings=True,
                              **_LLAMA),
    "gpt2": dict(model_type="gpt2", vocab_size=101, n_embd=36, n_layer=3, n_head=4, n_positions=19),
    "gpt2-untied-inner-cross": dict(model_type="gpt2", vocab_size=101, n_embd=36, n_layer=2, n_head=6,
                                    n_positions=19, n_inner=50, tie_word_embeddings=False, add_cross_attention=True),
    "gpt2-hf-names": dict(model_type="gpt2", vocab_size=101, hidden_size=36, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=23),
    "gpt_neox": dict(model_type="gpt_neox", **_NEOX),
    "gpt_neox-nobias-tied-seq": dict(model_type="gpt_neox", attention_bias=False, tie_word_embeddings=True,
                                     use_parallel_residual=False, **_NEOX),
    "opt": dict(model_type="opt", **_OPT),
    "opt-proj-postln-nobias-untied": dict(model_type="opt", word_embed_proj_dim=16, do_layer_norm_before=False,
                                          enable_bias=False, layer_norm_elementwise_affine=False,
                                          tie_word_embeddings=False, **_OPT),
    "opt-removed-final-ln": dict(model_type="opt", _remove_final_layer_norm=True, **_OPT),
    "bloom": dict(model_type="bloom", vocab_size=107, hidden_size=40, n_layer=2, n_head=5),
    "bloom-untied-hf-names": dict(model_type="bloom", vocab_size=107, hidden_size=40, num_hidden_layers=3,
                                  num_attention_heads=4, tie_word_embeddings=False),
    "falcon-7b-style": dict(model_type="falcon", **_FALCON),
    "falcon-new-arch-gqa-bias-untied": dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=2,
                                            bias=True, tie_word_embeddings=False, ffn_hidden_size=100, **_FALCON),
    "falcon-new-arch-1ln": dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=3,
                                num_ln_in_parallel_attn=1, **_FALCON),
    "falcon-mha-sequential-alibi": dict(model_type="falcon", multi_query=False, parallel_attn=False, alibi=True,
                                        **_FALCON),
    "falcon-parallel-2ln": dict(model_type="falcon", num_ln_in_parallel_attn=2, **_FALCON),
    "mpt": dict(model_type="mpt", vocab_size=103, d_model=48, n_layers=2, n_heads=6),
    "mpt-untied-ignored-keys": dict(model_type="mpt", vocab_size=103, d_model=48, n_layers=2, n_heads=4,
                                    tie_word_embeddings=False, no_bias=False, expansion_ratio=2),
    "bert": dict(model_type="bert", **_BERT),
    "bert-untied": dict(model_type="bert", tie_word_embeddings=False, **_BERT),
}
# Token ids inside the tiny vocabularies (the defaults, e.g. Phi-3's pad id 32000, are not).
SMALL_CONFIGS = {key: {**cfg, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
                 for key, cfg in SMALL_CONFIGS.items()}


def test_every_supported_type_has_a_small_config():
    from test_family_counts import FAMILY_CONFIGS  # the families added with the table (issue 9)

    covered = {c["model_type"] for c in (*SMALL_CONFIGS.values(), *FAMILY_CONFIGS.values())}
    assert set(supported_model_types()) == covered
    assert {"llama", "mistral", "qwen2", "gpt2", "gpt_neox", "opt", "bloom", "falcon", "mpt", "phi3",
            "bert"} <= set(supported_model_types())


@pytest.mark.parametrize("key", SMALL_CONFIGS)
def test_counts_match_transformers_exactly(key):
    cfg = SMALL_CONFIGS[key]
    spec = from_hf_config(cfg)
    model = build_on_meta(cfg)
    assert spec.n_params == numel(model)
    assert spec.block_params == numel(first_block(model, spec.block_class))
    assert spec.n_layers == len([m for m in model.modules() if type(m).__name__ == spec.block_class])
    # The same model read back as an nn.Module gives the same spec, split included.
    assert from_module(model, name=spec.name) == spec


@pytest.mark.parametrize("name", list_presets())
def test_presets_match_transformers_exactly(name):
    spec = load_preset(name)
    model = build_on_meta(preset_hf_config(name))
    assert spec.n_params == numel(model)
    last_block = [m for m in model.modules() if type(m).__name__ == spec.block_class][-1]
    assert spec.block_params == numel(last_block)  # the last: DeepSeek's leading dense blocks differ
    assert spec.name == name


@pytest.mark.parametrize("name, expected", [
    ("llama2-7b", 6_738_415_616),     # Touvron et al. 2023 / HF model card
    ("llama3-8b", 8_030_261_248),     # HF model card
    ("llama3-405b", 405_853_388_800),  # Llama 3.1 405B, HF model card
])
def test_cited_exact_counts(name, expected):
    assert load_preset(name).n_params == expected


@pytest.mark.parametrize("name, published, rel_tol", [
    ("gpt-175b", 175e9, 0.01),  # Brown et al. 2020 Table 2.1
    ("gpt-13b", 12.9e9, 0.02),  # Table 2.1 says 13.0B; d_model 5120 instead of the listed 5140
])
def test_gpt3_sizes_near_published(name, published, rel_tol):
    assert load_preset(name).n_params == pytest.approx(published, rel=rel_tol)


def test_preset_shape_fields():
    llama70 = load_preset("llama2-70b")
    assert (llama70.n_heads, llama70.n_kv_heads, llama70.head_dim, llama70.kv_dim) == (64, 8, 128, 1024)
    assert llama70.lora_target_shapes == ((8192, 8192), (8192, 1024), (8192, 1024), (8192, 8192))
    assert (llama70.norm, llama70.activation, llama70.gated_mlp, llama70.tied_embeddings) == \
        ("rmsnorm", "silu", True, False)
    gpt = load_preset("gpt-1.3b")
    assert (gpt.family, gpt.n_heads, gpt.head_dim, gpt.max_seq_len) == ("gpt2", 16, 128, 2048)
    assert gpt.tied_embeddings and gpt.head_params == 0 and gpt.dropout and gpt.activation == "gelu_new"
    bert = load_preset("bert-large")
    assert not bert.causal and bert.family == "bert" and bert.max_seq_len == 512
    assert load_preset("bloom-7b1").max_seq_len == 0  # ALiBi
    assert load_preset("mistral-7b").n_kv_heads == 8


def test_quirk_fields_of_small_configs():
    falcon = from_hf_config(SMALL_CONFIGS["falcon-7b-style"])
    assert falcon.n_kv_heads == 1 and falcon.parallel_block and falcon.lora_target_shapes[0] == (48, 48 + 2 * 8)
    assert not from_hf_config(SMALL_CONFIGS["falcon-mha-sequential-alibi"]).parallel_block
    assert not from_hf_config(SMALL_CONFIGS["gpt_neox-nobias-tied-seq"]).parallel_block
    phi3 = from_hf_config(SMALL_CONFIGS["phi3-gqa"])
    assert phi3.lora_target_shapes == ((48, 48 + 2 * 16), (48, 48))  # fused qkv_proj, then o_proj
    assert from_hf_config(SMALL_CONFIGS["opt"]).activation == "relu"
    # MPT's only dropout knob is attn_config.attn_pdrop (which transformers types as int, so the
    # count tests cannot build a model with 0.1)
    assert from_hf_config({**SMALL_CONFIGS["mpt"], "attn_config": {"attn_pdrop": 0.1}}).dropout
    assert not from_hf_config(SMALL_CONFIGS["mpt"]).dropout


# -- inputs: paths, dicts, presets ---------------------------------------------------------------

def test_resolve_accepts_every_input_kind(tmp_path):
    cfg = SMALL_CONFIGS["llama-gqa"]
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "other.json").write_text(json.dumps(cfg))
    from_dir = resolve_model(str(tmp_path / "tiny-llama"))
    assert from_dir.name == "tiny-llama"
    assert resolve_model(tmp_path / "tiny-llama" / "config.json") == from_dir
    assert resolve_model(str(tmp_path / "other.json")).name == "other"
    assert resolve_model(cfg).n_params == from_dir.n_params
    assert resolve_model("LLAMA2-7B") == load_preset("llama2-7b")  # case-insensitive
    assert resolve_model(from_dir) is from_dir
    assert hf_config_of(tmp_path / "tiny-llama") == cfg
    assert hf_config_of("llama2-7b")["model_type"] == "llama"
    assert "_source" not in preset_hf_config("gpt-125m")


def test_every_preset_cites_a_source():
    from planner.models import _catalog

    assert all(entry["_source"].strip() for entry in _catalog().values())


# -- errors ----------------------------------------------------------------------------------------

def test_unknown_preset_suggests_close_names():
    with pytest.raises(ModelNotFound) as err:
        resolve_model("llama2-7")
    assert err.value.field == "model" and "llama2-7b" in str(err.value)
    with pytest.raises(ModelNotFound, match="gpt-175b"):
        load_preset("gpt-157b")


def test_model_type_transformers_cannot_build_as_a_causal_lm_names_it_and_the_version():
    import transformers

    with pytest.raises(UnsupportedModel) as err:
        from_hf_config({"model_type": "t5", "d_model": 512})
    assert err.value.field == "model_type"
    assert "'t5'" in str(err.value) and transformers.__version__ in str(err.value)
    with pytest.raises(UnsupportedModel, match=f"'no-such-model' is not a model type transformers {transformers.__version__}"):
        from_hf_config({"model_type": "no-such-model", "hidden_size": 64})


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"hidden_size": 64}), "model_type"),
    (json.dumps({k: v for k, v in SMALL_CONFIGS["llama-gqa"].items() if k != "num_hidden_layers"}),
     "num_hidden_layers"),
    (json.dumps({**SMALL_CONFIGS["llama-gqa"], "hidden_size": 0}), "hidden_size"),
    (json.dumps({**SMALL_CONFIGS["gpt2"], "n_head": "4"}), "n_head"),
    (json.dumps({**SMALL_CONFIGS["llama-gqa"], "num_key_value_heads": 4}), "num_key_value_heads"),
    (json.dumps({**SMALL_CONFIGS["bert"], "hidden_dropout_prob": 2}), "hidden_dropout_prob"),
])
def test_malformed_config_json_raises_one_line_planner_error(tmp_path, content, expected):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(PlannerError) as err:
        resolve_model(str(path))
    assert err.value.field == "model" and expected in str(err.value) and "\n" not in str(err.value)


def test_missing_files_raise_planner_error(tmp_path, monkeypatch):
    with pytest.raises(PlannerError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(PlannerError, match="no such file"):
        resolve_model(str(tmp_path / "missing.json"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub id outside the cache: tests/unit/test_hub_ids.py
    with pytest.raises(PlannerError, match="is not in the Hugging Face cache"):
        resolve_model("meta-llama/Llama-2-7b-hf")


_junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(-1, 2), st.text(max_size=3),
                  st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_keys = sorted({k for cfg in SMALL_CONFIGS.values() for k in cfg} - {"model_type"})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_type=st.sampled_from(sorted(supported_model_types())),
       base=st.sampled_from(sorted(SMALL_CONFIGS)),
       overrides=st.dictionaries(st.sampled_from(_keys), _junk, max_size=4),
       drop=st.sets(st.sampled_from(_keys), max_size=3))
def test_any_config_gives_a_spec_or_a_planner_error(model_type, base, overrides, drop):
    cfg = {k: v for k, v in {**SMALL_CONFIGS[base], **overrides}.items() if k not in drop}
    cfg["model_type"] = model_type
    try:
        spec = from_hf_config(cfg)
    except PlannerError as err:
        assert "\n" not in str(err)
    else:
        assert isinstance(spec, ModelSpec) and spec.n_params > 0


# -- nn.Module input -------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, h: int, n_heads: int):
        super().__init__()
        self.num_heads = n_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)


class Block(nn.Module):
    def __init__(self, h: int, f: int, n_heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = Attention(h, n_heads)
        self.mlp = nn.Sequential(nn.Linear(h, f), nn.GELU(approximate="tanh"), nn.Linear(f, h))


class TinyLM(nn.Module):
    def __init__(self, vocab=50, h=32, f=80, n_heads=4, n_layers=3, tied=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, h)
        self.pos = nn.Embedding(16, h)
        self.blocks = nn.ModuleList(Block(h, f, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight


@pytest.mark.parametrize("tied", [True, False])
def test_from_module_custom_model(tied):
    with torch.device("meta"):
        model = TinyLM(tied=tied)
    spec = from_module(model)
    assert block_classes_of(model) == {Block}
    assert spec.n_params == numel(model) and spec.block_params == numel(model.blocks[0])
    assert (spec.n_layers, spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size) == (3, 32, 80, 50)
    assert (spec.n_heads, spec.head_dim, spec.block_class, spec.family) == (4, 8, "Block", "generic")
    assert spec.embedding_params == (50 + 16) * 32 and spec.root_other_params == 2 * 32
    assert spec.tied_embeddings is tied and spec.head_params == (0 if tied else 50 * 32)
    assert spec.lora_target_shapes == ((32, 96), (32, 32)) and spec.activation == "gelu_tanh"


def test_from_module_prefers_repeated_blocks_over_a_single_big_child():
    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(d_model=24, nhead=3, dim_feedforward=40, dropout=0.0)
        model = nn.Sequential(nn.Embedding(30, 24), nn.TransformerEncoder(layer, num_layers=2,
                                                                          enable_nested_tensor=False),
                              nn.Linear(24, 30))
    spec = from_module(model)
    assert block_classes_of(model) == {nn.TransformerEncoderLayer}
    assert spec.n_params == numel(model) and spec.n_layers == 2
    assert (spec.n_heads, spec.ffn_hidden_size, spec.activation, spec.dropout) == (3, 40, "relu", False)
    assert spec.lora_target_shapes == ((24, 72), (24, 24))


def test_from_module_transformers_model_detects_block_class():
    model = build_on_meta(SMALL_CONFIGS["llama-gqa"])
    assert block_classes_of(model) == {transformers.models.llama.modeling_llama.LlamaDecoderLayer}
    base = model.model  # LlamaModel: no lm_head, the difference lands outside the head
    spec = from_module(base)
    assert spec.n_params == numel(base) and spec.head_params == 0 and spec.block_class == "LlamaDecoderLayer"


def test_from_module_without_blocks_is_a_planner_error():
    with pytest.raises(PlannerError, match="no repeated block"):
        from_module(nn.Linear(3, 4))


def test_import_leaves_torch_and_transformers_unloaded():
    code = ("import sys, planner.models as m; m.load_preset('llama2-7b'); m.resolve_model('gpt-125m'); "
            "bad = [n for n in ('torch', 'transformers') if n in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mistral_sliding_window():
    from planner.models import from_hf_config, load_preset

    assert load_preset("mistral-7b").sliding_window == 4096
    base = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    assert from_hf_config(base).sliding_window == 4096          # MistralConfig's default
    assert from_hf_config({**base, "sliding_window": None}).sliding_window == 0
    assert from_hf_config({**base, "model_type": "llama"}).sliding_window == 0
