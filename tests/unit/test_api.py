"""The Python API: plan()/estimate() on presets and nn.Modules, and the real torch objects they return."""

import pytest
import torch
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from calibration.reference import build_reference, tiny_llama_spec
from planner import estimate, plan


def test_plan_on_a_module_counts_its_parameters_on_meta():
    spec = tiny_llama_spec()
    with torch.device("meta"):
        module = build_reference(spec)
    p = plan(module, gpus=2, gpu="a100-80gb", seq_len=128)
    assert p.model.n_params == sum(q.numel() for q in module.parameters()) == spec.n_params
    assert p.model.block_class == type(module.layers[0]).__name__
    kwargs = p.best.fsdp_kwargs(module)
    assert isinstance(kwargs["sharding_strategy"], ShardingStrategy)
    assert kwargs["sharding_strategy"].name == p.best.config.sharding.value
    assert isinstance(kwargs["mixed_precision"], MixedPrecision)
    assert kwargs["mixed_precision"].param_dtype is torch.bfloat16
    assert kwargs["mixed_precision"].reduce_dtype is torch.float32
    assert kwargs["backward_prefetch"] is BackwardPrefetch.BACKWARD_PRE
    assert isinstance(kwargs["auto_wrap_policy"], ModuleWrapPolicy)
    assert type(module.layers[0]) in kwargs["auto_wrap_policy"]._module_classes
    assert kwargs["use_orig_params"] is True


def test_preset_plan_kwargs_for_a_matching_module():
    # the block class named by the preset is found in a module built from the same architecture
    spec = tiny_llama_spec()
    with torch.device("meta"):
        module = build_reference(spec)
    c = estimate(spec, gpus=8, sharding="SHARD_GRAD_OP", precision="fp16", offload=True)
    kwargs = c.fsdp_kwargs(module)
    assert kwargs["sharding_strategy"] is ShardingStrategy.SHARD_GRAD_OP
    assert kwargs["mixed_precision"].param_dtype is torch.float16
    assert kwargs["cpu_offload"].offload_params is True


def test_plan_json_kwargs_match_the_torch_objects():
    spec = tiny_llama_spec()
    with torch.device("meta"):
        module = build_reference(spec)
    best = plan(module, gpus=2, seq_len=128).best
    described = best.to_dict()["fsdp_kwargs"]
    real = best.fsdp_kwargs(module)
    assert described["sharding_strategy"] == real["sharding_strategy"].name
    assert described["mixed_precision"]["param_dtype"] == str(real["mixed_precision"].param_dtype).removeprefix("torch.")
    assert described["auto_wrap_policy"] == {"ModuleWrapPolicy": [spec.block_class]}
    # the tiny model's pick on 2 GPUs is NO_SHARD since FSDP's copies around its collectives are priced
    # (cost_models/fsdp_copies.py: none without a shard group): FSDP2 spells it a (replicate 2, shard 1) mesh
    fs = best.to_dict()["fully_shard_kwargs"]
    assert described["sharding_strategy"] == "NO_SHARD"
    assert fs["mesh"] == {"shape": [2, 1], "dim_names": ["dp_replicate", "dp_shard"]}


def test_fsdp_kwargs_needs_the_module():
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match="module"):
        plan("llama2-7b", gpus=8).best.fsdp_kwargs(None)


def test_lora_kwargs_put_adapters_in_their_own_units():
    """FSDP1 flattens a unit into one flat parameter (one dtype, one gradient): with LoRA the policy must
    also wrap each trainable leaf, and each unit casts its inputs (peft casts to the sharded fp32 weight's
    dtype). The JSON description says the same."""
    from torch.distributed.fsdp.wrap import CustomPolicy

    spec = tiny_llama_spec()
    with torch.device("meta"):
        module = build_reference(spec)
    c = estimate(spec, gpus=2, precision="bf16", finetune="lora", lora_rank=4)
    kwargs = c.fsdp_kwargs(module)
    assert isinstance(kwargs["auto_wrap_policy"], CustomPolicy)
    assert kwargs["mixed_precision"].cast_forward_inputs is True
    described = c.to_dict()["fsdp_kwargs"]
    assert described["auto_wrap_policy"] == {"CustomPolicy": {"blocks": [spec.block_class], "trainable_leaves": True}}
    assert described["mixed_precision"]["cast_forward_inputs"] is True
    full = estimate(spec, gpus=2, precision="bf16").fsdp_kwargs(module)
    assert isinstance(full["auto_wrap_policy"], ModuleWrapPolicy) and full["mixed_precision"].cast_forward_inputs is False
