"""The ledger's forward moments beside FSDP2's deferred all-gather free (memory.py): block 0's copy-out beside the
root's all-gather output, the last block's under SHARD_GRAD_OP, the loss inside the forward beside the last block's
all-gather output under SHARD_GRAD_OP; and a frozen head under Liger's loss (no grad_weight). The traced figures are the
trace tier's (`planner.tracing.trace(arch_config(arch), 8, attention="sdpa", **knobs)`, fake tensors, ~2-15 s each),
quoted here; each estimate takes ~0.3 s."""

import pytest

from benchmarks.memory_accuracy import arch_config
from cost_models.kernels import liger_loss_bytes
from cost_models.step_allocations import replays
from planner.api import estimate
from tests.unit.test_step_allocations import _events_peak, _walk

SMALL = dict(attention="sdpa", micro_batch=1, precision="fp32", activation_checkpointing="full")


def test_full_fine_tuning_block_0_copied_out_beside_the_root():
    """llama3-gqa (h 512, V 16,000, 8 blocks), full fine-tuning, 8 ranks, FULL_SHARD fp32, full checkpointing, 1 x 64
    tokens: the trace's allocations peak at 223,996,204 B while the root's all-gather output (65,538,048 B) is alive
    (block 0's copy-out, in the forward); the ledger's largest forward moment is that one, -0.001% (before: not
    written). The step's peak stays the backward's (trace 229,641,780 B, the ledger -2.5%: another moment)."""
    c = estimate(arch_config("llama3-gqa"), 8, seq_len=64, sharding="FULL_SHARD", **SMALL)
    assert c.memory.phases["forward"].total_bytes == pytest.approx(223_996_204, rel=1e-4)
    assert c.memory.peak_allocated_bytes == pytest.approx(229_641_780 * (1 - 0.0246), rel=1e-3)


@pytest.mark.parametrize("arch, traced", [("llama3-gqa", 227_573_504), ("neox-parallel", 171_814_592)])
def test_zero2_last_block_copied_out_in_forward(arch, traced):
    """LoRA (rank 16), SHARD_GRAD_OP fp32, full checkpointing, 1 x 64 tokens: the trace peaks in the forward, at the
    last block's copy-out beside its all-gather output and the block below's (every block kept gathered); the ledger
    +0.06% / +0.09% (before, without the moment under ZeRO-2: -6.7% / -12.0%)."""
    c = estimate(arch_config(arch), 8, seq_len=64, sharding="SHARD_GRAD_OP", finetune="lora", **SMALL)
    assert c.memory.peak_moment == "forward all-gather copy-out of block 7"
    assert c.memory.peak_allocated_bytes == pytest.approx(traced, rel=0.002)


def test_zero2_loss_in_forward_beside_the_last_blocks_all_gather():
    """phi3-fused (Phi-3's fused qkv / gate_up), LoRA, SHARD_GRAD_OP bf16, no checkpointing, 1 x 128 tokens: the trace
    peaks in the forward at 64,504,048 B, the loss computed inside the model's forward before the root's post-forward
    frees the last block's all-gather output; the ledger -0.17% (before: -4.2%, the loss backward's moment)."""
    c = estimate(arch_config("phi3-fused"), 8, seq_len=128, sharding="SHARD_GRAD_OP", finetune="lora",
                 **{**SMALL, "precision": "bf16", "activation_checkpointing": "none"})
    assert c.memory.peak_moment == "loss in forward"
    assert c.memory.peak_allocated_bytes == pytest.approx(64_504_048, rel=0.003)


