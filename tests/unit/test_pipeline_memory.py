"""Memory per pipeline rank (issue 18 item 2): cost_models/pipeline_memory.py against counts by hand, torch's
in-flight microbatches, and cached traces of torch.distributed.pipelining's schedules on fake tensors.

The cached figures are calibration.trace_pipeline.trace_pipeline's peaks (allocated bytes per pipeline rank) of the
rows of benchmarks/memory_accuracy_pp.py, recorded with `python benchmarks/memory_accuracy.py --pp --json out.json`
(torch 2.13, transformers 5.24); each trace takes 10-60 s, so the tests read the figures, not the traces.
"""

from __future__ import annotations

import functools

import pytest

from benchmarks.memory_accuracy_pp import PP_ARCHS, estimate_row
from cost_models.memory import estimate_memory
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig
from planner.api import resolve_inputs

LLAMA8 = PP_ARCHS["llama-8"]  # 8 blocks, h 256, f 768, 4 heads over 2 KV heads, V 8000, untied


@functools.cache
def specs(gpus: int, seq_len: int = 256):
    return resolve_inputs(dict(LLAMA8), gpus, gpus_per_node=min(gpus, 8), seq_len=seq_len)


def ranks(schedule: str, pp: int, microbatches: int, gpus: int, **config):
    spec, cluster, training = specs(gpus)
    cfg = FsdpConfig(pp=pp, pp_schedule=schedule, micro_batch=2, grad_accum=microbatches, **config)
    return estimate_memory(spec, cluster, training, cfg, DEFAULT_PROFILE)


def test_without_pipeline_there_are_no_pipeline_ranks():
    spec, cluster, training = specs(4)
    assert estimate_memory(spec, cluster, training, FsdpConfig(micro_batch=2), DEFAULT_PROFILE).pipeline_ranks == ()


def test_stage_states_counted_by_hand():
    # a block: q, o 256 x 256, k, v 256 x 128, gate / up / down 256 x 768, two norms: 786,944 parameters;
    # stage 0 = embedding 8000 x 256 + blocks 0-3 = 5,195,776; stage 1 = blocks 4-7 + norm 256 + head = 5,196,032.
    # bf16: fp32 shards over dp 2 (2 bytes a parameter), kept gathered in bf16 (2 bytes), AdamW 8 / 2 = 4 bytes
    est = ranks("1f1b", 2, 4, 4)
    for rank, params in zip(est.pipeline_ranks, (5_195_776, 5_196_032)):
        assert rank.breakdown.sharded_params == params * 2
        assert rank.breakdown.unsharded_params == params * 2
        assert rank.breakdown.optimizer_state == params * 4
    # the same figures the trace shows: 10,391,552 / 10,392,064 B sharded and gathered params (traced by hand with
    # trace_pipeline on this config; the tracker's optimizer state adds 148 / 152 B of step counters)


def test_headline_is_the_largest_rank():
    est = ranks("gpipe", 4, 4, 8)
    top = max(est.pipeline_ranks, key=lambda r: r.peak_allocated_bytes)
    assert est.peak_allocated_bytes == top.peak_allocated_bytes and top.rank == 3  # the head, logits and loss
    assert est.peak_moment.endswith("(pipeline rank 3)")


@pytest.mark.parametrize("schedule, pp, m, expected", [
    ("gpipe", 4, 6, [6, 6, 6, 6]),                 # GPipe: every microbatch before any backward
    ("1f1b", 4, 8, [4, 3, 2, 1]),                  # 1F1B: min(m, pp - rank)
    ("1f1b", 2, 6, [2, 1]),
])
def test_in_flight_microbatches_follow_torchs_order(schedule, pp, m, expected):
    est = ranks(schedule, pp, m, pp * 2)
    held = [int(r.description.split("up to ")[1].split()[0]) for r in est.pipeline_ranks]
    assert held == expected


