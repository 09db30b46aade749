"""ModelSpec from a preset name, a Hugging Face config.json, or an nn.Module.

    resolve_model("llama2-7b")                 preset from planner/catalog/models.json
    resolve_model("path/to/config.json")       or a directory holding one, or the config as a dict
    resolve_model(torch_module)                counted on whatever device it lives (meta is fine)

Parameter counts are exact: for every supported `model_type` they equal
`sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())` in transformers 5
(BertForMaskedLM for bert), which deduplicates tied weights. Each per-type function below mirrors
the module tree of transformers' `modeling_<type>.py`, including the places where transformers
ignores a config key (MPT's `no_bias` and `expansion_ratio`, Phi-3's `resid_pdrop`): we count what
gets built, not what the key promises.

torch and transformers are imported inside the functions that need them, never at module import:
`fsdp-plan --model llama2-7b ...` must start without loading torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from cost_models.specs import ModelSpec, SpecError
from planner.errors import ModelNotFound, PlannerError, UnsupportedModel

CATALOG_PATH = Path(__file__).parent / "catalog" / "models.json"

# Keys of a preset entry that are ours, not Hugging Face's: stripped before building a torch model.
_PRESET_META_KEYS = ("_source",)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def resolve_model(model) -> ModelSpec:
    """ModelSpec from a preset name, a config.json path (file or directory), an HF config dict,
    an nn.Module, or a ModelSpec (returned unchanged)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return from_hf_config(model)
    if _is_module(model):
        return from_module(model)
    if isinstance(model, str) and _preset_key(model) is not None:
        return load_preset(model)
    if isinstance(model, (str, Path)):
        path = _config_path(model)
        return from_hf_config(read_hf_config(path), name=_name_from_path(path))
    raise PlannerError("model", f"expected a preset name, a config.json path, a dict or an nn.Module, "
                                f"got {type(model).__name__}")


def list_presets() -> list[str]:
    return sorted(_catalog())


def preset_hf_config(name: str) -> dict:
    """The Hugging Face config dict of a preset (without our `_source` note): feed it to
    `transformers.AutoConfig.for_model(**d)` to build the real model."""
    key = _preset_key(name)
    if key is None:
        raise _unknown_preset(name)
    return {k: v for k, v in _catalog()[key].items() if k not in _PRESET_META_KEYS}


def preset_source(name: str) -> str:
    """Where a preset's numbers come from (the catalog's `_source` note)."""
    key = _preset_key(name)
    if key is None:
        raise _unknown_preset(name)
    return _catalog()[key].get("_source", "")


def load_preset(name: str) -> ModelSpec:
    key = _preset_key(name)
    if key is None:
        raise _unknown_preset(name)
    return from_hf_config(preset_hf_config(key), name=key)


def hf_config_of(model) -> dict | None:
    """The HF config dict behind a preset name, a config path or a dict; None for an nn.Module."""
    if isinstance(model, dict):
        return dict(model)
    if isinstance(model, str) and _preset_key(model) is not None:
        return preset_hf_config(model)
    if isinstance(model, (str, Path)):
        return read_hf_config(_config_path(model))
    return None


def _config_path(model: str | Path) -> Path:
    """The config path a non-preset string names; ModelNotFound (with close preset names) when the
    string looks like neither an existing path nor a path at all (a mistyped preset)."""
    path = Path(model)
    if isinstance(model, Path) or path.exists() or _looks_like_path(str(model)):
        return path
    raise _unknown_preset(str(model))


