"""`--emit verl` and `--emit trl` loaded by the frameworks' own config code: verl 0.9.1's Hydra config
(verl/trainer/config/ppo_trainer.yaml composed with the script's overrides through Hydra's compose API; Hydra
refuses a key the config does not have), then verl's own startup validation of the composed config (main_ppo's
utils.config.validate_config, and omega_conf_to_dataclass of the actor / ref / rollout / critic sections as
engine_workers.init_model converts them), and TRL 1.16's GRPOConfig. `fsdp-plan check`'s verl inputs
(tests/doctor/test_rl_check.py) go through the same validation here, so that verl is imported in one test file.
Needs: the README's test install (verl 0.9.1 with ray 2.60.0 and tensordict 0.10.0, hydra-core 1.3.8, trl 1.16.0;
skipped without them)."""

import importlib.util
import json
import os
import re
import warnings

import pytest
import yaml

from planner.doctor.readers.verl import script_overrides
from planner.emit.trl import emit_trl
from planner.emit.verl import emit_verl
from planner.rl import rl_estimate

# rl.md golden case 1 (verl's 2 x H800 Qwen2-7B GRPO example), as tests/golden/test_rl_cases.py prices it
CASE_1 = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=1024, ppo_mini_batch_size=256,
              ppo_micro_batch_size_per_gpu=16, rollout_n=5, param_offload=True, optimizer_offload=True,
              rollout_tp=2, gpu_memory_utilization=0.6, engine_version="0.8", enforce_eager=True, max_num_seqs=1024,
              mean_prompt_len=100, mean_response_len=300)
# PPO with a LoRA FSDP2 bf16 actor, dynamic batches and Ulysses 2 on 2 nodes: every branch of the emitter
PPO = dict(gpu="h100-80gb", gpus_per_node=8, prompt_len=1024, response_len=2048, train_batch=256, rollout_n=4,
           algorithm="ppo", strategy="fsdp2", actor_dtype="bf16", finetune="lora", lora_rank=64,
           use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16384, ulysses_sequence_parallel_size=2,
           critic_param_offload=True, engine="sglang")
# FSDP2's CPUOffloadPolicy on the actor (fsdp_config.offload_policy)
OFFLOAD_POLICY = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8,
                      strategy="fsdp2", actor_dtype="bf16", offload_policy=True)


def _compose(overrides: list[str]):
    hydra = pytest.importorskip("hydra")
    spec = importlib.util.find_spec("verl")   # its YAML only: the validation tests below import it
    if spec is None:
        pytest.skip("verl not installed")
    config_dir = os.path.join(spec.submodule_search_locations[0], "trainer", "config")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with hydra.initialize_config_dir(config_dir=config_dir, version_base=None):
            return hydra.compose(config_name="ppo_trainer", overrides=overrides)


@pytest.mark.parametrize("model, gpus, knobs", [("qwen2-7b", 2, CASE_1), ("qwen2.5-7b", 16, PPO)],
                         ids=["grpo-case-1", "ppo-lora-dynamic-ulysses"])
def test_verl_script_composes_in_verls_own_config(model, gpus, knobs):
    from omegaconf import OmegaConf

    script = emit_verl(rl_estimate(model, gpus, **knobs))
    overrides = script_overrides(script.replace("MODEL_PATH=" + model, "MODEL_PATH=Qwen/Qwen2-7B-Instruct"))
    assert overrides["actor_rollout_ref.model.path"] == "Qwen/Qwen2-7B-Instruct"   # $MODEL_PATH resolved
    base = _compose([])
    composed = _compose([f"{k}={v}" for k, v in overrides.items()])
    for key, value in overrides.items():
        got, default = OmegaConf.select(composed, key), OmegaConf.select(base, key)
        assert str(got) == value, key
        if default is not None:   # verl's YAML types: bool stays bool, 0.6 a float, 1024 an int
            assert type(got) is type(default), (key, got, default)
    if knobs is CASE_1:
        assert len(overrides) == 37   # counted in the script by hand (rollout.load_format=dummy the 37th)
        assert OmegaConf.select(composed, "actor_rollout_ref.actor.fsdp_config.param_offload") is True
        assert OmegaConf.select(composed, "actor_rollout_ref.rollout.gpu_memory_utilization") == 0.6
    else:   # the critic's keys are verl 0.9's (critic.fsdp.*), the nodes 16 / 8
        assert OmegaConf.select(composed, "critic.fsdp.param_offload") is True
        assert OmegaConf.select(composed, "trainer.nnodes") == 2
        assert OmegaConf.select(composed, "algorithm.adv_estimator") == "gae"


