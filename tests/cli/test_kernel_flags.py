"""The kernel knobs (issue 26 items 2 and 5): --norm-kernel, --rope-kernel, --swiglu-kernel, --loss-kernel, --liger
(HF's use_liger_kernel: the four Liger kernels at once, each flag overriding its own) and --compile-scope
(FsdpConfig.compile_loss). The defaults are eager: an estimate without them is the estimate with them spelled
out, byte for byte; a bad value is one line naming the field and the choices, exit 2."""

import json

import pytest

from cost_models.specs import FsdpConfig, Kernel, LossKernel, SpecError
from planner.api import estimate
from tests.cli.test_float_flags import invoke

BASE = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "4096"]


def test_the_defaults_are_eager_and_absent_from_the_config():
    config = FsdpConfig()
    assert (config.norm_kernel, config.rope_kernel, config.swiglu_kernel) == (Kernel.EAGER,) * 3
    assert config.loss_kernel is LossKernel.EAGER
    assert not {"norm_kernel", "rope_kernel", "swiglu_kernel", "loss_kernel"} & set(config.to_dict())
    spelled = FsdpConfig(norm_kernel="eager", rope_kernel="EAGER", swiglu_kernel=Kernel.EAGER, loss_kernel="eager")
    assert spelled == config


def test_spelled_out_eager_kernels_price_the_default_estimate():
    default = estimate("llama3-8b", 8, gpu="h100-80gb", seq_len=4096)
    spelled = estimate("llama3-8b", 8, gpu="h100-80gb", seq_len=4096, norm_kernel="eager", rope_kernel="eager",
                       swiglu_kernel="eager", loss_kernel="eager", liger=False)
    assert spelled.memory.peak_reserved_bytes == default.memory.peak_reserved_bytes
    assert spelled.time.step_s == default.time.step_s


def test_liger_sets_the_four_kernels_and_a_flag_overrides_its_own(capsys):
    code, out, err = invoke([*BASE, "--liger", "--norm-kernel", "eager", "--format", "json"], capsys)
    assert code == 0, err
    config = json.loads(out)["config"]
    assert (config.get("norm_kernel"), config["rope_kernel"], config["swiglu_kernel"], config["loss_kernel"]) == (
        None, "liger", "liger", "liger")
    code, out, err = invoke([*BASE, "--rope-kernel", "liger", "--loss-kernel", "liger", "--format", "json"], capsys)
    assert code == 0, err
    config = json.loads(out)["config"]
    assert (config.get("norm_kernel"), config["rope_kernel"], config["loss_kernel"]) == (None, "liger", "liger")
    spelled = FsdpConfig(rope_kernel="te", loss_kernel="chunked").to_dict()
    assert (spelled["rope_kernel"], spelled["loss_kernel"], "norm_kernel" in spelled) == ("te", "chunked", False)


@pytest.mark.parametrize("flag,value,line", [
    ("--norm-kernel", "apex", "error: norm_kernel: unknown value 'apex'; choose one of: eager, liger, te\n"),
    ("--loss-kernel", "te", "error: loss_kernel: unknown value 'te'; choose one of: eager, chunked, liger\n"),
    ("--compile-scope", "loss", "error: compile_scope: 'loss'; choose one of: blocks, blocks+loss\n"),
])
def test_a_bad_kernel_is_one_line_naming_the_field(flag, value, line, capsys):
    code, out, err = invoke([*BASE, "--compile", flag, value], capsys)
    assert (code, out, err) == (2, "", line)


def test_compile_scope_sets_compile_loss(capsys):
    code, out, err = invoke([*BASE, "--compile", "--compile-scope", "blocks", "--format", "json"], capsys)
    assert code == 0, err
    assert json.loads(out)["config"]["compile_loss"] is False
    code, out, err = invoke([*BASE, "--compile", "--compile-scope", "blocks+loss", "--format", "json"], capsys)
    assert code == 0 and "compile_loss" not in json.loads(out)["config"]
    code, out, err = invoke([*BASE, "--compile-scope", "blocks"], capsys)
    assert (code, err) == (2, "error: compile_scope: scopes torch.compile: give --compile with it, or leave it "
                              "out\n")


def test_a_loss_kernel_is_not_the_models_compiled_loss():
    assert FsdpConfig(compile=True).loss_compiled
    assert not FsdpConfig(compile=True, loss_kernel="chunked").loss_compiled
    with pytest.raises(SpecError, match="^swiglu_kernel: unknown value 'fused'; choose one of: eager, liger, te$"):
        FsdpConfig(swiglu_kernel="fused")


@pytest.mark.parametrize("flag,line", [
    ("--swiglu-kernel", "error: swiglu_kernel: gpt-125m has no SwiGLU MLP: the liger kernel replaces none of its ops; "
                        "use eager\n"),
    ("--norm-kernel", "error: norm_kernel: gpt-125m has no RMSNorm: the liger kernel replaces none of its ops; use "
                      "eager\n"),
    ("--rope-kernel", "error: rope_kernel: gpt-125m has no rotary embedding: the liger kernel replaces none of its "
                      "ops; use eager\n"),
])
def test_a_kernel_for_an_op_the_model_lacks_is_one_line(flag, line, capsys):
    code, out, err = invoke(["estimate", "--model", "gpt-125m", "--gpus", "8", flag, "liger"], capsys)
    assert (code, out, err) == (2, "", line)


def test_the_trace_refuses_kernels_it_does_not_run(capsys):
    code, out, err = invoke(["trace", "--model", "llama3-8b", "--gpus", "8", "--liger"], capsys)
    assert (code, out, err) == (2, "", "error: norm_kernel: the trace runs the model's own eager ops, not Liger / "
                                       "Transformer Engine kernels or torchtitan's chunked loss: trace with eager "
                                       "kernels\n")
