"""The loss's memory: the caching allocator's reserved bytes (cost_models/allocator.py), the eager and
compiled loss sequences (activations.loss_events), and the fused loss the trace runs for a compiled one."""

import pytest
import torch

from calibration.fused_loss import fused_causal_lm_loss
from calibration.reference import causal_lm_loss
from cost_models import activations, allocator


def test_best_fit_reuses_a_freed_block_only_when_it_fits():
    # 2 freed, then 4 requested: a new segment (2 stays reserved); then 2 requested: the cached 2 serves it.
    events = [("alloc", "a", 2), ("alloc", "b", 4), ("free", "a", 2), ("alloc", "c", 4), ("alloc", "d", 2)]
    assert allocator.reserved_peak(events) == (10, 10)
    # freed 4 serves a later 4 (no new segment): reserved 4 + 4
    assert allocator.reserved_peak([("alloc", "a", 4), ("alloc", "b", 4), ("free", "a", 4), ("alloc", "c", 4)]) == (8, 8)
    with pytest.raises(ValueError, match="alloc or free"):
        allocator.reserved_peak([("malloc", "a", 1)])


def test_eager_bf16_loss_strands_the_logits_segment():
    # By hand, bytes per logit element: logits 2, fp32 copy 4, log_softmax 4 (three segments); the copy and
    # logits freed; backward: the NLL gradient (4) takes the copy's segment, log_softmax's gradient (4) fits
    # no free block (2) -> a fourth segment; the bf16 gradient (2) reuses the logits'. Allocated peak
    # 4 + 4 + 4 = 12, reserved 2 + 4 + 4 + 4 = 14.
    assert activations._loss_bytes(2, False) == (10, 12, 14)
    assert activations._loss_bytes(4, False) == (8, 12, 12)   # fp32: no copy, nothing stranded
    assert activations._loss_bytes(2, True) == (2, 4, 4)      # compiled: saved logits + their gradient


def test_loss_parallel_holds_four_fp32_copies_in_backward():
    # By hand, bytes per element of the rank's vocab / tp logits (loss_memory.loss_parallel_events). Forward: logits
    # 2, fp32 copy 4, shifted 4, exp 4 (peak 14, four segments), exp freed, the result (4) in exp's segment, shifted,
    # copy and logits freed. Backward: zeros (4) and exp (4) take the copy's and shifted's segments, their sum (4)
    # fits no free block (logits' is 2) -> a fifth segment; exp freed, the product (4) in its segment, the sum, the
    # zeros and the saved result freed, the bf16 gradient (2) in the logits'. Allocated peak: saved + zeros + exp +
    # sum = 16 (the eager loss: 12); reserved 2 + 4 x 4 = 18.
    assert activations._loss_bytes(2, False, True) == (14, 16, 18)
    assert activations._loss_bytes(4, False, True) == (12, 16, 16)   # fp32: no copy, nothing stranded
    assert activations._loss_bytes(2, True, True) == activations._loss_bytes(2, True)   # compiled: the compiled loss


def test_compiled_loss_saves_only_the_logits():
    # What torch.compile (inductor, here on CPU) saves for the loss's backward: the bf16 logits and per-row
    # statistics, no fp32 copy of them (the 2 bytes per logit element activations.loss_events counts).
    n, v = 64, 1000
    logits = torch.randn(1, n, v, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, v, (1, n))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = torch.compile(causal_lm_loss)(logits, ids)
    loss.backward()
    assert n * v * 2 <= sum(saved) <= n * v * 2 + 64 * n   # logits + O(rows)
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_equals_eager(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 1500, 300, dtype=dtype) * 3   # 3000 rows: 64 chunks
    ids = torch.randint(0, 300, (2, 1500))
    eager, fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = causal_lm_loss(eager, ids), fused_causal_lm_loss(fused, ids)
    a.backward(), b.backward()
    assert b.item() == pytest.approx(a.item(), rel=1e-5)
    assert torch.allclose(fused.grad.float(), eager.grad.float(), atol=1e-7 if dtype == torch.float32 else 2e-5)
    assert fused.grad[:, -1].abs().sum() == 0   # the padded last position has no target


def test_the_walks_keep_gemma2s_soft_capped_tanh_output():
    """Gemma 2 soft-caps its logits inside the model (cap * tanh(logits / cap)): tanh saves its output, c per logit,
    which the ledger holds at the loss backward (logits_bytes_per_token) and the allocation walks now write too
    (loss_memory.events with the model). memory_accuracy.py's gemma2 (V 32,000), bf16, 2 x 1,024 tokens on 8: 2,048 x
    32,000 x 2 B = 131,072,000 B, what the walk had below the ledger (-9.45% without checkpointing, -13.5% with);
    walk == ledger now, full fine-tuning and LoRA. Reserved against the trace's replay (docs/accuracy.md, 2026-12-07
    night): gemma2's 10 rows median 11.9% -> 6.6% (full), 13.1% -> 6.0% (LoRA)."""
    from benchmarks.memory_accuracy import arch_config
    from cost_models import loss_memory
    from planner.api import estimate
    from tests.unit.test_step_allocations import _events_peak, _walk

    for finetune in ("full", "lora"):
        c = estimate(arch_config("gemma2"), 8, gpu="h100-80gb", seq_len=1024, finetune=finetune, precision="bf16",
                     activation_checkpointing="none", micro_batch=2, global_batch=16)
        events, _ = _walk(c)
        tanh = [e for e in events if e[0] == "alloc" and e[1][:2] == ("loss", "softcap tanh")]
        assert tanh and tanh[0][2] == 131_072_000
        assert _events_peak(events) == c.memory.peak_allocated_bytes
    forward, backward = loss_memory.events(2, False, model=c.model)
    assert forward[0] == ("alloc", "softcap tanh", 2) and backward[-2] == ("free", "softcap tanh", 2)
    assert loss_memory.events(2, False) == loss_memory.loss_events(2, False)
