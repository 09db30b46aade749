"""An MoE step's allocations at pp = 1 (cost_models/moe_events.py under step_allocations._FullStepWalk, LoRA's
under _LoraStepWalk): the walk's live tensors peak at the memory ledger's allocated peak, and the estimate reports the
replay's reserved. No trace runs here: the traced figures are benchmarks/memory_accuracy.py's (the trace tier,
planner.tracing.trace on fake tensors), quoted where they are used. Each estimate here takes ~0.3 s of CPU."""

import pytest

from benchmarks.memory_accuracy import arch_config
from cost_models.moe_events import moe_block_tensors
from cost_models.step_allocations import replays, step_replay
from planner.api import estimate
from tests.unit.test_step_allocations import EP_FLAT, _events_peak, _walk  # (live peak, a walk)

ON_8 = dict(gpu="h100-80gb", seq_len=2048)


@pytest.mark.parametrize("model, knobs", [
    # the backward's gradients: the ledger's 2,403,352,576 B at block 1's recompute (the stacked down projection's
    # and the head's), the walk's 1,006,600,192 B short before its blocks had the model's tensors
    ("mixtral-8x7b", dict(micro_batch=2, activation_checkpointing="full", precision="fp32")),
    # the last block's forward copy-out beside its input and inputs_embeds: 2 x 4,096 x 4,096 x 2 = 67,108,864 B short
    ("mixtral-8x7b", dict(micro_batch=2, activation_checkpointing="none", finetune="lora")),
    # every-2: block 2 (checkpointed, block 1 prefetched) leads; the ledger's candidates lacked it (+0.54%)
    ("mixtral-8x7b", dict(micro_batch=1, activation_checkpointing="every-2", precision="fp32")),
    ("qwen3-30b-a3b", dict(micro_batch=1, activation_checkpointing="none", precision="fp32")),
    # 8 experts on 16 ranks: the stacked experts and the router padded to 16 rows (their shards, all-gathers,
    # reduce-scatters and states twice their size), the gradients not
    ("mixtral-8x7b", dict(micro_batch=2, activation_checkpointing="full", precision="fp32", gpus=16)),
], ids=["mixtral-fp32-full", "mixtral-lora-none", "mixtral-fp32-every-2", "qwen3-fp32-none", "mixtral-padded-on-16"])
def test_an_moe_step_allocates_the_ledgers_peak(model, knobs):
    """8 x h100-80gb, 2,048 tokens a sequence: the walk's live tensors peak at the ledger's allocated peak to the byte
    (docs/accuracy.md "MoE's step replayed": 126 of 128 of micro-batch 1 / 2 x every checkpointing mode x bf16 / fp32 x
    FSDP / SHARD_GRAD_OP x full / LoRA on Mixtral 8x7B and Qwen3 30B-A3B), and the estimate reports the replay's
    reserved."""
    knobs = {**ON_8, **knobs}
    c = estimate(model, knobs.pop("gpus", 8), **knobs)
    assert replays(c.model, c.training, c.config, c.config.shard_group_size(c.cluster)) is None
    events, _ = _walk(c)
    assert _events_peak(events) == c.memory.peak_allocated_bytes
    assert any("replayed through the caching allocator" in n for n in c.memory.notes)


def test_a_sparse_blocks_tensors():
    """Mixtral 8x7B's block by hand: q and o 4,096 x 4,096, k and v 1,024 x 4,096, the router 8 x 4,096, the stacked
    gate_up 8 x 28,672 x 4,096 and down 8 x 4,096 x 14,336, two norms of 4,096 - the block's 1,451,270,144 exactly.
    gpt-oss 20B: each stacked bias (32 x 5,760, 32 x 2,880) one tensor with its matrix."""
    c = estimate("mixtral-8x7b", 8, **ON_8)
    assert moe_block_tensors(c.model, c.model.block_params) == [
        16_777_216, 4_194_304, 4_194_304, 16_777_216, 32_768, 939_524_096, 469_762_048, 4_096, 4_096]
    oss = estimate("gpt-oss-20b", 8, **ON_8).model
    tensors = moe_block_tensors(oss, oss.block_params)
    assert tensors[5:7] == [32 * (2 * 2_880 * 2_880 + 5_760), 32 * (2_880 * 2_880 + 2_880)]
    assert sum(tensors) == oss.block_params


