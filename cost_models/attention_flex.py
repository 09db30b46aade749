"""FlexAttention (torch.nn.attention.flex_attention, compiled): what it saves for backward, its block mask, the
work it executes and its speed against the flash kernel. Pure sizing functions; the model's own code around the
kernel (gpt-oss's sinks) is priced in activations_sinks.py.

Saved for backward. FlexAttentionAutogradOp.forward (torch/_higher_order_ops/flex_attention.py, torch 2.13) saves
q, k, v, the output, the fp32 logsumexp and max_scores (b x heads x s each), the block mask's index tensors and the
score_mod's captured buffers. Its backward passes flex_attention_backward q, k, v, out, logsumexp and the mask,
never max_scores, so compiled (how transformers and torchtitan call it: AOTAutograd's partitioner keeps what the
backward graph reads) the kernel saves q, k, v, out and the logsumexp: c (q + 2 kv) + c q + 4 heads per token
(tests/unit/test_attention_flex.py partitions the compiled kernel on CPU and lists them). With enable_gqa=True
(transformers sets it when the local query heads are a power of two) k and v are read at the kv heads, not
repeated. No s x s scores: the kernel recomputes them, block by block, in the backward.

Block mask (BlockMask, _DEFAULT_SPARSE_BLOCK_SIZE = 128): kv_num_blocks, full_kv_num_blocks, q_num_blocks,
full_q_num_blocks (B, 1, n) and the four index tensors (B, 1, n, n), int32, n = ceil(s / 128): 16 (n + n^2) bytes
per sequence and mask (measured: 16,896 B at s = 4,096). transformers builds one per mask kind (masking_utils:
causal and sliding for alternating models) for the whole forward; a checkpointed block keeps them for its recompute.

Work. The Triton kernel visits, for each block of 128 queries, the kv blocks its block mask lists (full and
partial): causal, query block i visits i + 1 blocks; a sliding window of w tokens the m = floor((w + 126) / 128) + 1
blocks that hold a key within w of one of its queries (2 for gpt-oss' w = 128), fewer at the start. Executed
forward FLOPs = 4 q_dim x keys visited (QK^T and PV). The MFU reference stays 4 q_dim s.

Speed. The PyTorch blog "FlexAttention: The Flexibility of PyTorch with the Performance of FlashAttention" (Aug
2024, and Dong et al. 2024, arXiv:2412.05496, figs. 6-7): FlexAttention reaches ~90% of FlashAttention-2's
throughput forward and ~85% backward (A100, causal, head dim 64-128). Priced as those fractions of the flash
kernel's rate (kernel_time.Rates.attention_rate). Ignored: the partial blocks' mask_mod evaluation beyond the
visited-block count, Hopper-specific kernels (the FLASH backend of torch >= 2.9 is opt-in, not transformers' path).
"""

from __future__ import annotations

import math

BLOCK_SIZE = 128                    # torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE
LOGSUMEXP_BYTES = 4                 # fp32 per head and token
FORWARD_SPEED = 0.90                # of FlashAttention-2's throughput (PyTorch FlexAttention blog, Aug 2024)
BACKWARD_SPEED = 0.85


def kernel_saved_bytes_per_token(c: int, q_dim: int, kv_dim: int, n_heads: int) -> int:
    """What the compiled kernel saves per token: q, k and v at their own heads, the output, the logsumexp."""
    return c * (q_dim + 2 * kv_dim) + c * q_dim + LOGSUMEXP_BYTES * n_heads


def block_mask_bytes(seq_len: int, micro_batch: int) -> int:
    """One BlockMask over a micro-batch: eight int32 tensors, four (B, 1, n) and four (B, 1, n, n)."""
    n = math.ceil(seq_len / BLOCK_SIZE)
    return micro_batch * 16 * (n + n * n)


def keys_visited_per_query(seq_len: int, window: int = 0) -> float:
    """Mean keys the kernel computes per query, at the block mask's granularity: causal, or causal within a
    sliding window of `window` tokens (0: none)."""
    n = math.ceil(seq_len / BLOCK_SIZE)
    m = n if not window else min(n, (window + BLOCK_SIZE - 2) // BLOCK_SIZE + 1)
    blocks = sum(min(i + 1, m) for i in range(n))
    return BLOCK_SIZE * blocks / n


def forward_flops_per_token(q_dim: int, seq_len: int, windowed_layers: int = 0, n_layers: int = 1,
                            window: int = 0) -> float:
    """Executed forward FLOPs per token of QK^T and PV, averaged over the layers (windowed_layers of n_layers
    attend within `window`, the others causally over the whole sequence)."""
    full = keys_visited_per_query(seq_len)
    windowed = keys_visited_per_query(seq_len, window) if window and windowed_layers else full
    keys = (windowed_layers * windowed + (n_layers - windowed_layers) * full) / n_layers
    return 4.0 * q_dim * keys