# (arch, schedule, pp, V, microbatches, gpus, per node, sharding, precision, ac_every, mb, seq): traced peaks
CACHED = [
    (("llama-8", "1f1b", 2, 0, 4, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256), (114_368_916, 170_882_476)),
    (("llama-8", "1f1b", 2, 0, 4, 4, 8, "FULL_SHARD", "bf16", 1, 2, 256), (74_178_964, 147_504_556)),
    (("llama-8", "gpipe", 2, 0, 4, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256), (142_573_972, 274_848_184)),
    (("llama-8", "interleaved-1f1b", 2, 2, 4, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256), (129_532_308, 185_456_044)),
    (("llama-8", "gpipe", 8, 0, 4, 16, 8, "FULL_SHARD", "bf16-pure", 0, 2, 256),
     (42_683_176,) + (33_491_748,) * 6 + (174_956_620,)),
    # the preset, tied embeddings (the last stage trains its own copy of the table): the step-end reduce-scatter and
    # the first microbatch's root post-backward set these peaks
    (("llama3.2-1b", "1f1b", 2, 0, 2, 4, 8, "FULL_SHARD", "bf16", 0, 1, 512), (10_047_857_188, 10_501_556_788)),
    (("llama3.2-1b", "interleaved-1f1b", 2, 2, 4, 8, 8, "FULL_SHARD", "bf16", 0, 1, 512), (8_197_095_972, 8_762_413_628)),
    # the step-end reduce-scatter of block units (grads freed before the output is made) and, without a dtype change,
    # fc2's weight gradient made whole before its in-place add
    (("llama3.2-1b", "gpipe", 4, 0, 4, 8, 8, "FULL_SHARD", "bf16", 1, 1, 512),
     (7_132_627_348, 3_110_703_504, 3_110_703_504, 7_965_120_976)),
    (("llama3.2-1b", "1f1b", 4, 0, 8, 4, 8, "FULL_SHARD", "bf16-pure", 0, 1, 256),
     (5_932_589_460, 2_825_658_768, 2_713_256_336, 6_301_955_516)),
    # the split backward: the trace without the memory tracker's module-input hooks (no reference cycle: the same
    # bytes with Python's cycle collector on and off)
    (("llama-8", "zero-bubble", 2, 2, 4, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256), (125_904_276, 211_568_048)),
    (("llama-8", "dualpipev", 2, 2, 4, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256), (213_464_492, 105_218_448)),
    # fp32: the first norm saves the block input itself, the receive buffer (or, on DualPipeV's rank pp - 1, the
    # adjacent stage's output): counted once (before +0.48% on GPipe's rank 1, +1.41% on DualPipeV's)
    (("llama-8", "gpipe", 2, 0, 8, 2, 8, "FULL_SHARD", "fp32", 0, 1, 256), (267_108_756, 414_329_360)),
    (("llama-8", "dualpipev", 2, 2, 8, 4, 8, "FULL_SHARD", "fp32", 0, 1, 256), (236_958_648, 109_027_728)),
    # four stages a rank: the runtime keeps three unsharded; tp 2 (no sequence parallel): RMSNorm's backward moment
    (("llama-8", "interleaved-1f1b", 2, 4, 4, 4, 8, "FULL_SHARD", "bf16", 1, 2, 256), (79_893_908, 153_151_916)),
    (("llama-16", "1f1b", 4, 0, 8, 16, 8, "FULL_SHARD", "bf16", 0, 1, 256, 2),
     (122_810_516, 84_590_736, 72_249_488, 114_059_196)),
]
KEYS = ("arch", "pp_schedule", "pp", "pp_stages_per_rank", "microbatches", "gpus", "gpus_per_node", "sharding",
        "precision", "ac_every", "micro_batch", "seq_len", "tp")  # tp only where > 1


