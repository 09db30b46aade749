"""The RL search (planner/rl/search.py): its space counted by hand, verl's Ulysses rule, and the pruned search
against the whole product on a small case."""

import dataclasses

import pytest

import planner.rl.search as search
from planner.models import resolve_model
from planner.rl.request import rl_request

JOB = dict(gpu="h100-80gb", prompt_len=1024, response_len=4096, rollout_n=8, train_batch=256)


@pytest.fixture(scope="module")
def qwen7():
    return resolve_model("qwen2.5-7b")


def test_space_sizes(qwen7):
    """The issue's job (Qwen2.5-7B: 28 heads, 4 KV heads; 8 GPUs; 2,048 sequences a step): shared 2 strategies (fsdp,
    fsdp2) x 2 dtypes x 2 x 2 offloads = 16 (no reference offload: verl offloads it whatever the knob says; under
    offload_policy FSDP2 alone, no manual offload: 2); engine: TP 1 / 2 / 4 (8 does not divide 28 heads) with 256 /
    512 / 1,024 sequences a replica, so max_num_seqs {256}, {256, 512}, {256, 512, 1024}, each with
    max_num_batched_tokens 8,192 (the request's), 2,048 and 4,096 (all >= max_num_seqs, as vLLM asks): 6 x 3 x 5
    utilizations = 90; actor: Ulysses 1 / 2 / 4 x checkpointing on / off x (5 micro-batches (all divide 256 x sp) x
    6 log-prob ones, or dynamic batches: 3 token budgets x 4 log-prob ones, each x sp holding one sequence of 5,120)
    = 6 x 42 = 252."""
    shared, engine, actor = search.spaces(rl_request("qwen2.5-7b", 8, **JOB), qwen7, 8)
    assert (len(shared), len(engine), len(actor)) == (16, 90, 252)
    assert sum(s["strategy"] == "fsdp" for s in shared) == 8
    policy = search.spaces(rl_request("qwen2.5-7b", 8, **JOB, offload_policy=True), qwen7, 8)[0]
    assert [(s["strategy"], s["actor_dtype"], s["param_offload"], s["optimizer_offload"]) for s in policy] == [
        ("fsdp2", "fp32", False, False), ("fsdp2", "bf16", False, False)]
    assert sum(a["use_dynamic_bsz"] for a in actor) == 72
    assert {e["max_num_seqs"] for e in engine if e["rollout_tp"] == 2} == {256, 512}
    # vLLM refuses max_num_batched_tokens < max_num_seqs: with 1,024 sequences, 512 is not priced
    low = search.spaces(rl_request("qwen2.5-7b", 8, **JOB, max_num_batched_tokens=512), qwen7, 8)[1]
    assert [e["max_num_batched_tokens"] for e in low if e["max_num_seqs"] == 1024][::5] == [2048, 4096, 8192]
    assert [e["max_num_batched_tokens"] for e in low if e["max_num_seqs"] == 256 and e["rollout_tp"] == 1][::5] == [
        512, 2048, 4096, 8192]
    # LoRA the same; PPO: the critic's two offloads; under the critic's CPUOffloadPolicy (its manual offloads forced
    # off) FSDP2 alone where the critic follows the actor's strategy (verl's FSDP1 would ignore it), both where
    # --critic-strategy fsdp2 fixes the critic, and the critic's offloads too where --critic-strategy fsdp ignores it
    assert len(search.spaces(rl_request("qwen2.5-7b", 8, **JOB, finetune="lora"), qwen7, 8)[0]) == 16
    assert len(search.spaces(rl_request("qwen2.5-7b", 8, **JOB, algorithm="ppo"), qwen7, 8)[0]) == 64
    ppo = dict(JOB, algorithm="ppo", critic_offload_policy=True)
    sizes = [search.spaces(rl_request("qwen2.5-7b", 8, **ppo, critic_strategy=c), qwen7, 8)[0]
             for c in (None, "fsdp2", "fsdp")]
    assert [len(s) for s in sizes] == [8, 16, 64]
    assert {s["strategy"] for s in sizes[0]} == {"fsdp2"} and not any(s["critic_param_offload"] for s in sizes[1])
    # dynamic, 1024 + 8192 tokens: a budget x sp holds one sequence of 9,216: sp 1 -> 16k, 32k; sp 2 and 4 -> all 3;
    # log-prob budgets likewise, 64k too (sp 1: 3 of 4, sp 2 / 4: 4)
    dynamic = [a for a in search.spaces(rl_request("qwen2.5-7b", 8, **{**JOB, "response_len": 8192}), qwen7, 8)[2]
               if a["use_dynamic_bsz"]]
    assert len(dynamic) == 2 * (2 * 3 + 3 * 4 + 3 * 4)
    assert {a["ppo_max_token_len_per_gpu"] for a in dynamic if a["ulysses_sequence_parallel_size"] == 1} == {
        16384, 32768}


