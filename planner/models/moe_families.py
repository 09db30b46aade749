"""Mixture-of-experts families as data: the attention side is a dense-table Family (family_table.py), the
MLP side a few switches; one shared counter turns a config into ModelSpec fields with a MoeSpec.

transformers 5 stores a sparse layer's routed experts as stacked parameters, `experts.gate_up_proj`
(E, 2f, h) and `experts.down_proj` (E, h, f) - gpt-oss transposed, (E, h, 2f) and (E, f, h), plus
`gate_up_proj_bias` (E, 2f) and `down_proj_bias` (E, h) - next to a router `gate`/`router` (E, h) (+ bias
for gpt-oss) and, for Qwen-MoE and DeepSeek, always-active shared experts. Which layers are sparse:

    mixtral, gpt_oss        every layer
    qwen2_moe, qwen3_moe    layer i unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
                            (released configs: every layer); the dense ones are counted as MoeSpec's dense
                            blocks, wherever they sit
    deepseek_v2, _v3        from first_k_dense_replace on (DeepSeek-V3: 3 leading dense layers)

DeepSeek's multi-head latent attention (MLA) replaces the q/k/v projections by low-rank ones: q_a_proj
(h -> q_lora_rank) + RMSNorm + q_b_proj (-> heads x (qk_nope + qk_rope)), or one q_proj when q_lora_rank
is null (V2-Lite); kv_a_proj_with_mqa (h -> kv_lora_rank + qk_rope) + RMSNorm + kv_b_proj (-> heads x
(qk_nope + v_head_dim)); o_proj (heads x v_head_dim -> h). DeepSeek-V3's multi-token-prediction layer
(num_nextn_predict_layers = 1, layer 61 of the checkpoint) is not built by transformers (it ignores those
weights on load), so it is not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cost_models.specs import MoeSpec, SpecError
from planner.errors import PlannerError

from .config_reader import Cfg, linear, mlp
from .family_table import (Dims, Family, Flag, alternating, attention_params, common_fields, flex_or_eager,
                           norm_params, qwen_window, read_dims, read_flag, window_if_set)


# -- which layers are sparse: config -> the indices of the dense layers among n_layers ---------------

def all_sparse(c: Cfg, n_layers: int) -> tuple[int, ...]:
    return ()


def _count(c: Cfg, key: str, default: int) -> int:
    """A count that may be 0 (dense layers, shared experts); absent or null: transformers' default."""
    value = c.data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlannerError("model", f"{c.model_type} config key {key!r} must be an integer >= 0, got {value!r}")
    return value


def qwen_dense_layers(c: Cfg, n_layers: int) -> tuple[int, ...]:
    step = c.size("decoder_sparse_step", default=1)
    only = c.data.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise PlannerError("model", f"{c.model_type} config key 'mlp_only_layers' must be a list of layer "
                                    f"indices, got {only!r}")
    return tuple(i for i in range(n_layers) if i in only or (i + 1) % step)


def first_k_dense(default: int):
    def rule(c: Cfg, n_layers: int) -> tuple[int, ...]:
        return tuple(range(min(_count(c, "first_k_dense_replace", default), n_layers)))
    return rule


@dataclass(frozen=True)
class MoeFamily:
    attention: Family                     # attention, norms, root: the dense table's switches
    experts_keys: tuple[str, ...]         # routed experts per layer, the attribute_map's names in its order
    expert_ffn_key: str                   # width of one routed expert
    shared: str = ""                      # "" | qwen (shared_expert_intermediate_size, + a gate h -> 1)
    #                                       | deepseek (n_shared_experts x the routed expert width)
    shared_default: int = 0               # transformers' default of shared_expert_intermediate_size / n_shared_experts
    router_bias: bool = False
    expert_bias: bool = False             # gpt-oss: gate_up_proj_bias, down_proj_bias
    dense_layers: Callable[[Cfg, int], tuple[int, ...]] = all_sparse  # the dense blocks' indices
    mla: bool = False                     # DeepSeek's multi-head latent attention
    mlp_bias: Flag = False                # biases of the dense MLPs and shared experts (DeepSeek-V2 mlp_bias)
    renormalise_top_k: Flag = ("norm_topk_prob", False)  # top-k weights divided by their sum (Mixtral always)
    fp32_routing_weights: bool = False    # the routing weights stay fp32 (Mixtral; DeepSeek's fp32 router)
    router_kind: str = "softmax"          # softmax then top-k | topk_softmax (gpt-oss)
    expert_activation: str = "swiglu"     # swiglu | clamped_swiglu (gpt-oss's _apply_gate)


