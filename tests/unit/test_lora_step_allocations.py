"""A LoRA / QLoRA step's allocations (cost_models/lora_events.py under step_allocations._LoraStepWalk): the walk's live tensors
peak at the memory ledger's allocated peak, its states are the adapters' alone, and the reserved figure the estimate
reports is the replay's. No trace runs here: the traced figures are the trace tier's (planner.tracing.trace, fake
tensors), quoted where they are used. Each estimate here takes ~0.3 s of CPU."""

import pytest

from cost_models.step_allocations import replays, step_replay
from planner.api import estimate
from tests.unit.test_step_allocations import _events_peak, _walk  # the walk's live peak, the walk of a candidate

LLAMA_8B_LORA = dict(gpu="h100-80gb", seq_len=2048, finetune="lora")


@pytest.fixture(scope="module")
def lora8():
    return estimate("llama3-8b", 8, micro_batch=2, global_batch=16, activation_checkpointing="full", **LLAMA_8B_LORA)


@pytest.mark.parametrize("knobs", [
    dict(micro_batch=1, activation_checkpointing="none", global_batch=16),                 # accumulation 2
    dict(micro_batch=4, activation_checkpointing="selective-op", precision="fp32", lora_rank=64, global_batch=32),
    dict(micro_batch=2, activation_checkpointing="every-2", sharding="shard_grad_op", global_batch=16),
    dict(micro_batch=2, activation_checkpointing="full", lora_targets="all-linear", lora_dropout=0.05, global_batch=16),
], ids=["accum-2", "fp32-selective-r64", "zero2-every-2", "all-linear-dropout"])
def test_a_lora_step_allocates_the_ledgers_peak(knobs):
    """Llama 3 8B on 8 x h100-80gb, 2,048 tokens a sequence: the walk's live tensors peak at the ledger's allocated
    peak to the byte (188 of 192 of the grid micro-batch 1/2/4 x every checkpointing mode x bf16 / fp32 x rank 16 / 64
    x accumulation 1 / 2 x FSDP / SHARD_GRAD_OP, docs/accuracy.md), and the estimate reports the replay's reserved."""
    c = estimate("llama3-8b", 8, **{**LLAMA_8B_LORA, **knobs})
    assert replays(c.model, c.training, c.config, 8) is None
    events, _ = _walk(c)
    assert _events_peak(events) == c.memory.peak_allocated_bytes
    assert any("replayed through the caching allocator" in n for n in c.memory.notes)


def test_the_adapters_alone_hold_gradients_and_states(lora8):
    """By hand, rank 16 on q, k, v, o (h 4,096, kv 1,024): 16 x (4,096 + 4,096 + 2 x (4,096 + 1,024) + 4,096 + 4,096)
    = 425,984 adapter elements a block, 13,631,488 over 32 blocks. Sharded over 8: their fp32 shards 6,815,744 B, Adam's
    two fp32 states 13,631,488 B, their fp32 reduce-scatter outputs 6,815,744 B; the frozen base in bf16 (mixed
    precision: memory_shape's frozen_p) 8,030,261,248 elements -> 2,007,565,312 B. No gradient of the root (embedding,
    final norm, head) and no reduce-scatter of it."""
    events, first = _walk(lora8)
    sizes = {e[1]: e[2] for e in events[:first] if e[0] == "alloc"}
    params = [(k, v) for k, v in sizes.items() if k[0] == "param"]
    adapters = sum(v for k, v in params if k[2] > 0 and k[3] >= 9)
    assert adapters == 6_815_744 and sum(v for _, v in params) - adapters == 2_007_565_312
    assert sum(v for k, v in sizes.items() if k[0] == "state") == 13_631_488
    assert sum(v for k, v in sizes.items() if k[0] == "sharded_grad") == 6_815_744
    assert not any(k[0] in ("wgrad", "rs_in", "sharded_grad") and k[2] == 0 for k in sizes)  # the root: unit 0
    assert {k[3] for k in sizes if k[0] == "wgrad"} == set(range(9, 17))  # lora_A / lora_B of q, k, v, o


