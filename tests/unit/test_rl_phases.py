"""GPU memory per phase of a verl GRPO step (cost_models/rl_phases.py) and host RAM per node (rl_host.py): each
figure worked by hand from the configs (planner/catalog/models.json): Qwen2.5-7B 7,615,616,512 parameters, hidden
3584, vocab 152064; Qwen3-8B hidden 4096, KV dim 1024, FFN 12288, vocab 151936, 36 layers."""

import pytest

from cost_models.outside_allocator import outside_allocator_terms
from cost_models.profile import DEFAULT_PROFILE
from cost_models.rl_batch import RlBatch, batch_plan
from cost_models.rl_critic import critic_states
from cost_models.rl_host import host_ram_per_node
from cost_models.rl_actor import all_linear_lora, verl_logits_bytes
from cost_models.rl_phases import PHASES, rl_phases
from cost_models.rl_settings import RlSettings
from cost_models.rollout_engine import EngineSettings
from cost_models.specs import FsdpConfig, SpecError
from planner.hardware import make_cluster
from planner.models import resolve_model

P7 = 7_615_616_512


@pytest.fixture(scope="module")
def qwen7():
    return resolve_model("qwen2.5-7b")


@pytest.fixture(scope="module")
def job(qwen7):
    """Qwen2.5-7B, full fine-tuning, fp32 actor on 8 x H100, vLLM current TP 2 at 0.5, nothing offloaded but the
    reference; mean lengths 300 + 500 so the micro-batch (4 x 800 = 3,200 tokens) is small."""
    cluster, settings = make_cluster(8, gpu="h100-80gb"), RlSettings()
    return cluster, settings, _phases(qwen7, cluster, settings)


def _phases(model, cluster, settings):
    """The job's phases under these settings (the job fixture's batch and engine)."""
    batch = RlBatch(train_batch_size=64, rollout_n=8, ppo_mini_batch_size=32, max_prompt_length=1024,
                    max_response_length=1024, ppo_micro_batch_size_per_gpu=4, log_prob_micro_batch_size_per_gpu=4,
                    mean_prompt_length=300, mean_response_length=500)
    plan = batch_plan(batch, 8, model.n_heads, model.n_kv_heads, 2)
    engine = EngineSettings(gpu_memory_utilization=0.5, tp=2, max_model_len=2048)
    return rl_phases(model, cluster, settings, engine, plan, DEFAULT_PROFILE)


def test_verl_logits_path():
    m = resolve_model("qwen3-8b")
    logits = 16_384 * 151_936 * 2                 # 4,978,638,848 B: [tokens, vocab] in bf16
    assert verl_logits_bytes(m, 16_384, 2, RlSettings(entropy=False)) == logits
    assert verl_logits_bytes(m, 16_384, 2, RlSettings()) == 3 * logits    # compiled entropy (verl's default)
    assert verl_logits_bytes(m, 16_384, 2, RlSettings(entropy_compile=False)) == 7 * logits   # eager, traced
    # chunked entropy: three fp32 chunks of 2048 rows instead (3 x 2048 x 151,936 x 4 = 3,733,979,136)
    assert verl_logits_bytes(m, 16_384, 2, RlSettings(entropy_chunking=True)) == logits + 3_733_979_136


def test_all_linear_lora_adds_the_mlp():
    m = all_linear_lora(resolve_model("qwen3-8b"))
    # rank 32 x (q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096, gate 4096+12288, up 4096+12288,
    # down 12288+4096) = 32 x 75,776 = 2,424,832 per block
    assert m.lora_params_per_block(32) == 2_424_832


def test_actor_states_fp32_full(job):
    _, _, memory = job
    a = memory.actor
    assert a.params_bytes == P7 * 4 // 8              # fp32 shard over 8 GPUs: 3,807,808,256
    assert a.optimizer_bytes == 2 * a.params_bytes    # Adam's two fp32 states
    assert a.step_temporary_bytes == a.params_bytes   # foreach: one more fp32 copy (optimizer_step.py)
    assert a.largest_tensor_bytes == 152_064 * 3_584 * 4   # the fp32 embedding, gathered at the weight sync
    # the first step's backward has no Adam states yet (created lazily in the step)
    assert a.update_steady.total_bytes - a.update_first.total_bytes == a.optimizer_bytes


def test_phases_in_verls_order_and_adam_beside_the_engine(job):
    _, _, memory = job
    assert tuple(p.name for p in memory.phases) == tuple(n for n in PHASES if not n.startswith("critic") and n != "reward")  # GRPO
    init, rollout = memory.phases[0], memory.phases[1]
    # the KV budget was sized without Adam's states; from step 2 they sit beside it (verl PR 1349): the rollout
    # holds 2 x 3,807,808,256 B more, times the profile's 5% fragmentation
    adam = memory.actor.optimizer_bytes
    assert rollout.gpu_bytes["Adam states"] == adam
    assert abs(rollout.reserved_bytes - init.reserved_bytes - adam * 1.05) <= 1   # int() rounding of each
    assert "engine KV cache" not in memory.phases[2].gpu_bytes   # current vLLM wakes the KV after the sync
    assert "engine asleep (level 2)" in memory.phases[3].offloaded   # verl's level for a full model (rl_sleep.py)


