"""FSDP2's CPUOffloadPolicy in verl (actor_rollout_ref.actor.fsdp_config.offload_policy, cost_models/rl_settings.py):
the actor's params, grads and Adam states on the host in every phase, the update's and log-prob's GPU bytes without
them, host RAM with them, the copies and the CPU step in the time; ignored under FSDP1 as verl 0.9.1 ignores it.
Figures by hand: Qwen2.5-7B 7,615,616,512 parameters, bf16 actor on 8 x H100: a rank's shard 7,615,616,512 x 2 / 8
= 1,903,904,128 B of params, as much of grads, twice that of Adam's two bf16 states."""

import pytest

from planner.rl import rl_estimate

SHARD = 7_615_616_512 * 2 // 8
STATES = SHARD + SHARD + 2 * SHARD          # params + grads + Adam's exp_avg, exp_avg_sq: 7,615,616,512 B
JOB = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8, strategy="fsdp2",
           actor_dtype="bf16")


@pytest.fixture(scope="module")
def pair():
    return rl_estimate("qwen2.5-7b", 8, **JOB), rl_estimate("qwen2.5-7b", 8, offload_policy=True, **JOB)


def _phases(e) -> dict:
    return {p.name: p for p in e.memory.phases}


def test_the_model_states_leave_the_gpu_for_the_host(pair):
    plain, policy = pair
    assert (policy.memory.actor.params_bytes, policy.memory.actor.grads_bytes,
            policy.memory.actor.optimizer_bytes) == (SHARD, SHARD, 2 * SHARD)
    a, b = _phases(plain), _phases(policy)
    # the update (its steady backward): sharded params, grads and Adam's states gone, the rest as it was
    assert a["update"].allocated_bytes - b["update"].allocated_bytes == STATES == 7_615_616_512
    for term in ("sharded_params", "sharded_grads", "optimizer_state"):
        assert term in a["update"].gpu_bytes and term not in b["update"].gpu_bytes
    # log-prob: the shard and Adam's states (resident from step 2) gone; the gathered units stay
    assert a["log_prob"].allocated_bytes - b["log_prob"].allocated_bytes == SHARD + 2 * SHARD
    assert b["log_prob"].gpu_bytes["gathered units"] == a["log_prob"].gpu_bytes["gathered units"]
    # the optimizer step runs on the CPU: params, grads, states and the foreach temporaries (one state) gone
    assert a["optimizer_step"].allocated_bytes - b["optimizer_step"].allocated_bytes == STATES + SHARD
    # rollout and init: the actor's shard never resident beside the engine
    assert a["rollout"].allocated_bytes - b["rollout"].allocated_bytes == SHARD + 2 * SHARD
    assert "actor params" not in b["init"].gpu_bytes
    assert all("actor params, grads, Adam states (CPUOffloadPolicy)" in p.offloaded for p in policy.memory.phases)
    # host RAM per node: the same bytes on each of 8 GPUs, and the CPU step's temporaries: verl's AdamW sets neither
    # foreach nor fused, so torch steps the host shards for-loop (cost_models/optimizer_step.py): the final norm's
    # quotient and two copies of the head's shard, bf16: 2 x (3,584 / 8 + 2 x 152,064 x 3,584 / 8) B a rank
    host, temporaries = policy.host.terms, 2 * (3_584 // 8 + 2 * 152_064 * 3_584 // 8)
    assert host["actor params, grads, Adam states (CPUOffloadPolicy)"] == 8 * STATES == 60_924_932_096
    assert host["actor CPU optimizer step temporaries"] == 8 * temporaries == 2_179_996_672
    assert policy.host.resident_bytes - plain.host.resident_bytes == 8 * (STATES + temporaries)
    assert any(n.startswith("offload_policy: FSDP2's CPUOffloadPolicy") for n in policy.notes)


def test_the_copies_and_the_cpu_step_cost_time(pair):
    plain, policy = pair
    # outside the update: the shard copied in per old-log-prob micro-batch (64 sequences per rank x 2,048 tokens /
    # 8,192 per micro-batch of 4 = 16) and once for the weight sync, at PCIe rate
    moved = 17 * SHARD
    pcie = policy.cluster.gpu.pcie_bytes_per_s
    assert policy.time.offload_s - plain.time.offload_s == pytest.approx(moved / pcie, rel=1e-12)
    assert policy.time.update_s > plain.time.update_s   # per-unit H2D, gradient D2H, Adam on the CPU
    assert policy.time.generation_s == plain.time.generation_s


def test_verl_forces_the_manual_offloads_off():
    e = rl_estimate("qwen2.5-7b", 8, offload_policy=True, param_offload=True, optimizer_offload=True, **JOB)
    plain = rl_estimate("qwen2.5-7b", 8, offload_policy=True, **JOB)
    assert [p.reserved_bytes for p in e.memory.phases] == [p.reserved_bytes for p in plain.memory.phases]
    assert e.host.terms == plain.host.terms


def test_fsdp1_ignores_it_as_verl_does():
    knobs = dict(JOB, strategy="fsdp")
    plain, asked = rl_estimate("qwen2.5-7b", 8, **knobs), rl_estimate("qwen2.5-7b", 8, offload_policy=True, **knobs)
    assert [p.reserved_bytes for p in asked.memory.phases] == [p.reserved_bytes for p in plain.memory.phases]
    assert not asked.memory.actor.on_host and asked.time == plain.time
    assert any(n.startswith("offload_policy is ignored under actor.strategy fsdp") for n in asked.notes)


def test_verls_reference_is_on_the_host_whatever_ref_param_offload_says(pair):
    """verl builds the reference forward_only and wraps it with FSDP's own CPU offload (dp_ref.yaml,
    transformer_impl.py _build_fsdp_module): param_offload=False is priced as verl runs it - the bf16 reference
    (7,615,616,512 x 2 / 8 = 1,903,904,128 B a GPU) in host RAM, none on the GPU, its copies in the time - with a
    note that verl ignores the setting."""
    plain = pair[0]
    asked = rl_estimate("qwen2.5-7b", 8, ref_param_offload=False, **JOB)
    assert [p.reserved_bytes for p in asked.memory.phases] == [p.reserved_bytes for p in plain.memory.phases]
    assert all("reference" not in p.gpu_bytes or p.gpu_bytes["reference"] == 0 for p in asked.memory.phases)
    assert asked.host.terms["reference (offloaded)"] == SHARD * 8
    assert asked.time.step_s == plain.time.step_s
    assert any(n.startswith("ref.fsdp_config.param_offload=False is ignored") for n in asked.notes)
    assert not any("param_offload=False is ignored" in n for n in plain.notes)


# PPO's critic under its own CPUOffloadPolicy (critic.fsdp.offload_policy): the actor's model with a Linear(3,584, 1)
# value head, 7,615,616,512 - 152,064 x 3,584 + 3,585 = 7,070,622,721 parameters, fp32 (verl's model_dtype), over 8
# GPUs. FSDP2 pads the head's weight, 1 row of 3,584, to d x ceil(1 / d) = 8 rows (torch 2.13 _fsdp_param.py
# padded_sharded_param_size; cost_models/dim0_padding.py; every other table's rows divide by 8): 7 x 3,584 = 25,088
# more, 7,070,647,809; rank 0 holds the head's real row, so its shard is that / 8: params and grads 3,535,323,905 B
# each (rounded up), Adam's two fp32 states 7,070,647,809 B
CRITIC_SHARD, CRITIC_ADAM = 3_535_323_905, 7_070_647_809
PPO = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8, strategy="fsdp2",
           algorithm="ppo")


