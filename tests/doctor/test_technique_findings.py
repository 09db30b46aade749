"""Doctor findings and setup reading for Float8, the FP8 all-gather, an int reshard_after_forward, torch.compile
with dynamic shapes and selective-op checkpointing: a setup that triggers each and one that does not."""

import pytest
import yaml

from cost_models.specs import FsdpConfig
from planner.doctor import check
from planner.doctor.rules_cost import kv_cache_extra_bytes
from planner.emit import emit_accelerate
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.doctor.readers import from_accelerate, from_kwargs
from tests.doctor.test_findings import GOOD

FSDP2 = {"reshard_after_forward": True, "mp_policy": GOOD["mixed_precision"]}
ACCELERATE = {"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 16, "num_machines": 2,
              "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}}


def codes(setup, gpus=16, gpu="h100-80gb", model="llama3-8b", **kw):
    return {f.code: f.severity for f in check(setup, model, gpus, gpu=gpu, seq_len=2048, **kw).findings}


def test_float8_on_a_gpu_without_fp8():
    setup = from_kwargs({**FSDP2, "float8": True, "fp8_all_gather": True})
    assert setup.config.float8 and setup.config.fp8_all_gather
    assert codes(setup, gpu="a100-80gb")["float8-without-fp8-tensor-cores"] == "error"
    assert "float8-without-fp8-tensor-cores" not in codes(setup)  # h100: FP8 tensor cores
    assert "float8-without-fp8-tensor-cores" not in codes(from_kwargs(FSDP2), gpu="a100-80gb")


def test_float8_without_bf16_compute():
    fp32 = from_kwargs({"reshard_after_forward": True, "float8": True})  # no mp_policy: fp32 compute
    assert codes(fp32)["float8-without-bf16-compute"] == "warning"
    assert "float8-without-bf16-compute" not in codes(from_kwargs({**FSDP2, "float8": True}))


def test_fp8_all_gather_outside_fsdp2():
    fsdp1 = from_kwargs({**GOOD, "float8": True, "fp8_all_gather": True})
    assert fsdp1.fsdp_version == 1
    assert codes(fsdp1)["fp8-all-gather-needs-fsdp2"] == "error"
    assert "fp8-all-gather-needs-fsdp2" not in codes(from_kwargs({**FSDP2, "float8": True, "fp8_all_gather": True}))
    assert "fp8-all-gather-needs-fsdp2" not in codes(from_kwargs({**GOOD, "float8": True}))


@pytest.mark.parametrize("group,code,severity", [
    (3, "reshard-after-forward-not-a-divisor", "error"),     # 16 % 3
    (32, "reshard-after-forward-not-a-divisor", "error"),    # larger than the shard group
    (16, "reshard-after-forward-is-the-whole-group", "advice"),
])
def test_int_reshard_after_forward_against_the_shard_group(group, code, severity):
    setup = from_kwargs({**FSDP2, "reshard_after_forward": group})
    assert setup.config.reshard_after_forward == group and setup.config.sharding.value == "FULL_SHARD"
    assert codes(setup)[code] == severity
    node = codes(from_kwargs({**FSDP2, "reshard_after_forward": 8}))  # the node: the intended use
    assert not {c for c in node if c.startswith("reshard-after-forward")}


def test_compile_with_dynamic_shapes():
    dynamic = {**ACCELERATE, "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_dynamic": True}}
    setup = from_accelerate(dynamic)
    assert setup.config.compile and setup.compile_dynamic
    assert codes(setup)["compile-with-dynamic-shapes"] == "warning"
    static = from_accelerate({**ACCELERATE, "dynamo_config": {"dynamo_backend": "INDUCTOR",
                                                              "dynamo_use_regional_compilation": True}})
    assert static.config.compile and "compile-with-dynamic-shapes" not in codes(static)
    assert codes(from_kwargs({**FSDP2, "compile": {"dynamic": True}}))["compile-with-dynamic-shapes"] == "warning"
    assert "compile-with-dynamic-shapes" not in codes(from_kwargs({**FSDP2, "compile": True}))
    assert not from_accelerate(ACCELERATE).config.compile  # no dynamo_config: no compile


def test_selective_op_in_an_accelerate_config():
    data = {**ACCELERATE, "fsdp_config": {**ACCELERATE["fsdp_config"], "fsdp_activation_checkpointing": "selective-op"}}
    setup = from_accelerate(data)
    assert setup.config.selective_op_ac and setup.config.activation_checkpointing == "selective-op"
    assert codes(setup)["selective-op-not-expressible"] == "error"
    # in code (a kwargs file of the training script's choices) it is expressible
    kwargs = from_kwargs({**FSDP2, "activation_checkpointing": "selective-op"})
    assert kwargs.config.selective_op_ac and "selective-op-not-expressible" not in codes(kwargs)


def test_emitted_accelerate_reads_back_with_compile_float8_and_the_fp8_all_gather():
    spec, cluster = load_preset("llama3-8b"), make_cluster(16, gpu="h100-80gb")
    config = FsdpConfig(compile=True, float8=True, fp8_all_gather=True, ac_every=1)
    back = from_accelerate(yaml.safe_load(emit_accelerate(config, spec, cluster, fsdp_version=2))).config
    assert (back.compile, back.float8, back.fp8_all_gather, back.ac_every) == (True, True, True, 1)
    fsdp1 = from_accelerate(yaml.safe_load(emit_accelerate(config, spec, cluster, fsdp_version=1))).config
    assert (fsdp1.float8, fsdp1.fp8_all_gather) == (True, False)  # FSDP1 gathers in the compute dtype


def test_kv_cache_under_selective_op_counts_every_block():
    spec = load_preset("llama3-8b")
    every = kv_cache_extra_bytes(spec, FsdpConfig(ac_every=1), 2048)
    assert kv_cache_extra_bytes(spec, FsdpConfig(ac_every="selective-op"), 2048) == every > 0
    assert kv_cache_extra_bytes(spec, FsdpConfig(ac_every=2), 2048) == every // 2
