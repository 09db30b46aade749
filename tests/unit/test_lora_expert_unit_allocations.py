"""LoRA with each sparse block's routed experts an FSDP unit of their own (cost_models/lora_expert_unit_events.py under
step_allocations._LoraStepWalk): the walk's live tensors peak at the memory ledger's allocated peak and the estimate
reports the replay's reserved. The traced figures are the trace tier's (`PYTHONPATH=$PWD .venv/bin/python
benchmarks/memory_accuracy.py --families 2026 --expert-units --finetune lora --jobs 1`, planner.tracing.trace on fake
tensors), quoted where used; no trace runs here. Each estimate takes ~0.2 s of CPU."""

import pytest

from benchmarks.memory_accuracy import arch_config
from cost_models import moe
from cost_models.step_allocations import replays, step_replay
from planner.api import estimate
from planner.errors import PlannerError
from tests.unit.test_step_allocations import _events_peak, _walk

# the expert-units grid's row 3: Mixtral (h 512, 8 experts, 4 blocks) on 8, FULL_SHARD bf16, no AC, 2 x 2,048 tokens
ROW_3 = dict(sharding="FULL_SHARD", precision="bf16", activation_checkpointing="none", attention="sdpa", micro_batch=2,
             seq_len=2048, gpus_per_node=8, expert_units=True, finetune="lora", lora_rank=16)
# row 5's and row 9's (the padded rows: 8 experts on 128 ranks) settings over row 3's
ROW_5 = dict(precision="fp32", activation_checkpointing="every-2", attention="eager", micro_batch=1)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek-v3"])
def test_lora_expert_units_allocate_the_ledgers_peak(arch):
    """Walk == ledger on all 17 unpadded rows of the grid (DeepSeek's dense block beside the sparse ones within 4 B:
    the shards' ceil); the frozen experts gathered and resharded, never reduced."""
    c = estimate(arch_config(arch), 8, **ROW_3)
    assert replays(c.model, c.training, c.config, 8) is None
    events, _ = _walk(c)
    assert _events_peak(events) == pytest.approx(c.memory.peak_allocated_bytes, abs=4)
    assert not any(e[0] == "alloc" and e[1][0] == "rs_in" and isinstance(e[1][2], tuple) for e in events)
    assert any("replayed through the caching allocator" in note for note in c.memory.notes)


def test_against_the_traces_replay():
    """Row 3: the trace 591,528,392 B allocated, its replay 727,711,744 B (694.0 MiB); the flat rule said 689,848,387
    (-5.2%), the replay 700,448,768 (-3.7%), with the experts' forward un-permute in the walk
    (ExpertUnitsHooks.forward_unpermute) 742,391,808 (+2.0%). The ledger (= the walk) within 0.02% of the trace's
    allocated."""
    c = estimate(arch_config("mixtral"), 8, **ROW_3)
    assert c.memory.peak_allocated_bytes == pytest.approx(591_528_392, rel=0.0002)
    replayed = step_replay(c.model, c.cluster, c.training, c.config, snapshots=False).peak_reserved_bytes
    assert c.memory.allocator_reserved_bytes == replayed == 742_391_808
    assert replayed == pytest.approx(727_711_744, rel=0.03)


def test_all_linear_with_expert_units_is_refused():
    """peft's all-linear on an MoE with the experts a unit of their own: the trace's step fails (peft registers its
    merged-weight parametrization on the experts module before FSDP2 gathers it: baddbmm on the sharded DTensor), so
    the estimate refuses it (moe_lora.refusals) rather than price a step that does not run."""
    with pytest.raises(PlannerError, match="moe-all-linear-expert-units|expert_units: experts as FSDP units"):
        estimate(arch_config("mixtral"), 8, **ROW_3, lora_targets="all-linear")


def test_padded_experts_under_lora():
    """On 128 ranks (fp32, every-2, eager, 1 x 2,048) the 8 experts' stacks and the router are padded to 128 rows: the
    walk pads them as the ledger does (their shards and all-gathers), so qwen3-moe's row 9 is walked == ledger
    (773,620,328 B; trace 773,678,064) where LoRA with padded experts kept the flat rule; its reserved 1,054.0 MiB in the
    trace's replay, flat -26.5%, the replay -11.0%. Mixtral's row 5: walk == ledger at the last block's experts' forward
    copy-out with the un-permute's working set (test_the_padded_experts_copy_out_in_forward_and_backward; the walk's
    ExpertUnitsHooks.forward_unpermute), 821,511,752 B against the trace's peak there, 821,577,640 (before the walk
    made the un-permute it peaked in backward, 808,797,768, 12,713,984 B under the ledger)."""
    row = {**ROW_3, **ROW_5}
    for arch, traced in [("qwen3-moe", 773_678_064), ("mixtral", 821_577_640)]:
        c = estimate(arch_config(arch), 128, **row)
        assert replays(c.model, c.training, c.config, 128) is None
        walk = _events_peak(_walk(c)[0])
        assert walk == pytest.approx(c.memory.peak_allocated_bytes, abs=16)
        assert walk == pytest.approx(traced, rel=0.0005)


