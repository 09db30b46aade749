"""A checkpointed Llama block without TP (FSDP alone), op by op (cost_models/tp_block_events.py at tp = 1), against
the trace of a small FSDP2 step.

The traced config: 2 ranks FULL_SHARD, 2 blocks, h 256, MLP 640, 4 heads of 64 over 2 KV heads (so q's and k's
gradients are copied to contiguous), 1 x 384 tokens, full checkpointing, SDPA, bf16 (a (b, s, h) tensor 192 KiB) and
fp32 (the RMSNorm's casts no-ops, the input's gradients summed as autograd gets them).
"""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.caching_allocator import replay
from cost_models.tp_block_events import BlockWidths, applies, backward_events, forward_events
from cost_models.units import KiB
from planner.api import estimate
from tests.unit.test_step_allocations import _events_peak, _walk
from tests.unit.test_tp_block_events import live_bytes, occurrences

ARCH = {"model_type": "llama", "_name_or_path": "llama-tp1", "hidden_size": 256, "intermediate_size": 640,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000,
        "max_position_embeddings": 1024}
CONFIG = dict(sharding="FULL_SHARD", precision="bf16", activation_checkpointing="full", attention="sdpa",
              micro_batch=1, seq_len=384, gpus_per_node=2)
WIDTHS = BlockWidths(tokens=384, tp=1, h=256, q=256, kv=128, f=640, heads=4, kv_heads=2, c=2, b=1)


COMPUTE_BYTES = {"bf16": 2, "fp32": 4}


@pytest.fixture(scope="module", params=list(COMPUTE_BYTES))
def precision(request):
    return request.param


@pytest.fixture(scope="module")
def candidate(precision):
    return estimate(dict(ARCH), 2, **dict(CONFIG, precision=precision))


@pytest.fixture(scope="module")
def traced(precision):
    """The step's trace (~4 s of CPU each)."""
    pytest.importorskip("transformers")
    from planner.tracing import trace

    return trace(dict(ARCH), 2, **dict(CONFIG, precision=precision))


def widths(precision: str) -> BlockWidths:
    return dataclasses.replace(WIDTHS, c=COMPUTE_BYTES[precision])


def test_the_widths_and_the_rule(candidate, precision):
    from cost_models.pipeline_memory import rank_inputs

    local, _ = rank_inputs(candidate.model, candidate.training, candidate.config)
    assert applies(local, candidate.config) and BlockWidths.of(local, candidate.config, 384) == widths(precision)


def test_one_blocks_forward_and_backward_by_hand():
    """(b, s, h) 384 x 256 x 2 B = 192 KiB, its fp32 upcast 384 KiB, (b, s, f) 480 KiB, k / v 96 KiB. The no-grad
    forward's largest moment is the gate product made: silu's and up's outputs and it (480 KiB each) beside the
    second norm's output and the attention's sum with the input (h1); it keeps only its output. The backward passes
    on dx and w0..w8, frees its input x and output gradient dy."""
    forward = forward_events(WIDTHS)
    assert live_bytes(forward)[-1] == 192 * KiB
    assert max(live_bytes(forward)) == 3 * 480 * KiB + 2 * 192 * KiB
    backward = backward_events(WIDTHS)
    made = {e[1] for e in backward if e[0] == "alloc"}
    freed = {e[1] for e in backward if e[0] == "free"}
    assert freed - made == {"dy", "x"} and made - freed == {"dx"} | {f"w{i}" for i in range(9)}
    assert not any(name.endswith((".ag", ".ar", ".mm")) for name in made) and "o.cat" not in made   # no collective


def test_the_trace_makes_and_frees_each_blocks_tensors_in_this_order(traced, precision):
    """Each block's no-grad forward and its backward (2 blocks x 2 steps), size for size and free for free."""
    events = [tuple(e) for e in traced.traced.allocation_events]
    assert occurrences(forward_events(widths(precision)), events) == 4
    assert occurrences(backward_events(widths(precision)), events) == 4


def test_the_walk_allocates_the_ledgers_peak_and_reserves_what_the_trace_does(candidate, traced):
    """The walk's live tensors peak at the last block's MLP backward (dsilu made), the ledger's moment there plus the
    two norms' saved fp32 statistics (rsqrt, 4 B a token each), which the trace makes and the ledger leaves out
    (activations.py: per-token scalars ignored). Its replay against the trace's, measured at this commit: allocated
    28,931,584 vs 28,950,528 B (-0.1%; fp32 38,133,248 vs 38,152,192); reserved 81,788,928 vs 90,177,536 (-9.3%;
    -11.6% with the block as one sweep, before; fp32 88,080,384 vs 94,371,840, -6.7%, -11.1% before): at these
    widths every tensor is in the small pool (< 1 MiB, 2 MiB segments), whose caching the walk's other tensors
    decide. Tolerance 1% allocated, 10% reserved."""
    events, _ = _walk(candidate)
    assert _events_peak(events) == candidate.memory.peak_allocated_bytes + 2 * 4 * 384
    walk, trace = replay(events), traced.replayed
    assert walk.peak_allocated_bytes == pytest.approx(trace.peak_allocated_bytes, rel=0.01)
    assert walk.peak_reserved_bytes == pytest.approx(trace.peak_reserved_bytes, rel=0.10)
