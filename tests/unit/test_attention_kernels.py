"""The fused attention's kernel (FsdpConfig.attention_kernel; cost_models/attention_kernels.py): its speed over
FlashAttention-2 derived by hand from the FlashAttention-3 paper's figures (Shah et al. 2024, sec. 4.1: bf16
forward up to 740 TFLOP/s = 0.75 of H100 SXM's 989; backward 1.5-1.75x FlashAttention-2's; FlashAttention-2 ~0.35
of H100 in forward), the catalog's fwd+bwd FlashAttention-2 efficiency 0.30, FLOPs weighted 1 : 2.5; what each
GPU runs; and the one-line refusals (exit 2)."""

import pytest

from cost_models.attention_kernels import flash2_backward_efficiency, speed_over_flash2
from cost_models.kernel_time import Rates
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig, SpecError, TrainingSpec
from planner.api import estimate_config
from tests.cli.test_float_flags import invoke
from planner.hardware import get_gpu, make_cluster
from planner.models import load_preset

# by hand: FlashAttention-2's backward b2 from 3.5 / 0.30 = 1 / 0.35 + 2.5 / b2 -> b2 = 2.5 / 8.8095 = 0.28378;
# FlashAttention-3 at 1.625 x b2 = 0.46115: 1 / 0.75 + 2.5 / 0.46115 = 1.3333 + 5.4212 = 6.7545 seconds per forward
# FLOP-unit against FlashAttention-2's 11.6667: 1.7272x, i.e. 0.30 x 1.7272 = 0.518 of H100's peak fwd+bwd
FA2_BACKWARD = 0.28378
FA3_SPEED = 1.7272


def test_flash2_backward_from_the_catalog_and_the_paper():
    assert flash2_backward_efficiency(0.30, 0.35) == pytest.approx(FA2_BACKWARD, abs=1e-5)


def test_fa3_speed_over_flash2_by_hand():
    assert speed_over_flash2(0.30, 0.35, 0.75, 1.625) == pytest.approx(FA3_SPEED, abs=1e-4)
    # the paper's backward range, 1.5x and 1.75x: 11.6667 over 1 / 0.75 + 2.5 / (1.5 x 0.28378) = 7.2063 is 1.6189x,
    # over 1 / 0.75 + 2.5 / (1.75 x 0.28378) = 6.3673 is 1.8323x: the priced middle sits within it
    assert speed_over_flash2(0.30, 0.35, 0.75, 1.5) == pytest.approx(1.6189, abs=1e-4)
    assert speed_over_flash2(0.30, 0.35, 0.75, 1.75) == pytest.approx(1.8323, abs=1e-4)
    # FlashAttention-2 against itself: 1
    assert speed_over_flash2(0.30, 0.35, 0.35, 1.0) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("gpu, kernels", [
    ("h100-80gb", ("flash2", "cudnn", "fa3")), ("h200-141gb", ("flash2", "cudnn", "fa3")),
    ("h100-96gb", ("flash2", "cudnn", "fa3")), ("a100-80gb", ("flash2",)), ("v100-32gb", ("flash2",)),
])
def test_only_hopper_runs_the_wgmma_kernels(gpu, kernels):
    spec = get_gpu(gpu)
    assert spec.attention_kernels() == kernels
    for k in kernels[1:]:
        assert spec.attention_speed(k) == pytest.approx(FA3_SPEED, abs=1e-4)


def test_rates_scale_only_the_attention():
    """The kernel multiplies the attention rate alone; flash2 is the catalog's rate to the bit (0.30 x 989)."""
    gpu = get_gpu("h100-80gb")
    flash2 = Rates.of(gpu, "bf16", DEFAULT_PROFILE)
    assert Rates.of(gpu, "bf16", DEFAULT_PROFILE, "flash2") == flash2
    assert flash2.attention_flops_per_s == 0.30 * 989e12 * DEFAULT_PROFILE.attention_efficiency
    fa3 = Rates.of(gpu, "bf16", DEFAULT_PROFILE, "fa3")
    assert fa3.attention_flops_per_s / flash2.attention_flops_per_s == pytest.approx(FA3_SPEED, abs=1e-4)
    assert (fa3.matmul_flops_per_s, fa3.memory_bytes_per_s) == (flash2.matmul_flops_per_s, flash2.memory_bytes_per_s)