_ATTENTION_BIAS = ("attention_bias", False)

MOE_FAMILIES: dict[str, MoeFamily] = {
    "mixtral": MoeFamily(Family("MixtralDecoderLayer", 4096 * 32, kv_heads=8, window=window_if_set),
                         ("num_local_experts", "num_experts"), "intermediate_size", renormalise_top_k=True,
                         fp32_routing_weights=True),
    "qwen2_moe": MoeFamily(Family("Qwen2MoeDecoderLayer", 32768, qkv_bias=("qkv_bias", True), kv_heads=16,
                                  window=qwen_window),
                           ("num_experts",), "moe_intermediate_size", shared="qwen", shared_default=5632,
                           dense_layers=qwen_dense_layers),
    "qwen3_moe": MoeFamily(Family("Qwen3MoeDecoderLayer", 32768, qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS,
                                  qk_norm="head", kv_heads=4, window=qwen_window),
                           ("num_local_experts", "num_experts"), "moe_intermediate_size",
                           dense_layers=qwen_dense_layers),
    "deepseek_v2": MoeFamily(Family("DeepseekV2DecoderLayer", 2048), ("n_routed_experts", "num_experts"),
                             "moe_intermediate_size", shared="deepseek", shared_default=2,
                             dense_layers=first_k_dense(0), mla=True, mlp_bias=("mlp_bias", False),
                             fp32_routing_weights=True),
    "deepseek_v3": MoeFamily(Family("DeepseekV3DecoderLayer", 4096), ("n_routed_experts", "num_local_experts"),
                             "moe_intermediate_size", shared="deepseek", shared_default=1,
                             dense_layers=first_k_dense(3), mla=True, renormalise_top_k=("norm_topk_prob", True),
                             fp32_routing_weights=True, router_kind="sigmoid"),
    # Attention sinks run in FlexAttention or eager: transformers' GptOss has _supports_sdpa = False.
    "gpt_oss": MoeFamily(Family("GptOssDecoderLayer", 131072, qkv_bias=("attention_bias", True),
                                o_bias=("attention_bias", True), head_dim=64, kv_heads=8, attention_sinks=True,
                                norm="rmsnorm_fp32",  # (weight * x).to(dtype): the weight applied in fp32
                                window=alternating(None, 2, 128), attention=flex_or_eager),
                         ("num_local_experts", "num_experts"), "intermediate_size", router_bias=True,
                         expert_bias=True, renormalise_top_k=False, router_kind="topk_softmax",
                         expert_activation="clamped_swiglu"),
}


def _mla(c: Cfg, d: Dims) -> tuple[int, tuple[tuple[int, int], ...]]:
    """Parameters and LoRA target shapes (in, out) of DeepSeek's latent attention."""
    h, n, bias = d.hidden, d.n_heads, c.flag("attention_bias", False)
    nope, rope = c.size("qk_nope_head_dim", default=128), c.size("qk_rope_head_dim", default=64)
    v_dim, kv_rank = c.size("v_head_dim", default=128), c.size("kv_lora_rank", default=512)
    q_out = n * (nope + rope)
    if "q_lora_rank" in c.data and c.data["q_lora_rank"] is None:  # V2-Lite: a plain q_proj
        q_params, q_shapes = linear(h, q_out, False), ((h, q_out),)
    else:
        q_rank = c.size("q_lora_rank", default=1536)
        q_params = linear(h, q_rank, bias) + q_rank + linear(q_rank, q_out, False)  # + q_a_layernorm
        q_shapes = ((h, q_rank), (q_rank, q_out))
    kv_params = linear(h, kv_rank + rope, bias) + kv_rank + linear(kv_rank, n * (nope + v_dim), False)
    params = q_params + kv_params + linear(n * v_dim, h, bias)
    return params, (*q_shapes, (h, kv_rank + rope), (kv_rank, n * (nope + v_dim)), (n * v_dim, h))


def _mla_dims(c: Cfg) -> Dims:
    """Every head gets its own k and v from kv_b_proj: n_kv_heads = n_heads, head_dim = the q/k width."""
    n = c.size("num_attention_heads")
    head_dim = c.size("qk_nope_head_dim", default=128) + c.size("qk_rope_head_dim", default=64)
    return Dims(c.size("hidden_size"), c.size("num_hidden_layers"), c.size("vocab_size"), n, n, head_dim)


