"""The device mesh in a candidate (issue 17, items 1, 4 and 7): the degrees a configuration derives, what a TP
rank holds, the batch split over data-parallel ranks only, the search over meshes, and bad degrees as one line
naming the field with exit code 2. Figures checked by hand in the comments."""

import pytest

from cost_models.mesh import Mesh, mesh_of
from cost_models.mesh_rules import mesh_refusals, tp_degrees
from cost_models.specs import FsdpConfig, SpecError, TrainingSpec
from cost_models.tensor_parallel import local_model
from planner.api import estimate, plan
from planner.cli import main
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.search.space import SearchSpace, mesh_choices


def test_mesh_of_follows_torchtitans_layout():
    # 64 GPUs, FULL_SHARD, tp 2 x cp 4: dp = 64 / 8 = 8 data-parallel ranks, FSDP over dp_shard x cp = 32
    cluster = make_cluster(64, gpu="h100-80gb")
    mesh = mesh_of(FsdpConfig(tp=2, cp=4), cluster)
    assert (mesh.dp_replicate, mesh.dp_shard, mesh.cp, mesh.tp, mesh.world) == (1, 8, 4, 2, 64)
    assert FsdpConfig(tp=2, cp=4).shard_group_size(cluster) == 32 == mesh.fsdp
    # HSDP with tp 2 on 8-GPU nodes: a node's 8 GPUs = dp_shard 4 x tp 2, replicated over the 8 nodes
    hsdp = mesh_of(FsdpConfig(sharding="HYBRID_SHARD", tp=2), cluster)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.tp) == (8, 4, 2)
    assert hsdp.describe() == "HSDP 8x4 x TP 2"
    # experts: efsdp = dp_shard x cp x tp / ep = 8 x 4 x 2 / 16 = 4
    assert Mesh(dp_shard=8, cp=4, tp=2, ep=16).efsdp == 4
    with pytest.raises(SpecError, match="ep: 3 must divide"):
        Mesh(dp_shard=8, ep=3)


def test_a_tp_rank_holds_its_slice_of_llama3_8b():
    # llama3-8b block: q, o 4096 x 4096; k, v 1024 x 4096; gate, up, down 14336 x 4096; two RMSNorms of 4096.
    # tp 2: linears 218,103,808 / 2 + norms 8,192 = 109,060,096 per rank; embedding and head 128,256 x 4096 / 2.
    model = load_preset("llama3-8b")
    local = local_model(model, FsdpConfig(tp=2))
    assert (local.n_heads, local.n_kv_heads, local.ffn_hidden_size) == (16, 4, 7168)
    assert local.block_params == 109_060_096
    assert local.embedding_params == local.head_params == 262_668_288
    # FULL_SHARD on 8 GPUs with tp 2: FSDP over 4 ranks; fp32 sharded params = 4,015,263,744 elements x 4 B / 4
    c = estimate(model, 8, gpu="h100-80gb", tp=2)
    assert c.memory.breakdown.sharded_params == 32 * 109_060_096 + 2 * 262_668_288 + 4096
    # tp 16 would keep one of the 8 KV heads per rank (replicated), 2 query heads: mesh_rules refuses it (no
    # dialect replicates KV heads), the slice stays priced for `fsdp-plan check`, which reports a user's tp 16
    assert local_model(model, FsdpConfig(tp=16)).n_kv_heads == 1


def test_global_batch_splits_over_data_parallel_ranks_only():
    # 1,024 GPUs, global batch 512: data parallelism alone cannot place one sequence per GPU; tp 2 leaves 512
    # data-parallel ranks, micro-batch 1, no accumulation
    c = estimate("llama3.1-70b", 1024, gpu="h100-80gb", global_batch=512, tp=2, activation_checkpointing="full")
    assert (c.config.micro_batch, c.config.grad_accum) == (1, 1)
    with pytest.raises(PlannerError, match="global_batch: 512 is not a multiple of micro_batch x gpus = 1024"):
        estimate("llama3.1-70b", 1024, gpu="h100-80gb", global_batch=512)
    with pytest.raises(PlannerError, match=r"data-parallel ranks .* = 2048"):
        estimate("llama3.1-70b", 1024, gpu="h100-80gb", global_batch=512, tp=2, micro_batch=4)


