"""CPU re-implementations of the GPU-only kernels cost_models/kernels.py prices: the same
torch.autograd.Function shapes as Liger Kernel 0.8.5 and Transformer Engine 2.20 - the same
ctx.save_for_backward sets, the same in-place writes, the same chunking and buffers - with the Triton / CUDA
kernels' arithmetic written in torch ops on the rows they own. Liger and TE run only on GPUs (Triton, CUDA);
these run on real CPU tensors, so the tensors each kernel keeps and allocates can be measured by the memory
tracker and compared with the estimate (tests/unit/test_kernels_memory.py). The numbers they compute equal
the eager ops' (checked there too); their speed is not the kernels'.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class LigerRMSNorm(torch.autograd.Function):
    """liger_kernel/ops/rms_norm.py LigerRMSNormFunction, casting_mode "llama": rstd in fp32 per row, the
    normalised row cast back to the input dtype before the weight; save_for_backward(X, W, RSTD); backward
    writes dX into dY (in_place=True) and sums the weight gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        rows = x.view(-1, x.shape[-1])
        rstd = torch.rsqrt(rows.float().pow(2).mean(-1) + eps)  # the kernel's fp32 registers, row by row
        y = (rows.float() * rstd[:, None]).to(x.dtype) * weight
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        dy_rows = dy.contiguous().view(-1, rows.shape[-1])
        n = rows.float() * rstd[:, None]
        g = dy_rows.float() * weight.float()
        dw = (dy_rows.float() * n).sum(0)
        dy_rows.copy_(rstd[:, None] * (g - n * (g * n).mean(-1, keepdim=True)))  # dX into dY
        return dy_rows.view(dy.shape), dw.to(weight.dtype), None


class LigerSiLUMul(torch.autograd.Function):
    """liger_kernel/ops/swiglu.py LigerSiLUMulFunction: c = silu(a) * b; save_for_backward(a, b); backward
    recomputes silu(a) and writes da into a and db into b (swiglu_backward's tl.store into a_ptr, b_ptr)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return (torch.nn.functional.silu(a.float()) * b.float()).to(a.dtype)

    @staticmethod
    def backward(ctx, dc: torch.Tensor):
        a, b = ctx.saved_tensors
        x, y, g = a.float(), b.float(), dc.float()  # the kernel's fp32 registers, row by row
        sig = torch.sigmoid(x)
        silu = x * sig
        b.copy_(g * silu)                            # db into b, da into a (tl.store into b_ptr, a_ptr)
        a.copy_(g * y * (silu * (1 - sig) + sig))
        return a, b


class TESwiGLU(torch.autograd.Function):
    """transformer_engine/pytorch/ops/basic/swiglu.py SwiGLU: input [gate | up] (2f), output silu(gate) * up;
    save_for_backward(input_); op_backward allocates the 2f input gradient, then clear_tensor_data(input_)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        gate, up = x.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        dx = torch.empty_like(x)
        dx_gate, dx_up = dx.chunk(2, dim=-1)
        dx_up.copy_(dy.float() * gate * sig)
        dx_gate.copy_(dy.float() * up * (sig * (1 + gate * (1 - sig))))
        return dx


def liger_chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """fused_linear_cross_entropy_forward's chunk_size (_CHUNK_MEM_CONST 1)."""
    inc = -(-vocab // hidden)
    return min(rows, 1 << max(0, (-(-rows // inc) - 1).bit_length()))


class LigerFusedLinearCrossEntropy(torch.autograd.Function):
    """liger_kernel/ops/fused_linear_cross_entropy.py LigerFusedLinearCrossEntropyFunction (reduction "mean",
    accum_dtype None) on its CUDA path (use_mm_out): grad_input = zeros_like(input), grad_weight =
    zeros_like(weight), loss_1d (fp32) and target_mask per row, one logits_storage of chunk x V reused by every
    chunk; the cross-entropy kernel writes each logit's gradient in place; torch.mm(..., out=grad_input[rows])
    and addmm into grad_weight; save_for_backward(grad_input, grad_weight); backward returns them (scaled
    when grad_output is not 1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rows, vocab = x.shape[0], weight.shape[0]
        chunk = liger_chunk_rows(rows, vocab, x.shape[1])
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight)
        loss_1d = torch.zeros(rows, dtype=torch.float32)
        target_mask = target != IGNORE_INDEX
        n = max(1, int(target_mask.sum()))
        storage = torch.empty((chunk, vocab), dtype=x.dtype)
        row = torch.empty(vocab, dtype=torch.float32)  # the Triton program's fp32 registers (one row)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            logits = storage[: end - start]
            torch.mm(x[start:end], weight.t(), out=logits)
            for i in range(end - start):  # liger_cross_entropy_kernel: one program per row, in place
                t = int(target[start + i])
                if t == IGNORE_INDEX:
                    logits[i].zero_()
                    continue
                row.copy_(logits[i])
                top = row.max()
                picked = row[t] - top
                total = row.sub_(top).exp_().sum()
                loss_1d[start + i] = total.log() - picked
                row.div_(total)[t] -= 1
                logits[i].copy_(row.div_(n))
            torch.mm(logits, weight, out=grad_input[start:end])
            grad_weight.addmm_(logits.t(), x[start:end])
        del storage, row
        ctx.save_for_backward(grad_input, grad_weight)
        return loss_1d.sum() / n

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_input, grad_weight = ctx.saved_tensors
        if not torch.equal(grad_output, torch.ones_like(grad_output)):
            grad_input.mul_(grad_output)
            grad_weight.mul_(grad_output)
        return grad_input, grad_weight, None
