"""The root unit gathered a second time, at its pre-backward (memory.py's ledger, issue 27).

The planner's FSDP2 code (planner/emit, calibration/apply.py) passes reshard_after_forward to the root's fully_shard
explicitly (True under FULL_SHARD / HYBRID_SHARD). torch 2.13 keeps the root gathered after forward only when it was
left unset: FSDPState._lazy_init (torch/distributed/fsdp/_fully_shard/_fsdp_state.py:205) clears the root's
post_forward_mesh_info `if self._auto_reshard_after_forward`, which fully_shard sets to `reshard_after_forward is
None` (_fully_shard.py:246). So the root's post-forward reshards it like any unit, and its pre-backward hook (on the
model's outputs) all-gathers it again: FSDPParamGroup.pre_backward -> unshard + wait_for_unshard (the all-gather output
beside the copied-out parameters, the output freed after the copy-out), then the last block's prefetch. With the loss
inside the model's forward (Hugging Face's, a loss kernel's) that is before the loss's backward, beside what the loss
saved for it; with a compiled loss run on the returned logits, after it, beside the logits' gradient. Either way every
block's saved tensors are alive. Where the root outweighs a block and the logits are small (short sequences, large
vocabularies in fp32) this moment leads: qwen3 (h 256, V 30,000, untied) full fine-tuning FULL_SHARD fp32, 1 x 64
tokens on 8 ranks, the trace's peak 166,702,928 B is this moment (docs/accuracy.md, 2026-12-07).
"""

from __future__ import annotations

import functools

from . import loss_memory, tensor_parallel
from .kernels import Kernels
from .loss_kernel_events import loss_kernel_events
from .specs import FsdpConfig, LossKernel, ModelSpec


def _net_bytes(events) -> int:
    """Bytes an event list leaves allocated (frees named after their alloc; a free's own size is ignored)."""
    live: dict[str, int] = {}
    for kind, name, size in events:
        if kind == "alloc":
            live[name] = live.get(name, 0) + size
        else:
            live.pop(name, None)
    return sum(live.values())


@functools.lru_cache(maxsize=None)
def _eager_bytes_per_logit(c: int, compiled: bool, parallel: bool) -> int:
    """Bytes per logit element the eager (or compiled) loss's forward leaves allocated (loss_memory.events)."""
    return _net_bytes(loss_memory.events(c, compiled, parallel)[0])


def loss_bytes_at_regather(model: ModelSpec, c: int, config: FsdpConfig, kernels: Kernels, tokens: int,
                           head_grad: bool) -> int:
    """The loss's tensors alive at the root's pre-backward: what its forward leaves for its backward (eager: the
    log-softmax output; a loss kernel: its gradients, loss_kernel_events), or after a compiled loss's backward the
    logits' gradient (c per logit, the bytes its forward kept); a soft-capped model's tanh output beside them. Priced
    once per ledger shape (memory_shape.LedgerShape.loss_at_regather), the eager loss's bytes once per logit width."""
    v = model.vocab_size
    softcap = tokens * c * v if model.logit_softcap else 0
    if kernels.loss is not LossKernel.EAGER:
        return _net_bytes(loss_kernel_events(model, c, config, tokens, head_grad)[0]) + softcap
    return _eager_bytes_per_logit(c, config.loss_compiled, tensor_parallel.loss_parallel(config)) * tokens * v + softcap


def regather_moment(loss_moment, root_gathered: int, loss_bytes: int):
    """The root's pre-backward after its post-forward resharded it: loss_moment (memory.py's "loss backward", the
    root gathered and every block's saved tensors) with the root's all-gather output in place of the last block's
    prefetch (issued after this copy-out) and the loss's tensors of that moment (loss_bytes_at_regather)."""
    return loss_moment._replace(collective_buffers=root_gathered, logits_and_loss=loss_bytes)
