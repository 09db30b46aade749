"""TRL 1.16's own schedule (cost_models/rl_schedule.py, rl_trl_head.py): a Qwen2.5-7B GRPO on 8 x H100 with TRL's
defaults worked by hand phase by phase, the old-log-prob and reference passes appearing with their GRPOConfig keys,
the engine built first and left awake without sleep mode, and TRL's FSDP2 reference as one unit, traced with TRL's
own prepare_fsdp on fake tensors.

Qwen2.5-7B: 7,615,616,512 parameters, vocabulary 152,064, hidden 3,584, 28 layers of 4 KV heads x 128; the
embedding and head 544,997,376 each, a block 233,057,792. TRL's defaults (grpo_config.py, TrainingArguments):
per_device_train_batch_size 8, gradient_accumulation_steps 1 (so steps_per_generation 1), num_generations 8,
max_completion_length 512, vllm_gpu_memory_utilization 0.3, vllm_tensor_parallel_size 1, beta 0.0,
num_iterations 1, vllm_importance_sampling_correction True, vllm_enable_sleep_mode False; the actor loaded in fp32
(create_model_from_path's default dtype) with bf16 autocast; accelerate's FSDP2 (trl/accelerate_configs/fsdp2.yaml).
Prompts of 512 tokens: 8 prompts x 8 completions a generation over 8 GPUs."""

import pytest

from cost_models.rl_actor import logits_bytes
from cost_models.rl_settings import RlSettings
from cost_models.spec_values import SpecError
from planner.errors import PlannerError
from planner.rl import rl_estimate

H100 = 85_520_809_984
SHARD = 7_615_616_512 * 4 // 8            # the fp32 actor's shard: 3,807,808,256
ADAM = 2 * SHARD
WEIGHTS = 7_615_616_512 * 2                # the engine's bf16 weights at TP 1
PROFILE = 4096 * (2 * 3584 + 3584 + 2 * 512 + 3 * 18944) * 2 + 2 * 8 * 152_064 * 4   # 4,096 tokens, 8 rows
PAGE = 16 * 2 * 4 * 128 * 2                # a 16-token block of one layer
KV = (int(H100 * 0.3) - WEIGHTS - PROFILE) // PAGE // 28 * PAGE * 28
GRAPHS = 2**29
TRL = dict(gpu="h100-80gb", framework="trl", strategy="fsdp2", prompt_len=512, response_len=512, train_batch=8,
           rollout_n=8, ppo_micro_batch_size_per_gpu=8, gpu_memory_utilization=0.3, rollout_tp=1)


def phases(e) -> dict:
    return {p.name: p for p in e.memory.phases}


@pytest.fixture(scope="module")
def defaults():
    return rl_estimate("qwen2.5-7b", 8, **TRL)