def test_max_num_seqs_defaults_are_what_verl_passes_to_vllm():
    """verl 0.9.1 hands rollout.max_num_seqs to vLLM's engine args itself (workers/rollout/vllm_rollout/
    vllm_async_server.py launch_server: args["max_num_seqs"] = self.config.max_num_seqs), so vLLM's own default
    (EngineArgs: 1024 for its API server on a >= 70 GiB GPU in v1) never applies, whatever the vLLM version. The value
    is the YAML's (trainer/config/rollout/rollout.yaml: 256; RolloutConfig's dataclass default 1024 only for a config
    built without it) and the reward model's (reward/reward.yaml: 1024): the planner's defaults."""
    from omegaconf import OmegaConf

    from cost_models.rl_reward import REWARD_MAX_NUM_SEQS
    from planner.rl.request import RlRequest

    base = _compose([])
    assert OmegaConf.select(base, "actor_rollout_ref.rollout.max_num_seqs") == RlRequest().max_num_seqs == 256
    assert OmegaConf.select(base, "reward.reward_model.rollout.max_num_seqs") == REWARD_MAX_NUM_SEQS == 1024


def test_lora_merge_is_written_under_verls_key():
    """--lora-merge: model.lora.merge (trainer/config/model/hf_model.yaml, default False) composes as a bool in
    verl's config, for a LoRA actor only."""
    from omegaconf import OmegaConf

    knobs = dict(OFFLOAD_POLICY, offload_policy=False, finetune="lora", lora_merge=True)
    overrides = script_overrides(emit_verl(rl_estimate("qwen2.5-7b", 8, **knobs)))
    assert overrides["actor_rollout_ref.model.lora.merge"] == "True"
    composed = _compose([f"{k}={v}" for k, v in overrides.items()])
    assert OmegaConf.select(composed, "actor_rollout_ref.model.lora.merge") is True
    assert OmegaConf.select(_compose([]), "actor_rollout_ref.model.lora.merge") is False
    full = script_overrides(emit_verl(rl_estimate("qwen2.5-7b", 8, **OFFLOAD_POLICY)))
    assert "actor_rollout_ref.model.lora.merge" not in full


def test_a_reward_pools_engine_loads_nothing_on_the_host():
    """What cost_models/rl_host.py rests on for a reward model on its own pool: verl 0.9.1's RewardModelManager builds
    its model config from the path alone (HFModelConfig's use_shm, False by default, not passed: no /dev/shm copy,
    whatever actor_rollout_ref.model.use_shm says), and reward.yaml's engine loads with load_format auto (vllm serve
    reads the checkpoint from disk)."""
    import dataclasses
    import inspect

    from omegaconf import OmegaConf

    _verl_validation()
    from verl.experimental.reward_loop.reward_model import RewardModelManager
    from verl.workers.config import HFModelConfig

    source = inspect.getsource(RewardModelManager._initialize_llm_servers)
    assert "HFModelConfig(path=self.config.model_path)" in source and "use_shm" not in source
    assert next(f.default for f in dataclasses.fields(HFModelConfig) if f.name == "use_shm") is False
    assert OmegaConf.select(_compose([]), "reward.reward_model.rollout.load_format") == "auto"


def test_hydra_refuses_a_key_verl_does_not_have():
    """What makes the test above a check: a misspelt key does not compose."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose(["actor_rollout_ref.actor.ppo_micro_batch_per_gpu=16"])


def _verl_validation():
    """verl's own startup checks. Importing verl runs verl/__init__.py: ray and tensordict (skipped without them)."""
    pytest.importorskip("ray")
    config = pytest.importorskip("verl.utils.config")
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    return config, need_reference_policy, need_critic


def _validated(overrides: dict[str, str], *extra: str):
    """Composed, then checked as main_ppo.main checks it before starting Ray: validate_config converts the actor
    (and the critic, for PPO) with omega_conf_to_dataclass and runs their validate()."""
    config, need_reference_policy, need_critic = _verl_validation()
    composed = _compose([f"{k}={v}" for k, v in overrides.items()] + list(extra))
    config.validate_config(composed, need_reference_policy(composed), need_critic(composed))
    return composed


