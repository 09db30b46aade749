"""Pipeline stages: the even block split, torch's stage-to-rank placement, and the schedule's rules."""

import pytest

from cost_models.pipeline import blocks_per_stage, microbatch_refusal, rank_stages, stage_rank, stages, stage_refusals
from cost_models.schedules import Schedule
from cost_models.specs import FsdpConfig, SpecError
from planner.models import resolve_model


def test_blocks_split_evenly_with_the_end_stages_one_fewer():
    # Llama 3.1 405B's 126 blocks over 16 stages: 14 x 8 + 2 x 7, the two 7s on the first and last stage
    assert blocks_per_stage(126, 16) == (7,) + (8,) * 14 + (7,)
    assert blocks_per_stage(32, 4) == (8, 8, 8, 8)
    assert blocks_per_stage(10, 4) == (2, 3, 3, 2)
    assert sum(blocks_per_stage(80, 24)) == 80


def test_stage_placement_follows_torch_loop_and_v_styles():
    # torch.distributed.pipelining.schedules.generate_stage_to_rank_mapping(pp=4, stages=8, style=...)
    assert [stage_rank(s, 4, Schedule.INTERLEAVED_1F1B) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_rank(s, 4, Schedule.DUALPIPEV) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_stages_hold_embedding_first_and_head_last():
    model = resolve_model("llama3-8b")  # 32 blocks
    config = FsdpConfig(pp=4, pp_schedule="interleaved-1f1b", grad_accum=8)
    assert config.pp_stages_per_rank == 2 and config.pp_stages == 8
    split = stages(model, config)
    assert [(s.first_block, s.n_blocks) for s in split] == [(4 * i, 4) for i in range(8)]
    assert split[0].embedding and not split[0].head and split[-1].head and not split[-1].embedding
    assert [s.index for s in rank_stages(model, config, 1)] == [1, 5]
    assert split[0].describe() == "embedding + blocks 0-3"
    assert split[-1].describe() == "blocks 28-31 + norm + head + loss"
    v = FsdpConfig(pp=4, pp_schedule="dualpipev", grad_accum=8)
    assert [s.index for s in rank_stages(model, v, 0)] == [0, 7]  # rank 0 holds the embedding and the head


def test_schedule_shape_and_microbatch_rules():
    with pytest.raises(SpecError, match="pp_stages_per_rank.*looped"):
        FsdpConfig(pp=2, pp_schedule="1f1b", pp_stages_per_rank=2)
    with pytest.raises(SpecError, match="pp_schedule"):
        FsdpConfig(pp=2, pp_schedule="pipedream")
    with pytest.raises(SpecError, match="exactly 2"):
        FsdpConfig(pp=2, pp_schedule="dualpipev", pp_stages_per_rank=3)
    assert FsdpConfig(pp=1, pp_schedule="gpipe") == FsdpConfig()  # no pipeline: one spelling
    assert microbatch_refusal(FsdpConfig(pp=4, grad_accum=3)).code == "pp-too-few-microbatches"
    assert microbatch_refusal(FsdpConfig(pp=4, grad_accum=4)) is None
    assert microbatch_refusal(FsdpConfig(pp=4, pp_schedule="gpipe", grad_accum=1)) is None
    # torch's ScheduleInterleaved1F1B: rounds = max(1, m // pp) must divide m: 10 over pp 4 has 2 rounds (ok), 9 has 2
    assert microbatch_refusal(FsdpConfig(pp=4, pp_schedule="interleaved-1f1b", grad_accum=10)) is None
    assert microbatch_refusal(FsdpConfig(pp=4, pp_schedule="interleaved-1f1b", grad_accum=9)).code == \
        "pp-microbatches-not-rounds"
    assert microbatch_refusal(FsdpConfig(pp=2, pp_schedule="dualpipev", grad_accum=3)).code == \
        "pp-too-few-microbatches"  # 4 stages


def test_more_stages_than_blocks_is_refused():
    model = resolve_model("llama3-8b")  # 32 blocks: 34 stages at most (embedding-only and head-only ends)
    assert stage_refusals(model, FsdpConfig(pp=32, grad_accum=32)) == []
    assert stage_refusals(model, FsdpConfig(pp=17, pp_schedule="interleaved-1f1b", grad_accum=34)) == []
    (refusal,) = stage_refusals(model, FsdpConfig(pp=32, pp_schedule="interleaved-1f1b", grad_accum=64))
    assert refusal.field == "pp" and "64 stages" in refusal.reason and "pp <= 17" in refusal.fix


def test_two_stages_more_than_blocks_put_embedding_and_head_alone():
    # Llama 3 405B as Meta ran it (Dubey et al. 2024, section 3.3.2): 126 blocks, pp 16 x V 8 = 128 stages
    model = resolve_model("llama3.1-405b")
    split = stages(model, FsdpConfig(pp=16, pp_schedule="interleaved-1f1b", pp_stages_per_rank=8, grad_accum=16))
    assert [s.n_blocks for s in split] == [0] + [1] * 126 + [0]
    assert split[0].describe() == "embedding" and split[-1].describe() == "norm + head + loss"
    assert split[1].describe() == "block 0" and split[-2].describe() == "block 125"
