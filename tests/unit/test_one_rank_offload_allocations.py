"""A step's allocations with a shard group of one rank (cost_models/one_rank_events.py) and under CPU offload
(cost_models/offload_events.py): the walk's live tensors peak at the memory ledger's allocated peak where the ledger
prices what FSDP2 allocates, at the trace's where it does not, and the estimate reports the replay's reserved. No trace
runs here: the traced figures are the trace tier's (planner.tracing.trace, fake tensors), quoted where they are used.
Each estimate here takes ~0.3 s of CPU."""

import pytest

from cost_models.step_allocations import replays, step_replay
from planner.api import estimate
from tests.unit.test_step_allocations import _events_peak, _walk  # the walk's live peak, the walk of a candidate

LLAMA_8B = dict(gpu="h100-80gb", seq_len=2048)


def _sizes(events) -> dict:
    return {e[1]: e[2] for e in events if e[0] == "alloc"}


@pytest.mark.parametrize("gpus, knobs", [
    (1, dict(finetune="lora", micro_batch=1, activation_checkpointing="none", global_batch=2)),    # accumulation 2
    (1, dict(finetune="lora", micro_batch=4, activation_checkpointing="selective-op", precision="fp32")),
    (1, dict(finetune="full", micro_batch=2, activation_checkpointing="every-2")),
    (8, dict(finetune="lora", micro_batch=2, activation_checkpointing="full", sharding="NO_SHARD")),
    (8, dict(finetune="full", micro_batch=2, activation_checkpointing="full", offload=True, global_batch=32)),
    (1, dict(finetune="lora", micro_batch=4, activation_checkpointing="every-2", offload=True)),
    # bf16 (fp32 reduce): the root's reduce output beside its input leads, 2 x 4,202,708,992 B (ledger 5,858,418,688
    # before it priced them at d = 1)
    (1, dict(finetune="full", micro_batch=1, activation_checkpointing="full", offload=True, precision="bf16")),
], ids=["1-lora-accum-2", "1-lora-fp32-selective", "1-full-every-2", "8-no-shard-lora", "8-offload-full-accum-2",
        "1-offload-lora", "1-offload-full-bf16"])
def test_the_walk_allocates_the_ledgers_peak(gpus, knobs):
    """Llama 3 8B on h100-80gb, 2,048 tokens: the walk's live tensors peak at the ledger's allocated peak to the byte
    (docs/accuracy.md "One rank, CPU offload": 96 / 96 of micro-batch 1/2/4 x every checkpointing mode x bf16 / fp32 x
    full / LoRA x accumulation 1 / 2 on 1 GPU, on 8 under NO_SHARD, with offload on 8 and on 1, FSDP2's world-size-1
    reduce-scatter buffers in the ledger), and the estimate reports the replay's reserved."""
    c = estimate("llama3-8b", gpus, **{**LLAMA_8B, **knobs})
    assert replays(c.model, c.training, c.config, c.config.shard_group_size(c.cluster)) is None
    events, _ = _walk(c)
    assert _events_peak(events) == c.memory.peak_allocated_bytes
    assert any("replayed through the caching allocator" in n for n in c.memory.notes)


def test_one_rank_unshards_parameter_by_parameter():
    """d = 1: FSDP2 all-gathers nothing (no copy-in source, no all-gather output); wait_for_unshard casts each fp32
    parameter to bf16 and copies it into its own storage. By hand, Llama 3 8B's root: the embedding and the head
    128,256 x 4,096 x 2 B = 1,050,673,152 B each, the final norm 4,096 x 2 = 8,192 B, each cast beside its copy."""
    c = estimate("llama3-8b", 1, micro_batch=1, activation_checkpointing="full", **LLAMA_8B)
    events, first = _walk(c)
    sizes = _sizes(events[:first])
    assert not any(k[0] in ("all_gather", "all_gather_in") for k in sizes)
    root = [1_050_673_152, 8_192, 1_050_673_152]
    assert [sizes[("unsharded", 0, 0, i)] for i in range(3)] == [sizes[("cast", 0, 0, i)] for i in range(3)] == root
    # the reduce-scatter still runs: a block's input (fp32, 218,112,000 parameters) and its full-size output
    assert sizes[("rs_in", 0, 1)] == sizes[("sharded_grad", 0, 1)] == 218_112_000 * 4


