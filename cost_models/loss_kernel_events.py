"""A loss kernel's tensors in order, for the step replay (step_allocations.py): Liger's fused linear cross-entropy
and torchtitan 0.3's chunked loss, written as the bytes kernels.liger_loss_bytes / chunked_loss_bytes price, so that
the walk's live tensors peak where memory.py's "loss backward" moment does.

    forward, backward = loss_kernel_events(model, c, config, tokens)   # ("alloc" | "free", name, bytes) each

Sizes are whole tensors in bytes (loss_memory.loss_events' are per logit element). "head grad" is the head's weight
gradient (V x h in c) made inside the loss: the walk keeps it as the head's gradient to the root's post-backward;
"hidden grad" is the gradient the loss hands the final norm (freed at its backward). LossKernelWalk keys them in the
step walk (a mixin of step_walk.StepWalk).
"""

from __future__ import annotations

from . import kernels, loss_memory
from .specs import FsdpConfig, LossKernel, ModelSpec


def loss_kernel_events(model: ModelSpec, c: int, config: FsdpConfig, tokens: int,
                       head_grad: bool = True) -> tuple[tuple, tuple]:
    """(forward, backward) events of config.loss_kernel (liger or chunked) on `tokens` tokens (head_grad False: the
    head frozen, LoRA's, which makes no "head grad")."""
    if config.loss_kernel is LossKernel.LIGER:
        return liger_events(model, c, tokens, head_grad)
    return chunked_events(model, c, tokens, config.compile and config.compile_loss, head_grad)


def liger_events(model: ModelSpec, c: int, tokens: int, head_grad: bool = True) -> tuple[tuple, tuple]:
    """fused_linear_cross_entropy_forward (Liger Kernel 0.8.5): grad_weight and grad_input zeroed (kept for backward,
    where they are the head's and the hidden states' gradients: backward with grad_output 1 returns them as they are),
    loss_1d (fp32) and the target mask (bool) per row, then chunk by chunk the chunk's logits (the cross-entropy
    kernel writes their gradient in place, two matmuls fold it into grad_input and grad_weight); loss_1d and the mask
    go on return. Not written: the chunk's rows x h product before its copy into grad_input (nor priced by
    kernels.liger_loss_bytes)."""
    v, h = model.vocab_size, model.hidden_size
    rows = kernels.liger_chunk_rows(tokens, model)
    forward = [("alloc", "head grad", v * h * c)] * head_grad + [("alloc", "hidden grad", tokens * c * h),
               ("alloc", "loss_1d", tokens * 4), ("alloc", "target_mask", tokens)]
    for start in range(0, tokens, rows):
        forward += [("alloc", "chunk logits", min(rows, tokens - start) * v * c), ("free", "chunk logits", 0)]
    forward += [("free", "target_mask", 0), ("free", "loss_1d", 0)]
    return tuple(forward), (("free", "hidden grad", 0),)


def chunked_events(model: ModelSpec, c: int, tokens: int, compiled: bool,
                   head_grad: bool = True) -> tuple[tuple, tuple]:
    """torchtitan's ChunkedLossWrapper (torchtitan/components/loss.py, 0.3.0), all inside the loss call:
    GradAccumulator's fp32 buffer (4h per token), then per chunk of T / 8 tokens the head's logits (kept by the
    loop's `logits` through the loss's backward), the inner loss forward and backward (loss_memory.loss_events, its
    last gradient - the logits' - kept), the head's backward (the chunk's input gradient, the head's weight gradient:
    the first chunk's becomes .grad, a later one is added into it in place and freed), the chunk's input gradient
    cast to fp32 into the buffer; at the end the buffer cast back to c (the hidden states' gradient; fp32: the buffer
    itself). Written in the forward (the walk's loss moment, beside the last block's all-gather output, as the
    ledger's "loss backward" moment counts its prefetch)."""
    v, h = model.vocab_size, model.hidden_size
    chunk = -(-tokens // kernels.TORCHTITAN_LOSS_CHUNKS)
    forward, backward = loss_memory.loss_events(c, compiled)
    inner = [e for e in forward + backward if e[1] != "logits"]
    *inner, (_, logits_grad, _) = inner  # the last free: the logits' gradient, which the head's backward reads
    events = [("alloc", "grad acc", 4 * h * tokens)]
    for k in range(kernels.TORCHTITAN_LOSS_CHUNKS):
        weight_grad = "new head grad" if k else "head grad"
        events += [("alloc", "chunk logits", chunk * v * c)]
        events += [(kind, name, chunk * v * size) for kind, name, size in inner]
        events += [("alloc", "chunk input grad", chunk * h * c)] + [("alloc", weight_grad, v * h * c)] * head_grad
        events += [("free", logits_grad, 0), ("free", "chunk logits", 0)]
        events += [("free", "new head grad", 0)] if k and head_grad else []
        events += [("alloc", "chunk grad fp32", chunk * h * 4), ("free", "chunk grad fp32", 0)] if c != 4 else []
        events += [("free", "chunk input grad", 0)]
    if c == 4:
        return tuple(events), (("free", "grad acc", 0),)
    events += [("alloc", "hidden grad", tokens * h * c), ("free", "grad acc", 0)]
    return tuple(events), (("free", "hidden grad", 0),)


class LossKernelWalk:
    """step_walk.StepWalk's loss kernel (a mixin ahead of its bases)."""

    def kernel_loss(self, events, s: int, mb: int) -> None:
        """A loss kernel's tensors (loss_kernel_events, whole bytes): its "head grad" the head's weight gradient (tied:
        the table's, wgrad 1; else wgrad 2, beside the final norm's wgrad 0), kept to the root's post-backward."""
        head = ("wgrad", s, "head", 0) if self.edges else ("wgrad", s, 0, 1 if self.model.tied_embeddings else 2)
        for kind, name, size in events:
            key = head if name == "head grad" else ("loss", name, s, mb)
            if kind == "alloc":
                self.alloc(key, size)
            else:
                self.free(key)
