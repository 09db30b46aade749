"""Llama-like decoder families as data: one declarative entry per model_type, read by a few shared counters.

Every family here is a stack of L identical blocks - attention (q/k/v/o projections, optionally q/k norms
and per-head sinks) and an MLP between norms - under a token embedding, a final norm and an LM head. What
differs between them is a handful of switches, and each entry of FAMILIES sets exactly those, as the
family's modeling_<type>.py (transformers 5) builds them:

    block class, transformers' default max_position_embeddings / head_dim / num_key_value_heads /
    tie_word_embeddings, which linears carry biases (a constant, or a config key with its default),
    norm kind and where the norms sit, q/k norms, gated or plain MLP, the activation key, fused
    projections, the sliding-window rule and the attention implementations the family can train with.

Counts are exact (tests/unit/test_models.py, tests/unit/test_family_counts.py compare them with
sum(p.numel()) of AutoModelForCausalLM.from_config on the meta device). Adding a family is an entry here
and a small config in the tests; mixture-of-experts families reuse the attention side (moe_families.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config_reader import Cfg, head, layernorm, linear, mlp, normalise_activation

Flag = bool | tuple[str, bool]  # a constant, or (config key, transformers' default)


def read_flag(c: Cfg, value: Flag) -> bool:
    return value if isinstance(value, bool) else c.flag(*value)


# ---------------------------------------------------------------------------------------------
# Sliding-window rules: config -> (window in tokens, layers among n_layers that still attend fully).
# A window of 0 means full attention everywhere.
# ---------------------------------------------------------------------------------------------

def no_window(c: Cfg, n_layers: int) -> tuple[int, int]:
    return 0, 0


def window_if_set(c: Cfg, n_layers: int) -> tuple[int, int]:
    """Every layer, when the config sets one (Phi-3-mini-4k: 2047; StarCoder2: 4096; Mixtral: null)."""
    return (c.size("sliding_window"), 0) if c.data.get("sliding_window") is not None else (0, 0)


def mistral_window(c: Cfg, n_layers: int) -> tuple[int, int]:
    """MistralConfig's default window is 4096; an explicit null disables it."""
    if "sliding_window" in c.data and c.data["sliding_window"] is None:
        return 0, 0
    return c.size("sliding_window", default=4096), 0


def _full_layers_from_types(c: Cfg, n_layers: int) -> int | None:
    """Full-attention layers named by an explicit `layer_types` list, None when the config has none."""
    types = c.data.get("layer_types")
    if not isinstance(types, list) or len(types) != n_layers:
        return None
    return sum(1 for t in types if t != "sliding_attention")


def qwen_window(c: Cfg, n_layers: int) -> tuple[int, int]:
    """Qwen2 / Qwen3 (and their MoE): a window only with use_sliding_window (off in released configs), and
    then only for layers from max_window_layers on."""
    if not c.flag("use_sliding_window", False) or c.data.get("sliding_window", 4096) is None:
        return 0, 0
    window = c.size("sliding_window", default=4096)
    full = _full_layers_from_types(c, n_layers)
    if full is None:
        max_window_layers = c.data.get("max_window_layers", 28)
        full = min(max_window_layers, n_layers) if isinstance(max_window_layers, int) else n_layers
    return window, max(full, 0)


def alternating(period_key: str | None, period: int, window: int):
    """Local/global alternation: layer i attends fully when (i + 1) % period == 0 (Gemma 2 and gpt-oss:
    every other layer; Gemma 3: one in `sliding_window_pattern` = 6), unless `layer_types` says otherwise."""

    def rule(c: Cfg, n_layers: int) -> tuple[int, int]:
        if "sliding_window" in c.data and c.data["sliding_window"] is None:
            return 0, 0
        full = _full_layers_from_types(c, n_layers)
        if full is None:
            p = c.size(period_key, default=period) if period_key else period
            full = n_layers // p
        return c.size("sliding_window", default=window), full

    return rule


