"""--emit fsdp2 for a pipeline (issue 18 item 4): the stage split as constants (cost_models/pipeline.py's, torch's
loop / v placement), Stage modules with FSDP2 (and TP without sequence parallel) per stage, PipelineStage with
static shapes and the schedule class, every line at most 100 columns; what it does not write, one line each.
The emitted code is run on a tiny transformers Llama under a fake process group here (the stages it builds) and
for real under torchrun in tests/distributed/test_torchrun_pp.py (it trains two steps like the unsplit model)."""

from __future__ import annotations

import pytest

from cost_models.pipeline import stages
from cost_models.specs import FsdpConfig, TrainingSpec
from planner.emit import emit_fsdp2
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import load_preset

LLAMA = load_preset("llama3-8b")      # 32 blocks
PLANS = [  # (config, GPUs, STAGES_OF_RANK by hand)
    (FsdpConfig(pp=2, grad_accum=8), 16, [[0], [1]]),
    (FsdpConfig(pp=4, pp_schedule="gpipe", grad_accum=4, ac_every=2, compile=True), 8, [[0], [1], [2], [3]]),
    (FsdpConfig(pp=4, pp_schedule="interleaved-1f1b", grad_accum=8, tp=2, sequence_parallel=False), 16,
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (FsdpConfig(pp=2, pp_schedule="dualpipev", grad_accum=8, ac_every="selective-op"), 8, [[0, 3], [1, 2]]),
    (FsdpConfig(pp=2, pp_schedule="zero-bubble", pp_stages_per_rank=4, grad_accum=4, precision="fp32"), 4,
     [[0, 2, 4, 6], [1, 3, 5, 7]]),
]


def _exec(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)  # imports resolve on this torch
    return namespace


@pytest.mark.parametrize("config, gpus, of_rank", PLANS, ids=lambda v: getattr(v, "pp_schedule", v))
def test_the_snippet_writes_the_plans_split_and_schedule_in_short_lines(config, gpus, of_rank):
    code = emit_fsdp2(config, LLAMA, make_cluster(gpus), TrainingSpec(seq_len=4096))
    ns = _exec(code)
    assert max(len(line) for line in code.splitlines()) <= 100
    split = stages(LLAMA, config)
    assert ns["STAGE_BLOCKS"] == [(s.first_block, s.n_blocks) for s in split]
    assert sum(n for _, n in ns["STAGE_BLOCKS"]) == 32
    assert ns["STAGES_OF_RANK"] == of_rank
    assert (ns["N_MICROBATCHES"], ns["MICROBATCH_SIZE"], ns["SEQ_LEN"]) == (config.grad_accum, 1, 4096)
    assert ns["MESH_DIMS"][0] == "pp" and ns["MESH_SHAPE"][0] == config.pp
    cls = config.pp_schedule.torch_class
    assert f"from torch.distributed.pipelining.schedules import {cls}" in code
    assert f"    schedule = {cls}(\n        {'pipeline_stages' if config.pp_schedule.looped else 'pipeline_stages[0]'}," \
        in code
    assert "reshard_after_forward=False" in code  # torchtitan's default under PP
    for s in split:  # the split is printed
        assert f"#   stage {s.index} (pp rank {s.rank}): {s.describe()}" in code


@pytest.mark.parametrize("config, field, seq_len, words", [
    (FsdpConfig(pp=2, cp=2, grad_accum=4), "cp", 4096, "torchtitan"),
    # sequence parallel between stages: static shards of seq_len / tp tokens
    (FsdpConfig(pp=2, tp=4, grad_accum=4), "sequence_parallel", 4098, "seq_len=4098 with tp=4"),
])
def test_what_the_pipeline_snippet_does_not_write_is_one_line(config, field, seq_len, words):
    with pytest.raises(PlannerError) as err:
        emit_fsdp2(config, LLAMA, make_cluster(16), TrainingSpec(seq_len=seq_len))
    assert err.value.field == field and len(str(err.value).splitlines()) == 1 and words in str(err.value)


@pytest.mark.parametrize("schedule, pairs", [("1f1b", [0, 1]), ("dualpipev", None)])
def test_tied_embeddings_across_stages_train_a_copy_whose_gradient_is_summed(fake_rank, schedule, pairs):
    """A tiny Llama that ties its embedding to the head, pp 2 on 2 fake ranks (rank 0): the last stage's head is a
    Linear of its own holding the embedding's values; pipeline_step sums the two copies' gradients - over the pair of
    ranks {0, 1} when the ends sit on two ranks (1F1B), on the rank itself when one holds both (DualPipeV's rank 0
    holds stages 0 and 3). tests/distributed/test_emit_pp_sp_torchrun.py trains both against the unsplit model."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from planner.models import from_module

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "tie_word_embeddings": True}, attn_implementation="sdpa"))
    spec = from_module(model, name="tiny-tied")
    assert spec.tied_embeddings
    config = FsdpConfig(pp=2, pp_schedule=schedule, grad_accum=4, precision="fp32")
    code = emit_fsdp2(config, spec, make_cluster(2), TrainingSpec(seq_len=32))
    assert "    tie_gradients(schedule)  # the embedding's and the head's copies: one gradient" in code
    fake_rank(2, 0)
    ns = _exec(code)
    schedule_, modules, has_first, has_last = ns["build_pipeline"](model, "cpu")
    stage_modules, group = schedule_.tied
    assert stage_modules is modules
    if pairs is None:
        assert group is None and (has_first, has_last) == (True, True)
        head = modules[-1].lm_head
        assert head is not model.lm_head and head.weight is not modules[0].embed_tokens.weight
        assert torch.equal(head.weight.full_tensor(), modules[0].embed_tokens.weight.full_tensor())
    else:
        assert dist.get_process_group_ranks(group) == pairs and (has_first, has_last) == (True, False)


def test_expert_parallel_inside_stages_is_one_line():
    with pytest.raises(PlannerError) as err:
        emit_fsdp2(FsdpConfig(pp=2, ep=2, grad_accum=4), load_preset("mixtral-8x7b"), make_cluster(16))
    assert err.value.field == "ep" and len(str(err.value).splitlines()) == 1


TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture
def fake_rank():
    """A fake process group of `world` ranks in which we are `rank`: collectives move nothing, shapes are real."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from calibration.fake_world import _forget_dtensor_placements

    yield lambda world, rank: dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_dtensor_placements()  # DTensor's caches hold the dead world's groups (fake_world.py says why)


@pytest.mark.parametrize("rank", [0, 3])
def test_build_pipeline_cuts_this_ranks_stage_and_shards_it(fake_rank, rank):
    """pp 2 x tp 2 (no sequence parallel) x dp_shard 1 on 4 fake ranks, a 4-block tiny Llama: global rank 0 (pp
    rank 0) holds stage 0 = the embedding and blocks 0-1, rank 3 (pp rank 1) blocks 2-3, norm and head; each block
    and the stage root are FSDP units, q_proj a DTensor sharded on the tp dim, the schedule 1F1B over 4
    microbatches with this rank's PipelineStage."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from planner.models import from_module

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, attn_implementation="sdpa"))
    config = FsdpConfig(pp=2, tp=2, sequence_parallel=False, pp_schedule="1f1b", grad_accum=4, precision="fp32")
    code = emit_fsdp2(config, from_module(model, name="tiny"), make_cluster(4), TrainingSpec(seq_len=32))
    fake_rank(4, rank)
    ns = _exec(code)
    schedule, modules, has_first, has_last = ns["build_pipeline"](model, "cpu")
    (stage,) = modules
    assert (has_first, has_last) == (rank == 0, rank == 3)
    assert list(stage.layers) == (["0", "1"] if rank == 0 else ["2", "3"])
    assert (stage.embed_tokens is not None, stage.lm_head is not None) == (rank == 0, rank == 3)
    assert isinstance(stage, FSDPModule) and all(isinstance(b, FSDPModule) for b in stage.layers.values())
    q = next(iter(stage.layers.values())).self_attn.q_proj.weight
    assert isinstance(q, DTensor) and q.device_mesh.mesh_dim_names[-1] == "tp" and q.placements[-1] == Shard(0)
    assert q.to_local().shape == (64 // 2, 64)
    assert type(schedule).__name__ == "Schedule1F1B" and schedule._n_microbatches == 4
    assert schedule._stage.stage_index == (0 if rank == 0 else 1) and schedule._stage.submod is stage


@pytest.mark.parametrize("rank", [0, 3])
def test_sequence_parallel_stages_send_local_sequence_shards(fake_rank, rank):
    """pp 2 x tp 2 with sequence parallel (torchtitan's plan, loss parallel) on 4 fake ranks, seq_len 32: the stages
    exchange plain [1, 32 / 2, 64] tensors (PipelineStage's static metadata and what the first stage returns); the
    last stage takes such a shard and returns the vocab-sharded logits, a DTensor [1, 32, 128] on tp with 128 / 2
    columns a rank; the embedding and the head are split over the vocabulary, the norms replicated."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from planner.models import from_module

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, attn_implementation="sdpa"))
    config = FsdpConfig(pp=2, tp=2, pp_schedule="1f1b", grad_accum=4, precision="fp32")
    code = emit_fsdp2(config, from_module(model, name="tiny"), make_cluster(4), TrainingSpec(seq_len=32))
    assert "with loss_parallel():" in code and max(len(line) for line in code.splitlines()) <= 100
    fake_rank(4, rank)
    ns = _exec(code)
    schedule, (stage,), has_first, has_last = ns["build_pipeline"](model, "cpu")
    assert stage.sequence_mesh.mesh_dim_names == ("tp",) and stage.sequence_mesh.size() == 2
    meta = schedule._stage._user_meta
    if rank == 0:
        assert [m.shape for m in meta.outputs] == [(1, 16, 64)]
        assert stage.embed_tokens.weight.placements[-1] == Shard(0)  # vocab rows: 128 / 2 a rank
        assert stage.embed_tokens.weight.to_local().shape == (64, 64)
        out = stage(torch.zeros(1, 32, dtype=torch.long))
        assert not isinstance(out, DTensor) and out.shape == (1, 16, 64)
    else:
        assert [m.shape for m in meta.inputs] == [(1, 16, 64)]
        assert stage.lm_head.weight.placements[-1] == Shard(0) and stage.norm.weight.placements[-1] == Replicate()
        out = stage(torch.randn(1, 16, 64))
        assert isinstance(out, DTensor) and out.shape == (1, 32, 128) and out.placements == (Shard(2),)
        assert out.to_local().shape == (1, 32, 64)