@pytest.mark.parametrize("row, traced", CACHED, ids=lambda v: "-".join(map(str, v[1:5])) if len(v) > 2 else "")
def test_estimate_within_one_percent_of_the_trace_on_every_rank(row, traced):
    _, est = estimate_row(dict(zip(KEYS, row)))
    assert len(est) == len(traced)
    for rank, peak in zip(est, traced):
        assert rank.peak_allocated_bytes == pytest.approx(peak, rel=0.01), rank.rank


@pytest.mark.parametrize("schedule, pp, v, m", [("interleaved-1f1b", 4, 2, 8), ("interleaved-1f1b", 2, 4, 4),
                                                ("gpipe", 2, 1, 4)])
def test_in_flight_microbatches_match_torchs_own_pipeline_order(schedule, pp, v, m):
    """Counted from torch's pipeline_order (a fake group, tests/golden/test_pipeline_rows.torch_orders): forwards
    minus backwards on each stage, at their most."""
    from tests.golden.test_pipeline_rows import torch_orders

    est = ranks(schedule, pp, m, pp * 2, pp_stages_per_rank=v)
    for rank in est.pipeline_ranks:
        theirs: dict[int, int] = {}
        live: dict[int, int] = {}
        for stage, kind, _ in torch_orders(schedule, pp, v, m)[rank.rank]:
            live[stage] = live.get(stage, 0) + (1 if kind == "F" else -1 if kind == "B" else 0)
            theirs[stage] = max(theirs.get(stage, 0), live[stage])
        ours = [int(part.split("up to ")[1].split()[0]) for part in rank.description.split("; ")]
        assert ours == [theirs[s] for s in rank.stages], rank.rank


def test_input_pass_keeps_the_output_gradient_of_each_linear_and_norm():
    """Zero-bubble's I pass on a non-first stage keeps, per block and token, the gradient at q (256), k, v (128
    each), o, down (256 each), gate, up (768 each) and both norms' weight products (256 each): 3,072 bf16 elements,
    6,144 B. Stage 2 of llama-8 pp 2 V 2 (blocks 4-5) over 2 x 256 tokens: 6,291,456 B, the 18 tensors the trace's
    param_groups hold for that microbatch (stage.backward_state after I, this row's trace). The first stage skips
    I (torch runs its whole backward at W): none."""
    from cost_models.pipeline import rank_stages
    from cost_models.pipeline_stage_pieces import stage_pieces

    spec, _, training = specs(4)
    cfg = FsdpConfig(pp=2, pp_schedule="zero-bubble", pp_stages_per_rank=2, micro_batch=2, grad_accum=4)
    held = {st.index: stage_pieces(spec, training, cfg, st).weight_inputs for st in rank_stages(spec, cfg, 0)}
    assert held == {0: 0, 2: 6_291_456}


def test_fp8_all_gather_keeps_each_stage_s_float8_weights_at_one_byte():
    """FSDP2's FP8 all-gather under PP, by hand (calibration/float8.py refuses to trace Float8 on CPU): a llama-8
    block's Float8 linears are q, o 256 x 256, k, v 256 x 128, gate / up / down 256 x 768 = 786,432 weights, kept
    gathered at 1 byte instead of bf16's 2 (its two norms, 512, stay bf16): 787,456 B a block. Stage 0 = embedding
    8000 x 256 x 2 + 4 blocks = 7,245,824 B; stage 1 = norm + head (256 + 2,048,000) x 2 + 4 blocks = 7,246,336 B,
    3,145,728 B (4 x 786,432) under the bf16 figures at each rank's peak; the pp = 1 rule's saving per block
    (operators.fp8_all_gather_saving_bytes, what memory.py takes off each gathered block) is the same 786,432."""
    from cost_models import operators

    spec, _, _ = specs(4)
    assert operators.fp8_all_gather_saving_bytes(spec, 2, 256) == 786_432
    plain, fp8 = ranks("1f1b", 2, 4, 4), ranks("1f1b", 2, 4, 4, float8=True, fp8_all_gather=True)
    assert [r.breakdown.unsharded_params for r in fp8.pipeline_ranks] == [7_245_824, 7_246_336]
    assert [a.peak_allocated_bytes - b.peak_allocated_bytes
            for a, b in zip(plain.pipeline_ranks, fp8.pipeline_ranks)] == [3_145_728, 3_145_728]
    assert not any("FP8" in note for note in fp8.notes)


