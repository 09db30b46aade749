"""Seconds of a block's operators on one GPU: matmuls by shape, the attention kernel, memory-bound chains.

- Matmul (y = x W, m rows, k inputs, n outputs): 2mnk FLOPs at peak x the GPU's large-GEMM efficiency (the
  best measured bf16 product / peak, catalog `matmul_efficiency`: A100 0.87, H100 0.80, MI300X 0.51,
  hardware.md) x profile.compute_efficiency[dtype] (what a training step's products reach of that) x a shape
  factor prod over m, n, k of x / (x + x0): small and skinny products (LoRA's rank-r factors, a routed
  expert's few rows, a 768-wide model) run far below peak; x0 = profile.matmul_half_dim. The backward's
  two products (input gradient, weight gradient) have the same three dimensions: twice the forward
  (once for a frozen weight). Float8 linears run on the FP8 peak at the same fractions.
- Attention (SDPA flash kernel; another attention_kernel at its speed over it, attention_kernels.py): forward
  FLOPs as executed (causal: half of 4 q_dim s) at peak x the GPU's
  attention-kernel efficiency (catalog `attention_efficiency`, fwd+bwd at long sequences and head dim
  128: FlashAttention-2 reaches ~0.6 of A100's peak and ~0.35 of H100's, which it runs without Hopper's
  wgmma/TMA - FlashAttention-2 and -3 papers) x s / (s + s0) (short sequences: fewer key blocks per query
  block; under CP the ring's calls, s / cp: context_parallel.py) x a head-dim factor (d / (d + 24), 1 at
  d = 128, ~0.86 at 64). Backward: 2.5x the forward's FLOPs (it recomputes the scores), as the FlashAttention
  papers count. FlexAttention: the kv blocks its block mask visits, at ~0.90 / 0.85 of the flash kernel's
  forward / backward rate (attention_flex.py). Eager attention: its four score products as matmuls (k =
  head_dim or s) over all s keys, and the score traffic as memory-bound bytes.
- Memory-bound: bytes at HBM bandwidth x profile.memory_bound_efficiency (streaming kernels reach
  ~80-90%, hardware.md).
Ignored: wave quantisation, L2 reuse, kernel launch gaps (profile.microstep_overhead_s covers the host).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .operators import BlockOps, Matmul, MemoryOp
from .profile import Profile
from .specs import GpuSpec

_ATTENTION_HALF_HEAD_DIM = 24  # d / (d + 24): ~0.86 of hdim 128's rate at 64 (FlashAttention-2 paper, fig. 4-5)


@dataclass(frozen=True)
class Rates:
    """What one GPU reaches for each operator class (FLOP/s and bytes/s), with the profile applied."""

    matmul_flops_per_s: float       # large products in the compute dtype
    float8_flops_per_s: float       # large products on FP8 tensor cores (0: none)
    attention_flops_per_s: float    # the flash kernel at long sequences, head dim 128
    memory_bytes_per_s: float
    half_dim: float
    attention_half_seq: float

    @classmethod
    def of(cls, gpu: GpuSpec, dtype: str, profile: Profile, attention_kernel: str = "flash2") -> "Rates":
        """attention_kernel: the fused attention's kernel (FsdpConfig.attention_kernel), at its speed over
        FlashAttention-2 on this GPU (cost_models/attention_kernels.py)."""
        peak = gpu.priced_peak_flops(dtype)
        achieved = profile.efficiency(dtype)   # what training products reach of the best large GEMM
        large = gpu.matmul_fraction(profile.default_gpu_matmul_efficiency) * achieved  # x a power cap's clock
        attention = gpu.attention_fraction(profile.default_attention_efficiency) * profile.attention_efficiency
        if attention_kernel != "flash2":
            attention *= gpu.attention_speed(attention_kernel)
        return cls(matmul_flops_per_s=peak * large,
                   float8_flops_per_s=gpu.peak_flops.get("fp8", 0.0) * large,
                   attention_flops_per_s=peak * attention,
                   memory_bytes_per_s=gpu.hbm_bytes_per_s * profile.memory_bound_efficiency,
                   half_dim=profile.matmul_half_dim, attention_half_seq=profile.attention_half_seq)

    def shape_factor(self, *dims: float) -> float:
        out = 1.0
        for x in dims:
            out *= x / (x + self.half_dim)
        return out

    def matmul_forward_s(self, m: Matmul, tokens: int, float8: bool = False) -> float:
        rows = tokens * m.rows_per_token
        rate = self.float8_flops_per_s if float8 and m.float8 and self.float8_flops_per_s else self.matmul_flops_per_s
        return m.count * 2.0 * rows * m.n * m.k / (rate * self.shape_factor(rows, m.n, m.k))

    def matmul_backward_s(self, m: Matmul, tokens: int, float8: bool = False) -> float:
        return (2 if m.trainable else 1) * self.matmul_forward_s(m, tokens, float8)

    def attention_rate(self, seq_len: int, head_dim: int) -> float:
        d = head_dim / (head_dim + _ATTENTION_HALF_HEAD_DIM) / (128 / (128 + _ATTENTION_HALF_HEAD_DIM))
        return self.attention_flops_per_s * seq_len / (seq_len + self.attention_half_seq) * min(1.0, d)

    def memory_s(self, n_bytes: float) -> float:
        return n_bytes / self.memory_bytes_per_s


@dataclass(frozen=True)
class BlockTime:
    """Seconds of one block for one micro-batch, by operator class and pass."""

    matmul_forward_s: float
    matmul_backward_s: float
    attention_forward_s: float
    attention_backward_s: float
    memory_forward_s: float
    memory_backward_s: float
    recompute_matmul_s: float
    recompute_attention_s: float
    recompute_memory_s: float

    @property
    def forward_s(self) -> float:
        return self.matmul_forward_s + self.attention_forward_s + self.memory_forward_s

    @property
    def recompute_s(self) -> float:
        return self.recompute_matmul_s + self.recompute_attention_s + self.recompute_memory_s

    @property
    def backward_s(self) -> float:
        """The backward pass, its recompute included."""
        return self.matmul_backward_s + self.attention_backward_s + self.memory_backward_s + self.recompute_s


def eager_attention_ops(ops: BlockOps, n_heads: int, c: int) -> tuple[tuple[Matmul, ...], MemoryOp]:
    """Eager attention: QK^T (k = head_dim) and PV (k = s) per head over all s keys (no causal skipping),
    and the score tensor's traffic: write the scores, the softmax reads and writes them (fp32 for
    Llama-style models) and P @ V reads them; about twice that in backward."""
    s, d = ops.seq_len, ops.head_dim
    products = (Matmul("scores QK^T", s, d, count=n_heads, float8=False),
                Matmul("P @ V", d, s, count=n_heads, float8=False))
    per_score = 3 * c + 8
    traffic = MemoryOp("attention scores", n_heads * s * per_score, 2 * n_heads * s * per_score,
                       n_heads * s * per_score, 2 * n_heads * s * per_score)
    return products, traffic


@lru_cache(maxsize=4096)  # candidates of one search share blocks, rates and micro-batches
def price_block(ops: BlockOps, rates: Rates, tokens: int, *, eager_attention: tuple | None = None,
                compiled: bool = False, float8: bool = False, recompute: str = "",
                kernel_seq_len: int = 0) -> BlockTime:
    """One micro-batch of `tokens` through a block. recompute: "" none, "full" (the whole forward again,
    activation checkpointing), "selective-op" (torchtitan's policy: every second matmul and every
    memory-bound op; the attention kernel's output is saved). kernel_seq_len: the causal length whose one call
    runs at the rate of the block's attention calls (CP's ring: context_parallel.ring_kernel_seq_len); 0: the
    sequence, one call."""
    mm_f = sum(rates.matmul_forward_s(m, tokens, float8) for m in ops.matmuls)
    mm_b = sum(rates.matmul_backward_s(m, tokens, float8) for m in ops.matmuls)
    memory_ops = ops.memory_ops
    if eager_attention is not None:
        products, traffic = eager_attention
        att_f = sum(rates.matmul_forward_s(m, tokens) for m in products)
        att_b = 2 * att_f
        memory_ops = memory_ops + (traffic,)
    else:
        rate = rates.attention_rate(kernel_seq_len or ops.seq_len, ops.head_dim)
        forward_speed, backward_speed = ops.attention_speed  # FlexAttention: fractions of the flash kernel's
        att_f = ops.attention_flops_per_token * tokens / (rate * forward_speed)
        att_b = 2.5 * (ops.attention_flops_per_token * tokens / (rate * backward_speed))
    mem_f = rates.memory_s(tokens * sum(op.bytes(compiled, backward=False) for op in memory_ops))
    mem_b = rates.memory_s(tokens * sum(op.bytes(compiled, backward=True) for op in memory_ops))
    if recompute == "full":
        re = (mm_f, att_f, mem_f)
    elif recompute == "selective-op":
        # eager attention's batched products and softmax are not on the save list: recomputed too
        re = (sum(rates.matmul_forward_s(m, tokens, float8) for m in ops.selective_op_recomputed()),
              att_f if eager_attention is not None else 0.0, mem_f)
    else:
        re = (0.0, 0.0, 0.0)
    return BlockTime(mm_f, mm_b, att_f, att_b, mem_f, mem_b, *re)
