"""The loss's activation memory: the logits, their fp32 copy and log-softmax, forward and backward, per token
(moved from activations.py, which re-exports these names; allocator.py replays the events)."""

from __future__ import annotations

import functools

from . import allocator
from .specs import ModelSpec


def loss_events(compute_bytes: int, compiled: bool) -> tuple[tuple, tuple]:
    """The loss's tensors of V elements per token, in order: (forward, backward) events (bytes per logit
    element; allocator.py).

    Eager (Hugging Face's ForCausalLMLoss, torchtitan's cross_entropy_loss): the head writes the logits
    (c), `.float()` copies them to fp32 unless they are, log_softmax writes (and saves) its fp32 output,
    the copy and the logits are freed (the training loop drops the model output before backward:
    Trainer's training_step, torchtitan's `del pred`). Backward: the NLL's gradient (4), log_softmax's
    (4) beside its saved output, then the cast back to c. Compiled (torch.compile of the loss, one
    inductor kernel each way, read from the generated code): forward saves the c logits and per-row
    statistics, backward writes the c gradient."""
    c = compute_bytes
    if compiled:
        return (("alloc", "logits", c),), (("alloc", "grad", c), ("free", "logits", c), ("free", "grad", c))
    cast = c != 4
    forward = (("alloc", "logits", c), *((("alloc", "fp32 copy", 4),) if cast else ()), ("alloc", "log_softmax", 4),
               *((("free", "fp32 copy", 4),) if cast else ()), ("free", "logits", c))
    backward = (("alloc", "nll grad", 4), ("alloc", "log_softmax grad", 4), ("free", "nll grad", 4),
                ("free", "log_softmax", 4), *((("alloc", "grad", c),) if cast else ()),
                ("free", "log_softmax grad", 4), *((("free", "grad", c),) if cast else ()))
    return forward, backward


def loss_parallel_events(compute_bytes: int) -> tuple[tuple, tuple]:
    """Loss parallel's tensors (torch.distributed.tensor.parallel.loss, torch 2.13: torchtitan's loss under TP with
    sequence parallel), per element of the rank's vocab / tp logits, in order (loss_events' format). Forward,
    _log_softmax: the logits (c), `.float()`'s copy unless they are fp32, shifted = x - max, exp(shifted) freed once
    summed, the result shifted - logsumexp (saved), then shifted and the copy freed. Backward,
    _nll_loss_and_log_softmax_backward (it does log_softmax's backward too, to save an all-gather): grad_input =
    zeros_like(x), exp(x), their sum (exp freed), its product with the incoming gradient (the sum freed),
    grad_input and the saved result freed, then the cast back to c. Peak: four fp32 copies in backward, where the
    eager loss holds three (both ledgers read it: logits_bytes_per_token(parallel=True)); the trace of a pp 2 x tp 2
    rank holds these tensors in this order (docs/accuracy.md), and a pp 1 x tp 2 Gemma 2 trace the soft-cap's tanh
    output beside them."""
    c = compute_bytes
    cast = c != 4
    forward = (("alloc", "logits", c), *((("alloc", "fp32 copy", 4),) if cast else ()), ("alloc", "shifted", 4),
               ("alloc", "exp", 4), ("free", "exp", 4), ("alloc", "log_softmax", 4), ("free", "shifted", 4),
               *((("free", "fp32 copy", 4),) if cast else ()), ("free", "logits", c))
    backward = (("alloc", "grad_input", 4), ("alloc", "exp", 4), ("alloc", "sum", 4), ("free", "exp", 4),
                ("alloc", "log_softmax grad", 4), ("free", "sum", 4), ("free", "grad_input", 4),
                ("free", "log_softmax", 4), *((("alloc", "grad", c),) if cast else ()),
                ("free", "log_softmax grad", 4), *((("free", "grad", c),) if cast else ()))
    return forward, backward


def events(compute_bytes: int, compiled: bool, parallel: bool = False,
           model: ModelSpec | None = None) -> tuple[tuple, tuple]:
    """The loss's events: loss parallel's (parallel, an eager loss on vocab / tp logits), else loss_events'. With a
    model that soft-caps its logits (Gemma 2: cap * tanh(logits / cap) inside the model; the allocation walks pass
    it) tanh's saved output too, c per logit (logits_bytes_per_token's c*V), made before the logits and freed by
    tanh's backward, which runs on the logits' gradient (before its last free)."""
    c = compute_bytes
    forward, backward = loss_parallel_events(c) if parallel and not compiled else loss_events(c, compiled)
    if model is None or not model.logit_softcap:
        return forward, backward
    return (("alloc", "softcap tanh", c), *forward), (*backward[:-1], ("free", "softcap tanh", c), backward[-1])


@functools.lru_cache(maxsize=None)
def _loss_bytes(compute_bytes: int, compiled: bool, parallel: bool = False) -> tuple[int, int, int]:
    """(forward peak, peak allocated, peak reserved) bytes per logit element of the loss (parallel: loss parallel's)."""
    forward, backward = events(compute_bytes, compiled, parallel)
    forward_peak, _ = allocator.reserved_peak(forward)
    peak, reserved = allocator.reserved_peak(forward + backward)
    return int(forward_peak), int(peak), int(reserved)


def logits_bytes_per_token(model: ModelSpec, compute_bytes: int, compiled: bool = False,
                           parallel: bool = False) -> tuple[int, int]:
    """(kept, peak) bytes per token of the logits and the loss (loss_events).

    kept: what of it stays alive through the blocks' backward: nothing once the training loop drops the
    model output before backward; a loop that keeps `outputs` alive adds c*V. peak: eager, at the
    log-softmax backward, its saved output, the gradient arriving from the NLL loss and the gradient it
    produces: three fp32 copies, 12*V; compiled, the saved logits and their gradient, 2c*V. Logit
    soft-capping (Gemma 2: cap * tanh(logits / cap), inside the model) keeps the tanh output (c*V) until
    its backward. parallel: loss parallel's events on the rank's vocab / tp (loss_parallel_events: four fp32 copies).
    """
    v = model.vocab_size
    return 0, _loss_bytes(compute_bytes, compiled, parallel)[1] * v + (compute_bytes * v if model.logit_softcap else 0)


def logits_reserved_extra_bytes_per_token(model: ModelSpec, compute_bytes: int, compiled: bool = False) -> int:
    """Bytes per token the caching allocator holds reserved above the loss's allocated peak: eager bf16, the
    logits' c-byte segment, freed before the fp32 requests of backward and too small for them (2*V)."""
    _, peak, reserved = _loss_bytes(compute_bytes, compiled)
    return (reserved - peak) * model.vocab_size


def forward_logits_bytes_per_token(model: ModelSpec, compute_bytes: int, compiled: bool = False) -> int:
    """At the end of forward: the logits, their fp32 upcast (a copy unless already fp32) and log_softmax's
    output (compiled: the logits alone); with logit soft-capping, the saved tanh output too."""
    v, c = model.vocab_size, compute_bytes
    return _loss_bytes(c, compiled)[0] * v + (c * v if model.logit_softcap else 0)
