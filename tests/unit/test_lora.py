"""calibration.lora: peft adapters where the cost model says they are, for every supported model type.

The cost model prices LoRA from ModelSpec.lora_shapes (the attention projections, lora_target_shapes, and under
all-linear the MLP's, mlp_linear_shapes); traces and calibration runs add the adapters with
calibration.lora.add_lora. Both must mean the same linears: for every small config of every supported Hugging
Face model type, peft's adapter parameters equal n_layers x lora_params_per_block(r) exactly, and nothing else
trains; under all-linear they are also what peft's own target_modules="all-linear" adapts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import dataclasses  # noqa: E402

from calibration.lora import add_lora, lora_target_names  # noqa: E402
from planner.models import from_hf_config  # noqa: E402
from tests.unit.test_models import SMALL_CONFIGS, build_on_meta  # noqa: E402

RANK = 4


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_adapters_are_the_linears_the_cost_model_prices(name):
    cfg = dict(SMALL_CONFIGS[name])
    spec = from_hf_config(dict(cfg))
    model = build_on_meta(cfg)
    classes = {type(m) for m in model.modules() if type(m).__name__ == spec.block_class}
    model = add_lora(model, spec, RANK, classes, "bf16")  # mixed: bf16 base, fp32 adapters
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == spec.n_layers * spec.lora_params_per_block(RANK)
    assert all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)


# where peft's "all-linear" adapts more than the blocks' attention and MLP: BERT's MLM head transform (a dense h x h
# outside the blocks), OPT's project_in / project_out (word_embed_proj_dim != hidden), GPT-2's cross-attention
ALL_LINEAR_BEYOND_THE_BLOCKS = {"bert", "bert-untied", "opt-proj-postln-nobias-untied", "gpt2-untied-inner-cross"}


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_all_linear_adapters_are_peft_all_linear(name):
    """Under lora_targets all-linear the MLP's linears too (Phi-3's gate_up_proj fused): add_lora's adapters are the
    priced count, and peft's own target_modules="all-linear" on the same model adapts as many parameters."""
    from peft import LoraConfig, get_peft_model

    cfg = dict(SMALL_CONFIGS[name])
    spec = from_hf_config(dict(cfg))
    if spec.moe is not None:
        pytest.skip("an MoE's all-linear: test_all_linear_on_an_moe_is_peft_all_linear")
    spec = dataclasses.replace(spec, lora_targets="all-linear")
    model = build_on_meta(cfg)
    classes = {type(m) for m in model.modules() if type(m).__name__ == spec.block_class}
    model = add_lora(model, spec, RANK, classes, "bf16")
    priced = spec.n_layers * spec.lora_params_per_block(RANK)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == priced
    peft = get_peft_model(build_on_meta(dict(SMALL_CONFIGS[name])), LoraConfig(r=RANK, target_modules="all-linear"))
    adapters = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
    assert (adapters > priced) if name in ALL_LINEAR_BEYOND_THE_BLOCKS else (adapters == priced)


def test_targets_are_found_by_shape_in_module_order():
    block = nn.Module()
    block.attn = nn.Module()
    block.attn.q, block.attn.k, block.attn.o = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 8)
    block.mlp = nn.Linear(8, 8)  # same shape as q and o: only the first two (8, 8) linears are taken
    assert lora_target_names(block, ((8, 8), (8, 4), (8, 8))) == ["attn.q", "attn.k", "attn.o"]
    with pytest.raises(ValueError, match=r"no linear of shape\(s\) \[\(8, 16\)\].*lora_target_shapes"):
        lora_target_names(block, ((8, 8), (8, 16)))


# one MoE block's router and stacked-expert adapters at rank 4 (benchmarks/peft_moe_lora.py part 1, docs/accuracy.md
# "peft's all-linear on an MoE"): r (h + E) + 2r E (h + 2f) + r E (f + h)
MOE_ADAPTERS = {"mixtral": 4 * (256 + 8) + 2 * 4 * 8 * (256 + 1024) + 4 * 8 * (512 + 256),          # 107,552
                "qwen3-moe": 4 * (256 + 16) + 2 * 4 * 16 * (256 + 256) + 4 * 16 * (128 + 256),   # 91,200
                # 46,112, and the shared expert's lora.Linears: gate, up, down 3r (h + fs) and shared_expert_gate r (h + 1)
                "qwen2-moe": 4 * (256 + 8) + 2 * 4 * 8 * (256 + 256) + 4 * 8 * (128 + 256) + 3 * 4 * (256 + 512)
                + 4 * (256 + 1)}


@pytest.mark.parametrize("arch", sorted(MOE_ADAPTERS))
def test_all_linear_on_an_moe_is_peft_all_linear(arch):
    """Mixtral, Qwen3-MoE and Qwen2-MoE under all-linear: the priced adapters are the attention's plus the router's and
    the stacked experts' (peft 0.22's transformers-5 conversion: ParamWrappers, gate_up at rank 2r; cost_models/
    moe_lora.py), 107,552 / 91,200 / 46,112 elements a block as benchmarks/peft_moe_lora.py counted, and Qwen2-MoE's
    shared expert's plain lora.Linears; add_lora (the trace's adapters) and peft's own get_peft_model(target_modules=
    "all-linear") adapt exactly that many."""
    from peft import LoraConfig, get_peft_model

    from benchmarks.memory_accuracy import arch_config

    spec = from_hf_config(arch_config(arch))
    wide = dataclasses.replace(spec, lora_targets="all-linear")
    assert wide.lora_params_per_block(RANK) - spec.lora_params_per_block(RANK) == MOE_ADAPTERS[arch]
    priced = spec.n_layers * wide.lora_params_per_block(RANK)
    model = build_on_meta(arch_config(arch))
    classes = {type(m) for m in model.modules() if type(m).__name__ == spec.block_class}
    model = add_lora(model, wide, RANK, classes, "bf16")
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == priced and all(p.dtype == torch.float32 for p in trainable)
    assert len(trainable) == spec.n_layers * len(wide.lora_tensor_elements(RANK))
    peft = get_peft_model(build_on_meta(arch_config(arch)), LoraConfig(r=RANK, target_modules="all-linear"))
    assert sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n) == priced


def test_all_linear_on_gpt_oss_is_refused():
    """gpt-oss has no transformers-5 conversion: peft's all-linear adapts its attention alone (its router and experts
    are no nn.Linear), which lora_targets attention prices; all-linear is refused in one line naming the field."""
    from peft import LoraConfig, get_peft_model

    from benchmarks.memory_accuracy import arch_config
    from cost_models.spec_values import SpecError

    spec = from_hf_config(arch_config("gpt-oss"))
    with pytest.raises(SpecError, match="lora_targets.*attention alone.*choose attention"):
        dataclasses.replace(spec, lora_targets="all-linear")
    peft = get_peft_model(build_on_meta(arch_config("gpt-oss")), LoraConfig(r=RANK, target_modules="all-linear"))
    adapters = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
    assert adapters == spec.n_layers * spec.lora_params_per_block(RANK)   # attention targets: q, k, v, o