def test_the_padded_experts_copy_out_in_forward_and_backward():
    """Row 5 (Mixtral on 128, fp32, every-2, eager, 1 x 2,048; its 8 experts padded to 128 rows, 16 x the rank's): the
    experts' all-gather output (201,326,592 B) and the unsharded experts copied out of it alive at once
    (expert_unit_terms.copy_out_moment). In forward (the trace's peak, 821,577,640 B: planner.tracing.trace, its
    allocation events labelled by op, the second step) at the last block's un-permute (aten.index, transformers
    integrations/moe.py:528), beside the saved tensors below and the block's own and what the experts' forward holds
    besides: the router's input and the gathered rows (not saved under LoRA), the weighted rows and their un-permuted
    copy, the router's logits, top-k weights, sorted ids and histc's input: 14,811,136 B = 2,048 x 7,232. In backward
    the same experts gathered again (808,863,632 live, test_padded_experts_under_lora). Before: the backward's moment
    led, 808,797,768 (-1.6%); before that the loss in forward, 737,066,568 (-10.3%)."""
    c = estimate(arch_config("mixtral"), 128, **{**ROW_3, **ROW_5})
    assert moe.forward_unpermute_bytes_per_token(c.model, 4, lora=True) == 7_232 == 14_811_136 // 2_048
    assert c.memory.peak_moment == "forward of block 3's experts (their all-gather copied out)"
    assert c.memory.breakdown.collective_buffers == 201_326_592
    assert c.memory.peak_allocated_bytes == pytest.approx(821_577_640, rel=0.0005)


def test_padded_experts_under_lora_without_expert_units():
    """Qwen2-MoE (memory_accuracy.py's, its 1 x h shared-expert gate padded to d rows) on 8, the expert-units grid's row
    3 settings without expert units (row 23 of --families 2026 --finetune lora): its sparse blocks cut as
    moe_block_tensors padded at d, walk == ledger 939,912,512 B (trace 940,043,976); reserved 1,134,559,232 B against
    the trace's replay 1,149,239,296 (-1.3%) where LoRA with padded experts kept the flat rule (1,115,932,137, -2.9%)."""
    row = {k: v for k, v in ROW_3.items() if k != "expert_units"}
    c = estimate(arch_config("qwen2-moe"), 8, **row)
    assert replays(c.model, c.training, c.config, 8) is None
    assert _events_peak(_walk(c)[0]) == c.memory.peak_allocated_bytes == 939_912_512
    assert c.memory.allocator_reserved_bytes == 1_134_559_232
    assert c.memory.allocator_reserved_bytes == pytest.approx(1_149_239_296, rel=0.02)


@pytest.mark.parametrize("arch, traced", [("mixtral", 622_613_896), ("qwen3-moe", 957_962_248)])
def test_lora_expert_units_on_a_shard_group_of_one(arch, traced):
    """Row 3's settings on 1 GPU (a shard group of one rank: FSDP2 gathers nothing, wait_for_unshard casts and copies
    each parameter, one_rank_events.py): the experts' unit goes through OneRankWalk as the block's does, its frozen
    tensors cast from frozen_p (the walk raised TypeError there: LoraWalk.stored_width compared the experts' unit key,
    a tuple, with an int). Walk == ledger; the trace (planner.tracing.trace, memory_accuracy.run_one on this row,
    2026-12-08, quoted) 622,613,896 / 957,962,248 B allocated, the ledger -0.01% of it."""
    c = estimate(arch_config(arch), 1, **{**ROW_3, "gpus_per_node": 1})
    assert replays(c.model, c.training, c.config, 1) is None
    assert _events_peak(_walk(c)[0]) == c.memory.peak_allocated_bytes
    assert c.memory.peak_allocated_bytes == pytest.approx(traced, rel=0.0005)


def test_a_checkpointed_blocks_frozen_experts_forward_against_the_traces_replay():
    """Row 2 (Mixtral HSDP on 16, bf16, every-2, eager, 4 x 2,048; the trace's replay 3,338,665,984 B quoted,
    2026-12-08): a checkpointed block's no-grad forward makes its MoE MLP's bytes with the frozen experts gathered, cut
    as the trace's routed rows (ExpertUnitsHooks.routed_tensors), where they were one remainder before the experts'
    all-gather: the replay 2,778,726,400 (-16.8%) -> 3,200,253,952 (-4.1%), the flat rule -12.3%. Tolerance 5%."""
    row = {**ROW_3, "sharding": "HYBRID_SHARD", "activation_checkpointing": "every-2", "attention": "eager",
           "micro_batch": 4}
    c = estimate(arch_config("mixtral"), 16, **row)
    assert replays(c.model, c.training, c.config, 8) is None
    assert c.memory.allocator_reserved_bytes == 3_200_253_952
    assert c.memory.allocator_reserved_bytes == pytest.approx(3_338_665_984, rel=0.05)