def test_trl_defaults_phase_by_phase(defaults):
    """TRL's order, no reference pass (beta 0), the old log-probs (the importance-sampling correction); the engine
    sized on an empty GPU (0.3 x 85,520,809,984 less the weights and its profile run: 10,739 blocks, 9,853,075,456
    B) and left awake: its weights and KV cache beside every training phase."""
    p = phases(defaults)
    assert list(p) == ["init", "weight_sync", "rollout", "log_prob", "update", "optimizer_step", "checkpoint"]
    assert (PROFILE, KV) == (571_768_832, 9_853_075_456) and defaults.memory.engine.kv_bytes == KV
    assert defaults.engine_settings.max_num_seqs == 8 * 1 * 1   # micro-batch x TP x steps_per_generation
    idle = {"engine weights": WEIGHTS, "engine KV cache": KV, "engine CUDA graphs": GRAPHS}
    assert p["init"].gpu_bytes == {"engine weights": WEIGHTS, "engine KV cache": KV,
                                   "engine activations": PROFILE, "engine CUDA graphs": GRAPHS}
    # one fp32 tensor at a time into the engine, the largest the embedding: 544,997,376 x 4
    assert p["weight_sync"].gpu_bytes == {"actor params": SHARD, "Adam states": ADAM, "gathered tensor": 2_179_989_504,
                                          **idle}
    assert p["rollout"].gpu_bytes == {"actor params": SHARD, "Adam states": ADAM, **idle,
                                      "engine activations": PROFILE}
    # accelerate's root (embedding, head, norm) and two blocks in bf16; the fused head on 8 x 512 completion tokens:
    # their compact hidden states, one 4,096 x 32,768 bf16 tile, 11 fp32 values each
    log_prob = p["log_prob"].gpu_bytes
    assert log_prob["gathered units"] == (1_089_998_336 + 2 * 233_057_792) * 2 == 3_112_227_840
    assert log_prob["log-prob head (fused)"] == 4096 * 3584 * 2 + 4096 * 32768 * 2 + 11 * 4096 * 4 == 297_975_808
    assert "logits and entropy" not in log_prob and "reference" not in log_prob
    assert {k: log_prob[k] for k in idle} == idle
    assert {k: p["update"].gpu_bytes[k] for k in idle} == idle and "engine activations" not in p["update"].gpu_bytes
    # TrainingArguments' default optim, adamw_torch_fused: no step temporaries
    assert p["optimizer_step"].gpu_bytes == {"actor params": SHARD, "actor grads": SHARD, "Adam states": ADAM, **idle}
    assert p["checkpoint"].gpu_bytes == {"actor params": SHARD, "Adam states": ADAM, **idle}
    assert not any(p[name].offloaded for name in p)   # nothing asleep, nothing on the host
    assert any(n.startswith("vllm_enable_sleep_mode is off") for n in defaults.notes)


def test_the_updates_fused_head_by_hand():
    """At the end of the fused head's backward on 4,096 scored tokens (8,192 padded tokens, half of them prompt): the
    compact hidden states and the tile, the hidden states' gradient in fp32 and bf16 (6 B x 3,584 a token), the
    head's (6 B x 152,064 x 3,584) and 5 fp32 values a token; LoRA leaves the head frozen."""
    e = rl_estimate("qwen2.5-7b", 8, **TRL)
    full = 29_360_128 + 268_435_456 + 4096 * 3584 * 6 + 152_064 * 3584 * 6 + 5 * 4096 * 4
    assert logits_bytes(e.model, 8192, 2, RlSettings(framework="trl"), e.batch) == full == 3_655_942_144
    lora = RlSettings(framework="trl", finetune="lora")
    assert logits_bytes(e.model, 8192, 2, lora, e.batch) == full - 152_064 * 3584 * 6


def test_old_log_probs_and_reference_follow_the_knobs(defaults):
    """grpo_trainer.py: the old log-probs run when gradient_accumulation_steps % (steps_per_generation x
    num_iterations) != 0 or with the importance-sampling correction; the reference's pass with beta != 0. Each pass
    prices the same forward; num_iterations 2 runs the update twice over a generation batch."""
    def names(**knobs):
        return [p.name for p in rl_estimate("qwen2.5-7b", 8, **{**TRL, **knobs}).memory.phases]

    no_is = dict(vllm_importance_sampling_correction=False)
    assert "log_prob" not in names(**no_is)                        # 1 % (1 x 1) == 0
    assert "log_prob" in names(**no_is, num_iterations=2)          # 1 % (1 x 2) != 0
    assert "log_prob" in names(**no_is, train_batch=16, ppo_mini_batch_size=8)   # steps_per_generation 2: 1 % 2
    assert "ref_log_prob" in names(beta=0.04) and "ref_log_prob" not in names(beta=0.0)
    one = defaults.time.log_prob_s
    assert one > 0 and rl_estimate("qwen2.5-7b", 8, **TRL, **no_is).time.log_prob_s == 0
    assert rl_estimate("qwen2.5-7b", 8, **TRL, beta=0.04).time.log_prob_s == pytest.approx(2 * one, rel=1e-12)
    twice = rl_estimate("qwen2.5-7b", 8, **TRL, num_iterations=2).time
    assert twice.update_s == pytest.approx(2 * defaults.time.update_s, rel=1e-12)


