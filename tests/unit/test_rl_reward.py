"""A reward model in verl 0.9.1 (cost_models/rl_reward.py): its own vLLM engine on the actor's GPUs, asleep but for
the `reward` phase. Worked by hand: a bf16 Qwen2.5-7B actor with a Qwen2.5-7B reward model on 8 x H100 80GB (vLLM
current, the reward engine at verl's defaults: TP 2, utilization 0.5, eager). Qwen2.5-7B: 7,615,616,512
parameters, hidden 3584, vocab 152064 (untied head), FFN 18944, 28 layers, 28 heads / 4 KV heads of 128."""

import pytest

from cost_models.units import GiB
from planner.rl import rl_estimate

P7 = 7_615_616_512
H, V, F = 3584, 152_064, 18_944
JOB = dict(gpu="h100-80gb", actor_dtype="bf16", prompt_len=1024, response_len=1024, train_batch=256, rollout_n=8)


@pytest.fixture(scope="module")
def pair():
    return rl_estimate("qwen2.5-7b", 8, **JOB), rl_estimate("qwen2.5-7b", 8, reward_model="qwen2.5-7b", **JOB)


def test_the_reward_engine_by_hand(pair):
    plain, e = pair
    rm = e.memory.reward
    # the score head Linear(3584, 1) without bias in place of the 152,064 x 3,584 vocabulary head
    assert rm.model.n_params == P7 - V * H + H == 7_070_622_720
    assert rm.memory.weights_bytes == 7_070_622_720          # bf16 over its TP 2: 2 B x params / 2
    # vLLM's profile run: 8,192 tokens x (2 h + (q + 2 kv) / 2 + 3 f / 2) x 2 B, and the sampler's 2 x 1,024 rows
    # x vocab 1 x 4 B
    acts = 8192 * (2 * H + (3584 + 2 * 512) // 2 + 3 * F // 2) * 2 + 2 * 1024 * 1 * 4
    assert rm.memory.activation_peak_bytes == acts == 620_765_184
    # vLLM >= 0.10: utilization x total less weights and the profile run; pages of 16 tokens x K, V x 2 KV heads
    # per rank x 128 x 2 B, over 28 layers
    available = int(e.cluster.gpu.memory_bytes * 0.5) - 7_070_622_720 - acts
    page = 16 * 2 * 2 * 128 * 2
    assert rm.memory.kv_bytes == available // page // 28 * page * 28
    assert rm.memory.cuda_graph_bytes == 0                    # verl's reward rollout: enforce_eager true


def test_the_reward_phase_and_its_process_beside_every_other(pair):
    plain, e = pair
    rm, phases = e.memory.reward, {p.name: p for p in e.memory.phases}
    assert [p.name for p in e.memory.phases][:5] == ["init", "rollout", "weight_sync", "reward", "log_prob"]
    assert "reward" not in {p.name for p in plain.memory.phases}
    # compute_rm_score: the actor as between phases (its rollout's torch terms), the actor's engine asleep, the
    # reward engine awake
    reward, rollout = phases["reward"].gpu_bytes, phases["rollout"].gpu_bytes
    assert (reward["reward weights"], reward["reward KV cache"]) == (7_070_622_720, rm.memory.kv_bytes)
    assert reward["actor params"] == rollout["actor params"] == -(-P7 * 2 // 8)   # the bf16 shard, 1,903,904,128
    assert "engine KV cache" not in reward and "engine asleep (level 2)" in phases["reward"].offloaded
    # every other phase holds the reward process's CUDA context only (its weights on the host: sleep level 1),
    # the same bytes as the actor process's outside the allocator
    for name, p in phases.items():
        if name != "reward":
            assert not {k for k in p.gpu_bytes if k.startswith("reward") and k != "reward CUDA context"}, name
            assert p.gpu_bytes["reward CUDA context"] == rm.context_bytes
    assert phases["log_prob"].reserved_bytes - {p.name: p for p in plain.memory.phases}["log_prob"].reserved_bytes \
        == rm.context_bytes
    # host RAM: the reward engine's level-1 backup, 8 GPUs x its bf16 weights, and one more process per GPU
    assert e.host.terms["reward weight backup (sleep level 1)"] == 8 * 7_070_622_720
    assert e.host.process_bytes == 2 * plain.host.process_bytes


def test_the_reward_time_is_a_prefill_and_two_copies(pair):
    plain, e = pair
    rm, gpu = e.memory.reward, e.cluster.gpu
    tokens = 256 * 8 // (8 // 2) * 2048          # 512 sequences per TP-2 replica, prompt + response each
    compute = 2 * rm.model.n_params / 2 * tokens / (gpu.priced_peak_flops("bf16") * gpu.matmul_fraction(0.8))
    chunks = -(-tokens // 8192) * rm.memory.weights_bytes / gpu.hbm_bytes_per_s
    assert e.time.reward_s == pytest.approx(max(compute, chunks) + 2 * 7_070_622_720 / gpu.pcie_bytes_per_s,
                                            rel=1e-12)
    assert e.time.step_s - plain.time.step_s == pytest.approx(e.time.reward_s, rel=1e-9)


def test_a_reward_engine_that_cannot_start_is_named_by_its_flag():
    """It starts beside the actor's fp32 shard (3,807,808,256 B) and its own process's context (the reference is on
    the host whatever ref_param_offload says: verl offloads it): 75.14 GiB free of 79.65, less than vLLM's 0.95 x
    79.65 = 75.67 GiB."""
    e = rl_estimate("qwen2.5-7b", 8, **{**JOB, "actor_dtype": "fp32"}, ref_param_offload=False,
                    reward_model="qwen2.5-7b", reward_model_gpu_memory_utilization=0.95)
    free = e.cluster.gpu.memory_bytes - 3_807_808_256 - e.memory.reward.context_bytes
    assert e.reasons == (f"reward_model_gpu_memory_utilization: vLLM: Free memory on device ({free / GiB:.2f}/79.65 "
                         "GiB) on startup is less than desired GPU memory utilization (0.95, 75.67 GiB); lower "
                         "--reward-model-gpu-memory-utilization, or offload the actor before the engine starts",)
    # at 0.9 it starts, and its budget (of the whole GPU, as vLLM's is) does not fit beside what stays resident
    e = rl_estimate("qwen2.5-7b", 8, **{**JOB, "actor_dtype": "fp32"}, ref_param_offload=False,
                    reward_model="qwen2.5-7b", reward_model_gpu_memory_utilization=0.9)
    assert len(e.reasons) == 1 and e.reasons[0].endswith("(in reward; largest: reward KV cache 64.5 GiB)")


# its own resource pool (reward.reward_model.enable_resource_pool): 4 GPUs of one node, two TP-2 replicas
POOL = dict(JOB, reward_model="qwen2.5-7b", reward_model_enable_resource_pool=True, reward_model_n_gpus_per_node=4)


@pytest.fixture(scope="module")
def pooled(pair):
    return pair[0], rl_estimate("qwen2.5-7b", 8, **POOL)


def test_a_reward_pool_leaves_the_actors_gpus_and_host_as_without_one(pooled):
    """verl's reward pool holds the engine; the reward loop workers that call it are CPU actors: every phase on the
    actor's GPUs, and the trainer's host RAM, as without a reward model - no `reward` phase, no reward context, no
    level-1 backup or process (its pool is taken as nodes of its own)."""
    plain, e = pooled
    assert [(p.name, p.gpu_bytes, p.reserved_bytes) for p in e.memory.phases] == \
        [(p.name, p.gpu_bytes, p.reserved_bytes) for p in plain.memory.phases]
    assert e.host == plain.host and e.memory.engine == plain.memory.engine


def test_the_reward_pools_own_gpu_by_hand(pooled):
    """Its engine starts on an empty GPU (its process's context only): vLLM >= 0.10's budget, 0.5 x 81,559 MiB less
    its weights (7,070,622,720 B) and profile run (620,765,184 B), in pages of 16 tokens x 2 KV heads x 128 x 2 B x
    K, V over 28 layers; beside it the context. The JSON and the text say so."""
    from planner.rl.report import rl_dict, rl_text

    _, e = pooled
    rm = e.memory.reward
    assert (rm.gpus, rm.replicas, rm.own_pool) == (4, 2, True)
    available = int(e.cluster.gpu.memory_bytes * 0.5) - 7_070_622_720 - 620_765_184
    page = 16 * 2 * 2 * 128 * 2
    assert rm.memory.kv_bytes == available // page // 28 * page * 28 == 35_068_837_888
    pool = rl_dict(e)["reward_pool"]
    assert pool["reserved_bytes"] == 7_070_622_720 + 35_068_837_888 + 620_765_184 + rm.context_bytes
    assert pool["gpus"] == 4 and "reward_pool" not in rl_dict(pooled[0])
    assert "reward pool: 4 GPUs of their own, 2 replicas of TP 2 at 0.5: 40.79 GiB per GPU" in \
        " ".join(rl_text(e).split())


def test_a_reward_pool_scores_beside_the_rollout(pooled):
    """Streamed: each replica prefills its 1,024 sequences of 2,048 tokens while the actor generates; only what
    outlasts generation is on the step. 2 replicas: 2,097,152 tokens each at 7,070,622,720 FLOPs a token on a TP-2
    rank, 18.7 s at 989 TFLOP/s x 0.8 (its 256 chunks of 8,192 reading the weights: 0.54 s) - no wake / sleep copies
    (awake). With 8 GPUs (4 replicas) the scoring hides behind generation entirely."""
    plain, e = pooled
    gpu = e.cluster.gpu
    tokens = 2048 // 2 * 2048
    compute = 2 * 7_070_622_720 / 2 * tokens / (gpu.priced_peak_flops("bf16") * gpu.matmul_fraction(0.8))
    chunks = tokens // 8192 * 7_070_622_720 / gpu.hbm_bytes_per_s
    scoring = max(compute, chunks)
    gen = e.time.generation_s
    assert scoring > gen   # 18.7 s of scoring against 16.6 s of generation
    assert (e.time.reward_overlapped_s, e.time.reward_s) == pytest.approx((gen, scoring - gen), rel=1e-12)
    assert e.time.step_s - plain.time.step_s == pytest.approx(scoring - gen, rel=1e-9)
    wide = rl_estimate("qwen2.5-7b", 8, **{**POOL, "reward_model_n_gpus_per_node": 8})
    assert wide.time.reward_s == 0 and wide.time.reward_overlapped_s == pytest.approx(scoring / 2, rel=1e-12)
    assert any("scores each response as it finishes, beside the rollout" in n for n in e.notes)


@pytest.mark.parametrize("knobs, reason", [
    (dict(reward_model_tp=4, reward_model_n_gpus_per_node=2),
     "reward_model_tp: verl: Not enough GPUs to run the reward model. world_size (2) < rollout_world_size (4)"),
    (dict(reward_model_n_gpus_per_node=3),
     "reward_model_tp: verl: the reward pool's 3 GPUs do not split into replicas of TP 2"),
    (dict(reward_model_tp=16, reward_model_n_gpus_per_node=12, reward_model_nnodes=4),
     "reward_model_tp: verl: world_size 16 must be divisible by gpus_per_node 12"),
    # Qwen2.5-72B's score model, 71,460,503,552 x 2 B / TP 2 = 71.5 GB a GPU, over 0.5 x 81,559 MiB
    (dict(reward_model="qwen2.5-72b", reward_model_n_gpus_per_node=2),
     "reward_model_gpu_memory_utilization: vLLM: No available memory for the cache blocks"),
], ids=["fewer-gpus-than-tp", "tp-not-dividing", "replica-across-part-nodes", "cannot-start"])
def test_a_reward_pool_that_cannot_run_it_is_one_line(knobs, reason):
    e = rl_estimate("qwen2.5-7b", 8, **{**POOL, **knobs})
    assert len(e.reasons) == 1 and e.reasons[0].startswith(reason), e.reasons
    assert "offload" not in e.reasons[0]   # its own GPUs: no actor to offload


@pytest.mark.parametrize("knobs, message", [
    (dict(reward_model_nnodes=0), "reward_model_nnodes: must be > 0, got 0"),
    (dict(reward_model=None), "reward_model_enable_resource_pool: a reward model's pool: valid with --reward-model"),
])
def test_a_reward_pool_verl_refuses_to_build_is_bad_input(knobs, message):
    from cost_models.spec_values import SpecError
    from planner.errors import PlannerError

    with pytest.raises((SpecError, PlannerError), match=message):
        rl_estimate("qwen2.5-7b", 8, **{**POOL, **knobs})