# ---------------------------------------------------------------------------------------------
# Attention implementations a family can train with: transformers' Gemma 2 and gpt-oss (attention sinks)
# classes declare _supports_sdpa = False, and its sdpa_attention_forward raises on a `softcap`, so a
# Gemma 3 config with attn_logit_softcapping is eager only.
# ---------------------------------------------------------------------------------------------

def any_attention(c: Cfg) -> tuple[str, ...]:
    return ("sdpa", "eager")


def eager_only(c: Cfg) -> tuple[str, ...]:
    return ("eager",)


def eager_if_softcapped(c: Cfg) -> tuple[str, ...]:
    return ("eager",) if c.data.get("attn_logit_softcapping") is not None else ("sdpa", "eager")


def flex_or_eager(c: Cfg) -> tuple[str, ...]:
    """gpt-oss' sinks: transformers runs them in FlexAttention (integrations/flex_attention.py: the sinks applied
    through the logsumexp; _supports_flex_attn = True) or eager, never SDPA; flex first: no s x s scores."""
    return ("flex", "eager")


def preferred_attention(choices: tuple[str, ...], runnable=None) -> str | None:
    """The attention to price for a model whose implementations are `choices` (ModelSpec.attention_choices, in
    order of preference) under a trainer that runs `runnable` (None: any): the first the trainer runs, None if
    it runs none of them."""
    return next((a for a in choices if runnable is None or a in runnable), None)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """What one model_type's modeling file builds, as switches. Flags are a constant or (config key,
    transformers' default)."""

    block_class: str
    max_positions: int                       # transformers' default max_position_embeddings
    qkv_bias: Flag = False                 # biases of q/k/v
    o_bias: Flag = False                   # bias of the output projection
    mlp_bias: Flag = False                 # biases of the MLP linears
    norm: str = "rmsnorm"                    # rmsnorm | rmsnorm_fp32 (weight applied in fp32) | layernorm (+ bias)
    norm_layout: str = "pre"                 # pre | sandwich (a norm before and after each sublayer) | post
    #                                          (after each sublayer only) | parallel (one norm, both branches)
    qk_norm: str = ""                        # "" | head (a head_dim-wide norm each for q and k) | full (q_dim, kv_dim)
    qk_norm_flag: Flag = True              # whether the q/k norms are built (Phi's qk_layernorm)
    gated_mlp: bool = True                   # gate_proj * up_proj (SwiGLU, GeGLU) or fc1 -> fc2
    activation: tuple[str, str] = ("hidden_act", "silu")  # config key, transformers' default
    tied: bool = False                       # transformers' default tie_word_embeddings
    fused_projections: bool = False          # Phi-3: qkv_proj and gate_up_proj (same counts; LoRA sees them fused)
    head_bias: bool = False                  # lm_head bias (Phi)
    head_dim: int | None = None              # default head_dim; None = hidden_size / num_attention_heads
    kv_heads: int | None = None              # default num_key_value_heads; None = num_attention_heads
    attention_sinks: bool = False            # a learned logit per head (gpt-oss)
    softcap: tuple[float | None, float | None] | None = None  # defaults of (attn_, final_)logit_softcapping
    window: Callable[[Cfg, int], tuple[int, int]] = no_window
    attention: Callable[[Cfg], tuple[str, ...]] = any_attention
    # with a sliding window and no attention dropout (transformers' flex path refuses it), FlexAttention comes last
    # (_supports_flex_attn; separate q/k/v projections, which cost_models/attention_flex.py is checked on)
    flex_windows: bool = False
    dropout: tuple[tuple[str, float], ...] = (("attention_dropout", 0.0),)  # keys read, with defaults
    activation_renames: tuple[tuple[str, str], ...] = ()  # what __post_init__ rewrites (Gemma: gelu -> tanh)

    @property
    def block_norms(self) -> int:
        return {"pre": 2, "sandwich": 4, "post": 2, "parallel": 1}[self.norm_layout]