def test_the_reference_by_strategy_and_lora():
    """beta 0.04: a second model in the actor's dtype (fp32: a 3,807,808,256 B shard, on the GPU throughout). Under
    FSDP2 prepare_fsdp shards it as one unit: its forward gathers all 7,615,616,512 parameters in bf16, beside the
    all-gather's buffer as large while it copies out (traced below) - more than the forward's activations here.
    FSDP1 wraps it by layer (the actor's units); LoRA has no second model (the actor, adapter disabled)."""
    fsdp2 = phases(rl_estimate("qwen2.5-7b", 8, **TRL, beta=0.04))
    ref = fsdp2["ref_log_prob"].gpu_bytes
    assert fsdp2["rollout"].gpu_bytes["reference"] == SHARD
    assert (ref["reference"], ref["reference gathered"], ref["reference all-gather buffer"]) == (SHARD, WEIGHTS,
                                                                                                 WEIGHTS)
    fsdp1 = phases(rl_estimate("qwen2.5-7b", 8, **{**TRL, "strategy": "fsdp"}, beta=0.04))
    assert fsdp1["ref_log_prob"].gpu_bytes["gathered units"] == 3_112_227_840
    assert fsdp1["ref_log_prob"].reserved_bytes < fsdp2["ref_log_prob"].reserved_bytes   # FSDP2 is not the lighter
    lora = phases(rl_estimate("qwen2.5-7b", 8, **TRL, beta=0.04, finetune="lora"))
    assert "reference" not in lora["rollout"].gpu_bytes and "reference gathered" not in lora["ref_log_prob"].gpu_bytes


def test_the_json_knobs_report_the_reference_offload_as_priced(defaults):
    """knobs.ref_param_offload reads the priced settings (RlSettings.reference_offloaded): TRL's reference follows
    the actor's fsdp_offload_params, its shard on the host with it (beta 0.04: the rollout holds none); verl's is
    on the host whatever ref.fsdp_config.param_offload says."""
    from planner.rl.report import rl_dict

    offloaded = rl_estimate("qwen2.5-7b", 8, **TRL, beta=0.04, param_offload=True, optimizer_offload=True)
    assert "reference" not in phases(offloaded)["rollout"].gpu_bytes
    verl = rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb", ref_param_offload=False)
    assert [rl_dict(e)["knobs"]["ref_param_offload"] for e in (defaults, offloaded, verl)] == [False, True, True]


def test_sleep_mode_frees_the_engine_outside_generation(defaults):
    """vllm_enable_sleep_mode: level 2 after each generation (the graph pool stays); the sync wakes the weights
    only, the KV cache after it; nothing backed up on the host (level 2 discards)."""
    asleep = rl_estimate("qwen2.5-7b", 8, **TRL, vllm_enable_sleep_mode=True)
    p = phases(asleep)
    for name in ("log_prob", "update", "optimizer_step", "checkpoint"):
        assert {k: v for k, v in p[name].gpu_bytes.items() if k.startswith("engine")} == {"engine CUDA graphs": GRAPHS}
        assert "engine asleep (level 2)" in p[name].offloaded
    assert {k for k in p["weight_sync"].gpu_bytes if k.startswith("engine")} == {"engine weights",
                                                                                "engine CUDA graphs"}
    assert p["init"].gpu_bytes == phases(defaults)["init"].gpu_bytes
    assert p["update"].reserved_bytes == phases(defaults)["update"].reserved_bytes - WEIGHTS - KV
    assert not any("sleep level 1" in t for t in asleep.host.terms)


