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
    assert host["CPU optimizer step temporaries"] == 8 * temporaries == 2_179_996_672
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