_ATTENTION_BIAS = ("attention_bias", False)
_GEMMA = dict(norm="rmsnorm_fp32", tied=True, head_dim=256, activation=("hidden_activation", "gelu_pytorch_tanh"))

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaDecoderLayer", 2048, qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS,
                    mlp_bias=("mlp_bias", False)),
    "mistral": Family("MistralDecoderLayer", 4096 * 32, kv_heads=8, window=mistral_window, flex_windows=True),
    "qwen2": Family("Qwen2DecoderLayer", 32768, qkv_bias=True, kv_heads=32, window=qwen_window, flex_windows=True),
    # Phi-3 declares resid_pdrop/embd_pdrop but its transformers module only applies attention dropout.
    "phi3": Family("Phi3DecoderLayer", 4096, fused_projections=True, window=window_if_set),
    "qwen3": Family("Qwen3DecoderLayer", 32768, qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS, qk_norm="head",
                    head_dim=128, kv_heads=32, window=qwen_window, flex_windows=True),
    "gemma": Family("GemmaDecoderLayer", 8192, qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS, kv_heads=16,
                    **{**_GEMMA, "activation": ("hidden_act", "gelu_pytorch_tanh")},
                    activation_renames=(("gelu", "gelu_pytorch_tanh"),)),
    "gemma2": Family("Gemma2DecoderLayer", 8192, qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS, kv_heads=4,
                     norm_layout="sandwich", softcap=(50.0, 30.0), window=alternating(None, 2, 4096),
                     attention=eager_only, flex_windows=True, **_GEMMA),
    "gemma3_text": Family("Gemma3DecoderLayer", 131072, qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS,
                          kv_heads=4, norm_layout="sandwich", qk_norm="head", softcap=(None, None),
                          window=alternating("sliding_window_pattern", 6, 4096), attention=eager_if_softcapped,
                          flex_windows=True, **_GEMMA),
    "olmo2": Family("Olmo2DecoderLayer", 2048, qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS,
                    norm="rmsnorm_fp32", norm_layout="post", qk_norm="full"),
    "phi": Family("PhiDecoderLayer", 2048, qkv_bias=True, o_bias=True, mlp_bias=True, norm="layernorm",
                  norm_layout="parallel", qk_norm="head", qk_norm_flag=("qk_layernorm", False), gated_mlp=False,
                  activation=("hidden_act", "gelu_new"), head_bias=True,
                  dropout=(("resid_pdrop", 0.0), ("embd_pdrop", 0.0), ("attention_dropout", 0.0))),
    "starcoder2": Family("Starcoder2DecoderLayer", 4096, qkv_bias=("use_bias", True), o_bias=("use_bias", True),
                         mlp_bias=("use_bias", True), norm="layernorm", gated_mlp=False,
                         activation=("hidden_act", "gelu_pytorch_tanh"), tied=True, kv_heads=2,
                         window=window_if_set, flex_windows=True,
                         dropout=(("residual_dropout", 0.0), ("embedding_dropout", 0.0), ("attention_dropout", 0.0))),
}


# ---------------------------------------------------------------------------------------------
# Shared counting
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dims:
    """The attention shape of a config, with transformers' defaults applied."""

    hidden: int
    n_layers: int
    vocab: int
    n_heads: int
    n_kv: int
    head_dim: int

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv * self.head_dim


