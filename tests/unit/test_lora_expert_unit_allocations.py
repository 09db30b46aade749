"""LoRA with each sparse block's routed experts an FSDP unit of their own (cost_models/lora_expert_unit_events.py under
step_allocations._LoraStepWalk): the walk's live tensors peak at the memory ledger's allocated peak and the estimate
reports the replay's reserved. The traced figures are the trace tier's (`PYTHONPATH=$PWD .venv/bin/python
benchmarks/memory_accuracy.py --families 2026 --expert-units --finetune lora --jobs 1`, planner.tracing.trace on fake
tensors), quoted where used; no trace runs here. Each estimate takes ~0.2 s of CPU."""

import pytest

from benchmarks.memory_accuracy import arch_config
from cost_models.step_allocations import replays, step_replay
from planner.api import estimate
from planner.errors import PlannerError
from tests.unit.test_step_allocations import _events_peak, _walk

# the expert-units grid's row 3: Mixtral (h 512, 8 experts, 4 blocks) on 8, FULL_SHARD bf16, no AC, 2 x 2,048 tokens
ROW_3 = dict(sharding="FULL_SHARD", precision="bf16", activation_checkpointing="none", attention="sdpa", micro_batch=2,
             seq_len=2048, gpus_per_node=8, expert_units=True, finetune="lora", lora_rank=16)


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
    (-5.2%), the replay 700,448,768 (-3.7%). The ledger (= the walk) within 0.02% of the trace's allocated."""
    c = estimate(arch_config("mixtral"), 8, **ROW_3)
    assert c.memory.peak_allocated_bytes == pytest.approx(591_528_392, rel=0.0002)
    replayed = step_replay(c.model, c.cluster, c.training, c.config, snapshots=False).peak_reserved_bytes
    assert c.memory.allocator_reserved_bytes == replayed == 700_448_768
    assert replayed == pytest.approx(727_711_744, rel=0.04)


def test_all_linear_with_expert_units_is_refused():
    """peft's all-linear on an MoE with the experts a unit of their own: the trace's step fails (peft registers its
    merged-weight parametrization on the experts module before FSDP2 gathers it: baddbmm on the sharded DTensor), so
    the estimate refuses it (moe_lora.refusals) rather than price a step that does not run."""
    with pytest.raises(PlannerError, match="moe-all-linear-expert-units|expert_units: experts as FSDP units"):
        estimate(arch_config("mixtral"), 8, **ROW_3, lora_targets="all-linear")
