"""FSDP2's dim-0 padding of the dense parameters (cost_models/dim0_padding.py, dim0_padding_events.py): each tensor's
shard is ceil(rows / d) rows, and the sharded parameters, the all-gather outputs and the walk count them so.

The hand figures below equal the trace tier's (planner.tracing.trace, rank 0 of the real world size; the rows of
`PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_accuracy.py --mesh --only tp --jobs 1`, #11, and the llama3-gqa
row in docs/accuracy.md's "dim-0 padding of the dense parameters" section) to the byte."""

from __future__ import annotations

import pytest

from benchmarks.memory_accuracy import arch_config
from cost_models import dim0_padding
from cost_models.pipeline_memory import rank_inputs
from planner.api import estimate
from tests.unit.test_step_allocations import _events_peak, _walk


def _walk_peak(c) -> int:
    return _events_peak(_walk(c)[0])


def test_a_tp_slice_padded_to_the_shard_group_by_hand():
    """llama2-mha (h 512, 8 heads of 64, ffn 1,376, V 4,000, 8 blocks) at tp 8 with sequence parallel on 256 ranks:
    dp_shard d = 32 shards the rank's slice. Per block: q / k / v 64 rows -> 2 a rank x 512, o 512 rows -> 16 x 64,
    gate / up 172 rows -> ceil(172 / 32) = 6 x 512 (192 rows gathered, not 172), down 16 x 172, two norms 16 each:
    4 x 1,024 + 2 x 3,072 + 2,752 + 32 = 13,024 elements. Root: the embedding's and the head's 500 vocabulary rows
    -> 16 x 512 each, the final norm 16: 16,400. Sharded fp32 parameters (8 x 13,024 + 16,400) x 4 = 482,368 B,
    the trace's figure; ceil(bytes / d) gave 480,768 (the row's allocated error -0.68% -> -0.40%)."""
    c = estimate(arch_config("llama2-mha"), 256, tp=8, sequence_parallel=True, sharding="FULL_SHARD", precision="bf16",
                 activation_checkpointing="full", attention="sdpa", micro_batch=2, seq_len=2048, gpus_per_node=8)
    assert c.memory.phases["optimizer_step"].sharded_params == (8 * 13_024 + 16_400) * 4 == 482_368
    local = rank_inputs(c.model, c.training, c.config)[0]
    assert dim0_padding.block_padding_elements(local, 32) == 32 * 13_024 - local.block_params
    assert _walk_peak(c) == c.memory.peak_allocated_bytes


def test_tensors_of_fewer_rows_than_ranks_gather_d_rows():
    """llama3-gqa (h 512, 8 heads, 2 KV heads of 64, ffn 1,792, V 16,000 untied) fp32 on 512 ranks: k / v's 128 rows
    and q / o's 512 gather 512 rows each, gate / up 1,792 -> 2,048, down 1 row of 1,792 a rank; the root's tables
    16,000 -> 16,384 rows. Sharded parameters (8 x 7,938 + 32,769) x 4 = 385,092 B and the root gathered again in
    backward beside its all-gather output, 2 x 32,769 x 512 x 4 = 134,221,824 B: the trace's figures (its peak
    247,924,492 B, the ledger's 247,904,460, -0.008%; ignoring the padding -1.33%)."""
    c = estimate(arch_config("llama3-gqa"), 512, sharding="FULL_SHARD", precision="fp32",
                 activation_checkpointing="none", attention="sdpa", micro_batch=1, seq_len=256, gpus_per_node=8)
    m = c.memory
    assert m.phases["optimizer_step"].sharded_params == (8 * 7_938 + 32_769) * 4 == 385_092
    assert m.peak_moment == "root gathered again in backward"
    assert m.breakdown.unsharded_params + m.breakdown.collective_buffers == 2 * 32_769 * 512 * 4
    assert m.peak_allocated_bytes == pytest.approx(247_924_492, rel=2e-4)  # the trace's, 2e-4: the activations' gap
    assert _walk_peak(c) == m.peak_allocated_bytes


def test_no_padding_where_the_shard_group_divides_every_dimension():
    """d = 8 divides every row count of llama3-gqa: the counts are the real ones."""
    c = estimate(arch_config("llama3-gqa"), 8, precision="fp32", micro_batch=1, seq_len=256)
    assert dim0_padding.block_padding_elements(c.model, 8) == 0
    assert dim0_padding.root_padding_elements(c.model, 8) == (0, 0)
    assert c.memory.phases["optimizer_step"].sharded_params == c.model.n_params * 4 // 8



def test_lora_adapters_rank_rows_padded():
    """llama3-gqa LoRA (rank 16 on q / k / v / o, the base frozen in bf16) on 512 ranks, bf16, full checkpointing,
    1 x 256 tokens: each lora_A (16, 512) holds one padded row of 512 a rank, each lora_B (out, 16) one row of 16, so a
    block's adapter shard is 4 x 512 + 4 x 16 = 2,112 fp32 elements (104 unpadded); with the base's 7,938 a block and
    the root's 32,769 in bf16, sharded parameters (8 x 7,938 + 32,769) x 2 + 8 x 2,112 x 4 = 260,130 B and Adam's two
    states 135,168: the trace tier's 260,130 / 135,424 (its 64 fp32 step counters), its peak 96,086,570 B (the ledger
    91,714,850 before any dim-0 padding, 93,834,018 with the base's alone)."""
    c = estimate(arch_config("llama3-gqa"), 512, gpus_per_node=8, precision="bf16", activation_checkpointing="full",
                 micro_batch=1, seq_len=256, finetune="lora", attention="sdpa")
    step = c.memory.phases["optimizer_step"]
    assert step.sharded_params == (8 * 7_938 + 32_769) * 2 + 8 * 2_112 * 4 == 260_130
    assert step.optimizer_state == 2 * 8 * 2_112 * 4
    assert c.memory.peak_allocated_bytes == pytest.approx(96_086_570, rel=1e-4)
    assert _walk_peak(c) == c.memory.peak_allocated_bytes


def test_edge_units_pad_the_embedding_and_the_head_units():
    """torchtitan 0.3's edge units (the embedding a unit, [final norm, head] another) of llama3-gqa fp32 on 512, no
    checkpointing, 1 x 256 tokens: the final norm's backward leads, the head's unit gathered again (16,384 padded rows
    of the 16,000); the trace tier's peak 198,049,536 B (benchmarks/memory_accuracy.py's edge_units_trace), the ledger
    195,538,636 (-1.27%) without the padding, 198,031,564 (-0.009%) with it; the walk the ledger's."""
    from dataclasses import replace

    from planner.api import estimate_config

    c = estimate(arch_config("llama3-gqa"), 512, gpus_per_node=8, precision="fp32", activation_checkpointing="none",
                 micro_batch=1, seq_len=256, attention="sdpa")
    c = estimate_config(replace(c.model, edge_units=True), c.cluster, c.training, c.config)
    assert c.memory.peak_moment == "final norm's backward"
    assert c.memory.peak_allocated_bytes == pytest.approx(198_049_536, rel=2e-4)
    assert _walk_peak(c) == c.memory.peak_allocated_bytes