def test_ulysses_degrees_follow_verls_rule(qwen7):
    """verl monkey_patch.apply_monkey_patch asserts heads % sp == 0 and (kv % sp == 0 or sp % kv == 0) (it repeats
    the KV heads up to sp); and sp divides the GPUs. 24 heads, 6 KV heads: 1, 2 (4 and 8 divide 24, but neither
    divides 6 nor 6 them); 2 KV heads: 1, 2, 4, 8 (KV heads repeated to 4 and 8)."""
    def degrees(heads, kv):
        model = dataclasses.replace(qwen7, n_heads=heads, n_kv_heads=kv)
        return sorted({a["ulysses_sequence_parallel_size"] for a in search.spaces(
            rl_request("qwen2.5-7b", 8, **JOB), model, 8)[2]})
    assert degrees(24, 6) == [1, 2]
    assert degrees(24, 2) == [1, 2, 4, 8]


SMALL = dict(UTILIZATIONS=(0.3, 0.6), MICRO_BATCHES=(1, 16), LOG_PROB_MICRO_BATCHES=(2, 32), MAX_NUM_SEQS=(64, 256),
             TOKEN_BUDGETS=(16384,), LOG_PROB_TOKEN_BUDGETS=(32768,), MAX_NUM_BATCHED_TOKENS=(64, 16384))
# Qwen2.5-7B on 2 x H100 under vLLM 0.8, 32 prompts x 4 responses of 1,024 + 2,048 tokens
SMALL_JOB = dict(gpu="h100-80gb", prompt_len=1024, response_len=2048, rollout_n=4, train_batch=32, engine_version="0.8")


def _pruned_and_exhaustive(monkeypatch, request):
    """(plan_rl's plan, the whole product's best of each shared choice that fits, the product's size) on SMALL."""
    for name, values in SMALL.items():
        monkeypatch.setattr(search, name, values)
    plan = search.plan_rl(request, top=100)
    everything = search.exhaustive(request)
    shared = list(search.spaces(request, resolve_model("qwen2.5-7b"), 2)[0][0])

    def choice(e):
        return tuple(getattr(e.request, k) for k in shared)
    exhaustive = {}
    for e in everything:
        if e.fits and (choice(e) not in exhaustive or search.key(e) < search.key(exhaustive[choice(e)])):
            exhaustive[choice(e)] = e
    assert plan.searched == len(everything)
    assert {choice(e): search.key(e) for e in plan.ranked} == {c: search.key(e) for c, e in exhaustive.items()}
    return plan, exhaustive, len(everything)


def test_pruned_search_finds_the_exhaustive_best(monkeypatch):
    """Qwen2.5-7B GRPO on 2 x H100 (fp32 states 15 + 30 GB a GPU: offloads matter) under vLLM 0.8 (its weight sync
    wakes the KV cache too), a space cut to 5,120 configurations, FSDP1 and FSDP2: for every shared choice the
    pruned search's best has the step time and peak of the whole product's best, pricing a twenty-fifth of it. The
    best needs entropy chunking, so the chunking rule is exercised; both batch modes are (the fp32 actor's best
    without offloads under FSDP2 takes dynamic batches: 16k tokens, 5 sequences of 3,072 a micro-batch, which static
    batches of 1 or 16 do not offer). max_num_batched_tokens 64 (with max_num_seqs 64 only) trades vLLM's
    profile-run activations (more KV) against prefill chunks that read the weights more often than they compute.
    FSDP1's weight sync keeps a copy of the shard (15.2 GB with the fp32 actor) beside the engine awake: with neither
    offload it is over the GPU where FSDP2's best engine choice runs (TP 2 at 0.6), so FSDP1's best runs a smaller
    KV cache and generates slower; with the params offloaded and Adam's states not, no engine choice fits it (the
    KV cache, sized at init with the params off the GPU, is awake when they come back for the sync)."""
    plan, exhaustive, size = _pruned_and_exhaustive(monkeypatch, rl_request("qwen2.5-7b", 2, **SMALL_JOB))
    assert size == 5120 and plan.priced < 5120 / 25
    assert len(plan.ranked) == 15 and ("fsdp", "fp32", True, False) not in exhaustive
    assert plan.ranked[0].request.strategy == "fsdp" and plan.ranked[0].request.entropy_chunking
    assert {e.request.use_dynamic_bsz for e in plan.ranked} == {False, True}
    fsdp1, fsdp2 = (exhaustive[s, "fp32", False, False] for s in ("fsdp", "fsdp2"))
    assert (fsdp2.request.gpu_memory_utilization, fsdp1.request.gpu_memory_utilization) == (0.6, 0.3)
    assert fsdp1.time.generation_s > 3 * fsdp2.time.generation_s


