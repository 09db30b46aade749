"""Kernel knobs on a traced block inventory (cost_models/kernels.kernel_block_ops, operators._identified): a traced
family's RMSNorms are transformers' eager RMSNorm chains, whose bytes the formula prices (operators.norm_op), so a
norm kernel swaps those bytes out of the traced total for the kernel's; the rest keeps its traced bytes.

The identification is checked on real CPU tensors: transformers' own LlamaRMSNorm and GptOssRMSNorm run forward and
backward under the counter the traced inventory is built with (calibration/block_ops.py _Counter), bf16."""

import pytest
import torch

from calibration.block_ops import _Counter
from cost_models import operators
from cost_models.kernels import EAGER, Kernels, kernel_block_ops
from cost_models.specs import Kernel
from planner.api import estimate
from planner.models import load_preset


def _counted_bytes_per_element(norm_class, hidden: int = 256, tokens: int = 512) -> tuple[float, float]:
    norm = norm_class(hidden).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    counter = _Counter()
    with counter:
        counter.recording = "forward"
        y = norm(x)
        counter.recording = "backward"
        y.backward(grad)
        counter.recording = None
    return counter.memory["forward"] / x.numel(), counter.memory["backward"] / x.numel()


@pytest.mark.parametrize("preset, module, rel_forward, rel_backward", [
    # formula rmsnorm, 2-byte compute: 28 + 4c = 36 and 80 + 6c = 92 B per element; counted 36.10 / 92.16 (the
    # per-row fp32 variance and its gradient: 0.1 B per element at hidden 256)
    ("llama3-8b", "transformers.models.llama.modeling_llama.LlamaRMSNorm", 0.005, 0.005),
    # formula rmsnorm_fp32: 44 / 108 B; GPT-OSS's norm multiplies the weight in fp32 with no (1 + w) add: counted
    # 40.10 / 104.18, so the swap overstates its saving by 4 B per element each way (within 10% / 4%)
    ("gpt-oss-20b", "transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm", 0.10, 0.04),
])
def test_the_formula_norm_is_the_traced_chain(preset, module, rel_forward, rel_backward):
    path, name = module.rsplit(".", 1)
    norm_class = getattr(__import__(path, fromlist=[name]), name)
    forward, backward = _counted_bytes_per_element(norm_class)
    op = operators.norm_op(load_preset(preset), 2, 1, "norm")  # per element
    assert op.forward_bytes == pytest.approx(forward, rel=rel_forward)
    assert op.backward_bytes == pytest.approx(backward, rel=rel_backward)


@pytest.fixture(scope="module")
def gpt_oss():
    """GPT-OSS 20B as the API prices it: its traced block profile (flex attention), bf16."""
    return estimate("gpt-oss-20b", 8, gpu="h100-80gb", seq_len=4096, attention="flex").model


def test_te_norm_swaps_the_traced_norm_bytes(gpt_oss):
    """By hand: two RMSNorms of h = 2880 per block, rmsnorm_fp32 eager 44 / 108 B per element, the kernel 2c = 4
    / 4c = 8: forward 2 x 2880 x 40 = 230,400 B and backward 2 x 2880 x 100 = 576,000 B per token fewer."""
    ops = operators.block_ops(gpt_oss, 2, 4096, 0, "flex")
    assert ops.traced and [op.kind for op in ops.traced_identified] == ["norm", "norm"]
    (traced,) = ops.memory_ops
    (te,) = kernel_block_ops(ops, Kernels(norm=Kernel.TE)).memory_ops
    assert traced.forward_bytes - te.forward_bytes == pytest.approx(230_400, abs=1e-6)
    assert traced.backward_bytes - te.backward_bytes == pytest.approx(576_000, abs=1e-6)


def test_eager_and_unidentified_kernels_keep_the_trace(gpt_oss):
    """Eager kernels: the traced inventory itself; RoPE and SwiGLU kernels: not identified in a trace, its bytes
    stay."""
    ops = operators.block_ops(gpt_oss, 2, 4096, 0, "flex")
    assert kernel_block_ops(ops, EAGER) is ops
    assert kernel_block_ops(ops, Kernels(rope=Kernel.TE, swiglu=Kernel.LIGER)) is ops


def test_the_automodel_row_gains_the_norms_seconds():
    """GPT-OSS 20B in the Automodel row's setting (16 micro-steps of 2 x 4,096 = 8,192 tokens, 24 blocks, H100 at
    3.35 TB/s x the profile's memory-bound efficiency 0.42), TE RMSNorm against eager, by hand: the blocks'
    (230,400 + 576,000) B x 8,192 x 24 x 16 / 1.407e12 B/s = 1.8029 s, the final norm's (40 + 100) x 2,880 B x
    8,192 x 16 / 1.407e12 = 0.0376 s: 1.8405 s of memory-bound time; the recomputed forwards 230,400 B x 8,192 x 24
    x 16 / 1.407e12 = 0.5151 s. Matmuls and attention are the trace's either way."""
    from benchmarks.throughput_accuracy import AUTOMODEL_SETTING

    knobs = dict(micro_batch=2, global_batch=256, attention="flex", **AUTOMODEL_SETTING)
    te, eager = estimate("gpt-oss-20b", 8, **knobs), estimate("gpt-oss-20b", 8, **{**knobs, "norm_kernel": "eager"})
    assert (te.time.matmul_s, te.time.attention_s) == (eager.time.matmul_s, eager.time.attention_s)
    assert eager.time.memory_bound_s - te.time.memory_bound_s == pytest.approx(1.8405, abs=1e-4)
    assert eager.time.recompute_s - te.time.recompute_s == pytest.approx(0.5151, abs=1e-4)
