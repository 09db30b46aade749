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

Where the mechanisms reach today (python benchmarks/throughput_accuracy.py prints both rows):
- Qwen3-30B-A3B 12,040 tokens/s/GPU published, 10,250 predicted (-14.9%; step 25.58 s against 21.77). Before the
  attention kernel (every SDPA priced at FlashAttention-2's H100 rate, 0.30 of peak): 9,190 (-23.7%, 28.53 s).
  At 73420c7, without DeepEP, the round-robin gate and SHARD_GRAD_OP, with eager norms: 5,276 (-56.2%).
- GPT-OSS 20B 13,058 published, 8,013 predicted (-38.6%; step 16.36 s against 10.04). Its block is priced by the
  traced transformers inventory; TE RMSNorm now swaps the traced norm chains' bytes for the kernel's (memory-bound
  8.74 -> 6.94 s; before: 7,019, -46.3%), the rest of the trace's 2.7 MB per token stays eager.
Not yet within the issue's 10%. Left, not priced: TE fused RoPE (Automodel 0.7.0 forces it off; the Oct 2025 runs
had it), the other eager chains of a traced inventory (GPT-OSS's rotary, its clamped SwiGLU, the sink
renormalisation), Automodel's own GPT-OSS / Qwen3 modelling (TE linears and its fused ops) where the planner
prices transformers'. The bounds below are the errors reached plus 2 points: they hold the gain and fail on a
regression; tighten them as those land, and make them the issue's abs(error) < 0.10 once both rows are within it.
"""

import pytest

from benchmarks.throughput_accuracy import AUTOMODEL_GRAD_ACCUM, AUTOMODEL_ROWS, predict_automodel

# published step seconds (published.md) and the error reached (predicted / published - 1), per model
STEP_S = {"qwen3-30b-a3b": 21.773, "gpt-oss-20b": 10.04}
REACHED = {"qwen3-30b-a3b": -0.149, "gpt-oss-20b": -0.386}


@pytest.mark.parametrize("model, local_batch, attention, published", AUTOMODEL_ROWS)
def test_automodel_row(model, local_batch, attention, published):
    # published.md's own arithmetic: tokens/s/GPU = global batch x sequence / step time / GPUs (within 0.1%)
    assert local_batch * AUTOMODEL_GRAD_ACCUM * 8 * 4096 / STEP_S[model] / 8 == pytest.approx(published, rel=1e-3)
    c = predict_automodel(model, local_batch, attention)
    assert c.config.grad_accum == AUTOMODEL_GRAD_ACCUM and c.fits  # the published run ran on 80 GB
    error = c.time.tokens_per_s_per_gpu / published - 1
    assert REACHED[model] - 0.02 < error < 0.10, f"{model}: {100 * error:+.1f}% (reached {100 * REACHED[model]:+.1f}%)"