def test_one_rank_against_its_trace():
    """memory_accuracy.py's llama2-mha (h 512, f 1,376, 8 blocks, V 4,000) NO_SHARD on 4 ranks, fp32, full
    checkpointing, eager attention, 2 x 1,024 tokens: the trace tier (`planner.tracing.trace(arch_config("llama2-mha"),
    4, sharding="NO_SHARD", precision="fp32", activation_checkpointing="full", attention="eager", micro_batch=2,
    seq_len=1024, gpus_per_node=4)`) peaks at 740,409,908 B in block 0's backward, beside block 1's reduce-scatter
    input, which FSDP2 keeps at world size 1 too: 4 x (4 x 512 x 512 + 3 x 512 x 1,376 + 2 x 512) = 12,652,544 B.
    The walk and the ledger 740,374,528 (-0.005%; the ledger 727,721,984, -1.7%, before it priced that input at
    d = 1: memory.py reduce_scatter_above); the replay 874,512,384 B against the trace's replay 950,009,856 (-7.9%;
    the flat rule, allocated x 1.05, -18.2%)."""
    from benchmarks.memory_accuracy import arch_config

    c = estimate(arch_config("llama2-mha"), 4, sharding="NO_SHARD", precision="fp32", activation_checkpointing="full",
                 attention="eager", micro_batch=2, seq_len=1024, gpus_per_node=4)
    events, _ = _walk(c)
    assert _sizes(events)[("rs_in", 0, 2)] == 12_652_544
    assert _events_peak(events) == pytest.approx(740_409_908, rel=0.0005)
    assert c.memory.peak_allocated_bytes == _events_peak(events)
    replayed = step_replay(c.model, c.cluster, c.training, c.config, snapshots=False).peak_reserved_bytes
    assert replayed == pytest.approx(950_009_856, rel=0.08)
    assert c.memory.allocator_reserved_bytes == replayed


def test_offload_keeps_no_device_states():
    """CPU offload on 8 ranks, bf16 (fp32 shards on the host): no sharded parameter, gradient or optimizer state on
    the device; each block parameter's all-gather input copied to the device in fp32, then cast to bf16 (q: 4,096 x
    4,096 / 8 = 2,097,152 elements, 8,388,608 B then 4,194,304 B); each reduce-scatter output freed once copied to the
    host."""
    c = estimate("llama3-8b", 8, micro_batch=1, activation_checkpointing="full", offload=True, **LLAMA_8B)
    events, _ = _walk(c)
    sizes = _sizes(events)
    kinds = {k[0] if isinstance(k[0], str) else k[0][0] for k in sizes}  # a transient's key: ((kind, ...), i)
    assert "h2d" in kinds and not kinds & {"param", "state", "sharded_grad", "optimizer"}
    assert (sizes[("h2d", 0, 1, 0)], sizes[("cast", 0, 1, 0)]) == (8_388_608, 4_194_304)
    assert _events_peak(events) == c.memory.peak_allocated_bytes


def test_offload_on_one_gpu_reduces_the_root_at_full_size():
    """Offload on one GPU, full fine-tuning, full checkpointing, 1 x 2,048 tokens: the walk peaks at the root's
    post-backward, its reduce-scatter input and output at once, fp32 and full-size at world size 1: 4 x (2 x 128,256 x
    4,096 + 4,096) = 4,202,708,992 B each, 8,405,417,984 B; the ledger's "end of backward (the root's reduce output)"
    holds the same (before it priced FSDP2's buffers at d = 1 its peak was the loss backward, 5,858,418,688 B: -30%).
    With offload no sharded gradient stays on the device; the estimate's reserved is the replay's, above both."""
    c = estimate("llama3-8b", 1, micro_batch=1, activation_checkpointing="full", offload=True, **LLAMA_8B)
    events, _ = _walk(c)
    sizes = _sizes(events)
    assert sizes[("rs_in", 0, 0)] == sizes[("new_grad", 0, 0)] == 4_202_708_992
    assert _events_peak(events) == 8_405_417_984
    assert c.memory.peak_allocated_bytes == 8_405_417_984
    assert c.memory.peak_moment == "end of backward (the root's reduce output)"
    assert c.memory.allocator_reserved_bytes == step_replay(c.model, c.cluster, c.training, c.config,
                                                            snapshots=False).peak_reserved_bytes > 8_405_417_984