def test_the_engine_starts_before_the_actor():
    """vLLM's start check at 0.97 of the GPU: verl builds the engine beside the resident fp32 shard and it refuses to
    start; TRL builds it first (GRPOTrainer.__init__) - it starts, and the trainer's states come on top of it."""
    verl = rl_estimate("qwen2.5-7b", 8, **{**TRL, "framework": "verl", "gpu_memory_utilization": 0.97})
    trl = rl_estimate("qwen2.5-7b", 8, **{**TRL, "gpu_memory_utilization": 0.97})
    assert [r.code for r in verl.memory.engine.refusals] == ["engine-start"]
    assert not trl.memory.engine.refusals and not trl.fits


@pytest.mark.parametrize("knobs, field", [
    (dict(max_num_seqs=1024), "max_num_seqs"), (dict(engine_version="0.8"), "engine_version"),
    (dict(use_dynamic_bsz=True), "use_dynamic_bsz"), (dict(algorithm="ppo"), "algorithm"),
    (dict(framework="verl", beta=0.04), "beta")])
def test_what_the_other_framework_runs_is_one_line(knobs, field):
    with pytest.raises(SpecError) as raised:   # the request's (PlannerError) or the settings' (GRPO only)
        rl_estimate("qwen2.5-7b", 8, **{**TRL, **knobs})
    assert raised.value.field == field


def test_the_search_is_verls():
    from planner.rl.request import rl_request
    from planner.rl.search import plan_rl

    with pytest.raises(PlannerError, match="rl estimate --framework trl"):
        plan_rl(rl_request("qwen2.5-7b", 8, **TRL))


def test_trls_fsdp2_reference_is_one_unit_traced():
    """TRL's own prepare_fsdp (trl/models/utils.py, compiled out of its file: importing trl's package takes ~20 s)
    on 4 fake ranks, as GRPOTrainer calls it for the reference: fully_shard on the root alone, bf16 mixed precision,
    eval. A no-grad forward's peak holds the whole model gathered in bf16 and the all-gather's buffer as large
    (4 x 1,024 x 1,024 x 2 B each) - what rl_phases.reference_pass prices - against two layers' buffers when each
    layer is its own unit. accelerate is not imported (its import takes seconds): its installed version, and
    get_parameters_from_modules as it is for ignored_modules None (an empty set)."""
    import importlib.metadata
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    from packaging.version import Version
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard

    from calibration.apply import make_mesh
    from calibration.fake_world import _FakeWorld, _dtensors_under_fake_mode
    from calibration.memtrack import MemoryTracker
    from cost_models.specs import FsdpConfig
    from tests.unit.installed_source import function_from

    prepare_fsdp = function_from("trl", "models/utils.py", "prepare_fsdp", {
        "FSDP": FullyShardedDataParallel, "FSDPModule": FSDPModule, "torch": torch, "Version": Version,
        "accelerate": SimpleNamespace(__version__=importlib.metadata.version("accelerate")),
        "get_parameters_from_modules": lambda modules, model, device: set()})
    hidden, layers = 1024, 4

    def peak(per_layer: bool) -> dict:
        with _FakeWorld(4), _dtensors_under_fake_mode():
            mesh = make_mesh(FsdpConfig(), 4, 4, "cpu")
            plugin = SimpleNamespace(fsdp_version=2, reshard_after_forward=True, cpu_offload=OffloadPolicy(),
                                     mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                                     ignored_modules=None)
            accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu"),
                                          torch_device_mesh={("dp_shard",): mesh},
                                          parallelism_config=SimpleNamespace(fsdp_dim_names=("dp_shard",)))
            with FakeTensorMode():
                model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
                if per_layer:   # accelerate's auto-wrap, as for the actor
                    for layer in model:
                        fully_shard(layer, mesh=mesh, mp_policy=plugin.mixed_precision_policy)
                model = prepare_fsdp(model, accelerator)
                tracker = MemoryTracker(model)
                with tracker, torch.no_grad():
                    model(torch.randn(8, hidden))
                return tracker.snapshot().breakdown

    whole = layers * hidden * hidden * 2
    root = peak(per_layer=False)
    assert (root["unsharded_params"], root["collective_buffers"]) == (whole, whole)
    assert peak(per_layer=True)["collective_buffers"] == 2 * whole // layers