def test_tp_degrees_follow_heads_kv_heads_and_mlp():
    # llama3-8b: 32 heads, 8 KV heads, MLP 14336 = 2^11 x 7: 1, 2, 4, 8 divide all; 16 and 32 would split a KV
    # head (k_proj / v_proj column-wise; torchtitan refuses n_kv_heads % tp, the emitted plan's view fails)
    assert tp_degrees(load_preset("llama3-8b")) == [1, 2, 4, 8]
    # llama3.1-405b: 128 heads over 8 KV heads, MLP 53248 = 2^12 x 13: the KV heads cap it at 8
    assert tp_degrees(load_preset("llama3.1-405b")) == [1, 2, 4, 8]
    # GPT-2 blocks fuse q, k and v in one projection (c_attn): no TP plan, so no TP degree but 1; MoE models
    # take TP beside EP only
    assert tp_degrees(load_preset("gpt-175b")) == [1]
    # starcoder2-15b: 48 heads, 4 KV heads, MLP 24576 = 2^13 x 3 (its plain MLP c_fc / c_proj, transformers' names)
    assert tp_degrees(load_preset("starcoder2-15b")) == [1, 2, 4]
    assert tp_degrees(load_preset("mixtral-8x7b")) == [1] and tp_degrees(load_preset("mixtral-8x7b"), ep=2)[:3] == [1, 2, 4]


@pytest.fixture(scope="session")  # once per run: xdist may interleave modules, which re-ran module fixtures
def long_context_plan():
    return plan("llama3.1-8b", 8, gpu="h100-96gb", seq_len=131072)


def test_long_sequence_plans_context_parallelism(long_context_plan):
    # Data parallelism alone holds a whole 131k sequence per GPU: nothing fits without CP (the first
    # command said "Nothing fits"); torchtitan trains it as FSDP 2 x CP 4 or FSDP 1 x CP 8.
    p = long_context_plan
    assert p.best is not None and p.best.fits
    assert p.best.config.cp > 1
    # with the model's own loss (the whole logits, upcast); Liger's fused linear cross-entropy (searched for the
    # FSDP2 code) never holds them, and FSDP alone then fits too, slower
    eager = [c for c in p.candidates if c.config.loss_kernel.value == "eager"]
    assert eager and all(c.config.cp * c.config.tp > 1 and c.config.cp * c.config.tp <= 8 for c in eager)
    assert any(c.config.cp == c.config.tp == 1 and c.config.loss_kernel.value == "liger" for c in p.candidates)


