"""peft's target_modules="all-linear" on a mixture-of-experts block (issue 28): the router and the stacked experts.

peft 0.22 resolves all-linear on a model with a transformers v4 -> v5 checkpoint conversion (Mixtral, Qwen3-MoE:
utils/transformers_weight_conversion.py convert_peft_config_for_transformers, _convert_peft_config_moe) to the
attention's nn.Linear plus three target parameters per MoE block, each a ParamWrapper (tuners/lora/layer.py):

    tensor                                 lora_A            lora_B            elements
    router mlp.gate.weight (E, h)          (r, h)            (E, r)            r (h + E)
    mlp.experts gate_up_proj (E, 2f, h)    (2r E, h)         (2f, 2r E)        2r E (h + 2f)   (rank_pattern 2r)
    mlp.experts down_proj (E, h, f)        (r E, f)          (h, r E)          r E (f + h)

ParamWrapper.forward parametrizes the parameter for the wrapped module's forward: on a stacked (3-D) parameter with
one adapter _LoraFactorsProxy makes W_eff = baddbmm(W, B', A', alpha=s), a new tensor the size of the whole stack,
and grouped_mm saves it for its input gradient; the router's 2-D weight W + B @ A, saved by F.linear. So a block
saves, beside full fine-tuning's routed rows and the router's input (the experts and the router need weight
gradients: moe.mlp_bytes_per_token without LoRA's frozen-expert savings), p (3 E f h + E h) of merged weights, and
where the adapters are fp32 on a bf16 base, the factors cast to the base dtype (p r E (5f + 3h): lhs / rhs of both
stacks; under FSDP2's mixed precision the adapters are gathered in the compute dtype, so none). Measured equal to the
byte against peft itself: benchmarks/peft_moe_lora.py, docs/accuracy.md "peft's all-linear on an MoE". No lora_A
output is saved (a ParamWrapper adapts the weight, not the output). The ledger (memory_shape.ledger_shape) spreads a
block's merged weights over its tokens in its saved bytes, frees them with the MLP before the attention's backward,
and takes the MLP backward's moments from backward_moments below; the allocator walk replays it (lora_events.py,
dense blocks lora_dense_events.py, padded experts lora_expert_unit_events.py). Time: the experts' and router's weight
gradients for each token's k experts and the merges once per sequence (operators._formula_block_ops,
compute._training_flops).

Priced where that conversion exists: Mixtral, Qwen3-MoE, Qwen2-MoE, whose shared expert's nn.Linears (gate, up, down,
shared_expert_gate) get plain lora.Linear adapters (ModelSpec.lora_shapes: shared_expert_shapes; their lora_A outputs
and down's input saved, p T (fs + 4r), equal to peft's measured excess), and DeepSeek-V2 / V3, whose MLA projections and
shared experts take lora.Linear too (the shared experts' backward runs before the routed one: backward_moments). Dense
blocks (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers / decoder_sparse_step) take a dense model's all-linear:
their MLP's lora.Linear (model_spec.dense_block_spec; ModelSpec.lora_dense_delta in the ledger's counts). Counts equal
peft's get_peft_model to the element (tests/unit/test_moe_lora.py). Refused: gpt-oss has no conversion, so peft's
all-linear adapts its attention alone (lora_targets attention prices exactly that); Llama 4 has none either, and peft's
lora.Linear on its router (an nn.Linear returning a tuple) raises; OLMoE / GLM-4 MoE are read by the generic path (not
priced).
"""

from __future__ import annotations

from dataclasses import replace

from . import moe
from .feasibility import Refusal
from .moe_lora_targets import shared_expert_shapes, unpriced_reason
from .specs import BackwardMoment, ModelSpec

FSDP1_FAILURE = ("FSDP1 with all-linear LoRA on an MoE: the step fails with peft's router and stacked-expert "
                 "ParamWrappers (a 2-rank run, peft's wrap policy as verl's)")


def fsdp1_fails(model: ModelSpec, all_linear: bool) -> bool:
    """FSDP1 cannot run all-linear LoRA on an MoE: a 2-rank gloo run of the Mixtral small config (peft's
    get_peft_model, FSDP1 on CPU ranks) fails in its forward / backward under peft's fsdp_auto_wrap_policy (verl's
    is_lora policy is the same lambda: every leaf with a trainable weight a unit, and the blocks) with use_orig_params
    False ("Output 0 of View is a view ... modified inplace") and True ("inconsistent tensor size"), and with the blocks
    alone as units (use_orig_params True: the same view error); attention-only LoRA runs (benchmarks/peft_moe_fsdp1.py).
    FSDP2 runs it (the trace). all_linear: all-linear LoRA trains (verl's always does)."""
    return bool(all_linear) and model.moe is not None and not unpriced_reason(model)