@pytest.fixture(scope="module")
def critic_pair():
    return rl_estimate("qwen2.5-7b", 8, **PPO), rl_estimate("qwen2.5-7b", 8, critic_offload_policy=True, **PPO)


def test_the_critics_states_move_to_the_host(critic_pair):
    plain, policy = critic_pair
    c = policy.memory.critic
    assert c.on_host and not plain.memory.critic.on_host and not policy.memory.actor.on_host
    held = CRITIC_SHARD + CRITIC_SHARD + CRITIC_ADAM
    assert (c.params_bytes, c.grads_bytes, c.optimizer_bytes) == (CRITIC_SHARD, CRITIC_SHARD, CRITIC_ADAM)
    # host RAM per node: its fp32 params, grads and Adam states x 8 GPUs = 113,130,364,952 B, beside the CPU step's
    # temporaries; the actor's own offloads unchanged
    assert policy.host.terms["critic params, grads, Adam states (CPUOffloadPolicy)"] == 8 * held == 113_130_364_952
    assert policy.host.terms["critic CPU optimizer step temporaries"] == 8 * c.step_temporary_bytes > 0
    assert policy.host.resident_bytes - plain.host.resident_bytes == 8 * (held + c.step_temporary_bytes)
    a, b = _phases(plain), _phases(policy)
    # between its passes the critic's params and Adam's states leave every phase's GPU bytes: 10,605,971,714 B
    for name in ("rollout", "log_prob", "update", "optimizer_step", "checkpoint"):
        assert a[name].allocated_bytes - b[name].allocated_bytes == CRITIC_SHARD + CRITIC_ADAM, name
    # its values pass holds the gathered units only; its update no params, grads or Adam states (the step on the CPU)
    assert a["critic_values"].allocated_bytes - b["critic_values"].allocated_bytes == CRITIC_SHARD + CRITIC_ADAM
    assert not {"critic params", "critic grads", "critic Adam states"} & set(b["critic_update"].gpu_bytes)
    assert all("critic params, grads, Adam states (CPUOffloadPolicy)" in p.offloaded for p in policy.memory.phases)
    assert any(n.startswith("critic.fsdp.offload_policy: the critic's params") for n in policy.notes)


