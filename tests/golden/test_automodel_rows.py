"""Golden rows: NVIDIA NeMo Automodel's expert-parallel runs (shared/reference/published.md, "Mixture of experts with
expert parallelism: NVIDIA NeMo Automodel (PyTorch FSDP2 + EP), DGX-H100"), priced uncalibrated through the public
API in their published setting, one set of knobs for both rows:
8 x H100 80 GB SXM, FSDP 8 x EP 8, bf16 params and bf16 Adam states with an fp32 reduce (precision bf16-pure,
reduce_dtype fp32), full activation checkpointing, DeepEP dispatch / combine (moe_dispatch deepep), the gate
forced to balanced round-robin routing (routing round-robin: no router matmul), TE RMSNorm (norm_kernel te), no
compile, the MoE parallelizer's blocks kept gathered after forward (MoEParallelizerConfig.reshard_after_forward
false: SHARD_GRAD_OP), global batch = local batch x 16 accumulation steps x 8; Qwen's TE attention as the automodel
trainer's default attention_kernel cudnn (Transformer Engine's cuDNN fused attention, priced at the FlashAttention-3
paper's Hopper figures: 1.727x FlashAttention-2, cost_models/attention_kernels.py), GPT-OSS's FlexAttention as
attention flex (its own kernel, at ~0.90 / 0.85 of FlashAttention-2's rate).

Where the mechanisms reach today (python benchmarks/throughput_accuracy.py prints both rows; docs/accuracy.md, "NeMo
Automodel's own models", has each part):
- Qwen3-30B-A3B 12,040 tokens/s/GPU published, 11,781 predicted (-2.2%; step 22.25 s against 21.77). Its own model's
  RoPE in one kernel (planner/trainers/table.py own_models) took it from 10,250 (-14.9%) to 11,553, TE attention's
  bshd output (no layout copy) to 11,781. Earlier: 9,190 (-23.7%) before the cuDNN attention kernel, 5,276 (-56.2%)
  at 73420c7.
- GPT-OSS 20B 13,058 published, 12,414 predicted (-4.9%; step 10.56 s against 10.04). Automodel runs its own GPT-OSS,
  not transformers': priced from its structure instead of the traced transformers block (8,013, -38.6% -> 11,211),
  its RoPE in one kernel (11,948), its compiled swiglu_oai_deepep (12,414).
The bound: within the issue's 10%, and within 2 points of the error reached (a regression, or a gain, moves it).
"""

import pytest

from benchmarks.throughput_accuracy import AUTOMODEL_GRAD_ACCUM, AUTOMODEL_ROWS, predict_automodel

# published step seconds (published.md) and the error reached (predicted / published - 1), per model
STEP_S = {"qwen3-30b-a3b": 21.773, "gpt-oss-20b": 10.04}
REACHED = {"qwen3-30b-a3b": -0.022, "gpt-oss-20b": -0.049}


@pytest.mark.parametrize("model, local_batch, attention, published", AUTOMODEL_ROWS)
def test_automodel_row(model, local_batch, attention, published):
    # published.md's own arithmetic: tokens/s/GPU = global batch x sequence / step time / GPUs (within 0.1%)
    assert local_batch * AUTOMODEL_GRAD_ACCUM * 8 * 4096 / STEP_S[model] / 8 == pytest.approx(published, rel=1e-3)
    c = predict_automodel(model, local_batch, attention)
    assert c.config.grad_accum == AUTOMODEL_GRAD_ACCUM and c.fits  # the published run ran on 80 GB
    error = c.time.tokens_per_s_per_gpu / published - 1
    assert abs(error) < 0.10 and abs(error - REACHED[model]) < 0.02, \
        f"{model}: {100 * error:+.1f}% (reached {100 * REACHED[model]:+.1f}%)"