def test_stages_of_one_shape_share_their_pieces():
    """A rank replay prices each stage shape once (shaped_stage_pieces): llama-8's 8 blocks over pp 4 x V 2 = 8
    stages of one block, checkpointing every second block; the shapes are the first (embedding), the last (head) and
    the middle ones by whether their block is checkpointed: 4, and every stage's pieces equal its own pricing."""
    from cost_models.pipeline import stages
    from cost_models.pipeline_stage_pieces import shaped_stage_pieces, stage_pieces

    spec, _, training = specs(8)
    cfg = FsdpConfig(pp=4, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2, micro_batch=1, grad_accum=8,
                     ac_every=2)
    shapes: dict = {}
    for st in stages(spec, cfg):
        assert shaped_stage_pieces(spec, training, cfg, st, shapes) == stage_pieces(spec, training, cfg, st)
    assert len(stages(spec, cfg)) == 8 and len(shapes) == 4


def test_sequence_parallel_embedding_gradient_is_the_whole_table():
    """DTensor's embedding_dense_backward has no vocabulary-sharded strategy: under TP 2 with sequence parallel the
    first stage's embedding gradient is the whole 8,000 x 256 table, 1,024,000 elements beyond the rank's
    4,000 x 256 shard (the tiny Llama's trace: a [256, 64] fp32 gradient, 65,536 B, beside its 32,768 B shard).
    The last stage, and TP without sequence parallel (the embedding replicated), hold none."""
    from cost_models.pipeline import rank_stages
    from cost_models.pipeline_memory import rank_inputs
    from cost_models.pipeline_stage_pieces import stage_pieces

    spec, _, training = specs(8)
    for sp, expected in ((True, [1_024_000, 0]), (False, [0, 0])):
        config = FsdpConfig(pp=2, tp=2, sequence_parallel=sp, pp_schedule="1f1b", micro_batch=2, grad_accum=4)
        local, local_training = rank_inputs(spec, training, config)
        stages = [rank_stages(local, config, r)[0] for r in range(2)]
        assert [stage_pieces(local, local_training, config, s).grad_extra for s in stages] == expected


def test_first_stage_at_405b_widths_under_tp_8_within_two_percent_of_its_trace():
    """benchmarks/pipeline_replay_wide.py's model (Llama 3.1 405B's widths, 8 blocks, V 128,256), pipeline rank 0 of
    pp 4 x TP 8 (sequence parallel) x FSDP 2, 1F1B, 8 microbatches of 4 x 8,192, full checkpointing, bf16: traced
    29,487,039,052 B (trace_pipeline, ranks=(0,), 2026-12-07; `python benchmarks/pipeline_replay_wide.py`, its tp 8 rank
    0 row: 27.46 GiB). The ledger +1.02% (-23.9% before the embedding's whole-table gradient: 7.35 GB of it)."""
    from benchmarks.pipeline_replay_wide import ARCH, FSDP, PP, SEQ_LEN

    spec, cluster, training = resolve_inputs(dict(ARCH), PP * 8 * FSDP, gpus_per_node=8, seq_len=SEQ_LEN)
    config = FsdpConfig(precision="bf16", ac_every=1, micro_batch=4, grad_accum=8, pp=PP, tp=8, pp_schedule="1f1b")
    rank0 = estimate_memory(spec, cluster, training, config, DEFAULT_PROFILE).pipeline_ranks[0]
    assert rank0.peak_allocated_bytes == pytest.approx(29_487_039_052, rel=0.02)
