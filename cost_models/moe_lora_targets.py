"""Which linears peft's target_modules="all-linear" adapts on a mixture-of-experts model, and where it is priced:
the counts ModelSpec reads (its lora_shapes, lora_tensor_elements and its check). A leaf module: model_spec imports it,
so it imports nothing of cost_models, not even for annotations: `model` is a ModelSpec (the memory and time of
those adapters: moe_lora.py)."""

from __future__ import annotations

# families whose routed experts peft's transformers-5 conversion adapts (get_checkpoint_conversion_mapping) and whose
# MoE block the ledger prices whole (Qwen2-MoE's gated shared expert; DeepSeek's shared experts and MLA; the dense
# blocks of DeepSeek's first_k_dense_replace and Qwen's mlp_only_layers / decoder_sparse_step, a dense model's
# all-linear: model_spec.dense_block_spec)
PRICED_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3")


def is_llama4(model) -> bool:
    """Llama 4's text blocks (transformers' Llama4TextDecoderLayer: interleaved MoE and dense blocks, a shared expert
    its config names by no key of its own), read by the generic path (family "generic")."""
    return model.block_class.startswith("Llama4")


def unpriced_reason(model) -> str:
    """Why all-linear LoRA on this MoE is refused ("" where it is priced)."""
    if model.family == "gpt_oss":
        return ("peft 0.22's all-linear adapts gpt-oss's attention alone (its router and experts are no nn.Linear and "
                "have no transformers-5 conversion); choose attention, which prices exactly that")
    if is_llama4(model):
        return ("peft 0.22's all-linear fails on Llama 4: its router (Llama4Router, an nn.Linear) gets a lora.Linear, "
                "whose forward reads the base layer's tuple output as a tensor (peft tuners/lora/layer.py:1192 "
                "'tuple' object has no attribute 'dtype'); choose attention")
    if model.family not in PRICED_FAMILIES:
        return (f"all-linear on an MoE is priced for {', '.join(PRICED_FAMILIES)} (peft's router and stacked-expert "
                f"adapters); {model.family} is not; choose attention")
    if not model.gated_mlp:
        return "all-linear on an MoE is priced for blocks of routed gated experts; choose attention"
    return ""


def shared_expert_shapes(model) -> tuple[tuple[int, int], ...]:
    """(in, out) of a shared expert's nn.Linears, which all-linear adapts with plain lora.Linear (Qwen2-MoE: gate, up,
    down, and shared_expert_gate h -> 1): their lora_A outputs and down's input saved, as a dense MLP's adapters."""
    fs, h = model.moe.shared_ffn_size, model.hidden_size
    if not fs:
        return ()
    return ((h, fs), (h, fs), (fs, h)) + (((h, 1),) if model.shared_expert_gated else ())


def adapter_tensor_elements(model, rank: int) -> list[int]:
    """Elements of each adapter tensor of one MoE block (lora_A, lora_B): the router's, gate_up's, down's."""
    E, h, f = model.moe.n_experts, model.hidden_size, model.moe.expert_ffn_size
    return [rank * h, E * rank, 2 * rank * E * h, 2 * f * 2 * rank * E, rank * E * f, h * rank * E]