def read_dims(c: Cfg, fam: Family) -> Dims:
    h, L, vocab = c.size("hidden_size"), c.size("num_hidden_layers"), c.size("vocab_size")
    n_heads = c.size("num_attention_heads")
    n_kv = c.size("num_key_value_heads", default=fam.kv_heads or n_heads)
    c.divides("num_key_value_heads", n_kv, "num_attention_heads", n_heads)
    head_dim = c.size("head_dim", default=fam.head_dim or h // n_heads)  # an explicit head_dim wins
    return Dims(h, L, vocab, n_heads, n_kv, head_dim)


def norm_params(fam: Family, width: int) -> int:
    return layernorm(width) if fam.norm == "layernorm" else width


def attention_params(c: Cfg, fam: Family, d: Dims) -> int:
    """q/k/v/o projections (separate or fused: the same count), q/k norms, attention sinks."""
    params = linear(d.hidden, d.q_dim + 2 * d.kv_dim, read_flag(c, fam.qkv_bias))
    params += linear(d.q_dim, d.hidden, read_flag(c, fam.o_bias))
    if fam.qk_norm and read_flag(c, fam.qk_norm_flag):
        params += (2 * norm_params(fam, d.head_dim) if fam.qk_norm == "head"
                   else norm_params(fam, d.q_dim) + norm_params(fam, d.kv_dim))
    if fam.attention_sinks:
        params += d.n_heads
    return params


def dense_mlp_params(c: Cfg, fam: Family, hidden: int, ffn: int) -> int:
    return mlp(hidden, ffn, read_flag(c, fam.mlp_bias), gated=fam.gated_mlp)


def activation_of(c: Cfg, fam: Family) -> str:
    key, default = fam.activation
    name = c.text(key, default)
    return normalise_activation(dict(fam.activation_renames).get(name, name))


def attention_lora_shapes(fam: Family, d: Dims) -> tuple[tuple[int, int], ...]:
    h, q, kv = d.hidden, d.q_dim, d.kv_dim
    return ((h, q + 2 * kv), (q, h)) if fam.fused_projections else ((h, q), (h, kv), (h, kv), (q, h))


def common_fields(c: Cfg, fam: Family, d: Dims) -> dict:
    """Every ModelSpec field but the block's parameters and MLP width (and the MoE shape): root counts,
    attention shape, norms, activation, dropout, LoRA targets, window, attention implementations."""
    tied = c.flag("tie_word_embeddings", fam.tied)
    window, full_layers = fam.window(c, d.n_layers)
    attn_softcap = logit_softcap = False
    attention_dropout = c.any_dropout(**{k: p for k, p in fam.dropout if k == "attention_dropout"})
    choices = fam.attention(c)
    if fam.flex_windows and window and not attention_dropout and "flex" not in choices:
        choices += ("flex",)
    if fam.softcap is not None:
        attn_softcap = c.data.get("attn_logit_softcapping", fam.softcap[0]) is not None
        logit_softcap = c.data.get("final_logit_softcapping", fam.softcap[1]) is not None
    return dict(
        n_layers=d.n_layers, hidden_size=d.hidden, n_heads=d.n_heads, n_kv_heads=d.n_kv, head_dim=d.head_dim,
        vocab_size=d.vocab, embedding_params=d.vocab * d.hidden,
        head_params=head(tied, d.hidden, d.vocab, bias=fam.head_bias),
        # final norm; a tied lm_head shares the embedding's weight but keeps its own bias (Phi), like BERT's
        root_other_params=norm_params(fam, d.hidden) + (d.vocab if tied and fam.head_bias else 0),
        block_class=fam.block_class, gated_mlp=fam.gated_mlp, norm=fam.norm,
        norm_layout="pre" if fam.norm_layout == "parallel" else fam.norm_layout,
        qk_norm=fam.qk_norm if fam.qk_norm and read_flag(c, fam.qk_norm_flag) else "",
        parallel_block=fam.norm_layout == "parallel", activation=activation_of(c, fam), tied_embeddings=tied,
        dropout=c.any_dropout(**dict(fam.dropout)), lora_target_shapes=attention_lora_shapes(fam, d),
        attention_dropout=attention_dropout,
        max_seq_len=c.size("max_position_embeddings", default=fam.max_positions),
        sliding_window=window, full_attention_layers=full_layers if window else 0,
        attn_softcap=attn_softcap, logit_softcap=logit_softcap, attention_choices=choices,
    )


def dense_block(c: Cfg, fam: Family, d: Dims, ffn: int) -> int:
    """One dense block: attention, MLP, the block's norms."""
    return attention_params(c, fam, d) + dense_mlp_params(c, fam, d.hidden, ffn) + fam.block_norms * norm_params(fam, d.hidden)


def read_dense(c: Cfg) -> dict:
    """ModelSpec fields of a dense family of the table (the BUILDERS entry of each)."""
    fam = FAMILIES[c.model_type]
    d = read_dims(c, fam)
    f = c.size("intermediate_size")
    return dict(common_fields(c, fam, d), ffn_hidden_size=f, block_params=dense_block(c, fam, d, f))


BUILDERS: dict[str, Callable[[Cfg], dict]] = {model_type: read_dense for model_type in FAMILIES}
