"""Per-model_type readers: a Hugging Face config -> ModelSpec fields, each mirroring modeling_<type>.py.

Counts are exact: they equal sum(p.numel()) of AutoModelForCausalLM.from_config(cfg) on the meta device
(tests/unit/test_models.py), including the places where transformers ignores a config key (MPT's
`no_bias` and `expansion_ratio`, Phi-3's `resid_pdrop`): we count what gets built, not what the key promises.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.errors import PlannerError

from .config_reader import Cfg, head, layernorm, linear, mlp, normalise_activation, qkvo
from .family_table import BUILDERS as TABLE_BUILDERS
from .moe_families import BUILDERS as MOE_BUILDERS

# ---------------------------------------------------------------------------------------------
# Per-model_type builders: config -> ModelSpec fields. Each mirrors modeling_<type>.py.
# ---------------------------------------------------------------------------------------------

def _gpt2(c: Cfg) -> dict:
    # GPT2Config's attribute_map: hidden_size -> n_embd, num_hidden_layers -> n_layer, ...
    h = c.size("n_embd", "hidden_size", default=768)
    L = c.size("n_layer", "num_hidden_layers")
    n_heads = c.size("n_head", "num_attention_heads")
    c.divides("n_head", n_heads, "n_embd", h)
    vocab = c.size("vocab_size")
    n_pos = c.size("n_positions", "max_position_embeddings", default=1024)
    f = c.size("n_inner", default=4 * h)
    tied = c.flag("tie_word_embeddings", True)
    attention = qkvo(h, h, h, True, True)  # Conv1D c_attn (h, 3h) and c_proj, with biases
    block = 2 * layernorm(h) + attention + mlp(h, f, True, gated=False)
    if c.flag("add_cross_attention", False):
        # crossattention: c_attn (h, 2h) for k/v, q_attn (h, h), c_proj; plus ln_cross_attn
        block += attention + layernorm(h)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=f, vocab_size=vocab, block_params=block,
        embedding_params=vocab * h + n_pos * h,  # wte + learned positions wpe
        head_params=head(tied, h, vocab), root_other_params=layernorm(h),  # ln_f
        block_class="GPT2Block", activation=normalise_activation(c.text("activation_function", "gelu_new")),
        tied_embeddings=tied, dropout=c.any_dropout(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
        lora_target_shapes=((h, 3 * h), (h, h)), max_seq_len=n_pos,
    )


def _gpt_neox(c: Cfg) -> dict:
    h, L, vocab = c.size("hidden_size"), c.size("num_hidden_layers"), c.size("vocab_size")
    n_heads = c.size("num_attention_heads")
    c.divides("num_attention_heads", n_heads, "hidden_size", h)
    f = c.size("intermediate_size")
    tied = c.flag("tie_word_embeddings", False)
    attn_bias = c.flag("attention_bias", True)
    # query_key_value (h, 3h) and dense follow attention_bias; the MLP always has biases.
    block = 2 * layernorm(h) + qkvo(h, h, h, attn_bias, attn_bias) + mlp(h, f, True, gated=False)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=f, vocab_size=vocab, block_params=block, embedding_params=vocab * h,
        head_params=head(tied, h, vocab), root_other_params=layernorm(h),  # final_layer_norm
        block_class="GPTNeoXLayer", activation=normalise_activation(c.text("hidden_act", "gelu")),
        parallel_block=c.flag("use_parallel_residual", True), tied_embeddings=tied,
        dropout=c.any_dropout(hidden_dropout=0.0, attention_dropout=0.0),
        lora_target_shapes=((h, 3 * h), (h, h)), max_seq_len=c.size("max_position_embeddings", default=2048),
    )


# OPT's learned positional embedding reserves 2 extra rows (fairseq's padding offset).
_OPT_POSITION_OFFSET = 2


def _opt(c: Cfg) -> dict:
    h, L, vocab = c.size("hidden_size"), c.size("num_hidden_layers"), c.size("vocab_size")
    n_heads = c.size("num_attention_heads")
    c.divides("num_attention_heads", n_heads, "hidden_size", h)
    f = c.size("ffn_dim")
    n_pos = c.size("max_position_embeddings", default=2048)
    proj = c.size("word_embed_proj_dim", default=h)  # opt-350m embeds in 512, projects to 1024
    bias, affine = c.flag("enable_bias", True), c.flag("layer_norm_elementwise_affine", True)
    tied = c.flag("tie_word_embeddings", True)
    block = 4 * linear(h, h, bias) + mlp(h, f, bias, gated=False) + 2 * layernorm(h, affine)
    # project_in / project_out exist only when the embedding width differs from the model width;
    # the final LayerNorm only for pre-LN models (opt-350m is post-LN and has none).
    projections = 2 * proj * h if proj != h else 0
    final_norm = (c.flag("do_layer_norm_before", True) and not c.flag("_remove_final_layer_norm", False))
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=f, vocab_size=vocab, block_params=block,
        embedding_params=vocab * proj + (n_pos + _OPT_POSITION_OFFSET) * h,
        head_params=head(tied, proj, vocab),
        root_other_params=projections + (layernorm(h, affine) if final_norm else 0),
        block_class="OPTDecoderLayer", activation=normalise_activation(c.text("activation_function", "relu")),
        tied_embeddings=tied, dropout=c.any_dropout(dropout=0.1, attention_dropout=0.0),
        lora_target_shapes=((h, h),) * 4, max_seq_len=n_pos,
    )


def _bloom(c: Cfg) -> dict:
    # BloomConfig pops a legacy `n_embed` kwarg over hidden_size; attribute_map covers n_layer / n_head.
    h = c.size("n_embed", "hidden_size", default=64)
    L = c.size("n_layer", "num_hidden_layers")
    n_heads = c.size("n_head", "num_attention_heads")
    c.divides("n_head", n_heads, "hidden_size", h)
    vocab = c.size("vocab_size")
    tied = c.flag("tie_word_embeddings", True)
    block = 2 * layernorm(h) + qkvo(h, h, h, True, True) + mlp(h, 4 * h, True, gated=False)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=4 * h, vocab_size=vocab, block_params=block, embedding_params=vocab * h,
        head_params=head(tied, h, vocab),
        root_other_params=2 * layernorm(h),  # word_embeddings_layernorm and ln_f
        # BloomGelu: tanh-approximate GELU with a custom backward that saves only its input.
        block_class="BloomBlock", activation="gelu_tanh", tied_embeddings=tied,
        dropout=c.any_dropout(hidden_dropout=0.0, attention_dropout=0.0),
        lora_target_shapes=((h, 3 * h), (h, h)), max_seq_len=0,  # ALiBi: no trained length limit
    )


def _falcon(c: Cfg) -> dict:
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
    block = (linear(h, qkv_out, bias) + linear(h, h, bias) + mlp(h, f, bias, gated=False)
             + n_ln * layernorm(h))
    alibi = c.flag("alibi", False)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_hidden_size=f,
        vocab_size=vocab, block_params=block, embedding_params=vocab * h, head_params=head(tied, h, vocab),
        root_other_params=layernorm(h),  # ln_f
        block_class="FalconDecoderLayer", activation=normalise_activation(c.text("activation", "gelu")),
        parallel_block=new_arch or parallel, tied_embeddings=tied,
        dropout=c.any_dropout(hidden_dropout=0.0, attention_dropout=0.0),
        lora_target_shapes=((h, qkv_out), (h, h)),
        max_seq_len=0 if alibi else c.size("max_position_embeddings", default=2048),
    )


def _mpt(c: Cfg) -> dict:
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
    block = 2 * layernorm(h, bias=False) + qkvo(h, h, h, False, False) + mlp(h, 4 * h, False, gated=False)
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=4 * h, vocab_size=vocab, block_params=block, embedding_params=vocab * h,
        head_params=head(tied, h, vocab), root_other_params=layernorm(h, bias=False),  # norm_f
        block_class="MptBlock", activation="gelu", tied_embeddings=tied,
        # every dropout in transformers' MPT uses attn_config.attn_pdrop
        dropout=Cfg(attn_config, "mpt attn_config").any_dropout(attn_pdrop=0.0),
        lora_target_shapes=((h, 3 * h), (h, h)), max_seq_len=c.size("max_seq_len", default=2048),
    )


def _bert(c: Cfg) -> dict:
    """BertForMaskedLM: BertModel without its pooler, plus the MLM head (transform + decoder)."""
    h, L, vocab = c.size("hidden_size"), c.size("num_hidden_layers"), c.size("vocab_size")
    n_heads = c.size("num_attention_heads")
    c.divides("num_attention_heads", n_heads, "hidden_size", h)
    f = c.size("intermediate_size")
    n_pos = c.size("max_position_embeddings", default=512)
    n_types = c.size("type_vocab_size", default=2)
    tied = c.flag("tie_word_embeddings", True)
    attention = qkvo(h, h, h, True, True) + layernorm(h)  # self-attention + BertSelfOutput
    block = attention + mlp(h, f, True, gated=False) + layernorm(h)  # + BertIntermediate/BertOutput
    if c.flag("add_cross_attention", False):
        block += attention
    # MLM transform (dense h->h + LayerNorm) and the output bias `cls.predictions.bias`; the decoder's
    # own bias is that same tensor when tied, a separate one (part of the head) when untied.
    mlm_transform = linear(h, h, True) + layernorm(h) + vocab
    return dict(
        n_layers=L, hidden_size=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads,
        ffn_hidden_size=f, vocab_size=vocab, block_params=block,
        embedding_params=(vocab + n_pos + n_types) * h, head_params=head(tied, h, vocab, bias=True),
        root_other_params=layernorm(h) + mlm_transform,  # embeddings.LayerNorm + MLM head
        block_class="BertLayer", activation=normalise_activation(c.text("hidden_act", "gelu")),
        tied_embeddings=tied, dropout=c.any_dropout(hidden_dropout_prob=0.1,
                                                     attention_probs_dropout_prob=0.1),
        causal=False, lora_target_shapes=((h, h),) * 4, max_seq_len=n_pos,
    )


# Llama-like decoders (llama, mistral, qwen2, phi3, qwen3, gemma*, olmo2, phi, starcoder2) are rows of a
# table (family_table.py), mixture-of-experts ones too (moe_families.py); the rest have a reader each here.
BUILDERS: dict[str, Callable[[Cfg], dict]] = {
    **TABLE_BUILDERS, **MOE_BUILDERS,
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "opt": _opt, "bloom": _bloom, "falcon": _falcon, "mpt": _mpt,
    "bert": _bert,
}