def test_a_small_fp32_lora_step_against_its_trace():
    """memory_accuracy.py's llama3-gqa (h 512, V 16,000, 8 blocks) with LoRA, 8 ranks, FULL_SHARD fp32, full
    checkpointing, 1 x 256 tokens. The trace tier (`planner.tracing.trace(arch_config("llama3-gqa"), 8,
    finetune="lora", precision="fp32", activation_checkpointing="full", micro_batch=1, seq_len=256,
    sharding="FULL_SHARD", attention="sdpa")`) peaks in the forward at 181,900,032 B: block 0's copy-out beside the
    root's all-gather output, whose free FSDP2 defers past it (fsdp2_gathers.py). The ledger's moment for it: -0.003%
    (before it: 155,857,152, -14.3%). The walk the same, 181,895,424 B (-0.003%; it was 181,371,136, -0.3%, before
    it held the embedding's output at that copy-out: step_walk.StepWalk.pre_forward). Its replay reserves
    251,658,240 B against the trace's replay 253,755,392 (-0.8%; the flat rule 163,650,009, -35.5%)."""
    from benchmarks.memory_accuracy import arch_config

    c = estimate(arch_config("llama3-gqa"), 8, finetune="lora", precision="fp32", activation_checkpointing="full",
                 micro_batch=1, seq_len=256, sharding="FULL_SHARD", attention="sdpa")
    events, _ = _walk(c)
    assert _events_peak(events) == c.memory.peak_allocated_bytes
    assert c.memory.peak_moment == "forward all-gather copy-out of block 0"
    assert c.memory.peak_allocated_bytes == pytest.approx(181_900_032, rel=1e-4)
    replayed = step_replay(c.model, c.cluster, c.training, c.config, snapshots=False).peak_reserved_bytes
    assert replayed == pytest.approx(253_755_392, rel=0.01)
    assert c.memory.allocator_reserved_bytes == replayed


def test_qloras_packed_base_and_its_quant_state():
    """QLoRA (bitsandbytes nf4, double quantization, qlora.py), the same Llama 3 8B step: each block's linears q, k,
    v, o (4,096 x 4,096, 2 x 4,096 x 1,024) and gate, up, down (3 x 4,096 x 14,336) hold 218,103,808 weights, packed
    two a byte and sharded over 8: 32 x 109,051,904 / 8 = 436,207,616 B; their QuantStates on every rank, per linear
    n / 64 one-byte absmax + (n / 64 / 256 + 1 + 16 + 256) x 4 B: 3,468,764 B a block, 111,000,448 B in all. The walk
    peaks at the ledger's allocated peak and the estimate reports its replay."""
    c = estimate("llama3-8b", 8, micro_batch=2, global_batch=16, activation_checkpointing="full",
                 **{**LLAMA_8B_LORA, "finetune": "qlora"})
    events, first = _walk(c)
    sizes = {e[1]: e[2] for e in events[:first] if e[0] == "alloc"}
    assert sum(v for k, v in sizes.items() if k[0] == "param" and k[2] > 0 and k[3] < 7) == 436_207_616
    assert sum(v for k, v in sizes.items() if k[0] == "quant_state") == 111_000_448
    assert _events_peak(events) == c.memory.peak_allocated_bytes
    assert replays(c.model, c.training, c.config, 8) is None
    assert c.memory.allocator_reserved_bytes == step_replay(c.model, c.cluster, c.training, c.config,
                                                            snapshots=False).peak_reserved_bytes


def test_what_keeps_the_flat_rule_under_lora(lora8):
    """FSDP1's adapter units (accelerate, hf-fsdp1: fsdp1_adapters.py) stay flat: allocated x 1.05 + outside, no
    replay note (a loss kernel no longer: tests/unit/test_forward_copy_out_moments.py)."""
    spec, training, config = lora8.model, lora8.training, lora8.config
    assert replays(spec, training, config, 8) is None
    assert replays(spec, training, config, 8, adapter_units=True) == "LoRA's adapters as FSDP1 units of their own"
    for knobs in (dict(trainer="accelerate"), dict(finetune="qlora", trainer="hf-fsdp1")):
        c = estimate("llama3-8b", 8, micro_batch=2, global_batch=16, activation_checkpointing="full",
                     **{**LLAMA_8B_LORA, **knobs})
        assert not any("replayed through" in n for n in c.memory.notes), knobs
        assert c.memory.allocator_reserved_bytes >= int(c.memory.peak_allocated_bytes * 1.05)