def test_what_keeps_moe_on_the_flat_rule():
    """Flat: experts sharded on dim 1, expert units (EP among them) with CPU offload, EP with LoRA. Walked: dense blocks
    and padded experts under LoRA (lora_dense_events.py, lora_expert_unit_events.py), padded full fine-tuning (Qwen2-MoE's
    1 x 2,048 shared-expert gate padded to 4 rows, Mixtral's 8 experts on 16), experts as units of their own, with
    expert parallelism or without (expert_unit_events.py; test_ep_step_allocations.py)."""
    def why(model, gpus, **knobs):
        c = estimate(model, gpus, **{**ON_8, **knobs})
        return replays(c.model, c.training, c.config, c.config.shard_group_size(c.cluster))

    assert why("mixtral-8x7b", 16, ep=2) is None
    assert why("mixtral-8x7b", 16, ep=2, offload=True) == EP_FLAT
    assert why("mixtral-8x7b", 16) is None and why("qwen2-moe-a2.7b", 4) is None
    assert why("mixtral-8x7b", 16, finetune="lora") is None  # padded experts under LoRA walked (lora_expert_unit_events)
    assert why("deepseek-v2-lite", 8) is None  # dense blocks walked (test_moe_dense_blocks_allocations.py)
    # dense blocks under LoRA walked (lora_dense_events.py)
    assert why("deepseek-v2-lite", 8, finetune="lora") is None and why("deepseek-v2-lite", 16, ep=2) is None
    assert why("mixtral-8x7b", 8, expert_units=True) is None
    # expert units under LoRA walked, padded too (lora_expert_unit_events.py)
    assert why("mixtral-8x7b", 8, expert_units=True, finetune="lora") is None
    assert why("mixtral-8x7b", 16, expert_units=True, finetune="lora") is None
    assert why("mixtral-8x7b", 16, expert_shard_dim=1) == "MoE experts sharded on dim 1"


def test_padded_tensors():
    """Mixtral on 16 ranks by hand: the router 16 x 4,096 (8 rows padded), gate_up 16 x 28,672 x 4,096 and down
    16 x 4,096 x 14,336; attention and norms unpadded (the ledger's rule: moe.small_dim0_tensors)."""
    c = estimate("mixtral-8x7b", 16, **ON_8)
    assert moe_block_tensors(c.model, c.model.block_params, 16) == [
        16_777_216, 4_194_304, 4_194_304, 16_777_216, 65_536, 1_879_048_192, 939_524_096, 4_096, 4_096]


def test_against_the_traces_replay():
    """memory_accuracy.py --families 2026 row 5 (mixtral: h 512, 8 experts of f 1,408, 4 blocks; FULL_SHARD bf16 on 8
    ranks, no checkpointing, sdpa, 2 x 2,048 tokens): the trace's allocated peak 668.7 MiB, its replay's reserved
    796.0 MiB; the ledger 668.5 MiB and the walk to the byte; the estimate's replay 796.0 MiB (+0.0%; the flat rule
    767.6, -3.6%). Tolerance 1% (the replay's band on this row; 17 rows' median 1.7%, docs/accuracy.md)."""
    c = estimate(arch_config("mixtral"), 8, sharding="FULL_SHARD", precision="bf16", activation_checkpointing="none",
                 attention="sdpa", micro_batch=2, seq_len=2048, gpus_per_node=8)
    events, _ = _walk(c)
    assert _events_peak(events) == c.memory.peak_allocated_bytes
    assert c.memory.peak_allocated_bytes / 2**20 == pytest.approx(668.7, rel=0.001)
    replayed = step_replay(c.model, c.cluster, c.training, c.config, snapshots=False).peak_reserved_bytes
    assert c.memory.allocator_reserved_bytes == replayed
    assert replayed / 2**20 == pytest.approx(796.0, rel=0.01)
