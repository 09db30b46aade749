"""Next-token cross-entropy with the memory of a compiled (fused) loss, for the trace tier.

torch.compile of the loss (torchtitan's compile.components "loss"; calibration/runner.py) becomes one
inductor kernel each way: the forward saves the logits in their own dtype and a per-row log-sum-exp,
never an fp32 copy; the backward writes the logits' gradient in their dtype (cost_models/activations.py,
loss_events). The trace runs on fake tensors, where inductor cannot run, so this autograd function does
the same work in row chunks: the fp32 working set is one chunk, the tensors of V per token are the saved
logits and their gradient, as in the compiled step.
"""

from __future__ import annotations

import torch

CHUNKS = 64  # the fp32 working set is 1/64 of the logits' rows: 4/64 bytes per logit element beside their 2c


IGNORE_INDEX = -100  # Hugging Face's label for "no target" (the padded last position)


class _FusedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over rows whose target is not IGNORE_INDEX."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        kept = targets != IGNORE_INDEX
        safe = torch.where(kept, targets, 0)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows in _chunks(logits.shape[0]):
            chunk = logits[rows].float()
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(1, safe[rows, None]).squeeze(1)
            total = total + ((lse[rows] - picked) * kept[rows]).sum()
        count = kept.sum().clamp(min=1)
        ctx.save_for_backward(logits, safe, kept, lse, count)
        return total / count

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, safe, kept, lse, count = ctx.saved_tensors
        grad = torch.empty_like(logits)
        scale = grad_output.float() / count
        for rows in _chunks(logits.shape[0]):
            probs = logits[rows].float().sub_(lse[rows, None]).exp_()   # in place: one fp32 chunk
            probs.scatter_add_(1, safe[rows, None], torch.full_like(probs[:, :1], -1.0))
            grad[rows].copy_(probs.mul_(scale * kept[rows, None]))      # the cast inside the copy
        return grad, None


def _chunks(n_rows: int):
    step = max(1, -(-n_rows // CHUNKS))
    return [slice(start, start + step) for start in range(0, n_rows, step)]


def shifted_targets(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets of every position, the last one ignored (Hugging Face's ForCausalLMLoss pads
    the labels rather than slicing the logits, so the (batch, seq, V) logits are never copied)."""
    return torch.nn.functional.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX).flatten()


def fused_causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (batch, seq, V) logits, as calibration.reference.causal_lm_loss."""
    return _FusedCrossEntropy.apply(logits.flatten(0, 1), shifted_targets(ids))
