"""The fused attention's kernel (FsdpConfig.attention_kernel) as a speed over FlashAttention-2's on the same GPU.

The catalog's attention_efficiency is FlashAttention-2's fwd+bwd rate (PyTorch SDPA's flash backend). Hopper has
kernels built on wgmma / TMA and warp specialisation that FlashAttention-2 does not use: flash-attention 3 and
Transformer Engine's cuDNN fused attention. Their speed over FlashAttention-2 comes from the figures per
architecture in planner/catalog/gpus.json ("attention_kernels"):

- FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608, sec. 4.1): bf16 forward up to 740 TFLOP/s, 75% of H100
  SXM's 989; backward 1.5-1.75x FlashAttention-2's (the middle, 1.625x, priced).
- FlashAttention-2 on H100 (the same paper): ~35% of peak in forward; with the catalog's fwd+bwd 0.30 weighted 1 : 2.5
  as the FLOPs are (the backward recomputes the scores), its backward runs at 2.5 / (3.5 / 0.30 - 1 / 0.35) = 0.284.
- Seconds per unit of forward FLOPs: FlashAttention-2 3.5 / 0.30 = 11.67, FlashAttention-3 1 / 0.75 + 2.5 /
  (1.625 x 0.284) = 6.76: a 1.73x speed, applied to each Hopper part's own FlashAttention-2 efficiency (a power
  cap slows both alike).
Transformer Engine's cuDNN fused attention: no kernel-level cuDNN figure at head dim 128 is cited here; it is priced
at FlashAttention-3's figures (the same Hopper techniques), a stated assumption. Ignored: short-sequence and
head-dim shapes beyond the flash kernel's factors (kernel_time.Rates.attention_rate), FP8 attention.
"""

from __future__ import annotations

FLOPS_BACKWARD_OVER_FORWARD = 2.5  # the FlashAttention papers' count: the backward recomputes the scores
# what the output's layout copy is called among a block's memory-bound ops (cost_models/operators.py)
OUTPUT_COPY = "attention output copy"


def without_layout_copy(ops, kernel: str, attention: str):
    """A block's operators (operators.BlockOps) as the kernel's layout leaves them. Transformer Engine's
    DotProductAttention (cudnn) reads q, k, v and writes its output in bshd, the layout the projections give and
    o_proj reads (nemo_automodel 0.7.0 components/models/qwen3_moe/layers.py: qkv_format "bshd", out.flatten(2), a
    view): no transpose copy of the output. PyTorch SDPA and FlexAttention return (b, heads, s, d), which
    transformers' attention and Automodel's postprocess_output_for_attn copy back (transpose(1, 2).contiguous()).
    A traced inventory keeps its bytes (no op to swap by name)."""
    if kernel != "cudnn" or attention != "sdpa" or ops.traced:
        return ops
    from dataclasses import replace

    return replace(ops, memory_ops=tuple(op for op in ops.memory_ops if op.name != OUTPUT_COPY))


def flash2_backward_efficiency(flash2_efficiency: float, flash2_forward_efficiency: float) -> float:
    """FlashAttention-2's backward rate (of peak) from its fwd+bwd rate and its forward rate, FLOPs 1 : 2.5."""
    b = FLOPS_BACKWARD_OVER_FORWARD
    return b / ((1 + b) / flash2_efficiency - 1 / flash2_forward_efficiency)


def speed_over_flash2(flash2_efficiency: float, flash2_forward_efficiency: float, forward_efficiency: float,
                      backward_over_flash2: float) -> float:
    """A kernel's fwd+bwd speed over FlashAttention-2's: the forward at `forward_efficiency` of peak, the backward
    `backward_over_flash2` times FlashAttention-2's, weighted by FLOPs 1 : 2.5."""
    b = FLOPS_BACKWARD_OVER_FORWARD
    backward = backward_over_flash2 * flash2_backward_efficiency(flash2_efficiency, flash2_forward_efficiency)
    return ((1 + b) / flash2_efficiency) / (1 / forward_efficiency + b / backward)


def architecture_speeds(figures: dict) -> tuple[tuple[str, float], ...]:
    """(kernel, speed over FlashAttention-2) for one architecture's catalog entry (gpus.json attention_kernels):
    {"flash2_efficiency", "flash2_forward_efficiency", kernel: {"forward_efficiency", "backward_over_flash2"}}."""
    return tuple((name, speed_over_flash2(figures["flash2_efficiency"], figures["flash2_forward_efficiency"],
                                          k["forward_efficiency"], k["backward_over_flash2"]))
                 for name, k in sorted(figures.items()) if isinstance(k, dict))
