"""`--emit verl` and `--emit trl` loaded by the frameworks' own config code: verl 0.9.1's Hydra config
(verl/trainer/config/ppo_trainer.yaml composed with the script's overrides through Hydra's compose API; Hydra
refuses a key the config does not have) and TRL 1.16's GRPOConfig. verl's dataclass validation
(omega_conf_to_dataclass) is not run: importing verl.workers.config runs verl/__init__.py, which imports ray.
Needs: pip install --no-deps verl==0.9.1 hydra-core==1.3.8 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 trl==1.16.0
(skipped without them)."""

import importlib.util
import os
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


def _compose(overrides: list[str]):
    hydra = pytest.importorskip("hydra")
    spec = importlib.util.find_spec("verl")   # not imported: verl/__init__.py needs ray
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
        assert len(overrides) == 34   # counted in the script by hand
        assert OmegaConf.select(composed, "actor_rollout_ref.actor.fsdp_config.param_offload") is True
        assert OmegaConf.select(composed, "actor_rollout_ref.rollout.gpu_memory_utilization") == 0.6
    else:   # the critic's keys are verl 0.9's (critic.fsdp.*), the nodes 16 / 8
        assert OmegaConf.select(composed, "critic.fsdp.param_offload") is True
        assert OmegaConf.select(composed, "trainer.nnodes") == 2
        assert OmegaConf.select(composed, "algorithm.adv_estimator") == "gae"


def test_hydra_refuses_a_key_verl_does_not_have():
    """What makes the test above a check: a misspelt key does not compose."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose(["actor_rollout_ref.actor.ppo_micro_batch_per_gpu=16"])


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
