"""The tensor-parallel trace against real memory: a tiny Hugging Face Llama with tp = 2 run for real under
torchrun (2 ranks, gloo, CPU; worker_mesh.py says what runs) and traced on fake tensors at world size 2, the
same code path on both sides (calibration.apply.make_mesh + apply_fsdp2: the N-D mesh, the TP plan, then
FSDP2 over the dp_shard x cp sub-mesh, here one rank).

Cases: with sequence parallel + loss parallel (torchtitan's) and without (transformers' tp_plan), fp32 and
bf16, with and without full checkpointing, a logits-dominated shape (2 x 256 tokens) where loss parallel's
backward is the peak; and context parallel cp = 2 (ring attention on the CPU SDPA kernel through
calibration/context_parallel.py, which torch lacks), FSDP then sharding over the 2 ranks; a vocabulary-heavy
Llama (V 64,000, untied and tied) whose peak is the embedding's whole-table gradient under SP. When this was
written every case agreed to the byte (e.g. tp 2, SP, bf16, 2 x 256: 23,428,576 bytes on both sides; before
the trace kept DTensor's global-shape shape propagation out of the tracker it read +24% on the 2 x 512 case). The
tolerance, 0.1%, leaves room for nothing but allocator-free noise; the model states must agree to the byte.

gloo's own buffer copies, named: (1) FSDP2's gradient reduce-scatter on gloo all-reduces a clone of its input,
which NCCL does not make; the worker swaps it for an in-place all-reduce (worker_families.InPlaceReduceScatter).
FSDP2's all-gathers are settled (worker_families.SettledAllGather): gloo's thread frees a buffer a moment after the
op, and in about 1 run in 4 cp 2 fp32 peaked with the root's buffer still alive (+2.5%, 2026-12-02).
With tp 2 the FSDP group is one rank (nothing is reduce-scattered); with cp 2 it is both ranks, and one case
runs with gloo's own reduce-scatter to measure that copy (test_gloo_reduce_scatter_copy_...: +16%). (2) The TP collectives of
sequence parallel (all-gather before the column-wise linears, reduce-scatter after the row-wise ones) and
loss parallel's all-reduces run as c10d functional collectives: their tensors (the gathered input, the
reduce-scatter's concatenated chunks) are the same on gloo, NCCL and the fake group, and any staging inside
ProcessGroupGloo is C++-internal, outside the tracker on both sides. What the run shows is that nothing of
(2) appears as a tensor the trace does not also have.

The cases run in the shared 2-rank torchrun launch (cases.shared), then one ~1 s trace per case: about a minute
in all on 2 shared cores.
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed.cases import shared

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")

TIMEOUT_S = 300
# The real run's peak jitters by tens of kB from run to run on these tiny models (once -0.39%, 48 KiB more
# activations in the tp 2 fp32 seq 64 case, under a loaded machine; 0.0% on reruns): the order its tensors are
# freed in, as in test_torchrun_ep. The trace is fixed. Counted states are compared to the byte below.
TOLERANCE = 0.005
TINY = {"model_type": "llama", "_name_or_path": "tiny-llama-tp", "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 3000,
        "max_position_embeddings": 4096}
CASES = [
    {"config": {"tp": 2, "precision": "fp32"}, "seq_len": 64},
    {"config": {"tp": 2, "precision": "fp32", "sequence_parallel": False}, "seq_len": 64},
    {"config": {"tp": 2, "precision": "bf16", "micro_batch": 2}, "seq_len": 256},
    {"config": {"tp": 2, "precision": "bf16", "micro_batch": 2, "activation_checkpointing": "full"}, "seq_len": 256},
    {"config": {"tp": 2, "precision": "bf16", "micro_batch": 2, "sequence_parallel": False,
                "activation_checkpointing": "full"}, "seq_len": 256},
    # context parallel: torch's ring attention on the CPU kernel (calibration/context_parallel.py), FSDP over
    # dp_shard x cp = the 2 ranks
    {"config": {"cp": 2, "precision": "bf16", "micro_batch": 2}, "seq_len": 256},
    {"config": {"cp": 2, "precision": "fp32", "activation_checkpointing": "full"}, "seq_len": 256},
    {"config": {"cp": 2, "precision": "fp32"}, "seq_len": 64},
]
# The last case once more with gloo's own gradient reduce-scatter (no InPlaceReduceScatter): not compared with
# the trace, it measures gloo's copy.
GLOO_CASE = {**CASES[-1], "gloo_reduce_scatter": True}
# The TP plan's numerics (worker_mesh.tp_gradient_check): Qwen3, whose plan has all three styles (colwise,
# rowwise, and its q/k norms' replicated_with_grad_allreduce), against the unsharded model.
QWEN3 = {"model_type": "qwen3", "_name_or_path": "tiny-qwen3", "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000,
         "tie_word_embeddings": False, "max_position_embeddings": 512}
GRADIENT_CASE = {"gradient_check": True, "hf_config": QWEN3, "seq_len": 32}
# A vocabulary-heavy tiny Llama, untied and tied: under sequence parallel the embedding's whole-table gradient sets
# the peak (V 64,000 x h 128 fp32: 32,768,000 B; cost_models/memory.py, tensor_parallel.embedding_grad_extra_params)
VOCAB = {**TINY, "_name_or_path": "tiny-llama-vocab", "vocab_size": 64000}
VOCAB_CASES = [{"hf_config": {**VOCAB, "tie_word_embeddings": tied}, "config": {"tp": 2, "precision": "fp32"},
                "seq_len": 64} for tied in (False, True)]
TRACED = CASES + VOCAB_CASES  # the cases trace_case traces (by index)


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in {**case["config"], "seq": case["seq_len"]}.items())


real_runs = shared(__file__, "worker_mesh",
                   [{"hf_config": TINY, **case} for case in CASES + [GLOO_CASE, GRADIENT_CASE]] + VOCAB_CASES,
                   TIMEOUT_S,
                   while_launching=lambda: [trace_case(i) for i in range(len(TRACED))])


@functools.cache  # traced while the shared launch runs (cases.shared's while_launching)
def trace_case(index: int):
    from calibration.build import build_model
    from calibration.trace import trace_memory
    from planner.models import from_module
    from tests.distributed.cases import config_from_dict

    case = TRACED[index]
    hf_config = case.get("hf_config", TINY)
    config = config_from_dict(case["config"])
    spec = from_module(build_model(None, hf_config, device="meta"), name=hf_config["_name_or_path"])
    return trace_memory(spec, config, n_gpus=2, gpus_per_node=2, seq_len=case["seq_len"], hf_config=dict(hf_config))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_id(c) for c in CASES])
def test_mesh_trace_matches_the_real_run(index):
    real = real_runs()[index]
    traced = trace_case(index)
    measured = real["peak_allocated_bytes"]
    relative = traced.peak_allocated_bytes / measured - 1
    peak = max(real["phases"], key=lambda k: real["phases"][k]["peak_allocated_bytes"])
    assert abs(relative) <= TOLERANCE, (
        f"trace {traced.peak_allocated_bytes:,} vs real {measured:,} bytes ({100 * relative:+.3f}%); "
        f"trace {traced.peak_phase} {traced.breakdown}; real {real['peak_phase']} {real['phases'][peak]['breakdown']}")
    assert traced.peak_phase == real["peak_phase"]
    for key in ("sharded_params", "sharded_grads", "optimizer_state"):  # counted, not timed: to the byte
        assert traced.phases["optimizer_step"].breakdown[key] == real["phases"]["optimizer_step"]["breakdown"][key], key


def test_gloo_reduce_scatter_copy_is_what_the_trace_leaves_out():
    """gloo's reduce_scatter_tensor reduces a clone of its input and keeps a second input-sized buffer, which
    NCCL never allocates; with it (cp 2, fp32, 64 tokens, FSDP over the 2 ranks) the real peak moves to the
    end of backward, the root's gradient reduce-scatter: 16,779,996 bytes against 14,470,868 for the trace
    and for the same run with the in-place reduce-scatter (+2,309,128, +16%), when this was written. The
    trace models NCCL's run: it equals the in-place one (test above), never gloo's."""
    in_place, gloo = real_runs()[len(CASES) - 1], real_runs()[len(CASES)]
    traced = trace_case(len(CASES) - 1)
    assert traced.peak_allocated_bytes == in_place["peak_allocated_bytes"]
    assert gloo["peak_allocated_bytes"] > in_place["peak_allocated_bytes"]
    assert gloo["peak_phase"] == "backward"


def test_tp_plan_computes_the_unsharded_gradients():
    """Qwen3 with tp 2, fp32: the loss and every parameter's gradient equal the unsharded model's, with sequence
    parallel + loss parallel and with transformers' plan; the q/k norms' gradients (a norm over head_dim on each
    rank's heads, HeadShardedReplicate) are reduced over tp. When written: loss within 5e-7, gradients within
    7.5e-8, q/k norm gradients within 5.4e-9."""
    result = real_runs()[len(CASES) + 1]
    for mode in ("sp", "no_sp"):
        assert result[mode]["loss_error"] < 1e-5, result
        assert result[mode]["max_grad_error"] < 1e-6, result
        assert result[mode]["qk_norm_grad_error"] < 1e-6, result


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_whole_table_embedding_gradient_in_a_real_run(tied):
    """tp 2 with sequence parallel on V 64,000 x h 128, fp32, 64 tokens: the peak is the embedding's backward, its
    whole 32,768,000 B table beside the rows FSDP2 copies out of it (tied: AccumulateGrad's copy and sum), on the
    real gloo ranks as in the trace (equal to the byte when written: 199,938,268 / 150,786,264 B), and the ledger's
    moment for it agrees: -0.19% / -0.25% (at a shard group of one rank FSDP2 still keeps block 0's reduce-scatter
    input, 369,664 B, which the ledger leaves out there; -0.001% at tp 2 x dp 2, tests/unit/test_mesh_trace.py);
    without the moment -16.2% / -32.8%."""
    from planner.api import estimate

    case = VOCAB_CASES[int(tied)]
    real = real_runs()[len(CASES) + 2 + int(tied)]
    traced = trace_case(len(CASES) + int(tied))
    measured = real["peak_allocated_bytes"]
    assert abs(traced.peak_allocated_bytes / measured - 1) <= TOLERANCE, (traced.peak_allocated_bytes, measured)
    assert traced.peak_phase == real["peak_phase"] == "backward"
    memory = estimate(dict(case["hf_config"]), gpus=2, gpus_per_node=2, tp=2, precision="fp32", micro_batch=1,
                      seq_len=case["seq_len"]).memory
    assert memory.peak_moment == "embedding's gradient, its rows copied"
    assert abs(memory.peak_allocated_bytes / measured - 1) <= TOLERANCE, (memory.peak_allocated_bytes, measured)