def test_a_step_saves_the_attention_seconds_and_no_memory():
    """llama3-8b, 8 x h100-80gb, seq 8192: the attention's seconds divide by 1.727, nothing else moves."""
    spec, cluster, training = load_preset("llama3-8b"), make_cluster(8, "h100-80gb"), TrainingSpec(seq_len=8192)
    flash2 = estimate_config(spec, cluster, training, FsdpConfig(ac_every=1))
    fa3 = estimate_config(spec, cluster, training, FsdpConfig(ac_every=1, attention_kernel="fa3"))
    assert flash2.time.attention_s / fa3.time.attention_s == pytest.approx(FA3_SPEED, rel=1e-4)
    assert (fa3.time.matmul_s, fa3.time.memory_bound_s) == (flash2.time.matmul_s, flash2.time.memory_bound_s)
    assert fa3.memory.peak_reserved_bytes == flash2.memory.peak_reserved_bytes


def test_flex_and_eager_run_their_own_kernel():
    """One spelling: the kernel is SDPA's; with flex or eager the config keeps flash2 (and to_dict leaves it out)."""
    assert FsdpConfig(attention="flex", attention_kernel="cudnn").attention_kernel.value == "flash2"
    assert "attention_kernel" not in FsdpConfig().to_dict()
    assert FsdpConfig(attention_kernel="cudnn").to_dict()["attention_kernel"] == "cudnn"
    with pytest.raises(SpecError, match="attention_kernel: unknown value 'fa2'; choose one of: flash2, cudnn, fa3"):
        FsdpConfig(attention_kernel="fa2")


@pytest.mark.parametrize("flags, line", [
    (["--gpu", "a100-80gb", "--trainer", "automodel", "--attention-kernel", "cudnn"],
     "error: attention_kernel: cudnn attention is priced on Hopper GPUs only (wgmma / TMA kernels); a100-80gb "
     "(ampere) runs flash2; choose attention_kernel flash2, or a Hopper GPU\n"),
    (["--gpu", "h100-80gb", "--trainer", "automodel", "--attention-kernel", "cudnn", "--attention", "eager"],
     "error: attention_kernel: cudnn is a fused SDPA kernel and eager attention runs its own: give --attention "
     "sdpa, or leave --attention-kernel out\n"),
    (["--gpu", "h100-80gb", "--attention-kernel", "cudnn"],
     "error: attention_kernel: the planner's FSDP2 code runs flash2 or fa3, not cudnn; choose a --trainer that has "
     "it: automodel\n"),
    (["--gpu", "h100-80gb", "--attention-kernel", "fa3", "--trainer", "torchtitan"],
     "error: attention_kernel: torchtitan 0.3 runs flash2, not fa3; choose a --trainer that has it: fsdp2, fsdp1, "
     "hf, hf-fsdp1, accelerate-fsdp2, accelerate, lightning, axolotl\n"),
    (["--gpu", "h100-80gb", "--attention-kernel", "flash3"],
     "error: attention_kernel: unknown value 'flash3'; choose one of: flash2, cudnn, fa3\n"),
])
def test_a_kernel_that_cannot_run_is_one_line(flags, line, capsys):
    code, out, err = invoke(["estimate", "--model", "llama3-8b", "--gpus", "8", *flags], capsys)
    assert (code, out, err) == (2, "", line)


@pytest.mark.parametrize("flags, field_and_start", [
    (["--gpu", "a100-80gb", "--attention-kernel", "fa3"], "attention_kernel: fa3 attention is priced on Hopper"),
    (["--gpu", "h100-80gb", "--attention-kernel", "fa3", "--emit", "torchtitan"],
     "attention_kernel: torchtitan 0.3 runs flash2, not fa3"),
])
def test_the_plan_refuses_a_pinned_kernel_in_one_line_too(flags, field_and_start, capsys):
    """As estimate: not an empty plan whose reasons name something else."""
    code, out, err = invoke(["--model", "llama3-8b", "--gpus", "8", *flags], capsys)
    assert (code, out) == (2, "") and err.startswith(f"error: {field_and_start}") and len(err.splitlines()) == 1