def read_hf_config(path: str | Path) -> dict:
    """Parse a config.json (or the config.json inside a directory); PlannerError on any failure."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"no config.json in directory {path}" if path.is_dir() else f"no such file: {path}"
        raise PlannerError("model", f"{where} (and it is not a preset name)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PlannerError("model", f"{file} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlannerError("model", f"cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise PlannerError("model", f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def from_hf_config(cfg: dict, name: str | None = None) -> ModelSpec:
    """ModelSpec with exact parameter counts from a Hugging Face config dict."""
    if not isinstance(cfg, dict):
        raise PlannerError("model", f"a Hugging Face config must be a dict, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise PlannerError("model", "config is missing required key 'model_type' "
                                    f"(supported: {', '.join(supported_model_types())})")
    builder = _BUILDERS.get(model_type)
    if builder is None:
        raise UnsupportedModel("model_type", f"{model_type!r} is not supported; supported model_type values: "
                                             f"{', '.join(supported_model_types())}")
    fields = builder(_Cfg(cfg, model_type))
    if name is None:
        name = Path(str(cfg.get("_name_or_path") or model_type)).name or model_type
    try:
        return ModelSpec(name=name, family=model_type, **fields)
    except SpecError as e:  # a size the config allows but the spec rejects (e.g. a zero)
        raise PlannerError("model", f"config of {name!r}: {e}") from None


def supported_model_types() -> list[str]:
    return sorted(_BUILDERS)


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _catalog() -> dict[str, dict]:
    return json.loads(CATALOG_PATH.read_text(encoding="utf-8"))


def _preset_key(name: str) -> str | None:
    """Catalog key for a preset name, case-insensitively; None when it is not one."""
    lowered = name.strip().lower()
    return next((key for key in _catalog() if key.lower() == lowered), None)


def _unknown_preset(name: str) -> ModelNotFound:
    close = difflib.get_close_matches(name.strip().lower(), list_presets(), n=4, cutoff=0.5)
    hint = f"did you mean: {', '.join(close)}?" if close else f"presets: {', '.join(list_presets())}"
    return ModelNotFound("model", f"unknown model {name!r}: not a preset nor an existing config path; {hint}")


def _looks_like_path(text: str) -> bool:
    return text.endswith(".json") or "/" in text or "\\" in text or text.startswith(".")


def _name_from_path(path: Path) -> str:
    """'models/llama/config.json' -> 'llama'; 'tiny.json' -> 'tiny'."""
    if path.is_dir():
        return path.resolve().name
    return path.resolve().parent.name if path.stem == "config" else path.stem


# ---------------------------------------------------------------------------------------------
# Reading config values: every failure is a PlannerError naming the key
# ---------------------------------------------------------------------------------------------

_REQUIRED = object()


class _Cfg:
    """Typed, validated access to an HF config dict. `size(*keys)` takes a key and its aliases in
    the order transformers resolves them (its `attribute_map`); a None value counts as absent, as
    transformers treats it for the keys we read."""

    def __init__(self, data: dict, model_type: str):
        self.data = data
        self.model_type = model_type

    def _lookup(self, keys: tuple[str, ...]):
        for key in keys:
            if self.data.get(key) is not None:
                return key, self.data[key]
        return keys[0], None

    def size(self, *keys: str, default=_REQUIRED) -> int:
        """A positive integer (layers, widths, heads, vocabulary)."""
        key, value = self._lookup(keys)
        if value is None:
            if default is _REQUIRED:
                raise PlannerError("model", f"{self.model_type} config is missing required key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlannerError("model", f"{self.model_type} config key {key!r} must be a positive integer, "
                                        f"got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, (bool, int)) or value not in (0, 1):
            raise PlannerError("model", f"{self.model_type} config key {key!r} must be true or false, got {value!r}")
        return bool(value)

    def any_dropout(self, **defaults: float) -> bool:
        """True when one of the given dropout probabilities (key=transformers default) is non-zero."""
        for key, default in defaults.items():
            value = self.data.get(key)
            if value is None:
                value = default
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise PlannerError("model", f"{self.model_type} config key {key!r} must be a probability in "
                                            f"[0, 1], got {value!r}")
            if value > 0:
                return True
        return False

    def text(self, key: str, default: str) -> str:
        value = self.data.get(key)
        return default if value is None else str(value)

    def divides(self, small_key: str, small: int, big_key: str, big: int) -> None:
        if big % small:
            raise PlannerError("model", f"{self.model_type} config: {big_key}={big} is not divisible by "
                                        f"{small_key}={small}")


# ---------------------------------------------------------------------------------------------
# Parameter counting helpers (nn.Linear, transformers' Conv1D and nn.LayerNorm conventions)
# ---------------------------------------------------------------------------------------------

def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _layernorm(h: int, affine: bool = True, bias: bool = True) -> int:
    return (h + (h if bias else 0)) if affine else 0


def _qkvo(h: int, q_dim: int, kv_dim: int, qkv_bias: bool, o_bias: bool) -> int:
    """Separate or fused q/k/v projections plus the output projection: fusing changes no count."""
    return _linear(h, q_dim + 2 * kv_dim, qkv_bias) + _linear(q_dim, h, o_bias)


def _mlp(h: int, f: int, bias: bool, gated: bool) -> int:
    """Up (and gate) h->f, down f->h; gate and up share one bias pattern."""
    return (2 if gated else 1) * _linear(h, f, bias) + _linear(f, h, bias)


def _normalise_activation(name: str) -> str:
    """HF activation names -> the spec's vocabulary (same math, same autograd storage)."""
    name = name.strip().lower()
    return {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python": "gelu"}.get(name, name)


def _head(tied: bool, n_in: int, vocab: int, bias: bool = False) -> int:
    """An untied output projection; a tied one shares the embedding weight (counted once there)."""
    return 0 if tied else _linear(n_in, vocab, bias)


# ---------------------------------------------------------------------------------------------
# Per-model_type builders: config -> ModelSpec fields. Each mirrors modeling_<type>.py.
# ---------------------------------------------------------------------------------------------

# Llama-style decoders (RMSNorm, SwiGLU, rotary, GQA): block class and transformers' default
# max_position_embeddings. They differ only in which biases exist (_llama_biases) and in Phi-3's
# fused qkv_proj / gate_up_proj, which hold exactly as many parameters as separate projections.
_LLAMA_STYLE = {
    "llama": ("LlamaDecoderLayer", 2048),
    "mistral": ("MistralDecoderLayer", 4096 * 32),
    "qwen2": ("Qwen2DecoderLayer", 32768),
    "phi3": ("Phi3DecoderLayer", 4096),
}


def _llama_biases(c: _Cfg) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP bias) as each modeling file builds them."""
    if c.model_type == "llama":
        attention_bias = c.flag("attention_bias", False)
        return attention_bias, attention_bias, c.flag("mlp_bias", False)
    if c.model_type == "qwen2":
        return True, False, False  # hard-coded: q/k/v carry biases, o_proj does not
    return False, False, False     # mistral, phi3: hard-coded bias=False


def _llama_style(c: _Cfg) -> dict:
    block_class, default_max_pos = _LLAMA_STYLE[c.model_type]
    qkv_bias, o_bias, mlp_bias = _llama_biases(c)
    h, L, vocab = c.size("hidden_size"), c.size("num_hidden_layers"), c.size("vocab_size")
    n_heads = c.size("num_attention_heads")
    n_kv = c.size("num_key_value_heads", default=n_heads)
    c.divides("num_key_value_heads", n_kv, "num_attention_heads", n_heads)
    head_dim = c.size("head_dim", default=h // n_heads)  # explicit head_dim overrides h / n_heads
    f = c.size("intermediate_size")
    q_dim, kv_dim = n_heads * head_dim, n_kv * head_dim
    tied = c.flag("tie_word_embeddings", False)
    block = _qkvo(h, q_dim, kv_dim, qkv_bias, o_bias) + _mlp(h, f, mlp_bias, gated=True) + 2 * h  # 2 RMSNorms
    fused = c.model_type == "phi3"
    lora = ((h, q_dim + 2 * kv_dim), (q_dim, h)) if fused else ((h, q_dim), (h, kv_dim), (h, kv_dim), (q_dim, h))
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_hidden_size=f,
        vocab_size=vocab, block_params=block, embedding_params=vocab * h, head_params=_head(tied, h, vocab),
        root_other_params=h,  # final RMSNorm
        block_class=block_class, gated_mlp=True, norm="rmsnorm",
        activation=_normalise_activation(c.text("hidden_act", "silu")), tied_embeddings=tied,
        # Phi-3 declares resid_pdrop/embd_pdrop but its transformers module only applies attention dropout.
        dropout=c.any_dropout(attention_dropout=0.0), lora_target_shapes=lora,
        max_seq_len=c.size("max_position_embeddings", default=default_max_pos),
        sliding_window=_sliding_window(c),
    )


def _sliding_window(c: _Cfg) -> int:
    """The attention window of every layer, 0 for none. Mistral: MistralConfig's default is 4096, null
    disables it. Phi-3: none unless the config sets one (Phi-3-mini-4k's config.json says 2047). Qwen2
    windows only layers from max_window_layers on, and only with use_sliding_window (off in released
    configs): not modelled, counted as full attention."""
    if "sliding_window" in c.data and c.data["sliding_window"] is None:
        return 0
    if c.model_type == "mistral":
        return c.size("sliding_window", default=4096)
    if c.model_type == "phi3" and "sliding_window" in c.data:
        return c.size("sliding_window")
    return 0


def _gpt2(c: _Cfg) -> dict:
    # GPT2Config's attribute_map: hidden_size -> n_embd, num_hidden_layers -> n_layer, ...
    h = c.size("n_embd", "hidden_size", default=768)
    L = c.size("n_layer", "num_hidden_layers")
    n_heads = c.size("n_head", "num_attention_heads")
    c.divides("n_head", n_heads, "n_embd", h)
    vocab = c.size("vocab_size")
    n_pos = c.size("n_positions", "max_position_embeddings", default=1024)
    f = c.size("n_inner", default=4 * h)
    tied = c.flag("tie_word_embeddings", True)
    attention = _qkvo(h, h, h, True, True)  # Conv1D c_attn (h, 3h) and c_proj, with biases
    block = 2 * _layernorm(h) + attention + _mlp(h, f, True, gated=False)
    if c.flag("add_cross_attention", False):
        # crossattention: c_attn (h, 2h) for k/v, q_attn (h, h), c_proj; plus ln_cross_attn
        block += attention + _layernorm(h)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=f, vocab_size=vocab, block_params=block,
        embedding_params=vocab * h + n_pos * h,  # wte + learned positions wpe
        head_params=_head(tied, h, vocab), root_other_params=_layernorm(h),  # ln_f
        block_class="GPT2Block", activation=_normalise_activation(c.text("activation_function", "gelu_new")),
        tied_embeddings=tied, dropout=c.any_dropout(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
        lora_target_shapes=((h, 3 * h), (h, h)), max_seq_len=n_pos,
    )


def _gpt_neox(c: _Cfg) -> dict:
    h, L, vocab = c.size("hidden_size"), c.size("num_hidden_layers"), c.size("vocab_size")
    n_heads = c.size("num_attention_heads")
    c.divides("num_attention_heads", n_heads, "hidden_size", h)
    f = c.size("intermediate_size")
    tied = c.flag("tie_word_embeddings", False)
    attn_bias = c.flag("attention_bias", True)
    # query_key_value (h, 3h) and dense follow attention_bias; the MLP always has biases.
    block = 2 * _layernorm(h) + _qkvo(h, h, h, attn_bias, attn_bias) + _mlp(h, f, True, gated=False)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=f, vocab_size=vocab, block_params=block, embedding_params=vocab * h,
        head_params=_head(tied, h, vocab), root_other_params=_layernorm(h),  # final_layer_norm
        block_class="GPTNeoXLayer", activation=_normalise_activation(c.text("hidden_act", "gelu")),
        parallel_block=c.flag("use_parallel_residual", True), tied_embeddings=tied,
        dropout=c.any_dropout(hidden_dropout=0.0, attention_dropout=0.0),
        lora_target_shapes=((h, 3 * h), (h, h)), max_seq_len=c.size("max_position_embeddings", default=2048),
    )


# OPT's learned positional embedding reserves 2 extra rows (fairseq's padding offset).
_OPT_POSITION_OFFSET = 2


def _opt(c: _Cfg) -> dict:
    h, L, vocab = c.size("hidden_size"), c.size("num_hidden_layers"), c.size("vocab_size")
    n_heads = c.size("num_attention_heads")
    c.divides("num_attention_heads", n_heads, "hidden_size", h)
    f = c.size("ffn_dim")
    n_pos = c.size("max_position_embeddings", default=2048)
    proj = c.size("word_embed_proj_dim", default=h)  # opt-350m embeds in 512, projects to 1024
    bias, affine = c.flag("enable_bias", True), c.flag("layer_norm_elementwise_affine", True)
    tied = c.flag("tie_word_embeddings", True)
    block = 4 * _linear(h, h, bias) + _mlp(h, f, bias, gated=False) + 2 * _layernorm(h, affine)
    # project_in / project_out exist only when the embedding width differs from the model width;
    # the final LayerNorm only for pre-LN models (opt-350m is post-LN and has none).
    projections = 2 * proj * h if proj != h else 0
    final_norm = (c.flag("do_layer_norm_before", True) and not c.flag("_remove_final_layer_norm", False))
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=f, vocab_size=vocab, block_params=block,
        embedding_params=vocab * proj + (n_pos + _OPT_POSITION_OFFSET) * h,
        head_params=_head(tied, proj, vocab),
        root_other_params=projections + (_layernorm(h, affine) if final_norm else 0),
        block_class="OPTDecoderLayer", activation=_normalise_activation(c.text("activation_function", "relu")),
        tied_embeddings=tied, dropout=c.any_dropout(dropout=0.1, attention_dropout=0.0),
        lora_target_shapes=((h, h),) * 4, max_seq_len=n_pos,
    )


def _bloom(c: _Cfg) -> dict:
    # BloomConfig pops a legacy `n_embed` kwarg over hidden_size; attribute_map covers n_layer / n_head.
    h = c.size("n_embed", "hidden_size", default=64)
    L = c.size("n_layer", "num_hidden_layers")
    n_heads = c.size("n_head", "num_attention_heads")
    c.divides("n_head", n_heads, "hidden_size", h)
    vocab = c.size("vocab_size")
    tied = c.flag("tie_word_embeddings", True)
    block = 2 * _layernorm(h) + _qkvo(h, h, h, True, True) + _mlp(h, 4 * h, True, gated=False)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=4 * h, vocab_size=vocab, block_params=block, embedding_params=vocab * h,
        head_params=_head(tied, h, vocab),
        root_other_params=2 * _layernorm(h),  # word_embeddings_layernorm and ln_f
        # BloomGelu: tanh-approximate GELU with a custom backward that saves only its input.
        block_class="BloomBlock", activation="gelu_tanh", tied_embeddings=tied,
        dropout=c.any_dropout(hidden_dropout=0.0, attention_dropout=0.0),
        lora_target_shapes=((h, 3 * h), (h, h)), max_seq_len=0,  # ALiBi: no trained length limit
    )


def _falcon(c: _Cfg) -> dict:
    h = c.size("n_embed", "hidden_size", default=4544)
    L, vocab = c.size("num_hidden_layers"), c.size("vocab_size")
    n_heads = c.size("num_attention_heads")
    c.divides("num_attention_heads", n_heads, "hidden_size", h)
    head_dim = h // n_heads
    f = c.size("ffn_hidden_size", default=4 * h)
    bias, tied = c.flag("bias", False), c.flag("tie_word_embeddings", True)
    new_arch = c.flag("new_decoder_architecture", False)
    multi_query, parallel = c.flag("multi_query", True), c.flag("parallel_attn", True)
    # Three layouts of the fused query_key_value: grouped KV (40B/180B), one shared KV head (7B), MHA.
    if new_arch:
        n_kv = c.size("num_kv_heads", default=n_heads)
        c.divides("num_kv_heads", n_kv, "num_attention_heads", n_heads)
    else:
        n_kv = 1 if multi_query else n_heads
    qkv_out = (n_heads + 2 * n_kv) * head_dim
    # Two LayerNorms for sequential blocks (input, post-attention) and for parallel blocks with
    # num_ln_in_parallel_attn == 2 (ln_attn, ln_mlp; the default under new_decoder_architecture).
    n_ln_parallel = c.size("num_ln_in_parallel_attn", default=2 if new_arch else 1)
    n_ln = 2 if not parallel or n_ln_parallel == 2 else 1
    block = (_linear(h, qkv_out, bias) + _linear(h, h, bias) + _mlp(h, f, bias, gated=False)
             + n_ln * _layernorm(h))
    alibi = c.flag("alibi", False)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_hidden_size=f,
        vocab_size=vocab, block_params=block, embedding_params=vocab * h, head_params=_head(tied, h, vocab),
        root_other_params=_layernorm(h),  # ln_f
        block_class="FalconDecoderLayer", activation=_normalise_activation(c.text("activation", "gelu")),
        parallel_block=new_arch or parallel, tied_embeddings=tied,
        dropout=c.any_dropout(hidden_dropout=0.0, attention_dropout=0.0),
        lora_target_shapes=((h, qkv_out), (h, h)),
        max_seq_len=0 if alibi else c.size("max_position_embeddings", default=2048),
    )


def _mpt(c: _Cfg) -> dict:
    # MptConfig's attribute_map: hidden_size -> d_model, num_attention_heads -> n_heads, ...
    h = c.size("d_model", "hidden_size", default=2048)
    L = c.size("n_layers", "num_hidden_layers")
    n_heads = c.size("n_heads", "num_attention_heads")
    c.divides("n_heads", n_heads, "d_model", h)
    vocab = c.size("vocab_size")
    tied = c.flag("tie_word_embeddings", True)
    attn_config = c.data.get("attn_config") or {}
    if not isinstance(attn_config, dict):
        raise PlannerError("model", f"mpt config key 'attn_config' must be an object, got {attn_config!r}")
    # transformers' MPT ignores no_bias, expansion_ratio and learned_pos_emb: its linears never have
    # biases, the MLP is always 4h, positions are ALiBi only, and its LayerNorms drop their bias.
    block = 2 * _layernorm(h, bias=False) + _qkvo(h, h, h, False, False) + _mlp(h, 4 * h, False, gated=False)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=4 * h, vocab_size=vocab, block_params=block, embedding_params=vocab * h,
        head_params=_head(tied, h, vocab), root_other_params=_layernorm(h, bias=False),  # norm_f
        block_class="MptBlock", activation="gelu", tied_embeddings=tied,
        # every dropout in transformers' MPT uses attn_config.attn_pdrop
        dropout=_Cfg(attn_config, "mpt attn_config").any_dropout(attn_pdrop=0.0),
        lora_target_shapes=((h, 3 * h), (h, h)), max_seq_len=c.size("max_seq_len", default=2048),
    )


def _bert(c: _Cfg) -> dict:
    """BertForMaskedLM: BertModel without its pooler, plus the MLM head (transform + decoder)."""
    h, L, vocab = c.size("hidden_size"), c.size("num_hidden_layers"), c.size("vocab_size")
    n_heads = c.size("num_attention_heads")
    c.divides("num_attention_heads", n_heads, "hidden_size", h)
    f = c.size("intermediate_size")
    n_pos = c.size("max_position_embeddings", default=512)
    n_types = c.size("type_vocab_size", default=2)
    tied = c.flag("tie_word_embeddings", True)
    attention = _qkvo(h, h, h, True, True) + _layernorm(h)  # self-attention + BertSelfOutput
    block = attention + _mlp(h, f, True, gated=False) + _layernorm(h)  # + BertIntermediate/BertOutput
    if c.flag("add_cross_attention", False):
        block += attention
    # MLM transform (dense h->h + LayerNorm) and the output bias `cls.predictions.bias`; the decoder's
    # own bias is that same tensor when tied, a separate one (part of the head) when untied.
    mlm_transform = _linear(h, h, True) + _layernorm(h) + vocab
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=f, vocab_size=vocab, block_params=block,
        embedding_params=(vocab + n_pos + n_types) * h, head_params=_head(tied, h, vocab, bias=True),
        root_other_params=_layernorm(h) + mlm_transform,  # embeddings.LayerNorm + MLM head
        block_class="BertLayer", activation=_normalise_activation(c.text("hidden_act", "gelu")),
        tied_embeddings=tied, dropout=c.any_dropout(hidden_dropout_prob=0.1,
                                                     attention_probs_dropout_prob=0.1),
        causal=False, lora_target_shapes=((h, h),) * 4, max_seq_len=n_pos,
    )


_BUILDERS: dict[str, Callable[[_Cfg], dict]] = {
    **{model_type: _llama_style for model_type in _LLAMA_STYLE},
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "opt": _opt, "bloom": _bloom, "falcon": _falcon, "mpt": _mpt,
    "bert": _bert,
}


# ---------------------------------------------------------------------------------------------
# nn.Module
# ---------------------------------------------------------------------------------------------

def _is_module(obj) -> bool:
    # Without torch imported, obj cannot be an nn.Module: no need to import it to find out.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def block_classes_of(module) -> set[type]:
    """The repeated block class(es) of a module: the FSDP auto-wrap units."""
    return {type(block) for block in _find_blocks(module, _hf_block_class_name(module))}


def from_module(module, name: str | None = None) -> ModelSpec:
    """ModelSpec from an nn.Module, reading only shapes (works on the meta device, allocates nothing).

    A transformers model of a supported type takes its shape fields from its config; anything else
    is inferred from the repeated block's nn.Linear / nn.Embedding layers (family "generic").
    Parameter counts always come from the module itself.
    """
    name = name or type(module).__name__
    blocks = _find_blocks(module, _hf_block_class_name(module))
    split = _measure_split(module, blocks)
    hf_dict = _hf_config_dict(module)
    try:
        if hf_dict is not None and hf_dict.get("model_type") in _BUILDERS:
            return dataclasses.replace(from_hf_config(hf_dict, name=name), **split)
        return ModelSpec(name=name, family="generic", **_infer_shapes(module, blocks, hf_dict or {}), **split)
    except PlannerError:
        raise
    except SpecError as e:  # e.g. a module with no parameters in its blocks
        raise PlannerError("model", f"cannot describe module {name!r}: {e}") from None


def _hf_config_dict(module) -> dict | None:
    """`module.config.to_dict()` for a transformers model (anything with such a config), else None."""
    to_dict = getattr(getattr(module, "config", None), "to_dict", None)
    data = to_dict() if callable(to_dict) else None
    return data if isinstance(data, dict) else None


def _hf_block_class_name(module) -> str | None:
    """The decoder-layer class name transformers uses for this module's model_type, if supported."""
    hf_dict = _hf_config_dict(module)
    if hf_dict is None or hf_dict.get("model_type") not in _BUILDERS:
        return None
    try:
        return from_hf_config(hf_dict).block_class
    except PlannerError:
        return None


def _find_blocks(module, class_name: str | None = None) -> list:
    """Instances of the block class: `class_name` when known (transformers), else the class whose
    instances, as children of an nn.ModuleList / nn.Sequential, hold the most parameters. Classes
    repeated at least twice win over single ones, so a Sequential(embedding, encoder, head) does not
    make the whole encoder a one-layer "block"."""
    import torch.nn as nn

    if class_name is not None:
        found = [m for m in module.modules() if type(m).__name__ == class_name]
        if found:
            return found
    members: dict[type, list] = {}
    for container in module.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            for child in container.children():
                members.setdefault(type(child), []).append(child)
    scored = [(len(ms) >= 2, _numel(_unique_params(ms)), cls) for cls, ms in members.items()]
    scored = [s for s in scored if s[1] > 0]
    if not scored:
        raise PlannerError("model", f"no repeated block found in {type(module).__name__}: expected an "
                                    f"nn.ModuleList or nn.Sequential of blocks holding parameters")
    best = max(scored, key=lambda s: (s[0], s[1]))[2]  # max keeps the first (outermost) of equals
    return members[best]


def _unique_params(modules) -> dict:
    """id -> parameter over the modules, each shared (tied) parameter once, as .parameters() does."""
    return {id(p): p for m in modules for p in m.parameters()}


def _numel(params: dict) -> int:
    return sum(p.numel() for p in params.values())


def _measure_split(module, blocks: list) -> dict:
    """n_layers, block/embedding/head/root-other parameter counts, measured on the module."""
    import torch.nn as nn

    total = _unique_params([module])
    in_blocks = _unique_params(blocks)
    inside = {id(m) for b in blocks for m in b.modules()}
    outside = [m for m in module.modules() if id(m) not in inside]
    embeddings = {k: p for k, p in _unique_params([m for m in outside if isinstance(m, nn.Embedding)]).items()
                  if k not in in_blocks}
    head_module = _output_head(module, outside, embeddings)
    tied = head_module is not None and id(getattr(head_module, "weight", None)) in embeddings
    # A tied head adds nothing; an untied one counts its weight and bias (BERT's tied decoder bias
    # is the MLM head's `bias` parameter: root-other, like in from_hf_config).
    head = {} if head_module is None or tied else {
        k: p for k, p in _unique_params([head_module]).items() if k not in embeddings and k not in in_blocks}
    n_layers = len(blocks)
    # Blocks of one class can differ slightly (e.g. a first layer with extra parameters): the spec's
    # L identical blocks get the floor of the mean, the remainder goes to the root.
    block_params = _numel(in_blocks) // n_layers
    other = _numel(total) - n_layers * block_params - _numel(embeddings) - _numel(head)
    return dict(n_layers=n_layers, block_params=block_params, embedding_params=_numel(embeddings),
                head_params=_numel(head), root_other_params=other, tied_embeddings=tied)


def _output_head(module, outside: list, embeddings: dict):
    """The output projection: transformers' get_output_embeddings(), else the last nn.Linear outside
    the blocks whose output width is the vocabulary (the largest embedding table)."""
    import torch.nn as nn

    getter = getattr(module, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (AttributeError, NotImplementedError):
            head = None
        if isinstance(head, nn.Module):
            return head
    vocab = max((p.shape[0] for p in embeddings.values() if p.dim() == 2), default=None)
    heads = [m for m in outside if isinstance(m, nn.Linear) and m.out_features == vocab]
    return heads[-1] if heads else None


# -- generic shape inference ------------------------------------------------------------------

_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads", "n_head")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
_ATTENTION_LEAVES = {"q", "k", "v", "o", "qkv", "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
                     "wq", "wk", "wv", "wo", "wqkv", "query", "key", "value", "query_key_value", "c_attn"}
_DEFAULT_HEAD_DIM = 64  # when nothing names the head count: the common width of one head


def _infer_shapes(module, blocks: list, config: dict) -> dict:
    """Best-effort shape fields for a module we do not know: from the first block's layers, with
    standard HF config keys (when the module has a config) taking precedence."""
    import torch.nn as nn

    block = blocks[0]
    linears = [(qual, m) for qual, m in block.named_modules() if isinstance(m, nn.Linear)]
    inside = {id(m) for b in blocks for m in b.modules()}
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding) and id(m) not in inside]
    token_table = max(tables, key=lambda m: m.num_embeddings, default=None)

    h = config.get("hidden_size") or (token_table.embedding_dim if token_table else _most_common_in(linears))
    vocab = config.get("vocab_size") or (token_table.num_embeddings if token_table else 1)
    down_widths = [m.in_features for _, m in linears if m.out_features == h and m.in_features != h]
    f = config.get("intermediate_size") or max(down_widths, default=4 * h)
    n_heads = config.get("num_attention_heads") or _int_attr(block, _HEAD_ATTRS) or _default_heads(h)
    n_kv = config.get("num_key_value_heads") or _int_attr(block, _KV_HEAD_ATTRS) or n_heads
    if n_heads % n_kv:
        n_kv = n_heads
    head_dim = config.get("head_dim") or _int_attr(block, ("head_dim",)) or max(1, h // n_heads)
    up_shapes = [(m.in_features, m.out_features) for _, m in linears]
    gated = up_shapes.count((h, f)) >= 2 or (h, 2 * f) in up_shapes
    return dict(
        hidden_size=h, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_hidden_size=f,
        vocab_size=vocab, block_class=type(block).__name__, gated_mlp=gated,
        norm="rmsnorm" if any("rmsnorm" in type(m).__name__.lower() for m in block.modules()) else "layernorm",
        activation=_activation_of(block),
        dropout=_has_dropout(module), lora_target_shapes=_attention_shapes(block, linears),
        max_seq_len=config.get("max_position_embeddings") or 0,
    )


def _most_common_in(linears: list) -> int:
    widths = [m.in_features for _, m in linears]
    if not widths:
        raise PlannerError("model", "cannot infer the hidden size: the block has no nn.Linear and the "
                                    "model no nn.Embedding")
    return max(set(widths), key=widths.count)


def _default_heads(h: int) -> int:
    return h // _DEFAULT_HEAD_DIM if h % _DEFAULT_HEAD_DIM == 0 else 1


def _int_attr(block, names: tuple[str, ...]) -> int | None:
    for m in block.modules():
        for name in names:
            value = getattr(m, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _activation_of(block) -> str:
    import torch.nn as nn

    for m in block.modules():
        if isinstance(m, nn.GELU):
            return "gelu_tanh" if m.approximate == "tanh" else "gelu"
        for cls, name in ((nn.SiLU, "silu"), (nn.ReLU, "relu")):
            if isinstance(m, cls):
                return name
    # nn.TransformerEncoderLayer keeps its activation as a function attribute
    fn = getattr(block, "activation", None)
    fn_name = getattr(fn, "__name__", "")
    return _normalise_activation(fn_name) if fn_name in ("relu", "gelu", "silu") else "gelu"


def _has_dropout(module) -> bool:
    import torch.nn as nn

    return any((isinstance(m, nn.Dropout) and m.p > 0)
               or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0) for m in module.modules())


def _attention_shapes(block, linears: list) -> tuple[tuple[int, int], ...]:
    """(in, out) of the attention projections: nn.MultiheadAttention's packed in_proj and out_proj,
    or linears named like q/k/v/o projections or living under an 'attn'/'attention' module."""
    import torch.nn as nn

    for m in block.modules():
        if isinstance(m, nn.MultiheadAttention):
            if m.in_proj_weight is not None:
                shapes = [(m.in_proj_weight.shape[1], m.in_proj_weight.shape[0])]
            else:
                shapes = [(w.shape[1], w.shape[0]) for w in (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)]
            return (*shapes, (m.out_proj.in_features, m.out_proj.out_features))
    shapes = []
    for qual, m in linears:
        parts = qual.lower().split(".")
        if parts[-1] in _ATTENTION_LEAVES or any("attn" in p or "attention" in p for p in parts[:-1]):
            shapes.append((m.in_features, m.out_features))
    return tuple(shapes)
