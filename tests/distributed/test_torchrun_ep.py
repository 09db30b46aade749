"""Expert parallelism for real: a tiny transformers Mixtral under EP 2 + FSDP2 by torchrun (2 ranks, gloo, CPU),
against the trace tier of the same configuration (fake tensors, fake process group of 2).

Every case runs in the shared 2-rank launch (tests/distributed/worker_ep.py; cases.shared). Both sides go through calibration.apply.apply_fsdp2 and
calibration/expert_parallel.py: transformers' ep_plan and AllToAllEP, balanced routing, the experts fully_shard-ed
over efsdp = 2 / 2 = 1 and the rest over dp_shard = 2. The real run reads its all-to-all split sizes back from the
routed counts (AllToAllEP's own dispatch), the trace computes them in Python; every op runs on CPU on both sides,
so the peaks agree to the byte once gloo's own copy is named: its reduce_scatter_tensor all-reduces a clone of the
input (a unit's gradients in the reduce dtype), which NCCL does not make (worker_ep.py swaps it out; the
"gloo_reduce_scatter" case keeps it and the difference is that clone).
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed.cases import shared

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

TIMEOUT_S = 240
REAL_RUN_JITTER_BYTES = 2 * 65_536
SEQ_LEN = 64
# 4 experts of width 96, top-2, h 64, 2 blocks: each rank keeps 2 experts (gate_up 2 x 192 x 64)
TINY = dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, tie_word_embeddings=False)
CASES = [
    {"hf_config": TINY, "config": {"ep": 2, "precision": "fp32"}, "seq_len": SEQ_LEN},
    {"hf_config": TINY, "config": {"ep": 2, "precision": "fp32", "activation_checkpointing": "full"},
     "seq_len": SEQ_LEN},
    {"hf_config": TINY, "config": {"ep": 2, "precision": "fp32"}, "seq_len": SEQ_LEN, "gloo_reduce_scatter": True},
]


launch = shared(__file__, "worker_ep", CASES, TIMEOUT_S, while_launching=lambda: [traced(i) for i in (0, 1)])


@functools.cache  # traced while the shared launch runs (cases.shared's while_launching)
def traced(index: int):
    from calibration.trace import trace_memory
    from tests.distributed.cases import config_from_dict
    from planner.models import from_hf_config

    case = CASES[index]
    spec = from_hf_config(dict(case["hf_config"]), name="tiny-mixtral")
    return trace_memory(spec, config_from_dict(case["config"]), n_gpus=2, gpus_per_node=2, seq_len=case["seq_len"],
                        hf_config=dict(case["hf_config"]))


def test_each_rank_holds_its_experts_and_dispatches_balanced_rows():
    for result in launch():
        assert result["local_experts"] == [[2, 192, 64], [2, 192, 64]]          # E / ep = 2 experts per rank
        assert result["experts_are_units"]
        # 64 tokens x top-2 = 128 rows per rank, 64 to each rank's experts: AllToAllEP's own counts, read back
        assert result["split_sizes"] == [[64, 64], [64, 64]]
        assert result["loss_after"] == result["loss_after"] and result["loss_after"] < 6


@pytest.mark.parametrize("index", [0, 1])
def test_real_run_matches_the_trace(index):
    real = launch()[index]
    trace = traced(index)
    assert real["peak_phase"] == trace.peak_phase
    # The real run's peak moves with the interpreter's hash seed (the order its tensors are freed in; the trace's
    # figure is fixed): over PYTHONHASHSEED 0-4 it read +18,944 and +65,536 B above the trace's 2,409,636 and
    # 2,655,532 B, and equal to it under most random seeds. Bounded by 2 x 64 KiB (5% of these tiny peaks).
    assert abs(real["peak_allocated_bytes"] - trace.peak_allocated_bytes) <= REAL_RUN_JITTER_BYTES, (
        real["peak_allocated_bytes"], trace.peak_allocated_bytes, real["phases"], trace.to_dict()["phases"])


def test_gloo_reduce_scatter_clone_is_the_only_difference():
    """gloo's reduce_scatter_tensor clones its input: at most the largest unit's gradients (fp32: the root's
    embedding, head and final norm, (2 x 256 x 64 + 64) x 4 = 131,328 B, the largest FSDP unit here) for a moment. Here the peak is
    a block's backward, before any reduce-scatter of that size: gloo's clone does not move it. The two
    peaks come from two real runs, each off by up to REAL_RUN_JITTER_BYTES / 2 with the hash seed (the
    fresh-clone run at 82504bf measured kept - swapped below 0), so the difference is bounded by that."""
    kept, swapped = launch()[2], launch()[0]
    assert swapped["gloo_copy_bytes"] == (2 * 256 * 64 + 64) * 4
    extra = kept["peak_allocated_bytes"] - swapped["peak_allocated_bytes"]
    assert -REAL_RUN_JITTER_BYTES <= extra <= swapped["gloo_copy_bytes"] + REAL_RUN_JITTER_BYTES
