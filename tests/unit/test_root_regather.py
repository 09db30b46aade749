"""The root gathered a second time at its pre-backward (cost_models/root_regather.py): the planner's FSDP2 code passes
the root an explicit reshard_after_forward=True under FULL_SHARD, so torch 2.13's lazy init does not keep it gathered
(_fsdp_state.py:205, `if self._auto_reshard_after_forward`), its post-forward reshards it and its pre-backward
all-gathers it again. Traced figures: `planner.tracing.trace(arch_config(arch), gpus, attention="sdpa", **knobs)`
(fake tensors, ~25 s each) quoted here; each estimate takes ~0.3 s."""

import pytest

from benchmarks.memory_accuracy import arch_config
from cost_models.kernels import EAGER
from cost_models.root_regather import loss_bytes_at_regather
from cost_models.specs import FsdpConfig
from planner.api import estimate
from planner.models import resolve_model
from tests.unit.test_step_allocations import _events_peak, _walk

QWEN3 = dict(attention="sdpa", micro_batch=1, precision="fp32", activation_checkpointing="none", seq_len=64,
             sharding="FULL_SHARD")


def test_qwen3_peaks_with_the_root_gathered_again():
    """qwen3 (h 256, V 30,000 untied, 4 blocks), full fine-tuning, 8 ranks, FULL_SHARD fp32, no checkpointing, 1 x 64
    tokens: the trace peaks in the backward at 166,702,928 B, the root's 61,441,024 B all-gather output beside its
    copied-out embedding and head (30,720,000 B each) and the 7,680,000 B log-softmax output the loss saved (64 x
    30,000 x 4). The ledger -0.002% (before: -4.70%, its peak block 0's forward copy-out, 158,874,752 B); the walk
    peaks at the ledger's peak."""
    c = estimate(arch_config("qwen3"), 8, **QWEN3)
    assert c.memory.peak_moment == "root gathered again in backward"
    assert c.memory.breakdown.collective_buffers == 61_441_024
    assert c.memory.breakdown.logits_and_loss == 64 * 30_000 * 4
    assert c.memory.peak_allocated_bytes == pytest.approx(166_702_928, rel=1e-4)
    events, _ = _walk(c)
    assert _events_peak(events) == c.memory.peak_allocated_bytes


def test_lora_regathers_the_frozen_root():
    """LoRA (rank 16, frozen base): the frozen root is a unit too, resharded and gathered again. qwen3, the same knobs:
    the trace peaks at 145,531,668 B at this moment (all-gather output and copies 61,441,024 B each, the log-softmax
    output 7,680,000 B); the ledger -0.002% (before: -3.56%, block 0's forward copy-out); the walk at the ledger's."""
    c = estimate(arch_config("qwen3"), 8, finetune="lora", **QWEN3)
    assert c.memory.peak_moment == "root gathered again in backward"
    assert c.memory.peak_allocated_bytes == pytest.approx(145_531_668, rel=1e-4)
    events, _ = _walk(c)
    assert _events_peak(events) == c.memory.peak_allocated_bytes


def test_two_ranks_as_the_real_run():
    """The same on 2 ranks: a real gloo run (torchrun, 2 CPU ranks, calibration.apply.apply_fsdp2 and the trace's
    measuring loop, 2026-12-07) peaked at 252,350,672 B, the root sharded after forward and unsharded from its shards at
    PRE_BACKWARD (with the root's flag set as an unset reshard_after_forward leaves it, it stays gathered and the run
    peaks at 248,163,268 B); the trace agrees to the byte. The ledger -0.001%."""
    c = estimate(arch_config("qwen3"), 2, **QWEN3)
    assert c.memory.peak_moment == "root gathered again in backward"
    assert c.memory.peak_allocated_bytes == pytest.approx(252_350_672, rel=1e-4)


def test_zero2_keeps_the_root():
    """SHARD_GRAD_OP passes reshard_after_forward=False: no second gather. The trace (same knobs) peaks in the forward at
    158,876,220 B, block 0's copy-out beside the root's all-gather output, the ledger's moment (-0.001%)."""
    c = estimate(arch_config("qwen3"), 8, **{**QWEN3, "sharding": "SHARD_GRAD_OP"})
    assert c.memory.peak_moment == "forward all-gather copy-out of block 0"
    assert c.memory.peak_allocated_bytes == pytest.approx(158_876_220, rel=1e-4)


@pytest.mark.parametrize("precision, compiled, per_logit", [("fp32", False, 4), ("bf16", False, 4), ("bf16", True, 2)])
def test_the_loss_bytes_at_the_regather(precision, compiled, per_logit):
    """By hand (loss_memory.loss_events): the eager loss's forward leaves log_softmax's fp32 output (4 B a logit, the
    c-byte logits and their fp32 copy freed); a compiled loss's backward, done before the root's hook on the logits,
    leaves their gradient (c B a logit). Llama 3 8B, 2,048 tokens: 2,048 x 128,256 x 4 = 1,050,673,152 B."""
    config = FsdpConfig(precision=precision, compile=compiled, compile_loss=compiled)
    c = 4 if precision == "fp32" else 2
    got = loss_bytes_at_regather(resolve_model("llama3-8b"), c, config, EAGER, 2048, head_grad=True)
    assert got == 2048 * 128_256 * per_logit