def _mla_fields(c: Cfg) -> tuple[dict, dict]:
    """(ModelSpec, MoeSpec) fields: the latent attention's widths, and the DeepSeek router's - fp32 on an fp32
    copy of its input, group-limited for V3 (n_group 8, topk_group 4 by default) and for V2's
    topk_method group_limited_greedy."""
    plain_q = "q_lora_rank" in c.data and c.data["q_lora_rank"] is None  # V2-Lite: a plain q_proj
    widths = dict(kv_lora_rank=c.size("kv_lora_rank", default=512),
                  q_lora_rank=0 if plain_q else c.size("q_lora_rank", default=1536),
                  qk_rope_head_dim=c.size("qk_rope_head_dim", default=64), v_head_dim=c.size("v_head_dim", default=128))
    grouped = c.model_type == "deepseek_v3" or c.data.get("topk_method") == "group_limited_greedy"
    router = dict(fp32_router_input=True, router_groups=c.size("n_group", default=8) if grouped else 0,
                  router_topk_groups=c.size("topk_group", default=4) if grouped else 0)
    return widths, router


def read_moe(c: Cfg) -> dict:
    """ModelSpec fields, MoeSpec included, of a mixture-of-experts family of the table."""
    fam = MOE_FAMILIES[c.model_type]
    att = fam.attention
    d = _mla_dims(c) if fam.mla else read_dims(c, att)
    h = d.hidden
    fields = common_fields(c, att, d)
    router_fields = {}
    if fam.mla:
        attention, fields["lora_target_shapes"] = _mla(c, d)
        mla_fields, router_fields = _mla_fields(c)
        fields.update(mla_fields)
    else:
        attention = attention_params(c, att, d)
    n_experts = c.size(*fam.experts_keys)
    top_k = c.size("num_experts_per_tok")
    f = c.size(fam.expert_ffn_key)
    # in the module's parameter order: gate_up_proj (+ its bias), down_proj (+ its bias)
    if fam.expert_bias:
        stacked = ((n_experts, 2 * f * h), (n_experts, 2 * f), (n_experts, h * f), (n_experts, h))
    else:
        stacked = ((n_experts, 2 * f * h), (n_experts, h * f))
    router = linear(h, n_experts, fam.router_bias)
    mlp_bias = read_flag(c, fam.mlp_bias)
    shared_f = shared = 0
    if fam.shared == "qwen":
        shared_f = c.size("shared_expert_intermediate_size", default=fam.shared_default)
        shared = mlp(h, shared_f, False, gated=True) + linear(h, 1, False)  # shared_expert + its sigmoid gate
    elif fam.shared == "deepseek":
        shared_f = _count(c, "n_shared_experts", fam.shared_default) * f
        shared = mlp(h, shared_f, mlp_bias, gated=True)
    frame = attention + att.block_norms * norm_params(att, h)  # what a sparse and a dense block share
    dense_layers = fam.dense_layers(c, d.n_layers)
    n_dense = len(dense_layers)
    dense_f = c.size("intermediate_size") if n_dense else 0
    expert = sum(per_expert for _, per_expert in stacked)
    try:
        moe = MoeSpec(
            n_experts=n_experts, experts_per_token=top_k, expert_ffn_size=f, expert_params=expert,
            stacked_expert_tensors=stacked, router_params=router, shared_ffn_size=shared_f, shared_params=shared,
            n_dense_layers=n_dense, dense_ffn_size=dense_f, renormalise_top_k=read_flag(c, fam.renormalise_top_k),
            first_sparse_layer=n_dense if fam.mla else 0,  # DeepSeek's first_k_dense_replace layers lead
            dense_layers=dense_layers,
            fp32_routing_weights=fam.fp32_routing_weights, router_kind=fam.router_kind,
            expert_activation=fam.expert_activation, expert_bias=fam.expert_bias, **router_fields,
            dense_block_params=frame + (mlp(h, dense_f, mlp_bias, gated=True) if n_dense else 0),
        )
    except SpecError as e:  # e.g. num_experts_per_tok > the experts
        raise PlannerError("model", f"{c.model_type} config: {e}") from None
    return dict(fields, ffn_hidden_size=f, block_params=frame + router + n_experts * expert + shared, moe=moe)


BUILDERS: dict[str, Callable[[Cfg], dict]] = {model_type: read_moe for model_type in MOE_FAMILIES}