def _ref(composed):
    """The reference as engine_workers.init_model converts it: its log-prob keys renamed to the actor's first."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass

    ref = composed.actor_rollout_ref.ref
    with open_dict(ref):
        ref.ppo_mini_batch_size = composed.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return omega_conf_to_dataclass(ref)


def _model_dir(tmp_path, model: str) -> str:
    """The preset's config.json where verl's HFModelConfig (the critic's model) reads it: no Hub here."""
    from planner.models.resolve import hf_config_of

    (tmp_path / "config.json").write_text(json.dumps({**hf_config_of(model), "architectures": ["Qwen2ForCausalLM"]}))
    return str(tmp_path)


# what verl's dataclasses carry: the plan's knobs, by hand from CASE_1 / PPO and the planner's defaults for the rest
# (PPO: rollout TP 2, utilization 0.5 for SGLang; the reference offloaded in both). actor: strategy, mini, micro,
# dynamic, token budget, Ulysses, param / optimizer offload, dtype; rollout: name, TP, utilization, n, log-prob
# micro, dynamic, budget; then the reference's param offload
VERL_SEES = {"grpo-case-1": (("fsdp", 256, 16, False, 16384, 1, True, True, "fp32"),
                             ("vllm", 2, 0.6, 5, 16, False, 16384), True),
             "ppo-lora-dynamic-ulysses": (("fsdp2", 256, None, True, 16384, 2, False, False, "bf16"),
                                          ("sglang", 2, 0.5, 4, None, True, 16384), True),
             "grpo-offload-policy": (("fsdp2", 64, 4, False, 16384, 1, False, False, "bf16"),
                                     ("vllm", 2, 0.5, 8, 4, False, 16384), True)}


@pytest.mark.parametrize("model, gpus, knobs, case", [("qwen2-7b", 2, CASE_1, "grpo-case-1"),
                                                      ("qwen2.5-7b", 16, PPO, "ppo-lora-dynamic-ulysses"),
                                                      ("qwen2.5-7b", 8, OFFLOAD_POLICY, "grpo-offload-policy")])
def test_verl_validates_the_script_and_its_dataclasses_carry_the_plan(tmp_path, monkeypatch, model, gpus, knobs,
                                                                      case):
    """The emitted overrides pass verl's validate_config; the actor, reference, rollout and (PPO) critic dataclasses
    verl's workers build from them hold the planned values. The critic's HFModelConfig reads the model's
    config.json (a local copy of the preset's) and loads no tokenizer (`+critic.model.load_tokenizer=False`: no
    tokenizer files on this machine; the one key added)."""
    omega_conf_to_dataclass = _verl_validation()[0].omega_conf_to_dataclass
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    script = emit_verl(rl_estimate(model, gpus, **knobs))
    overrides = script_overrides(script.replace("MODEL_PATH=" + model, "MODEL_PATH=" + _model_dir(tmp_path, model)))
    composed = _validated(overrides, "+critic.model.load_tokenizer=False")
    actor = omega_conf_to_dataclass(composed.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(composed.actor_rollout_ref.rollout)
    assert type(actor).__name__ == "FSDPActorConfig" and type(rollout).__name__ == "RolloutConfig"
    fsdp = actor.fsdp_config
    assert (actor.strategy, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz,
            actor.ppo_max_token_len_per_gpu, actor.ulysses_sequence_parallel_size, fsdp.param_offload,
            fsdp.optimizer_offload, fsdp.model_dtype) == VERL_SEES[case][0]
    # verl's FSDP2 engine reads it (FSDPEngine._build_fsdp_module: CPUOffloadPolicy(pin_memory=True))
    assert fsdp.offload_policy is knobs.get("offload_policy", False)
    # FSDPActorConfig.__post_init__ hands the strategy and the Ulysses degree to the engine config the worker runs
    assert (fsdp.strategy, fsdp.ulysses_sequence_parallel_size) == (actor.strategy,
                                                                   actor.ulysses_sequence_parallel_size)
    assert (rollout.name, rollout.tensor_model_parallel_size, rollout.gpu_memory_utilization, rollout.n,
            rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_use_dynamic_bsz,
            rollout.log_prob_max_token_len_per_gpu) == VERL_SEES[case][1]
    ref = _ref(composed)
    assert (ref.fsdp_config.param_offload, ref.use_dynamic_bsz) == (VERL_SEES[case][2], actor.use_dynamic_bsz)
    assert (ref.ppo_micro_batch_size_per_gpu, ref.ppo_max_token_len_per_gpu) == (
        rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_max_token_len_per_gpu)
    if case == "ppo-lora-dynamic-ulysses":   # the critic: the actor's model (read: 28 heads), strategy and budget
        critic = omega_conf_to_dataclass(composed.critic)
        assert type(critic).__name__ == "FSDPCriticConfig"
        assert (critic.strategy, critic.fsdp.param_offload, critic.fsdp.optimizer_offload, critic.use_dynamic_bsz,
                critic.ppo_max_token_len_per_gpu) == ("fsdp2", True, False, True, 16384)
        assert critic.model.hf_config.num_attention_heads == 28
        # the critic's strategy and dtype as priced (the actor's here), not verl's defaults fsdp / fp32: its
        # engine config (FSDPCriticConfig.__post_init__ hands it the strategy) is what FSDPEngine builds from
        assert (critic.fsdp.strategy, critic.fsdp.model_dtype) == ("fsdp2", "bf16")
        base = omega_conf_to_dataclass(_compose(["algorithm.adv_estimator=gae"]).critic.fsdp)
        assert (base.strategy, base.model_dtype) == ("fsdp", "fp32")


def test_verls_critic_runs_the_ulysses_degree_the_plan_prices(tmp_path, monkeypatch):
    """--emit verl writes the critic's Ulysses degree (verl's dp_critic.yaml defaults it to 1): the actor's 2 here,
    the degree its batch plan was priced at."""
    omega_conf_to_dataclass = _verl_validation()[0].omega_conf_to_dataclass
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    script = emit_verl(rl_estimate("qwen2.5-7b", 16, **PPO))
    overrides = script_overrides(script.replace("MODEL_PATH=qwen2.5-7b", "MODEL_PATH=" + _model_dir(tmp_path,
                                                                                                  "qwen2.5-7b")))
    composed = _validated(overrides, "+critic.model.load_tokenizer=False")
    assert omega_conf_to_dataclass(composed.critic).ulysses_sequence_parallel_size == 2


def test_verls_critic_offload_policy_and_the_workers_threads_reach_verl_and_ray(tmp_path, monkeypatch):
    """PPO with the critic's own CPUOffloadPolicy priced at 8 threads a rank: critic.fsdp.offload_policy lands in the
    FSDPCriticConfig verl's critic worker builds its engine from (FSDPEngine._build_fsdp_module reads it, fsdp2), and
    the threads as Ray's job-wide env_vars: main_ppo merges ray_kwargs.ray_init.runtime_env over
    get_ppo_ray_runtime_env(config) and passes it to ray.init; Ray's RuntimeEnv takes it (it refuses an int) and
    merges it into each worker's own env_vars (RayWorkerGroup._create_worker's RANK ...), so every FSDP worker
    starts with OMP_NUM_THREADS=8. Without a CPU step (no policy) the key is not written."""
    from omegaconf import OmegaConf
    from ray.runtime_env import RuntimeEnv
    from ray.runtime_env.runtime_env import _merge_runtime_env

    omega_conf_to_dataclass = _verl_validation()[0].omega_conf_to_dataclass
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    knobs = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8,
                 strategy="fsdp2", algorithm="ppo", critic_offload_policy=True, omp_num_threads=8)
    script = emit_verl(rl_estimate("qwen2.5-7b", 8, **knobs))
    overrides = script_overrides(script.replace("MODEL_PATH=qwen2.5-7b", "MODEL_PATH=" + _model_dir(tmp_path,
                                                                                                  "qwen2.5-7b")))
    env_key = "ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS"
    assert overrides.pop(env_key) == '"8"'   # Hydra's quoted string; `+`: a key verl's config adds
    composed = _validated(overrides, "+critic.model.load_tokenizer=False", f'+{env_key}="8"')
    critic = omega_conf_to_dataclass(composed.critic)
    assert (critic.strategy, critic.fsdp.offload_policy, critic.fsdp.param_offload) == ("fsdp2", True, False)
    assert omega_conf_to_dataclass(composed.actor_rollout_ref.actor).fsdp_config.offload_policy is False
    ray_init = composed.ray_kwargs.get("ray_init", {})   # as main_ppo.run_ppo builds ray.init's runtime_env
    runtime_env = OmegaConf.to_container(OmegaConf.merge(get_ppo_ray_runtime_env(composed),
                                                         ray_init.get("runtime_env", {})))
    job = RuntimeEnv(**{k: v for k, v in runtime_env.items() if v is not None})
    worker = _merge_runtime_env(dict(job), {"env_vars": {"RANK": "0", "WORLD_SIZE": "8"}})
    assert worker["env_vars"]["OMP_NUM_THREADS"] == "8" and worker["env_vars"]["RANK"] == "0"
    with pytest.raises(TypeError, match="Dict\\[str, str\\]"):
        RuntimeEnv(env_vars={"OMP_NUM_THREADS": 8})
    assert env_key not in emit_verl(rl_estimate("qwen2.5-7b", 8, **dict(knobs, critic_offload_policy=False)))


def test_load_format_is_written_as_priced_and_verl_reads_it_as_the_plan_does(tmp_path, monkeypatch):
    """--load-format reaches verl's RolloutConfig as written (rollout.load_format; the default dummy is rollout.yaml's
    and RlRequest's). verl 0.9.1's worker sets base_sync_done = "dummy" not in load_format (engine_workers.py:673,
    pinned below), which RlSettings.base_preloaded restates: False under dummy, where the first LoRA sync asks
    collect_lora_params for the base, which raises with layered_summon (utils/fsdp_utils.py; the module is one verl
    takes for FSDP1's: fsdp_version patched to 1, the check comes before the module is read) - the plan's refusal
    (cost_models/rl_strategy.py sync_refusals); True under safetensors, where it runs."""
    import pathlib

    omega_conf_to_dataclass = _verl_validation()[0].omega_conf_to_dataclass
    import torch
    import verl
    from verl.utils import fsdp_utils

    from planner.rl.request import RlRequest

    # read, not imported (engine_workers imports its server stack, uvicorn, not in the test install)
    workers = (pathlib.Path(verl.__file__).parent / "workers" / "engine_workers.py").read_text().splitlines()
    assert workers[672].strip() == 'self.base_sync_done: bool = "dummy" not in self.config.rollout.load_format'
    knobs = dict(CASE_1, finetune="lora", layered_summon=True)
    for load_format, base_sync_done in (("safetensors", True), ("dummy", False)):
        e = rl_estimate("qwen2-7b", 2, **dict(knobs, load_format=load_format))
        script = emit_verl(e)
        assert f"    actor_rollout_ref.rollout.load_format={load_format} \\\n" in script
        # composed, not validated: validate_config checks a LoRA rank against vLLM's own limit, and vLLM is not here
        overrides = script_overrides(script)
        rollout = omega_conf_to_dataclass(_compose([f"{k}={v}" for k, v in overrides.items()]).actor_rollout_ref
                                          .rollout)
        assert (rollout.layered_summon, rollout.load_format) == (True, load_format)
        assert ("dummy" not in rollout.load_format) is base_sync_done is e.settings.base_preloaded
        assert e.fits is base_sync_done
    default = omega_conf_to_dataclass(_compose(["actor_rollout_ref.rollout.name=vllm"]).actor_rollout_ref.rollout)
    assert default.load_format == RlRequest().load_format == "dummy"
    monkeypatch.setattr(fsdp_utils, "fsdp_version", lambda module: 1)
    with pytest.raises(ValueError, match="rollout.load_format=safetensors"):
        fsdp_utils.collect_lora_params(torch.nn.Linear(2, 2), layered_summon=True,
                                       base_sync_done="dummy" not in default.load_format)


@pytest.mark.parametrize("gpus, change, planner_reason, verl_error", [
    (2, {"train_batch": 128}, "ppo_mini_batch_size: 256 > train batch 128",
     "train_batch_size (128) must be >= actor.ppo_mini_batch_size (256)"),
    (3, {"rollout_tp": 1}, "train_batch: real_train_batch_size (5120) must be divisible by minimal possible batch "
     "size (3)", "real_train_batch_size (5120) must be divisible by minimal possible batch size (3)")],
    ids=["mini-batch-over-train-batch", "batch-over-3-gpus"])
def test_verl_refuses_what_the_planner_refuses(gpus, change, planner_reason, verl_error):
    """Case 1 changed so that the planner refuses it (1,024 x 5 = 5,120 sequences over 3 GPUs; a mini-batch of 256
    from 128 prompts): the script it still emits is refused by verl's validate_config, for the same reason."""
    _verl_validation()
    e = rl_estimate("qwen2-7b", gpus, **{**CASE_1, **change})
    assert not e.fits and any(r.startswith(planner_reason) for r in e.reasons)
    with pytest.raises((AssertionError, ValueError), match=re.escape(verl_error)):
        _validated(script_overrides(emit_verl(e)))


def _micro_batches(rows: int, micro: int) -> int:
    """verl's own split of one rank's mini-batch (workers/engine/utils.prepare_micro_batches, static batches)."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    data = TensorDict({"input_ids": torch.zeros(rows, 1, dtype=torch.long)}, batch_size=[rows])
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro)
    return len(prepare_micro_batches(data)[0])


def test_a_micro_batch_not_dividing_the_ranks_mini_batch_passes_validation_and_fails_verls_split():
    """The check's finding (tests/doctor/test_rl_check.py, micro-batch 48): verl 0.9.1's validate_config checks
    divisibility only for the deprecated global ppo_micro_batch_size, so it accepts 48; verl's split of a rank's
    mini-batch, 256 x 5 / 2 GPUs = 640 sequences, refuses it at the first update. Case 1's 16: 40 micro-batches
    (TRL's gradient_accumulation_steps for the same job)."""
    _verl_validation()
    e = rl_estimate("qwen2-7b", 2, **{**CASE_1, "ppo_micro_batch_size_per_gpu": 48})
    assert any(r.startswith("ppo_micro_batch_size_per_gpu: normalized ppo_mini_batch_size 640") for r in e.reasons)
    _validated(script_overrides(emit_verl(e)))
    assert _micro_batches(640, 16) == 40
    with pytest.raises(AssertionError, match="divisible by force_group_size \\* micro_batch_size_per_gpu"):
        _micro_batches(640, 48)


def test_checks_verl_inputs_pass_and_fail_verls_validation_alike():
    """`fsdp-plan check`'s inputs (tests/doctor/test_rl_check.py): verl's own example script of case 1 (which check
    reads and fits) passes verl's validation; an override list without a micro-batch (which check refuses, naming
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu) fails FSDPActorConfig.__post_init__."""
    from hydra.errors import InstantiationException

    from tests.doctor.test_rl_check import VERL_EXAMPLE

    _verl_validation()
    assert _validated(script_overrides(VERL_EXAMPLE)).actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 16
    with pytest.raises(InstantiationException, match="ppo_micro_batch_size_per_gpu' if use_dynamic_bsz is not"):
        _validated({"actor_rollout_ref.rollout.name": "vllm"})


def test_trl_grpo_config_accepted_by_trl():
    """Case 1 in TRL's terms: 1,024 prompts x 5 over 2 ranks at 16 a micro-step = 160 micro-steps per generation;
    the mini-batch 256 x 5 / 2 / 16 = 40 micro-steps per optimizer step. TRL's GRPOConfig runs its checks
    (generation batch divisible by num_generations) at world size 1 here: 16 x 160 = 2,560 completions.
    use_cpu: transformers refuses bf16 without a GPU (training_args.py), the one key added for this machine."""
    trl = pytest.importorskip("trl")
    grpo, accelerate = yaml.safe_load_all(emit_trl(rl_estimate("qwen2-7b", 2, **CASE_1)))
    config = trl.GRPOConfig(**grpo, use_cpu=True)
    assert (config.steps_per_generation, config.gradient_accumulation_steps) == (160, 40)
    assert config.generation_batch_size == 2560
    assert (config.vllm_mode, config.vllm_gpu_memory_utilization, config.vllm_tensor_parallel_size) == ("colocate",
                                                                                                       0.6, 2)
    assert (config.num_generations, config.max_completion_length, config.vllm_max_model_length) == (5, 1024, 2048)
    fsdp = accelerate["fsdp_config"]
    assert (fsdp["fsdp_version"], fsdp["fsdp_offload_params"], accelerate["num_processes"]) == (2, True, 2)
    # a verl plan in TRL's terms keeps what verl runs: a reference (a KL term) and the engine asleep
    assert (config.beta, config.num_iterations, config.vllm_importance_sampling_correction,
            config.vllm_enable_sleep_mode) == (0.001, 1, True, True)


def test_trl_estimates_passes_reach_grpo_config():
    """A TRL estimate's GRPOConfig keys that decide its passes (cost_models/rl_schedule.py), as priced: TRL's defaults
    where the request leaves them (no reference, the engine awake), else the request's; GRPOConfig takes them, and
    its FSDP version follows --strategy."""
    trl = pytest.importorskip("trl")
    job = dict(gpu="h100-80gb", prompt_len=512, response_len=512, train_batch=64, rollout_n=8,
               ppo_micro_batch_size_per_gpu=8, framework="trl")
    grpo, accelerate = yaml.safe_load_all(emit_trl(rl_estimate("qwen2.5-7b", 8, **job)))
    config = trl.GRPOConfig(**grpo, use_cpu=True)
    assert (config.beta, config.num_iterations, config.vllm_importance_sampling_correction,
            config.vllm_enable_sleep_mode, accelerate["fsdp_config"]["fsdp_version"]) == (0.0, 1, True, False, 1)
    knobs = dict(job, beta=0.04, num_iterations=2, vllm_importance_sampling_correction=False,
                 vllm_enable_sleep_mode=True, strategy="fsdp2")
    grpo, accelerate = yaml.safe_load_all(emit_trl(rl_estimate("qwen2.5-7b", 8, **knobs)))
    config = trl.GRPOConfig(**grpo, use_cpu=True)
    assert (config.beta, config.num_iterations, config.vllm_importance_sampling_correction,
            config.vllm_enable_sleep_mode, accelerate["fsdp_config"]["fsdp_version"]) == (0.04, 2, False, True, 2)


def _cli(*args):
    from tests.doctor.cli_run import cli_process

    return cli_process(list(args))


def test_rl_emits_the_best_configuration_and_refuses_what_trl_cannot_run():
    """`fsdp-plan rl --emit verl` prints the best configuration's script alone (its rank-1 offloads and utilization
    as overrides); TRL has no PPO: one line naming the field, exit 2."""
    job = ["--model", "qwen2.5-7b", "--gpus", "8", "--gpu", "h100-80gb", "--prompt-len", "1024", "--response-len",
           "4096", "--rollout-n", "8", "--train-batch", "256"]
    r = _cli("rl", *job, "--emit", "verl")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/usr/bin/env bash") and "python3 -m verl.trainer.main_ppo \\" in r.stdout
    assert "    actor_rollout_ref.rollout.gpu_memory_utilization=" in r.stdout
    r = _cli("rl", "estimate", *job, "--algorithm", "ppo", "--emit", "trl")
    assert r.returncode == 2
    assert "algorithm" in r.stderr and "grpo" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_verl_validates_the_reward_model_keys_and_its_migration_reads_the_legacy_ones(tmp_path, monkeypatch):
    """--reward-model's overrides (reward.reward_model.*) compose in verl 0.9.1's config, pass validate_config, and
    convert to the RewardModelConfig RewardModelManager builds its engine from, with the plan's model, engine, TP,
    utilization and lengths; the legacy reward_model.* keys that check also reads become the same config through
    verl's own migrate_legacy_reward_impl."""
    from hydra.errors import ConfigCompositionException

    omega_conf_to_dataclass = _verl_validation()[0].omega_conf_to_dataclass
    from verl.experimental.reward_loop import migrate_legacy_reward_impl

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    knobs = dict(CASE_1, reward_model="qwen2-7b", reward_model_gpu_memory_utilization=0.3)
    overrides = script_overrides(emit_verl(rl_estimate("qwen2-7b", 2, **knobs)))
    reward = {k: v for k, v in overrides.items() if "reward" in k}
    assert len(reward) == 7
    composed = _validated(overrides)
    rm = omega_conf_to_dataclass(composed.reward.reward_model)
    assert type(rm).__name__ == "RewardModelConfig"
    assert (rm.enable, rm.model_path, rm.rollout.name, rm.rollout.tensor_model_parallel_size,
            rm.rollout.gpu_memory_utilization, rm.rollout.prompt_length, rm.rollout.response_length) == (
        True, "qwen2-7b", "vllm", 2, 0.3, 1024, 1024)
    legacy = {k.replace("reward.reward_model.model_path", "reward_model.model.path")
               .replace("reward.reward_model.", "reward_model."): v for k, v in reward.items()}
    migrated = migrate_legacy_reward_impl(_compose([f"{k}={v}" for k, v in {**overrides, **legacy}.items()
                                                    if not k.startswith("reward.")]))
    assert migrated.reward.reward_model == composed.reward.reward_model
    # the FSDP reward worker's knobs of older verl are not keys of 0.9.1: no reward micro-batch, no param offload
    for gone in ("reward_model.micro_batch_size_per_gpu=4", "reward_model.model.fsdp_config.param_offload=True"):
        with pytest.raises(ConfigCompositionException):
            _compose([gone])


def test_verl_takes_the_reward_pool_and_no_sleep_level_is_written(tmp_path, monkeypatch):
    """--reward-model-enable-resource-pool's overrides compose and validate in verl 0.9.1 and convert to the
    RewardModelConfig whose n_gpus_per_node x nnodes the trainer makes its reward_pool ([4] * 1 GPUs), with the
    engine kept awake (free_cache_engine False: RewardModelManager sleeps it at start otherwise). Their legacy
    spelling migrates to the same. The engine's sleep level is verl's: a --sleep-level asked writes nothing."""
    omega_conf_to_dataclass = _verl_validation()[0].omega_conf_to_dataclass
    from verl.experimental.reward_loop import migrate_legacy_reward_impl

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    knobs = dict(CASE_1, reward_model="qwen2-7b", reward_model_enable_resource_pool=True,
                 reward_model_n_gpus_per_node=4, sleep_level=1, engine_version="current")
    script = emit_verl(rl_estimate("qwen2-7b", 2, **knobs))
    assert "sleep" not in script.split("set -euo")[0]
    overrides = script_overrides(script)
    reward = {k: v for k, v in overrides.items() if "reward" in k}
    assert len(reward) == 11
    composed = _validated(overrides)
    rm = omega_conf_to_dataclass(composed.reward.reward_model)
    assert (rm.enable, rm.enable_resource_pool, [rm.n_gpus_per_node] * rm.nnodes, rm.rollout.free_cache_engine,
            rm.rollout.tensor_model_parallel_size) == (True, True, [4], False, 2)
    legacy = {k.replace("reward.reward_model.model_path", "reward_model.model.path")
               .replace("reward.reward_model.", "reward_model."): v for k, v in reward.items()}
    migrated = migrate_legacy_reward_impl(_compose([f"{k}={v}" for k, v in {**overrides, **legacy}.items()
                                                    if not k.startswith("reward.")]))
    assert migrated.reward.reward_model == composed.reward.reward_model


def test_trl_server_config_and_launch_line_accepted_by_trl():
    """vllm_mode server (cost_models/rl_trl_server.py): GRPOConfig takes the document (TRL's server keys; the colocated
    engine's left out), and TRL's own `trl vllm-serve` parser takes the commented launch line - its TP, DP,
    utilization and length, the vllm serve flags it forwards as they are (build_command appends them). A generation
    batch below the mini-batch is TRL's steps_per_generation below gradient_accumulation_steps: 128 x 5 / 2 / 16 =
    20 against 40, two generations an optimizer step."""
    trl = pytest.importorskip("trl")
    import shlex

    from trl.scripts.vllm_serve import build_command, make_parser

    job = dict(CASE_1, framework="trl", strategy="fsdp2", engine_version="current", enforce_eager=False,
               max_num_seqs=512, vllm_mode="server", vllm_server_host="10.0.0.2", rollout_tp=2,
               vllm_server_data_parallel_size=1, gpu_memory_utilization=0.85)
    text = emit_trl(rl_estimate("qwen2-7b", 2, **job))
    grpo, accelerate = yaml.safe_load_all(text)
    config = trl.GRPOConfig(**grpo, use_cpu=True)
    assert (config.vllm_mode, config.vllm_server_host, config.vllm_max_model_length) == ("server", "10.0.0.2", 2048)
    assert "vllm_tensor_parallel_size" not in grpo and "vllm_gpu_memory_utilization" not in grpo
    line = next(ln for ln in text.splitlines() if "trl vllm-serve" in ln).lstrip("# ")
    args, extra = make_parser().parse_args_and_config(shlex.split(line)[2:], return_remaining_strings=True)
    assert (args.model, args.tensor_parallel_size, args.data_parallel_size, args.gpu_memory_utilization,
            args.max_model_len) == ("qwen2-7b", 2, 1, 0.85, 2048)
    assert extra == ["--max-num-seqs", "512", "--max-num-batched-tokens", "8192"]
    assert build_command(args, extra)[-4:] == extra
    several = dict(CASE_1, framework="trl", strategy="fsdp2", engine_version="current", enforce_eager=False,
                   max_num_seqs=256, train_batch=128)
    config = trl.GRPOConfig(**next(yaml.safe_load_all(emit_trl(rl_estimate("qwen2-7b", 2, **several)))),
                            use_cpu=True)
    assert (config.steps_per_generation, config.gradient_accumulation_steps) == (20, 40)


def test_sglangs_lora_slots_reach_the_server_args_verl_builds(tmp_path, monkeypatch):
    """--max-loras-per-batch 1 (SGLang serving the adapter): the override --emit verl writes, with `+` (rollout.yaml
    declares engine_kwargs.sglang empty: Hydra refuses to override a key it lacks, pinned below), composes, passes
    verl's validation, and verl's RolloutConfig carries it in engine_kwargs["sglang"]. verl 0.9.1's launch_server
    (async_sglang_server.py, read, not imported: it imports sglang) spreads that dict into ServerArgs' arguments and
    its LoRA update sets the rank and targets, not the slots; one slot serves verl's one adapter: every generate
    request names it, and the weight sync (sglang_rollout.py ServerAdapter.update_weights) unloads the old adapter
    before loading the new one."""
    import pathlib

    from hydra.errors import ConfigCompositionException

    from planner.emit.verl import MAX_LORAS

    omega_conf_to_dataclass = _verl_validation()[0].omega_conf_to_dataclass
    import verl

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    knobs = dict(OFFLOAD_POLICY, offload_policy=False, finetune="lora", engine="sglang", max_loras_per_batch=1)
    script = emit_verl(rl_estimate("qwen2.5-7b", 8, **knobs))
    assert f"    +{MAX_LORAS}=1 \\" in script.splitlines()
    overrides = script_overrides(script.replace("MODEL_PATH=qwen2.5-7b", "MODEL_PATH=" + _model_dir(tmp_path,
                                                                                                  "qwen2.5-7b")))
    assert overrides.pop(MAX_LORAS) == "1"
    composed = _validated(overrides, f"+{MAX_LORAS}=1")
    rollout = omega_conf_to_dataclass(composed.actor_rollout_ref.rollout)
    assert rollout.name == "sglang" and rollout.engine_kwargs["sglang"] == {"max_loras_per_batch": 1}
    with pytest.raises(ConfigCompositionException):
        _compose([f"{MAX_LORAS}=1"])
    sglang = pathlib.Path(verl.__file__).parent / "workers" / "rollout" / "sglang_rollout"
    server = (sglang / "async_sglang_server.py").read_text()
    launch = server[server.index("async def launch_server"):server.index("server_args = ServerArgs(**args)")]
    assert 'engine_kwargs = self.config.get("engine_kwargs", {}).get("sglang", {})' in launch
    assert "**engine_kwargs," in launch and "max_loras_per_batch" not in launch
    assert "generate_request.lora_path = SGLANG_LORA_NAME" in server
    sync = (sglang / "sglang_rollout.py").read_text()
    assert sync.index("unload_lora_adapter(SGLANG_LORA_NAME)") < sync.index("load_lora_adapter_from_tensor(req)")


def test_attention_lora_targets_reach_verls_model_config_and_sglangs_pool(tmp_path, monkeypatch):
    """--lora-targets attention (issue 28): --emit verl writes model.target_modules as the attention projections'
    list, quoted for the shell; it composes, passes verl's validation, and HFModelConfig (its __post_init__ takes a
    string or a list of strings) holds the list verl hands PEFT; verl's own sglang_lora_target_modules passes it to
    SGLang as is, which the planner's pool read as priced (rollout_lora_sglang.sglang_target_modules: qkv_proj,
    o_proj). All-linear stays verl's default word."""
    from omegaconf import OmegaConf

    import ast
    import pathlib

    omega_conf_to_dataclass = _verl_validation()[0].omega_conf_to_dataclass
    import verl

    from cost_models.rollout_lora_sglang import sglang_target_modules
    from planner.emit.verl import TARGET_MODULES

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    knobs = dict(OFFLOAD_POLICY, offload_policy=False, finetune="lora", engine="sglang", lora_targets="attention")
    e = rl_estimate("qwen2.5-7b", 8, **knobs)
    script = emit_verl(e)
    assert f"    {TARGET_MODULES}='[q_proj,k_proj,v_proj,o_proj]' \\" in script.splitlines()
    overrides = script_overrides(script.replace("MODEL_PATH=qwen2.5-7b", "MODEL_PATH=" + _model_dir(tmp_path,
                                                                                                  "qwen2.5-7b")))
    assert overrides[TARGET_MODULES] == "[q_proj,k_proj,v_proj,o_proj]"
    composed = _validated(overrides, "+actor_rollout_ref.model.load_tokenizer=False")
    assert list(OmegaConf.select(composed, TARGET_MODULES)) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = omega_conf_to_dataclass(composed.actor_rollout_ref.model)
    assert type(model).__name__ == "HFModelConfig" and model.lora_rank == 32
    # verl's function, run from its source (its module imports the server stack, not in the test install)
    utils = pathlib.Path(verl.__file__).parent / "workers" / "rollout" / "sglang_rollout" / "utils.py"
    source = next(n for n in ast.parse(utils.read_text()).body
                  if isinstance(n, ast.FunctionDef) and n.name == "sglang_lora_target_modules")
    scope = {"Any": object}
    exec(compile(ast.Module([source], []), str(utils), "exec"), scope)
    served = scope["sglang_lora_target_modules"](model.target_modules)
    assert sglang_target_modules(served) == e.engine_settings.lora_target_modules == {"qkv_proj", "o_proj"}
    default = script_overrides(emit_verl(rl_estimate("qwen2.5-7b", 8, **dict(knobs, lora_targets="all-linear"))))
    assert default[TARGET_MODULES] == "all-linear" == OmegaConf.select(_compose([]), TARGET_MODULES)