def test_liger_under_lora_makes_no_head_gradient():
    """Liger 0.8.5's fused_linear_cross_entropy_forward: grad_weight = zeros_like(weight) only `if weight_needs_grad`
    (weight.requires_grad). Llama 3 8B, bf16, 2 x 2,048 tokens: 4,096 x (2 x 4,096 + 5) = 33,574,912 B of grad_input,
    loss_1d and mask, one chunk of 128 rows x 128,256 x 2 = 32,833,536 B, and the head's 128,256 x 4,096 x 2 =
    1,050,673,152 B only where the head trains. LoRA's step with Liger is replayed, the walk makes no root gradient
    and peaks at the ledger's peak (llama3-8b 8 x h100-80gb, micro-batch 1, no checkpointing): the root gathered again
    at its pre-backward (root_regather.py, 2026-12-07; 14,851,220,480 B before, block 31's backward)."""
    c = estimate("llama3-8b", 8, gpu="h100-80gb", seq_len=2048, finetune="lora", loss_kernel="liger", micro_batch=1,
                 global_batch=16, activation_checkpointing="none")
    assert liger_loss_bytes(c.model, 2, 4096) == 1_117_081_600
    assert liger_loss_bytes(c.model, 2, 4096, head_grad=False) == 66_408_448
    assert replays(c.model, c.training, c.config, 8) is None
    events, _ = _walk(c)
    assert not any(e[1][0] == "wgrad" and e[1][2] == 0 for e in events if e[0] == "alloc")
    assert _events_peak(events) == c.memory.peak_allocated_bytes == 15_935_833_088
    assert any("replayed through the caching allocator" in n for n in c.memory.notes)


def test_llama4_lora_blocks_priced_from_their_own_trace():
    """llama4 (the 2026 grid's: a generic family, MoE blocks interleaved with dense ones), LoRA, SHARD_GRAD_OP fp32,
    no checkpointing, 1 x 64 tokens: the trace peaks at 71,960,720 B at the loss inside the forward, its four blocks
    then holding 1,053,440 + 1,711,616 + 1,053,696 + 1,627,392 = 5,446,144 B of saved activations (21,274 B a token a
    block: Llama4TextMoe runs every token through every expert, `hidden_states.repeat(num_experts, 1)`, beside a shared
    expert, and its dense blocks' MLP is intermediate_size_mlp wide); the formulas, reading the generic spec, priced
    10,076 / 8,992 and the ledger -4.26%. The block traced under LoRA (planner/models/block_profiles.py) saves
    21,274 B a token (the pattern's mean) and the ledger is -0.08%."""
    c = estimate(arch_config("llama4"), 8, seq_len=64, sharding="SHARD_GRAD_OP", finetune="lora",
                 **{**SMALL, "activation_checkpointing": "none"})
    terms = c.model.lora_activation_profile.get("fp32", "sdpa")
    assert terms.saved_bytes_per_token(64) == pytest.approx(5_446_144 / 4 / 64, abs=1)
    assert c.memory.peak_moment == "loss in forward"
    assert c.memory.peak_allocated_bytes == pytest.approx(71_960_720, rel=0.002)


def test_llama4_lora_checkpointed_blocks_hold_the_chunked_mask():
    """llama4 LoRA, FULL_SHARD bf16-pure, full checkpointing, sdpa, 1 x 8,192 on 4 (row 5 of `memory_accuracy.py
    --families 2026 --arch llama4 --finetune lora`): the trace peaks at the loss backward, 1,292,908,424 B, holding
    Llama 4's chunked-attention mask (8,192 x 8,192 bool, 67,108,864 B: SDPA gets it from a chunk of 8,192 no longer
    than the sequence on, transformers masking_utils.py:286), an input of every checkpointed block kept for its
    recompute. The block traced under LoRA holds it (checkpoint_held); the ledger took its saved bytes but the
    formulas' held inputs (the rotary table alone): 1,225,700,992 (-5.2%). Now the profile's: -0.003%."""
    c = estimate(arch_config("llama4"), 4, seq_len=8192, sharding="FULL_SHARD", gpus_per_node=4, finetune="lora",
                 **{**SMALL, "precision": "bf16-pure"})
    held = c.model.lora_activation_profile.get("bf16", "sdpa").checkpoint_held_bytes(1, 8192)
    assert held == 8192 * 8192 + 8192 * 16 * 8 + 8192 * 8  # the mask, the complex64 rotary freqs, the positions
    assert c.memory.peak_moment == "loss backward"
    assert c.memory.peak_allocated_bytes == pytest.approx(1_292_908_424, rel=0.0005)
