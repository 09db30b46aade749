"""The linears an RL actor's LoRA adapts, as verl names them (actor_rollout_ref.model.target_modules, default
"all-linear"; TRL: peft's LoraConfig target_modules), priced as the single-run planner's lora_targets
(ModelSpec.lora_targets): all-linear (every block linear: the MLP's, an MoE's router and stacked experts too) or
attention (the attention projections alone).

Where verl 0.9.1 sends the value: PEFT's LoraConfig as is (workers/engine/fsdp/transformer_impl.py _build_lora_module:
"target_modules", "exclude_modules"), so the actor trains exactly those adapters; SGLang's lora_target_modules
(sglang_rollout/utils.py sglang_lora_target_modules: "all-linear" -> ["all"], a list as is, a regex string raises),
which sizes its LoRA pool (rollout_lora_sglang.py sglang_target_modules); vLLM gets none (vllm_rollout/
vllm_async_server.py launch_server: enable_lora, max_loras, max_lora_rank only), and wraps every linear whatever the
adapter targets (rollout_lora.py): its buffers do not depend on it. verl's own check (workers/config/model.py
HFModelConfig.__post_init__) takes a string or a list of strings.

A list reads as attention where its names (the last dotted part, as PEFT matches a key's suffix: verl utils/model.py
check_target_modules) are exactly the model's attention projections; any other list, or a string other than
all-linear (PEFT would read it as a regex), is refused: one line naming the field and the choices.
"""

from __future__ import annotations

import dataclasses

from .model_spec import FUSED_GATE_UP_FAMILIES, ModelSpec
from .spec_values import LoraTargets, SpecError, parse_enum

FIELD = "lora_targets"
ALL_LINEAR = LoraTargets.ALL_LINEAR.value
# transformers' attention projections by layout: q, k, v, o apart; Phi-3's fused qkv_proj (FUSED_GATE_UP_FAMILIES
# fuse both); DeepSeek's MLA (DeepseekV2Attention / V3: q_a_proj, q_b_proj, or V2-Lite's q_proj without q_lora_rank)
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
FUSED_QKV = ("qkv_proj", "o_proj")
MLA_KV = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def attention_modules(model: ModelSpec) -> tuple[str, ...]:
    """transformers' module names of the attention projections ModelSpec.lora_target_shapes prices."""
    if model.kv_lora_rank:
        return (("q_a_proj", "q_b_proj") if model.q_lora_rank else ("q_proj",)) + MLA_KV
    if model.family in FUSED_GATE_UP_FAMILIES:
        return FUSED_QKV
    if len(model.lora_target_shapes) == len(QKVO) and model.family != "phi":   # Phi-2: its o is named dense
        return QKVO
    raise SpecError(FIELD, f"attention: {model.family}'s attention module names are not read here (q_proj, k_proj, "
                           "v_proj, o_proj; Phi-3's qkv_proj; DeepSeek's MLA); choose one of: all-linear")


def module_names(value) -> str | tuple[str, ...]:
    """verl's target_modules as written (a string; a list, or a Hydra list '[q_proj,k_proj]' / 'q_proj,k_proj'): the
    string "all-linear" / "attention", else the names' last dotted parts."""
    if isinstance(value, str):
        text = value.strip().strip("'\"")
        if not (text.startswith("[") or "," in text):
            return text
        value = text.strip("[]").split(",")
    return tuple(str(n).strip().strip("'\" ").rpartition(".")[2] for n in value if str(n).strip())


def lora_targets(value, model: ModelSpec) -> LoraTargets:
    """The priced targets of verl's target_modules (module docstring); SpecError naming lora_targets (the request's
    field) otherwise."""
    names = module_names(value)
    if isinstance(names, str):
        if names.lower() in (ALL_LINEAR, LoraTargets.ATTENTION.value):
            return parse_enum(LoraTargets, names, FIELD)
        shown = repr(names)
    else:
        if set(names) == set(attention_modules(model)):
            return LoraTargets.ATTENTION
        shown = "[" + ",".join(names) + "]"
    raise SpecError(FIELD, f"{shown} is not priced; choose one of: all-linear, attention (the attention projections "
                           f"alone: [{','.join(attention_modules(model))}] for {model.name})")


def verl_value(targets: LoraTargets, model: ModelSpec) -> str | list[str]:
    """What verl passes on for the targets: "all-linear", or the attention projections' names."""
    return ALL_LINEAR if targets is LoraTargets.ALL_LINEAR else list(attention_modules(model))


def lora_model(model: ModelSpec, settings) -> ModelSpec:
    """The model as the actor trains it (settings: rl_settings.RlSettings): LoRA on its target_modules, the model
    itself in full fine-tuning. Where all-linear is not priced (moe_lora_targets.unpriced_reason: Llama 4,
    gpt-oss) the refusal names lora_targets."""
    if not settings.lora or model.lora_targets is settings.lora_targets:
        return model
    try:
        return dataclasses.replace(model, lora_targets=settings.lora_targets)
    except SpecError as refused:
        raise SpecError(FIELD, f"{ALL_LINEAR}: {str(refused).removeprefix(refused.field + ': ')} "
                               f"(--lora-targets attention; verl: model.target_modules="
                               f"[{','.join(attention_modules(model))}])") from None