BEST = dict(JOB, actor_dtype="bf16", gradient_checkpointing=False, rollout_tp=4,
            gpu_memory_utilization=0.5, max_num_seqs=512)


def test_entropy_chunking_is_what_fits_the_larger_log_prob_micro_batch():
    """The issue's job with 16 sequences a log-prob micro-batch (16 x 5,120 = 81,920 tokens a GPU), the search's pick
    for it: unchunked, the logits and the no-grad entropy hold 3 x 81,920 x 152,064 x 2 B = 74,742,497,280 B (over
    the GPU); chunked (verl entropy_from_logits_with_chunking), the logits and three fp32 chunks of 2,048 rows:
    24,914,165,760 + 3 x 2,048 x 152,064 x 4 = 28,651,290,624 B, and it fits."""
    from planner.rl import rl_estimate

    knobs = dict(BEST, ppo_micro_batch_size_per_gpu=1, log_prob_micro_batch_size_per_gpu=16)
    plain, chunked = (rl_estimate("qwen2.5-7b", 8, entropy_chunking=c, **knobs) for c in (False, True))
    assert [p.memory.phases[3].gpu_bytes["logits and entropy"] for p in (plain, chunked)] == [74_742_497_280,
                                                                                             28_651_290_624]
    assert not plain.fits and "in log_prob" in plain.reasons[0] and chunked.fits
    assert plain.time.step_s == chunked.time.step_s   # memory only: chunking's loop is not priced


def test_ulysses_is_what_fits_the_update_without_checkpointing():
    """No gradient checkpointing, 4 sequences an update micro-batch: Ulysses splits the micro-batch's 4 x 5,120
    tokens over sp GPUs (20,480 / 10,240 / 5,120 a GPU) and every saved activation with them (per token the same):
    the update needs 150 GiB at sp 1, 84 at sp 2 and fits at sp 4; the time pays the attention over the whole
    length and the all-to-alls (rl_time.ulysses_s), so the update is slower as sp grows."""
    from planner.rl import rl_estimate

    runs = [rl_estimate("qwen2.5-7b", 8, ulysses_sequence_parallel_size=sp, ppo_micro_batch_size_per_gpu=4,
                        log_prob_micro_batch_size_per_gpu=4, entropy_chunking=True, **BEST) for sp in (1, 2, 4)]
    assert [e.batch.update_tokens_per_gpu for e in runs] == [20_480, 10_240, 5_120]
    saved = [e.memory.phases[5].gpu_bytes["activations"] for e in runs]
    assert saved[0] == 2 * saved[1] == 4 * saved[2]
    assert [e.fits for e in runs] == [False, False, True]
    assert runs[0].time.update_s < runs[1].time.update_s < runs[2].time.update_s


def test_a_batch_verl_refuses_is_still_priced_to_say_why():
    """1 prompt x 1 response on 8 GPUs: verl's normalised mini-batch is 1 // 8 = 0 sequences, so no micro-batch
    divides it; the search prices the request's own batch (16 shared x 45 engine choices: TP 1 / 2 / 4 with
    max_num_seqs 256, 3 max_num_batched_tokens, 5 utilizations) and the nearest miss names verl's assert."""
    plan = search.plan_rl(rl_request("qwen2.5-7b", 8, gpu="h100-80gb", train_batch=1, rollout_n=1))
    assert not plan.ranked and plan.searched == 16 * 45
    assert plan.misses[0].reasons[0].startswith("train_batch: real_train_batch_size (1) must be divisible")


def test_lora_keeps_the_requests_layered_summon_and_says_so():
    """LoRA on the issue's job: FSDP1's update is the faster (its copies: tests/unit/test_rl_strategy.py), so the
    best is FSDP1's, whose weight sync summons the whole bf16 model unless rollout.layered_summon: 7,615,616,512 x 2
    = 15,231,233,024 B (14.19 GiB), which the output notes as verl's fix; with --layered-summon (and --load-format
    safetensors, without which verl raises: test_rl_weight_sync.py) the search keeps it and prices the largest unit,
    the root: (2 x 544,997,376 + 3,584) x 2 = 2,179,996,672 B."""
    from planner.rl.report import rl_plan_text

    lora = dict(JOB, finetune="lora", lora_merge=False)   # served as an adapter (merged: no summon)
    plain, layered = (search.plan_rl(rl_request("qwen2.5-7b", 8, layered_summon=x, **lora, **more), top=3)
                      for x, more in ((False, {}), (True, dict(load_format="safetensors"))))
    sync = [next(p.gpu_bytes for p in plan.ranked[0].memory.phases if p.name == "weight_sync")
            for plan in (plain, layered)]
    assert [plan.ranked[0].request.strategy for plan in (plain, layered)] == ["fsdp", "fsdp"]
    assert [plan.ranked[0].request.layered_summon for plan in (plain, layered)] == [False, True]
    assert [s["summoned params"] for s in sync] == [15_231_233_024, 2_179_996_672]
    text = " ".join(rl_plan_text(plain).split())   # unwrapped
    assert ("gathers the whole model at once (14.19 GiB, priced so); verl's fix, --layered-summon --load-format "
            "safetensors") in text
    assert "layered_summon: the request's" in text and "verl's fix" not in rl_plan_text(layered)


