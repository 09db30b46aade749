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
    assert "engine KV cache" not in reward and "engine asleep (level 1)" in phases["reward"].offloaded
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
