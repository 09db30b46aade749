"""The search's pipelines (issue 18, item 3): which pp / schedule / microbatch combinations are generated, counted by
hand, and how the search walks them."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from cost_models.pipeline import microbatch_refusal
from cost_models.profile import DEFAULT_PROFILE
from cost_models.schedules import Schedule
from cost_models.specs import FsdpConfig, TrainingSpec
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.search import MeshChoice, SearchSpace, pipeline_meshes, search
from planner.search.pipeline import PP_MICROBATCHES_PER_STAGE, Pipeline, microbatch_plans, pipelines, pp_degrees

I1F1B = Schedule.INTERLEAVED_1F1B


@functools.cache
def model(name: str):
    return load_preset(name)


def test_pp_degrees_are_powers_of_two_dividing_the_gpus_left_that_split_the_blocks():
    # llama3.1-405b: 126 blocks; 512 GPUs over tp 8 leave 64: 2 ... 64
    assert pp_degrees(model("llama3.1-405b"), 512 // 8) == [2, 4, 8, 16, 32, 64]
    # llama3.1-8b: 32 blocks, at most 34 stages (the end ones may hold the embedding / the head alone): 64 GPUs
    # give 2 ... 32
    assert pp_degrees(model("llama3.1-8b"), 64) == [2, 4, 8, 16, 32]
    # 24 GPUs: 2, 4, 8 divide 24 (16 does not, 32 neither)
    assert pp_degrees(model("llama3.1-8b"), 24) == [2, 4, 8]
    assert pp_degrees(model("llama3.1-8b"), 1) == []
    assert pp_degrees(model("llama3.1-8b"), 64, pinned=6) == [6]  # pinned: the mesh rules judge it
    assert pp_degrees(model("llama3.1-8b"), 64, pinned=1) == []


def test_schedules_tried_per_degree():
    m = model("llama3.1-405b")  # 126 blocks
    assert pipelines(m, 8) == [Pipeline(8), Pipeline(8, I1F1B, 2)]
    assert pipelines(model("llama3.1-8b"), 32) == [Pipeline(32)]  # interleaved: 64 stages for 32 blocks
    assert pipelines(m, 8, Schedule.GPIPE) == [Pipeline(8, Schedule.GPIPE, 1)]
    assert pipelines(m, 8, I1F1B, 4) == [Pipeline(8, I1F1B, 4)]
    assert pipelines(m, 8, Schedule.DUALPIPEV) == [Pipeline(8, Schedule.DUALPIPEV, 2)]
    assert pipelines(m, 8, None, 2) == [Pipeline(8, I1F1B, 2)]  # a pinned V picks the schedule with it


def test_pipeline_meshes_over_tp_2_on_128_gpus():
    # llama3.1-8b (32 blocks), 128 / tp 2 = 64 GPUs: degrees 2, 4, 8, 16 with both schedules (8) and 32 with 1F1B
    # only (interleaved: 64 stages): 9
    m, cluster = model("llama3.1-8b"), make_cluster(128, gpu="h100-80gb")
    found = pipeline_meshes(m, cluster, SearchSpace(), MeshChoice(tp=2))
    assert len(found) == 9 and found[-1] == Pipeline(32) and found[0] == Pipeline(2)
    assert pipeline_meshes(m, cluster, SearchSpace(pp=1), MeshChoice(tp=2)) == []


def test_microbatch_counts_with_a_global_batch():
    # 16 GPUs, global batch 32, llama3.2-1b's 16 blocks; per (pp, schedule): dp = 16 / pp, the local batch 32 / dp,
    # m = local / micro-batch; kept: m >= stages and what the schedule takes (interleaved: m a multiple of m // pp)
    training = TrainingSpec(seq_len=2048, global_batch=32)
    mbs = (1, 2, 4, 8, 16, 32, 64)
    expected = {
        Pipeline(2): [(1, 4), (2, 2)],              # dp 8, local 4: m 4, 2 (m 1 < 2 stages)
        Pipeline(2, I1F1B, 2): [(1, 4)],            # 4 stages: m 4 only
        Pipeline(4): [(1, 8), (2, 4)],              # dp 4, local 8
        Pipeline(4, I1F1B, 2): [(1, 8)],            # 8 stages
        Pipeline(8): [(1, 16), (2, 8)],             # dp 2, local 16
        Pipeline(8, I1F1B, 2): [(1, 16)],           # 16 stages; 16 % (16 // 8) == 0
        Pipeline(16): [(1, 32), (2, 16)],           # dp 1, local 32
    }
    for pipe, plans in expected.items():
        assert microbatch_plans(training, 16 // pipe.pp, mbs, pipe) == plans, pipe
    # pinned: every count the schedule takes; 1F1B still needs m >= stages (torch raises), GPipe does not
    assert microbatch_plans(training, 8, mbs, Pipeline(2), pinned_schedule=True) == [(1, 4), (2, 2)]
    assert microbatch_plans(training, 8, mbs, Pipeline(2, Schedule.GPIPE), pinned_schedule=True) == [
        (1, 4), (2, 2), (4, 1)]
    # interleaved on 4 ranks, local batch 6 (m 6: 6 // 4 = 1 round) and 3 (m 3, one round): both taken
    six = TrainingSpec(seq_len=2048, global_batch=6)
    assert microbatch_plans(six, 1, (1, 2), Pipeline(4, I1F1B, 2), pinned_schedule=True) == [(1, 6), (2, 3)]
    # 10 microbatches on 4 ranks: 2 rounds of 5 -> taken; 9: 2 rounds, 9 % 2 -> refused (torch raises)
    for m, ok in ((10, True), (9, False)):
        config = FsdpConfig(micro_batch=1, grad_accum=m, pp=4, pp_schedule=I1F1B)
        assert (microbatch_refusal(config) is None) is ok


def test_microbatch_counts_without_a_global_batch_are_two_per_stage():
    training = TrainingSpec(seq_len=2048)
    assert PP_MICROBATCHES_PER_STAGE == 2
    assert microbatch_plans(training, 8, (1, 2), Pipeline(4)) == [(1, 8), (2, 8)]
    assert microbatch_plans(training, 8, (1,), Pipeline(4, I1F1B, 2)) == [(1, 16)]
    assert microbatch_plans(training, 8, (1, 2), Pipeline()) == [(1, 1), (2, 1)]


def test_pipelines_only_add_to_the_meshes_without_them():
    # pp 1 leaves PP out; searched, the candidates without a pipeline are the same ones, the pipelines after them
    m, cluster = model("llama3.2-1b"), make_cluster(16, gpu="h100-80gb")
    training = TrainingSpec(seq_len=2048, global_batch=32)
    space = SearchSpace(tp=1, cp=1, compile=(False,), float8=(False,))
    plain = search(m, cluster, training, DEFAULT_PROFILE, dataclasses.replace(space, pp=1))
    walked = search(m, cluster, training, DEFAULT_PROFILE, space)
    assert all(e.config.pp == 1 for e in plain.fitting + plain.misses) and plain.n_costed > 0
    flat = [e.config for e in walked.fitting + walked.misses if e.config.pp == 1]
    assert sorted(map(repr, flat)) == sorted(repr(e.config) for e in plain.fitting + plain.misses)
    assert walked.n_costed >= plain.n_costed


def test_search_walks_pipelines():
    m, cluster = model("llama3.2-1b"), make_cluster(16, gpu="h100-80gb")
    training = TrainingSpec(seq_len=2048, global_batch=32)
    space = SearchSpace(tp=1, cp=1, compile=(False,), float8=(False,), ac_every=(0, 1))
    result = search(m, cluster, training, DEFAULT_PROFILE, space)
    piped = [e for e in result.fitting + result.misses if e.config.pp > 1]
    assert piped  # pp 2 at least is costed for each schedule
    allowed = {Pipeline(2), Pipeline(2, I1F1B, 2), Pipeline(4), Pipeline(4, I1F1B, 2), Pipeline(8),
               Pipeline(8, I1F1B, 2), Pipeline(16)}
    for e in piped:
        c = e.config
        pipe = Pipeline(c.pp, c.pp_schedule, c.pp_stages_per_rank)
        assert pipe in allowed
        # the microbatches the global batch gives: 32 sequences over 16 / pp data-parallel ranks
        assert c.micro_batch * c.grad_accum * (16 // c.pp) == 32
        assert c.grad_accum >= c.pp_stages and microbatch_refusal(c) is None
        assert c.sharding.value in ("FULL_SHARD", "NO_SHARD")  # one node: no HYBRID; SHARD_GRAD_OP runs alike
    # the walk goes up in degree only while the degree before fit faster (or nothing fit before)
    for schedule, v in ((Schedule.ONE_F_ONE_B, 1), (I1F1B, 2)):
        best = {}
        for e in result.fitting:
            c = e.config
            if c.pp > 1 and (c.pp_schedule, c.pp_stages_per_rank) == (schedule, v):
                best[c.pp] = max(best.get(c.pp, 0), e.time.tokens_per_s_per_gpu)
        degrees = sorted(best)
        for low, high in zip(degrees, degrees[1:]):
            assert high == 2 * low
        for low, high in zip(degrees[:-2], degrees[1:-1]):  # every degree but the last improved on the one before
            assert best[high] > best[low]


def test_the_walk_judges_degrees_with_every_checkpointing_choice():
    # llama3.1-70b on 1,024 A100 80 GB, global batch 512: judged under full checkpointing alone, no pipeline beat
    # FSDP 128 x TP 8 without checkpointing (320.7 tokens/s/GPU); FSDP 64 x TP 4 x PP 4 (interleaved, V 2, 8
    # microbatches of 1) fits without checkpointing and runs at 333.3. The search must find at least what pinning
    # that pipeline finds (both costed here, 2026-12-02).
    m, cluster = model("llama3.1-70b"), make_cluster(1024)
    training = TrainingSpec(seq_len=2048, global_batch=512)
    searched = search(m, cluster, training, DEFAULT_PROFILE, SearchSpace()).fitting[0]
    pinned = search(m, cluster, training, DEFAULT_PROFILE, SearchSpace(tp=4, pp=4)).fitting[0]
    assert pinned.time.tokens_per_s_per_gpu == pytest.approx(333.3, abs=0.5)
    assert searched.time.tokens_per_s_per_gpu >= pinned.time.tokens_per_s_per_gpu - 1e-9
    assert (searched.config.pp, searched.config.ac_every) == (4, 0)


def test_pinned_pp_searches_that_pipeline_only():
    m, cluster = model("llama3.2-1b"), make_cluster(16, gpu="h100-80gb")
    training = TrainingSpec(seq_len=2048, global_batch=32)
    space = SearchSpace(tp=1, cp=1, compile=(False,), float8=(False,), ac_every=(1,), pp=4, pp_schedule=Schedule.GPIPE)
    result = search(m, cluster, training, DEFAULT_PROFILE, space)
    configs = [e.config for e in result.fitting + result.misses]
    assert configs and {(c.pp, c.pp_schedule, c.pp_stages_per_rank) for c in configs} == {(4, Schedule.GPIPE, 1)}
    # GPipe pinned: every micro-batch whose count the global batch gives (dp 4, local 8): m 8, 4, 2, 1
    assert {(c.micro_batch, c.grad_accum) for c in configs} <= {(1, 8), (2, 4), (4, 2), (8, 1)}


def test_where_nothing_fits_the_walk_goes_on_while_the_nearest_miss_comes_closer():
    # 3 GiB GPUs: llama3.2-1b fits nowhere (its 1.24B params' adamw state alone is 1.24e9 x 16 B / 16 = 1.2 GiB
    # a rank, plus activations); each schedule's walk goes up from pp 2 while the least overshoot falls, and stops
    # at the first degree where it does not
    from planner.search import overshoot

    m, cluster = model("llama3.2-1b"), make_cluster(16, gpu="h100-80gb", gpu_memory=3 * 2**30)
    training = TrainingSpec(seq_len=2048, global_batch=32)
    space = SearchSpace(tp=1, cp=1, compile=(False,), float8=(False,), ac_every=(0, 1))
    result = search(m, cluster, training, DEFAULT_PROFILE, space)
    assert not result.fitting
    for schedule in (Schedule.ONE_F_ONE_B, I1F1B):
        least = {}
        for e in result.misses:
            if e.config.pp > 1 and e.config.pp_schedule is schedule:
                least[e.config.pp] = min(least.get(e.config.pp, 9e9), overshoot(e)[0])
        degrees = sorted(least)
        assert degrees[0] == 2 and degrees == [2 ** k for k in range(1, len(degrees) + 1)], (schedule, degrees)
        for low, high in zip(degrees[:-2], degrees[1:-1]):  # closer at every degree but the last
            assert least[high] < least[low], (schedule, least)
        last = pipelines(m, degrees[-1] * 2, schedule)
        assert not last or len(degrees) < 2 or least[degrees[-1]] >= least[degrees[-2]], (schedule, least)


def test_pipeline_ceiling_is_the_meshs_compute_with_the_textbook_bubble():
    from planner.search.walk import pipeline_ceiling

    # 1 ms of compute a token; 1F1B on 4 ranks, at most 12 microbatches: bubble 3 / (12 + 3) = 0.2 -> 800 tokens/s
    plans = [(1, 12), (2, 6)]
    assert pipeline_ceiling(1e-3, Pipeline(4), plans) == pytest.approx(800)
    # interleaved, 2 stages a rank: 3 / (2 x 12 + 3) = 1/9 -> 888.9
    assert pipeline_ceiling(1e-3, Pipeline(4, I1F1B, 2), plans) == pytest.approx(8000 / 9)
    # no closed form (zero bubble, DualPipeV), nothing costed, no plan: no bound
    assert pipeline_ceiling(1e-3, Pipeline(4, Schedule.ZERO_BUBBLE, 2), plans) is None
    assert pipeline_ceiling(None, Pipeline(4), plans) is None and pipeline_ceiling(1e-3, Pipeline(4), []) is None


def test_walk_on_rules():
    from planner.search.walk import Walk, walk_on

    # fits faster than the best so far (the mesh without PP: 100): on, the best moves
    assert walk_on(120.0, None, True, Walk(100.0)) == (True, Walk(120.0))
    # fits, no faster: stop
    assert walk_on(90.0, None, True, Walk(100.0)) == (False, Walk(100.0))
    # nothing fits: on while the nearest miss comes closer (1.3 x the GPU, then 1.1), stop when it does not (1.2)
    go, walk = walk_on(None, 1.3, True, Walk(100.0))
    assert go and walk == Walk(100.0, 1.3)
    go, walk = walk_on(None, 1.1, True, walk)
    assert go and walk.overshoot == 1.1
    assert walk_on(None, 1.2, True, walk)[0] is False
    # no micro-batch plan at this degree (the global batch does not split): on, unless a miss was seen before
    assert walk_on(None, None, False, Walk(100.0))[0] is True
    assert walk_on(None, None, False, Walk(100.0, 1.1))[0] is False


def test_pinned_pp_beside_searched_tp_skips_meshes_that_do_not_divide_the_gpus():
    """--pp 2 on 8 GPUs with tp searched: tp 8 x pp 2 = 16 ranks is not costed (it divided by zero before)."""
    from planner.api import plan

    p = plan("llama3-8b", 8, pp=2, global_batch=16)
    assert p.n_costed > 0 and p.candidates
    assert {c.config.tp for c in p.candidates} <= {1, 2, 4} and all(c.config.pp == 2 for c in p.candidates)
    assert all(8 % (c.config.tp * c.config.pp) == 0 for c in p.candidates + p.misses)