def test_the_old_log_probs_compute_the_entropy_the_references_do_not(job, qwen7):
    """verl (ray_trainer.py): _compute_old_log_prob sets calculate_entropy=True, _compute_ref_log_prob False, the
    update follows actor.calculate_entropy / entropy_coeff (settings.entropy). 4 x 800 = 3,200 tokens a micro-batch,
    logits 3,200 x 152,064 x 2 B = 973,209,600: the old pass holds three (no-grad entropy, traced), the reference's
    one, whatever the update does."""
    cluster, _, memory = job
    logits = 3_200 * 152_064 * 2
    log_prob, ref = (next(p for p in memory.phases if p.name == n) for n in ("log_prob", "ref_log_prob"))
    assert log_prob.gpu_bytes["logits and entropy"] == 3 * logits
    assert ref.gpu_bytes["logits"] == logits and "logits and entropy" not in ref.gpu_bytes
    off = _phases(qwen7, cluster, RlSettings(entropy=False))
    assert next(p for p in off.phases if p.name == "log_prob").gpu_bytes["logits and entropy"] == 3 * logits


def test_host_ram_per_node(job, qwen7):
    cluster, settings, memory = job
    host = host_ram_per_node(qwen7, cluster, settings, memory.actor, memory.engine)
    # verl sleeps a full model's engine at level 2: its weights discarded, no host backup (LoRA's level 1 backs up
    # 7,615,616,512 x 2 B / TP 2 x 8 GPUs: tests/unit/test_rl_sleep.py)
    assert not any("backup" in term for term in host.terms)
    # the reference's bf16 shard (1,903,904,128 B) on each of 8 GPUs
    assert host.terms["reference (offloaded)"] == 15_231_233_024
    # a save stages each rank's fp32 params and Adam shards: (3,807,808,256 + 7,615,616,512) x 8
    assert host.checkpoint_staging_bytes == 91_387_398_144
    # rank 0 builds the fp32 actor (7,615,616,512 x 4 B) before anything is offloaded; 8 processes of 282 MB
    assert (host.load_bytes, host.process_bytes) == (30_462_466_048, 8 * 282_000_000)
    assert host.peak_bytes == 8 * 282_000_000 + 15_231_233_024 + 91_387_398_144


def test_bad_settings_name_the_field():
    with pytest.raises(SpecError, match="strategy: unknown value 'megatron'; choose one of: fsdp, fsdp2"):
        RlSettings(strategy="megatron")
    with pytest.raises(SpecError, match="finetune: qlora is not a verl mode; choose one of: full, lora"):
        RlSettings(finetune="qlora")


def test_ppo_critic_beside_every_phase(qwen7):
    """PPO: the critic (the actor's model with a Linear(3584, 1) value head: 7,615,616,512 - 152,064 x 3,584 +
    3,585 = 7,070,622,721 parameters) in fp32 over 8 GPUs, in its own process (one more CUDA context)."""
    cluster = make_cluster(8, gpu="h100-80gb")
    batch = RlBatch(train_batch_size=64, rollout_n=8, ppo_mini_batch_size=32, max_prompt_length=1024,
                    max_response_length=1024, ppo_micro_batch_size_per_gpu=4, mean_prompt_length=300,
                    mean_response_length=500)
    plan = batch_plan(batch, 8, qwen7.n_heads, qwen7.n_kv_heads, 2)
    settings = RlSettings(algorithm="ppo")
    critic = critic_states(qwen7, cluster, settings, plan, DEFAULT_PROFILE)
    # fp32 over 8 GPUs: ceil(7,070,647,809 x 4 / 8); Adam's 8 B a parameter / 8 GPUs. 7,070,647,809: the head's
    # 1 x 3,584 weight padded to 8 rows, + 7 x 3,584 (dim0_padding.py; FSDP1, verl's default strategy here, is priced
    # with FSDP2's padding: its flat parameter pads < 8 elements a unit, 3,136 parameters a GPU fewer)
    assert (critic.params_bytes, critic.optimizer_bytes) == (3_535_323_905, 7_070_647_809)
    engine = EngineSettings(gpu_memory_utilization=0.5, tp=2, max_model_len=2048)
    ppo = rl_phases(qwen7, cluster, settings, engine, plan, DEFAULT_PROFILE, critic)
    assert tuple(p.name for p in ppo.phases) == tuple(n for n in PHASES if n != "reward")
    rollout = ppo.phases[1].gpu_bytes
    assert (rollout["critic params"], rollout["critic Adam states"]) == (critic.params_bytes, critic.optimizer_bytes)
    # the critic's process: its own context and FSDP communicator over the 8 GPUs (outside_allocator.py), as the actor's
    outside = outside_allocator_terms(cluster, FsdpConfig(), DEFAULT_PROFILE)
    assert rollout["critic CUDA context"] == sum(t.bytes for t in outside)
    assert "logits and entropy" not in ppo.phases[5].gpu_bytes   # the critic's values: no vocabulary