def _with_edge_units(c):
    """The candidate's model as torchtitan 0.3 wraps it (ModelSpec.edge_units: the embedding and [final norm, head]
    units of their own), re-priced: the ledger's estimate."""
    import dataclasses

    from planner.api import estimate_config

    spec = dataclasses.replace(c.model, edge_units=True)
    return dataclasses.replace(c, evaluation=estimate_config(spec, c.cluster, c.training, c.config).evaluation,
                               model=spec)


@pytest.mark.parametrize("knobs", [
    dict(activation_checkpointing="none", micro_batch=1, global_batch=16),                  # accumulation 2
    dict(activation_checkpointing="full", precision="fp32", sharding="shard_grad_op"),
    dict(activation_checkpointing="full", finetune="qlora"),
    dict(activation_checkpointing="full", loss_kernel="liger"),
], ids=["accum-2", "zero2-fp32", "qlora", "liger"])
def test_lora_with_edge_units_allocates_the_ledgers_peak(knobs):
    """Llama 3 8B on 8 x h100-80gb, 1,024 tokens, LoRA with edge units (lora_edge_events.py): walk == ledger to the
    byte (48 / 48 of llama3-8b's LoRA / QLoRA x bf16 / fp32 x none / full x 1 / 8 GPUs x FSDP / ZeRO-2 x micro-batch
    1 / 2, every dense 2026 grid architecture and Liger: docs/accuracy.md 2026-12-07 night), and it is replayed."""
    c = _with_edge_units(estimate("llama3-8b", 8, **{**dict(LLAMA_8B_LORA, seq_len=1024, micro_batch=2,
                                                            global_batch=16), **knobs}))
    assert c.model.split_edge_units and replays(c.model, c.training, c.config, 8) is None
    assert _events_peak(_walk(c)[0]) == c.memory.peak_allocated_bytes


def test_the_head_units_forward_copy_out_under_liger():
    """With Liger's loss (no logits kept) the step peaks at the head's unit copied out beside the last block's
    all-gather output, whose free FSDP2 defers past it (edge_units.edge_moments): llama3-8b LoRA bf16, full
    checkpointing, 2 x 1,024 tokens on 8. By hand: the head's unit (128,256 x 4,096 head + 4,096 norm) in bf16,
    1,050,681,344 B, gathered and copied out; the last block's all-gather output, its 218,112,000 frozen values and
    425,984 adapter values in bf16, 437,075,968 B; the 32 blocks' checkpointed inputs, 32 x 2,048 x 4,096 x 2 B =
    536,870,912 B among the activations. The ledger missed it (final norm's backward, 4,700,341,248 B, the walk 9.3%
    above)."""
    c = _with_edge_units(estimate("llama3-8b", 8, seq_len=1024, micro_batch=2, global_batch=16, gpu="h100-80gb",
                                  finetune="lora", activation_checkpointing="full", loss_kernel="liger"))
    m = c.memory
    assert m.peak_moment == "forward all-gather copy-out of the head's unit"
    assert m.breakdown.unsharded_params == 1_050_681_344
    assert m.breakdown.collective_buffers == 1_050_681_344 + 437_075_968
    assert m.breakdown.activations >= 536_870_912
    assert m.peak_allocated_bytes == _events_peak(_walk(c)[0]) == 5_137_417_216


def test_a_small_lora_step_with_edge_units_against_its_trace():
    """memory_accuracy.py's llama3-gqa (h 512, V 16,000, 8 blocks), LoRA, 8 ranks, FULL_SHARD fp32, no checkpointing,
    1 x 256 tokens, with edge units: the trace tier (`PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_accuracy.py
    --edge-units --finetune lora`'s path, memory_accuracy.edge_units_trace) peaks at 172,763,904 B, the ledger
    172,220,672 (-0.31%) and the walk the same; its replay reserves 287,309,824 B, the trace's own replay the same to
    the byte (the flat rule 180,831,705, -37.1%)."""
    from benchmarks.memory_accuracy import arch_config

    c = _with_edge_units(estimate(arch_config("llama3-gqa"), 8, finetune="lora", precision="fp32",
                                  activation_checkpointing="none", micro_batch=1, seq_len=256, sharding="FULL_SHARD",
                                  attention="sdpa"))
    assert c.memory.peak_allocated_bytes == _events_peak(_walk(c)[0]) == pytest.approx(172_763_904, rel=0.004)
    replayed = step_replay(c.model, c.cluster, c.training, c.config, snapshots=False).peak_reserved_bytes
    assert replayed == pytest.approx(287_309_824, rel=1e-3)
