"""Golden rows: NVIDIA NeMo Automodel's expert-parallel runs (shared/reference/published.md, "Mixture of experts with
expert parallelism: NVIDIA NeMo Automodel (PyTorch FSDP2 + EP), DGX-H100"), priced uncalibrated through the public
API in their published setting, one set of knobs for both rows:
8 x H100 80 GB SXM, FSDP 8 x EP 8, bf16 params and bf16 Adam states with an fp32 reduce (precision bf16-pure,
reduce_dtype fp32), full activation checkpointing, DeepEP dispatch / combine (moe_dispatch deepep), the gate
forced to balanced round-robin routing (routing round-robin: no router matmul), TE RMSNorm (norm_kernel te), no
compile, the MoE parallelizer's blocks kept gathered after forward (MoEParallelizerConfig.reshard_after_forward
false: SHARD_GRAD_OP), global batch = local batch x 16 accumulation steps x 8; Qwen's TE attention priced as SDPA's
flash kernel, GPT-OSS's FlexAttention as attention flex.

Where the mechanisms reach today (python benchmarks/throughput_accuracy.py prints both rows; at 73420c7 with
TE RMSNorm priced by cost_models/kernels.py):
- Qwen3-30B-A3B 12,040 tokens/s/GPU published, 9,190 predicted (-23.7%). Without this slice's mechanisms (NCCL
  all-to-all of every routed row, a learned router, FULL_SHARD) the same tree gives 5,276 with eager norms
  (-56.2%); DeepEP alone takes the EP seconds from 5.87 to 4.15 (learned routing: 5.34 of 8 ranks per token),
  with the round-robin gate to 0.80 (one rank per token).
- GPT-OSS 20B 13,058 published, 7,019 predicted (-46.3%; before: 6,482, -50.4%). Its block is priced by the traced
  transformers inventory (the routing chain swapped for DeepEP's permute by the formula's bytes), which the
  kernel knobs do not reach yet: its eager norms stay in the 3.5 MB per token the trace moves (8.7 s of 18.7 s).
Not yet within the issue's 10%. Left, priced elsewhere: TE / cuDNN attention runs at FlashAttention-2's H100 rate
(0.3 of peak; 5.45 s of Qwen's 28.5 s), TE fused RoPE (Automodel 0.7.0 forces it off; the Oct 2025 runs had it),
the kernel knobs on a traced inventory (GPT-OSS). The bounds below are the errors reached plus 2 points: they
hold the gain and fail on a regression; tighten them as those land.
"""

import pytest

from benchmarks.throughput_accuracy import AUTOMODEL_GRAD_ACCUM, AUTOMODEL_ROWS, predict_automodel

# published step seconds (published.md) and the error reached (predicted / published - 1), per model
STEP_S = {"qwen3-30b-a3b": 21.773, "gpt-oss-20b": 10.04}
REACHED = {"qwen3-30b-a3b": -0.237, "gpt-oss-20b": -0.463}


@pytest.mark.parametrize("model, local_batch, attention, published", AUTOMODEL_ROWS)
def test_automodel_row(model, local_batch, attention, published):
    # published.md's own arithmetic: tokens/s/GPU = global batch x sequence / step time / GPUs (within 0.1%)
    assert local_batch * AUTOMODEL_GRAD_ACCUM * 8 * 4096 / STEP_S[model] / 8 == pytest.approx(published, rel=1e-3)
    c = predict_automodel(model, local_batch, attention)
    assert c.config.grad_accum == AUTOMODEL_GRAD_ACCUM and c.fits  # the published run ran on 80 GB
    error = c.time.tokens_per_s_per_gpu / published - 1
    assert REACHED[model] - 0.02 < error < 0.10, f"{model}: {100 * error:+.1f}% (reached {100 * REACHED[model]:+.1f}%)"