def trains_all_linear(model: ModelSpec, training) -> bool:
    """All-linear LoRA trains: the training's adapters (finetune.adapters) on the model's all-linear targets
    (ModelSpec.lora_mlp) - fsdp1_fails' all_linear for a TrainingSpec (the trainers' and the doctor's rules)."""
    return bool(training.finetune.adapters and model.lora_mlp)


def fsdp1_refusals(model: ModelSpec, all_linear: bool, fsdp1: bool, field: str, fix: str) -> list:
    """fsdp1_fails as a refusal where the configuration is FSDP1 (fsdp1); all_linear: all-linear LoRA trains (verl's
    LoRA always does); field / fix: the caller's names (verl's strategy, the doctor's)."""
    if not (fsdp1 and fsdp1_fails(model, all_linear)):
        return []
    return [Refusal(field, "moe-all-linear-fsdp1", FSDP1_FAILURE, fix, priced=False)]


def selective_op_refused(model: ModelSpec, training) -> bool:
    """All-linear LoRA on an MoE: no selective op-level checkpointing, nor a dropout (refusals); the search leaves
    selective-op out for it."""
    return bool(training.finetune.adapters and model.lora_moe)


def refusals(model: ModelSpec, training, config) -> list:
    """What all-linear on an MoE cannot run: a dropout (peft's ParamWrapper raises, tuners/lora/layer.py: `does not work
    with lora_dropout != 0`: x cannot be factored out of the merged weight), the experts as FSDP units of their own
    (the search leaves them out too), and torchtitan's selective op-level checkpointing (torch/utils/checkpoint.py
    raises "Tensor cached during selective activation checkpoint has been mutated" in the backward of a block whose
    ParamWrappers merge under it: seen on real CPU tensors, a Mixtral block under
    calibration/checkpointing.selective_op_context, and in the trace tier)."""
    if not selective_op_refused(model, training):
        return []
    out = []
    if training.adapter_dropout > 0:
        out.append(Refusal("lora_dropout", "moe-all-linear-dropout", f"lora_dropout {training.adapter_dropout} with "
                           "all-linear on an MoE: peft's ParamWrapper (the router and stacked experts) raises for a "
                           "dropout above 0", "use --lora-dropout 0, or --lora-targets attention", priced=False))
    if config.selective_op_ac:
        out.append(Refusal("activation_checkpointing", "moe-all-linear-selective-op", "selective-op checkpointing "
                           "with all-linear on an MoE: torch's selective checkpoint raises in the backward (a cached "
                           "tensor mutated under peft's merged expert weights)",
                           "use --activation-checkpointing full or every-k, or --lora-targets attention",
                           priced=False))
    if config.expert_units:
        out.append(Refusal("expert_units", "moe-all-linear-expert-units", "experts as FSDP units of their own with "
                           "all-linear on an MoE: peft's ParamWrapper registers its merged-weight parametrization on "
                           "the experts module before that module's FSDP2 pre-forward gathers it, so baddbmm gets the "
                           "sharded DTensor (the trace tier: 'aten.baddbmm.default got mixed torch.Tensor and "
                           "DTensor'; peft 0.22 tuners/lora/layer.py ParamWrapper.forward -> _activate_lora)",
                           "leave expert_units off, or use --lora-targets attention", priced=False))
    return out


# the MoE MLP's products (operators._mlp_matmuls) whose weights train through W_eff under all-linear: each token's
# k experts and the router compute a weight gradient (grouped_mm's, F.linear's) that baddbmm's backward reduces
TRAINED_MATMULS = ("router", "experts gate|up", "experts down")


def merge_products(model: ModelSpec, rank: int) -> list[tuple[str, int, int, int, int]]:
    """The merges one forward runs, as (name, rows, k, n, count) products y (n) = x (k) @ W (k x n) on `rows` rows
    each: baddbmm's B' (E, out, r') @ A' (E, r', in) per stack (gate_up r' = 2r, down r) and the router's
    B (E, r) @ A (r, h); their backward makes both factors' gradients (two products each)."""
    E, h, f = model.moe.n_experts, model.hidden_size, model.moe.expert_ffn_size
    return [("lora merge gate|up", 2 * f, 2 * rank, h, E), ("lora merge down", h, rank, f, E),
            ("lora merge router", E, rank, h, 1)]


def trained_flops_per_token(model: ModelSpec, rank: int, seq_len: int) -> float:
    """FLOPs per token one sparse block adds under all-linear over LoRA's frozen MoE MLP: the weight gradients of
    each token's k experts and the router (2 a weight), and the merges (forward 2, backward 4 a product element)
    once per sequence (a micro-batch of several shares them: this counts micro-batch 1)."""
    spec = model.moe
    merges = sum(2 * rows * k * n * count for _, rows, k, n, count in merge_products(model, rank))
    return 2 * (spec.router_params + spec.experts_per_token * spec.expert_params) + 3 * merges / seq_len


