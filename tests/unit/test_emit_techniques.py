"""planner.emit for selective-op checkpointing, per-block compile, Float8 + FP8 all-gather and an int
reshard_after_forward: each dialect's code does what calibration.apply does, or says what it cannot."""

from __future__ import annotations

import ast
import os
from unittest import mock

import pytest
import torch

from calibration.checkpointing import SELECTIVE_OP_SAVE
from calibration.reference import Block
from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec
from planner.emit import (emit_accelerate, emit_fsdp1, emit_fsdp2, emit_lightning, emit_slurm, emit_torchrun)
from planner.models import load_preset
from tests.unit.test_apply import SPEC, fake_world  # noqa: F401 (the fixture)
from tests.unit.test_apply_sac_compile_fp8 import SDPA_CPU, _one_block_step

H100 = GpuSpec(id="h100-sxm", name="H100 SXM", memory_bytes=80 * 2**30, hbm_bytes_per_s=3.35e12,
               peak_flops={"bf16": 989e12, "fp8": 1979e12}, intra_node_bus_bytes_per_s=450e9)
TWO_NODES = ClusterSpec(gpu=H100, n_gpus=8, gpus_per_node=4, internode_bytes_per_s=50e9)
ALL = FsdpConfig(ac_every="selective-op", compile=True, float8=True, fp8_all_gather=True, reshard_after_forward=4)
TECHNIQUES = [
    FsdpConfig(ac_every="selective-op"),
    FsdpConfig(compile=True),
    FsdpConfig(compile=True, ac_every=2),
    FsdpConfig(float8=True),
    FsdpConfig(float8=True, fp8_all_gather=True),
    FsdpConfig(reshard_after_forward=4),
    FsdpConfig(sharding="HYBRID_SHARD", reshard_after_forward=2),
    ALL,
]


def _namespace(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "<emitted>", "exec"), namespace)
    return namespace


def _strip_float8(code: str) -> str:
    """The emitted code without torchao (absent here): Float8 is GPU-only and checked in tests/gpu."""
    return code.replace("from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n", "")


@pytest.mark.parametrize("config", TECHNIQUES, ids=lambda c: c.to_dict().__repr__())
@pytest.mark.parametrize("emit", [emit_fsdp1, emit_fsdp2])
def test_emitted_code_parses(emit, config):
    ast.parse(emit(config, SPEC, TWO_NODES))  # FSDP1: what it cannot do is a note, not code


def test_emitted_selective_op_policy_is_apply_s():
    """The snippet's module-level policy: the same saved ops as calibration.apply, and on a real block the
    same ops rerun in backward (3 of the 7 matmuls, no SDPA)."""
    namespace = _namespace(emit_fsdp2(FsdpConfig(ac_every="selective-op"), SPEC, TWO_NODES))
    assert namespace["_SAVE"] == SELECTIVE_OP_SAVE
    import tests.unit.test_apply_sac_compile_fp8 as apply_tests

    with mock.patch.object(apply_tests, "selective_op_context", namespace["selective_op_context"]):
        emitted, _, _ = _one_block_step("sac")
    ours, _, _ = _one_block_step("sac")
    plain, _, _ = _one_block_step("none")
    assert emitted == ours and emitted["mm"] - plain["mm"] == 3 and SDPA_CPU not in emitted


def test_emitted_fsdp2_applies_policy_compile_and_the_int_reshard(fake_world):
    """Run the emitted FSDP2 snippet on a fake 8-rank group: every block wrapped with the selective-op
    policy, compiled in place, its post-forward mesh groups of 4; the root keeps the whole group."""
    config = FsdpConfig(ac_every="selective-op", compile=True, reshard_after_forward=4)
    code = emit_fsdp2(config, SPEC, TWO_NODES)
    assert "fully_shard(block, **block_kwargs)" in code and "fully_shard(model, **fsdp_kwargs)" in code
    from calibration.reference import build_reference, tiny_llama_spec

    with torch.device("meta"):
        model = build_reference(tiny_llama_spec(n_layers=2))
    _namespace(code)["apply_fsdp"](model, device="cpu")
    assert all(layer.checkpoint_fn.keywords["context_fn"].__name__ == "selective_op_context" for layer in model.layers)
    assert all(layer._compiled_call_impl is not None for layer in model.layers) and model._compiled_call_impl is None
    assert model.layers[0]._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info.shard_mesh_size == 4
    assert model._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info.shard_mesh_size == 8