def test_the_critics_offload_policy_keeps_the_pruning_exact(monkeypatch):
    """PPO under the critic's CPUOffloadPolicy on SMALL_JOB. Where the critic follows the actor's strategy, an FSDP1
    actor would mean an FSDP1 critic, which verl runs without the policy: its states on the GPU, not the host, so
    FSDP1's engine side fits where FSDP2's does not (150 GiB of host RAM, bf16, TP 2 at 0.3: 152.0 GiB needed
    under FSDP2, 97.3 under FSDP1; the engine sleeps at verl's level 2, no backup) - against the pruning's premise (FSDP1's engine side priced only where FSDP2's
    fits). So the search keeps FSDP2 there: 8 shared choices, each the product's best (2,560 configurations). With
    --critic-strategy fsdp2 the critic is on the host under both actor strategies and both are searched: 16 shared
    choices (5,120 configurations), each the product's best, FSDP1's included."""
    from planner.rl import rl_estimate

    knobs = dict(SMALL_JOB, algorithm="ppo", critic_offload_policy=True, actor_dtype="bf16", rollout_tp=2,
                 gpu_memory_utilization=0.3, cpu_ram_per_node="150GiB")
    fsdp2, fsdp1 = (rl_estimate("qwen2.5-7b", 2, strategy=s, **knobs) for s in ("fsdp2", "fsdp"))
    assert (fsdp2.memory.critic.on_host, fsdp1.memory.critic.on_host) == (True, False)
    assert (search.side_fits(fsdp2, engine_side=True), search.side_fits(fsdp1, engine_side=True)) == (False, True)
    assert round(fsdp2.host.peak_bytes / 2 ** 30, 1) == 152.0 and round(fsdp1.host.peak_bytes / 2 ** 30, 1) == 97.3
    ppo = dict(SMALL_JOB, algorithm="ppo", critic_offload_policy=True)
    plan, exhaustive, size = _pruned_and_exhaustive(monkeypatch, rl_request("qwen2.5-7b", 2, **ppo))
    assert size == 2560 and len(exhaustive) == 8 and {e.request.strategy for e in plan.ranked} == {"fsdp2"}
    assert all(e.memory.critic.on_host for e in plan.ranked)
    plan, exhaustive, size = _pruned_and_exhaustive(monkeypatch, rl_request("qwen2.5-7b", 2, critic_strategy="fsdp2",
                                                                             **ppo))
    assert size == 5120 and len(exhaustive) == 15 and {e.request.strategy for e in plan.ranked} == {"fsdp", "fsdp2"}
    assert all(e.memory.critic.on_host for e in plan.ranked)


def test_the_pruning_reads_the_actors_shard_group(monkeypatch):
    """fsdp_size gives the actor's shard group (rl_actor.shard_group_ranks, which actor_run prices: -1 all GPUs, at
    most the GPUs). A group of one rank shards nothing and FSDP1 runs NO_SHARD there, holding less than FSDP2 in the
    update, so FSDP2's failures must not prune FSDP1's choices: _holds_no_more is told `sharded` from the same
    function (the pruned search equal to the product at fsdp_size 1 too)."""
    from cost_models.rl_actor import shard_group_ranks

    assert [shard_group_ranks(n, f) for n, f in ((8, -1), (8, 1), (8, 4), (8, 16), (1, -1))] == [8, 1, 4, 8, 1]
    told = []
    holds = search._holds_no_more
    monkeypatch.setattr(search, "_holds_no_more", lambda t, s, sharded: told.append(sharded) or holds(t, s, sharded))
    _pruned_and_exhaustive(monkeypatch, rl_request("qwen2.5-7b", 2, fsdp_size=1, **SMALL_JOB))
    assert told and not any(told)
    told.clear()
    search.plan_rl(rl_request("qwen2.5-7b", 2, fsdp_size=2, **SMALL_JOB))
    assert told and all(told)