def test_the_critics_adam_steps_on_the_cpu_at_the_priced_threads(critic_pair):
    """The critic's update priced as the actor's under the critic's settings on the value model (rl_time.
    critic_seconds): its Adam step on the host (host_optimizer.py), per-parameter AdamW (verl's torch default on CPU
    tensors) at 12 of 20 passes of 4 B = 48 B a parameter over the critic's shard, 7,070,647,809 / 8 =
    883,830,976.125 parameters (the head's row padded to 8: above) (not the LM's 951,952,064: its vocabulary head, 152,064 x 3,584, is 7.7% more),
    once a step (one mini-batch). One thread: 13,352,229,935.75 B/s (PUBLISHED_H100_HOST_THREAD_BYTES_PER_S); 8
    threads are capped by the node's bandwidth shared by 8 ranks, 614.4e9 x 0.8 / 8 = 61.44e9 B/s: 2.4868 s less
    (the actor's own policy on the LM: 2.6785 s). The actor's update, on the GPU, does not move."""
    plain, policy = critic_pair
    threaded = rl_estimate("qwen2.5-7b", 8, critic_offload_policy=True, omp_num_threads=8, **PPO)

    def saved(params):
        moved = params * 48
        return moved / (512 * 2 ** 20 * 12 * 4 / 1.93) - moved / 61.44e9
    assert (saved(7_070_647_809 / 8), saved(951_952_064)) == (pytest.approx(2.4868, abs=1e-4),
                                                              pytest.approx(2.6785, abs=1e-4))
    assert policy.time.critic_s - threaded.time.critic_s == pytest.approx(saved(7_070_647_809 / 8), rel=1e-9)
    assert threaded.time.update_s == policy.time.update_s == plain.time.update_s
    assert policy.time.critic_s > plain.time.critic_s
    # the actor under its own policy, the same rule on the LM's parameters
    grpo = {**PPO, "algorithm": "grpo", "offload_policy": True}
    actor = [rl_estimate("qwen2.5-7b", 8, omp_num_threads=n, **grpo).time.update_s for n in (1, 8)]
    assert actor[0] - actor[1] == pytest.approx(saved(951_952_064), rel=1e-9)
    # outside its update: the shard copied in for each values micro-batch, 64 x 8 / 8 x 2,048 tokens / 8,192 = 16
    assert policy.time.offload_s - plain.time.offload_s == pytest.approx(
        16 * CRITIC_SHARD / policy.cluster.gpu.pcie_bytes_per_s, rel=1e-12)


def test_verl_forces_the_critics_manual_offloads_off_and_fsdp1_ignores_it(critic_pair):
    policy = critic_pair[1]
    both = rl_estimate("qwen2.5-7b", 8, critic_offload_policy=True, critic_param_offload=True,
                       critic_optimizer_offload=True, **PPO)
    assert [p.gpu_bytes for p in both.memory.phases] == [p.gpu_bytes for p in policy.memory.phases]
    assert both.host.terms == policy.host.terms and both.time == policy.time
    knobs = dict(PPO, strategy="fsdp")
    plain, asked = rl_estimate("qwen2.5-7b", 8, **knobs), rl_estimate("qwen2.5-7b", 8, critic_offload_policy=True,
                                                                      **knobs)
    assert [p.gpu_bytes for p in asked.memory.phases] == [p.gpu_bytes for p in plain.memory.phases]
    assert not asked.memory.critic.on_host and asked.time == plain.time
    assert any(n.startswith("critic.fsdp.offload_policy is ignored under critic.strategy fsdp") for n in asked.notes)
    # and the actor's own policy leaves the critic on the GPU
    actor_only = rl_estimate("qwen2.5-7b", 8, offload_policy=True, **PPO)
    assert actor_only.memory.actor.on_host and not actor_only.memory.critic.on_host