def merged_weight_bytes(model: ModelSpec, base_bytes: int, adapter_bytes: int, rank: int) -> int:
    """What one MoE block saves beyond full fine-tuning's tensors: the merged stacks and router weight (base dtype),
    and the factors' casts where the adapters are kept in another dtype (peft's fp32 adapters on a bf16 base)."""
    E, h, f = model.moe.n_experts, model.hidden_size, model.moe.expert_ffn_size
    cast = rank * E * (5 * f + 3 * h) if adapter_bytes != base_bytes else 0
    return base_bytes * (3 * E * f * h + E * h + cast)


def merge_delta_elements(model: ModelSpec) -> int:
    """peft's merge_adapter on the stacked experts (ParamWrapper.merge, verl's model.lora.merge): each stack's delta
    B' @ A' made whole (one bmm output of E x out x in) and added in place, one stack at a time: the largest, gate_up's
    E 2f h (measured on a Mixtral model: its merge's peak is that one bmm output, 8,388,608 B in fp32)."""
    return model.moe.n_experts * 2 * model.moe.expert_ffn_size * model.hidden_size


def merged_bytes_per_token(model: ModelSpec, base_bytes: int, adapter_bytes: int, rank: int, tokens: int) -> int:
    """merged_weight_bytes spread over a block's tokens (the ledger's saved bytes per token), 0 but under all-linear
    on an MoE with adapters (rank > 0)."""
    if not (rank and model.lora_moe):
        return 0
    return -(-merged_weight_bytes(model, base_bytes, adapter_bytes, rank) // tokens)


def backward_moments(model: ModelSpec, c: int, recomputed: bool = False, rank: int = 0) -> tuple[BackwardMoment, ...]:
    """The MoE MLP backward's moments under all-linear: moe.backward_moments' with the experts training (their
    gathered inputs saved), but no weight gradient accumulates (the block's adapter gradients are tiny): each
    grouped_mm backward makes W_eff's gradient, a stack-sized transient its baddbmm backward turns into the factors'
    gradients and frees, and each saved W_eff goes with its grouped_mm's node (measured op by op on a Mixtral block,
    torch dispatch: benchmarks/peft_moe_lora.py's blocks):
    - down's grouped_mm backward: the incoming gradient (c h, the inverse permutation freed), W_eff's gradient
      (E h f) and the rows' gradient (k f);
    - the activation's backward: down's W_eff and its gradient gone (- E h f);
    - gate_up's grouped_mm backward: its W_eff's gradient (E 2f h), down's W_eff gone (+ E h f net);
    - the moments after the routed experts' backward (the norm's; Qwen2-MoE's gated shared expert's, whose lora.Linear
      adapters' gradients are negligible): every merged weight gone (- (3 E f h + E h)).
    (A gated shared expert's output gradient, c h, waits through the routed moments: moe.backward_moments.)
    DeepSeek's shared experts ran after the routed ones, so their backward comes first: full fine-tuning's dense-MLP
    moment (their lora.Linear adapters save the inputs the weights would: down's lora_A its input) without the weight
    gradient and with down's lora_A output (rank r: the adapters') gone; by the routed moments their saved tensors,
    the three lora_A outputs included, are gone (moe.backward_moments subtracts the rest)."""
    E, h, f, k = model.moe.n_experts, model.hidden_size, model.moe.expert_ffn_size, model.moe.experts_per_token
    full = moe.backward_moments(model, c, lora=False, recomputed=recomputed)
    first = [m for m in full if not m.experts_done]
    unpermute, activation, up = first[0], first[-2], first[-1]
    deepseek = [] if model.shared_expert_gated else first[1:-2]  # DeepSeek's shared experts' moment, if any
    waiting = c * h if model.shared_expert_gated else 0  # Qwen's gated shared output's gradient
    less = len(shared_expert_shapes(model)) * rank * c if deepseek else 0  # their lora_A outputs, freed with them
    shared = [replace(m, grad_bytes=0, per_token=m.per_token - rank * c) for m in deepseek]
    shared_saved = moe._shared_expert_bytes(model, c, False) if deepseek else 0
    down = BackwardMoment(0, E * h * f * c, c * h + k * c * f - moe.INDEX_BYTES * k + waiting - shared_saved, 0)
    routed = [replace(unpermute, grad_bytes=0, const_bytes=0), down,
              replace(activation, grad_bytes=0, const_bytes=-E * h * f * c),
              replace(up, grad_bytes=0, const_bytes=E * h * f * c)]
    routed += [replace(m, grad_bytes=0, const_bytes=-(3 * E * f * h + E * h) * c) for m in full if m.experts_done]
    return tuple(shared + [replace(m, per_token=m.per_token - less) for m in routed])