def test_more_gpus_than_sequences_plans_a_mesh_and_says_why():
    p = plan("llama3.1-70b", 1024, gpu="h100-80gb", global_batch=512)
    assert p.best is not None and p.best.config.model_parallel >= 2
    # global batch 512 on 1,024 GPUs: data parallelism can use at most 512 (512 divides 1,024 and 512)
    assert p.notes and p.notes[0].startswith("data parallelism alone cannot use 1024 GPUs with global batch 512 "
                                             "(512 sequences): use at most 512 GPUs")
    assert "the search found FSDP" in p.notes[0]
    assert all(512 % (c.config.micro_batch * 1024 // c.config.model_parallel) == 0 for c in p.candidates)


def test_the_search_offers_no_tp_above_the_kv_heads():
    # llama3-8b (8 KV heads) on 32 GB200s, one NVL72 scale-up domain: tp 16 and 32 divide the 32 heads, the MLP
    # and the GPUs and fit the fast tier, but would split a KV head: the search tries 1, 2, 4, 8 only
    cluster = make_cluster(32, gpu="gb200")
    assert cluster.fast_tier_gpus == 32
    tps = {m.tp for m in mesh_choices(load_preset("llama3-8b"), cluster, TrainingSpec(), SearchSpace())}
    assert tps == {1, 2, 4, 8}


def test_pinned_degrees_are_searched_alone():
    p = plan("llama3-8b", 16, gpu="h100-80gb", tp=2, cp=1)
    assert {(c.config.tp, c.config.cp) for c in p.candidates} == {(2, 1)}


BAD = [
    (["estimate", "--model", "gpt-13b", "--gpus", "8", "--tp", "2"],
     "error: tp: tp=2: gpt-13b's blocks (gpt2) have no TP plan here (it splits separate q/k/v/o and MLP "
     "projections, named as transformers' tp_plan names them: gemma, gemma2, gemma3_text, llama, mistral, qwen2, "
     "qwen3, starcoder2); use tp 1"),
    (["estimate", "--model", "olmo2-7b", "--gpus", "8", "--tp", "2"],
     "error: tp: tp=2: olmo2-7b's q/k norms span the whole projection width (olmo2): transformers gathers q/k/v to "
     "every rank for them (colwise_gather_output), which this TP plan does not write; use tp 1"),
    (["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--tp", "2"],
     "error: tp: tp=2: tensor parallelism of routed experts is not planned: split them with --ep (TP then splits "
     "the attention, torchtitan's layout); use tp 1"),
    (["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "3"],
     "error: tp: tp=3 does not split llama3-8b's 32 attention heads, 8 KV heads and MLP width 14336 evenly; "
     "choose one of: 1, 2, 4, 8"),
    (["--model", "llama3-8b", "--gpus", "16", "--tp", "16"],
     "error: tp: tp=16 does not divide llama3-8b's 8 KV heads: k_proj / v_proj split column-wise would leave a rank "
     "part of a head (torchtitan and transformers need n_kv_heads % tp == 0; no emitted plan replicates KV heads); "
     "choose one of: 1, 2, 4, 8"),
    (["estimate", "--model", "qwen2.5-7b", "--gpus", "8", "--tp", "16"],  # 28 heads: the model's limits first
     "error: tp: tp=16 does not split qwen2.5-7b's 28 attention heads, 4 KV heads and MLP width 18944 evenly; "
     "choose one of: 1, 2, 4"),
    (["estimate", "--model", "llama3-8b", "--gpus", "8", "--cp", "3", "--seq-len", "8192"],
     "error: cp: cp=3: load-balanced ring attention splits each sequence into 2 x cp = 6 chunks, and "
     "seq_len=8192 is not a multiple of 6; choose one of: 1, 2, 4, 8"),
    (["--model", "llama3-8b", "--gpus", "8", "--ep", "2"],
     "error: ep: ep=2: llama3-8b has no routed experts (a dense model); use ep 1"),
    (["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--ep", "16"],
     "error: ep: ep=16 does not divide the 8 routed experts; choose one of: 1, 2, 4, 8"),
    (["estimate", "--model", "llama3-8b", "--gpus", "12", "--tp", "8"],
     "error: tp: tp x cp x pp = 8 x 1 x 1 = 8 does not divide gpus=12; choose degrees whose product divides 12 "
     "(divisors: 1, 2, 3, 4, 6, 12)"),
    (["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--cp", "8", "--seq-len", "8192"],
     "error: mesh: tp x cp x pp = 2 x 8 x 1 = 16 does not divide gpus=8; choose degrees whose product divides 8 "
     "(divisors: 1, 2, 4, 8)"),
    (["estimate", "--model", "llama3-8b", "--gpus", "8", "--async-tp"],
     "error: async_tp: needs tensor parallelism (tp >= 2)"),
    (["--model", "llama3-8b", "--gpus", "64", "--pp", "64"],  # 32 blocks + embedding-only and head-only ends
     "error: pp: pp=64 x 1 stage per rank = 64 stages for the 32 blocks of llama3-8b; use pp <= 34"),
]


@pytest.mark.parametrize("argv,line", BAD, ids=[" ".join(a[-2:]) for a, _ in BAD])
def test_bad_degrees_are_one_line_and_exit_2(argv, line, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.strip().splitlines() == [line]


def test_mesh_refusals_name_every_broken_rule():
    model, cluster = load_preset("llama3-8b"), make_cluster(8, gpu="h100-80gb")
    refused = mesh_refusals(model, cluster, TrainingSpec(seq_len=8192), FsdpConfig(tp=3, cp=3, ep=2))
    assert [r.field for r in refused] == ["tp", "cp", "ep", "mesh"]


def test_nothing_costed_says_the_cause_not_an_empty_table():
    from planner.reports import table as report

    # 3 sequences on 8 GPUs with the mesh pinned to data parallelism: no micro-batch places whole sequences
    p = plan("llama3-8b", 8, global_batch=3, tp=1, cp=1)
    assert p.n_costed == 0 and not p.candidates and not p.misses
    text = report.plan_text(p, 5)
    assert "Nearest misses" not in text and "No single change" not in text
    assert ("- data parallelism alone cannot use 8 GPUs with global batch 3 (3 sequences): use at most 3 GPUs, a "
            "global batch that is a multiple of 8, or tensor / context / pipeline parallelism") in " ".join(text.split())
    assert any(line.startswith("  - data parallelism alone cannot use 8 GPUs") for line in text.splitlines())
    assert p.to_dict()["notes"] == p.notes


def test_explain_prices_a_mesh_ranks_matmuls_and_attention():
    from planner.reports.explain import explain_text

    # llama3-8b, tp 4 x cp 2 at 16k: a rank's q is 32 / 4 heads x 128 = 1,024 wide on 16,384 / 2 = 8,192 tokens;
    # the loss-parallel head 128,256 / 4 = 32,064 wide; its queries still see all 16,384 keys (8,192 causal)
    c = estimate("llama3-8b", 8, gpu="h100-80gb", tp=4, cp=2, seq_len=16384, activation_checkpointing="full")
    text = explain_text(c)
    assert "q 8192x1024x4096" in text and "output head 8192x32064x4096" in text
    assert "4 x q_dim 1024 x 8192 keys per query of s = 16384" in text and "x 8,192 tokens /" in text


def test_routing_imbalance_is_settable_and_stated(capsys):
    # Mixtral, ep 8 on 16 GPUs: the busiest rank's expert GEMMs and all-to-alls scale with the imbalance
    base = estimate("mixtral-8x7b", 16, gpu="h100-80gb", ep=8, activation_checkpointing="full")
    skewed = estimate("mixtral-8x7b", 16, gpu="h100-80gb", ep=8, activation_checkpointing="full",
                      routing_imbalance=1.5)
    assert skewed.time.step_s > base.time.step_s
    assert any("1.5x the mean rows" in n for n in skewed.memory.notes)
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--ep", "8", "--routing-imbalance", "0.5"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: routing_imbalance: must be >= 1 (the busiest rank's rows over "
                                               "the mean), got 0.5")


def test_explain_names_the_expert_all_to_alls():
    from planner.reports.explain import explain_text

    c = estimate("mixtral-8x7b", 16, gpu="h100-80gb", ep=8, activation_checkpointing="full")
    assert c.time.ep_comm_s > 0
    assert (f"expert parallel (ep 8 dispatch / combine all-to-alls) {c.time.ep_comm_s:.4f} s "
            f"({c.time.ep_comm_s:.4f} s exposed)") in explain_text(c)


def test_ep_beside_tp_is_searched_only_when_pinned_and_recommended_as_torchtitan():
    from planner.emit import recommendation_text

    # the trace tier and the FSDP2 snippet do not apply EP beside TP: the search leaves it out unless pinned
    p = plan("qwen3-30b-a3b", 64, gpu="h100-80gb", seq_len=4096)
    assert not any(c.config.tp > 1 and c.config.ep > 1 for c in p.candidates)
    assert any(c.config.ep > 1 for c in p.candidates) and not any(c.config.tp > 1 for c in p.candidates)
    # pinned beside each other: the FSDP2 code cannot write it (one line naming the trainers that can); torchtitan
    # plans it and recommends its own flags
    kw = dict(gpu="h100-80gb", seq_len=4096, tp=2, ep=4, activation_checkpointing="full")
    with pytest.raises(PlannerError, match="tp: the planner's FSDP2 code cannot write ep beside tp .* torchtitan"):
        estimate("qwen3-30b-a3b", 64, **kw)
    c = estimate("qwen3-30b-a3b", 64, trainer="torchtitan", **kw)
    text = recommendation_text(c)
    assert text.startswith("Recommended config (torchtitan 0.3, --emit torchtitan;")
    assert "--parallelism.tensor_parallel_degree=2" in text and "--parallelism.expert_parallel_degree=4" in text