def test_emitted_float8_converts_only_block_linears_with_dims_of_16(fake_world):
    """The snippet's module_filter_fn, run against a fake torchao: block linears whose dims are multiples of
    16 convert, the head and odd-sized linears do not; the FP8 all-gather flag is the plan's."""
    from calibration.reference import build_reference, tiny_llama_spec

    model = build_reference(tiny_llama_spec(n_layers=2))
    model.layers[1].mlp.down_proj = torch.nn.Linear(model.layers[1].mlp.down_proj.in_features, 24, bias=False)
    calls = {}

    def convert(model, config, module_filter_fn):
        calls["all_gather"] = config
        calls["converted"] = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                              and module_filter_fn(m, n)]

    code = _strip_float8(emit_fsdp2(FsdpConfig(float8=True, fp8_all_gather=True), SPEC, TWO_NODES))
    namespace = _namespace(code)
    namespace.update(convert_to_float8_training=convert, Float8LinearConfig=lambda **kw: kw,
                     fully_shard=lambda module, **kw: module, init_device_mesh=lambda *a, **k: None)
    namespace["apply_fsdp"](model, device="cpu")
    assert calls["all_gather"] == {"enable_fsdp_float8_all_gather": True}
    assert "lm_head" not in calls["converted"] and "layers.1.mlp.down_proj" not in calls["converted"]
    assert len(calls["converted"]) == 2 * 7 - 1  # q k v o gate up down per block, less the 24-wide one


def test_fsdp2_notes_precompute_and_fsdp1_says_what_it_cannot():
    assert "precompute_float8_dynamic_scale_for_fsdp(model)" in emit_fsdp2(ALL, SPEC, TWO_NODES)
    fsdp1 = emit_fsdp1(ALL, SPEC, TWO_NODES)
    assert "enable_fsdp_float8_all_gather=False" in fsdp1  # FSDP1 gathers in the compute dtype
    assert "which FSDP1 cannot: it gathers them in the compute dtype" in fsdp1
    assert "reshard_after_forward), which FSDP1 cannot" in fsdp1
    assert "context_fn=selective_op_context" in fsdp1 and "inner.compile()" in fsdp1


def test_options_off_emit_what_they_did_before():
    for emit in (emit_fsdp1, emit_fsdp2, emit_accelerate, emit_lightning, emit_torchrun, emit_slurm):
        text = emit(FsdpConfig(ac_every=2), SPEC, TWO_NODES)
        for word in ("selective", "compile()", "torchao", "fp8", "block_kwargs", "dynamo_config", "Float8"):
            assert word not in text, (emit.__name__, word)


def test_accelerate_regional_compile_and_torchao_fp8_load_with_accelerate(tmp_path, load_accelerate):
    spec = load_preset("llama3-8b")
    text = emit_accelerate(ALL, spec, TWO_NODES, fsdp_version=2)
    assert "mixed_precision: fp8" in text and "selective-op" in text and "cannot set" in text
    with mock.patch("accelerate.utils.launch.is_fp8_available", return_value=True):  # torchao is absent here
        loaded, env, _, _ = load_accelerate(tmp_path, text, ["--main_process_ip", "10.0.0.1"])
    assert loaded.mixed_precision == "fp8" and loaded.fp8_config["backend"] == "AO"
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
    assert env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] == "True"
    assert env["ACCELERATE_FP8_BACKEND"] == "AO" and env["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] == "True"
    assert env["FSDP_ACTIVATION_CHECKPOINTING"] == "true"  # whole blocks: what accelerate can do
    fsdp1 = emit_accelerate(ALL, spec, TWO_NODES, fsdp_version=1)
    assert "enable_fsdp_float8_all_gather" not in fsdp1 and "FSDP2 only (use --emit accelerate-fsdp2)" in fsdp1


def test_lightning_and_launchers_say_what_the_script_must_do():
    lightning = emit_lightning(ALL, SPEC, TWO_NODES)
    assert "activation_checkpointing_policy={Block}" in lightning and "selective_op_context" in lightning
    assert "block.compile()" in lightning and "convert_to_float8_training" in lightning
    assert "ModelParallelStrategy" in lightning
    for emit in (emit_torchrun, emit_slurm):
        text = emit(ALL, SPEC, TWO_NODES)
        assert "torch.compile per block, Float8 linears with FP8 all-gather, blocks resharded to 4" in text
        assert "--emit fsdp2 writes that code" in text


def test_emit_does_not_import_torch_for_the_techniques():
    import subprocess
    import sys

    code = ("import sys; from planner.emit import emit_fsdp2; from planner.models import load_preset; "
            "from planner.hardware import make_cluster; from cost_models.specs import FsdpConfig; "
            "emit_fsdp2(FsdpConfig(ac_every='selective-op', compile=True), load_preset('llama3-8b'), make_cluster(8)); "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[2])})
    assert r.stdout.strip() == "False", r.stderr


def test_compiled_loss_note_is_the_models_own_loss():
    # The note the dialects print with compile gives the loss to compile outside the model; run as written it
    # equals a Hugging Face model's own (next-token, shifted) loss.
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from planner.emit.code import techniques as tech

    expression = tech.COMPILED_LOSS_NOTE.split("loss_fn = torch.compile(")[1].rsplit("), applied", 1)[0]
    loss_fn = eval(expression, {"torch": torch})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=500))
    ids = torch.randint(0, 500, (2, 33))
    assert loss_fn(model(ids).logits, ids).item() == pytest.approx(model(ids, labels=ids).loss.item(), rel=1e-6)
