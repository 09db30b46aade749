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
        pytest.skip("all-linear is priced for dense blocks")
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


@pytest.mark.parametrize("arch, beyond", [("mixtral", True), ("qwen3-moe", True), ("gpt-oss", False)])
def test_all_linear_on_an_moe_is_refused(arch, beyond):
    """Why all-linear stays refused on an MoE (ModelSpec.__post_init__): transformers 5 keeps the routed experts
    stacked and the router's weight as parameters, yet peft 0.22's all-linear adapts them too on Mixtral and Qwen3-MoE
    (the router as a linear, the stacked gate_up / down through its parameter wrapper: memory_accuracy.py's configs,
    rank 4, ~17x the attention's adapters), not on gpt-oss (attention alone). Pricing those adapters is open."""
    from peft import LoraConfig, get_peft_model

    from benchmarks.memory_accuracy import arch_config
    from cost_models.spec_values import SpecError

    spec = from_hf_config(arch_config(arch))
    with pytest.raises(SpecError, match="lora_targets"):
        dataclasses.replace(spec, lora_targets="all-linear")
    peft = get_peft_model(build_on_meta(arch_config(arch)), LoraConfig(r=RANK, target_modules="all-linear"))
    adapters = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
    attention = spec.n_layers * spec.lora_params_per_block(RANK)   # attention targets: q, k, v, o
    assert (adapters > 2 * attention) if beyond else (adapters == attention)
