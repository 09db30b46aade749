"""`--emit verl`: an RL configuration as verl's launch script, `python3 -m verl.trainer.main_ppo` with one Hydra
override per knob the plan priced, under verl 0.9's key names (verl/trainer/config/ppo_trainer.yaml and the
actor / ref / rollout / critic / model YAMLs it composes). What verl has no key for (the GPU type, the vLLM
version, mean lengths) rides in a `# fsdp-plan:` comment line of the planner's own flags, which `fsdp-plan check`
reads back (planner/doctor/readers/verl.py), so the round trip prices what was planned. The engine's sleep level is
verl's own choice (cost_models/rl_sleep.py): not written.

This module owns both directions of the mapping: KEYS (verl key <-> request field) and the comment's flags."""

from __future__ import annotations

import json
import shlex
import textwrap

from cost_models.rl_lora_targets import verl_value
from cost_models.rollout_lora_sglang import SGLANG_MAX_LORAS_PER_BATCH
from cost_models.units import GiB
from planner.emit.common import _comment, cpu_step_threads
from planner.emit.rl_flags import MARK, planner_flags
from planner.line_width import LINE_WIDTH

A = "actor_rollout_ref."
# verl keys that carry one request field as it is (the rest: overrides() below, by rule)
KEYS = {
    "data.train_batch_size": "train_batch",
    "data.max_prompt_length": "prompt_len",
    "data.max_response_length": "response_len",
    A + "actor.strategy": "strategy",
    A + "actor.use_dynamic_bsz": "use_dynamic_bsz",
    A + "actor.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",  # copied into fsdp_config
    #                                            and read by the ref (verl workers/config/actor.py, dp_ref.yaml)
    A + "actor.fsdp_config.param_offload": "param_offload",
    A + "actor.fsdp_config.optimizer_offload": "optimizer_offload",
    A + "actor.fsdp_config.fsdp_size": "fsdp_size",
    A + "actor.fsdp_config.offload_policy": "offload_policy",   # read by verl's FSDP2 branch only
    A + "actor.use_torch_compile": "use_torch_compile",
    A + "actor.entropy_from_logits_with_chunking": "entropy_chunking",
    A + "ref.fsdp_config.param_offload": "ref_param_offload",
    A + "model.enable_gradient_checkpointing": "gradient_checkpointing",
    A + "model.use_remove_padding": "use_remove_padding",
    A + "model.use_shm": "use_shm",
    A + "rollout.name": "engine",
    A + "rollout.tensor_model_parallel_size": "rollout_tp",
    A + "rollout.gpu_memory_utilization": "gpu_memory_utilization",
    A + "rollout.n": "rollout_n",
    A + "rollout.max_num_seqs": "max_num_seqs",
    A + "rollout.max_num_batched_tokens": "max_num_batched_tokens",
    A + "rollout.enforce_eager": "enforce_eager",
    A + "rollout.layered_summon": "layered_summon",
    # verl 0.9.1 passes it to the engine as is; dummy (rollout.yaml's default) starts it with random weights and
    # makes a LoRA adapter's first sync send the base (engine_workers.py base_sync_done = "dummy" not in it), under
    # which layered_summon raises (cost_models/rl_strategy.py sync_refusals)
    A + "rollout.load_format": "load_format",
}
# PPO's critic (verl 0.9 dp_critic.yaml: its FSDP engine config under critic.fsdp)
CRITIC_KEYS = {"critic.fsdp.param_offload": "critic_param_offload",
               "critic.fsdp.optimizer_offload": "critic_optimizer_offload",
               # FSDP2's CPUOffloadPolicy for the critic (read by verl's FSDP2 branch only, as the actor's)
               "critic.fsdp.offload_policy": "critic_offload_policy",
               # verl's critic runs Ulysses 1 unless told (dp_critic.yaml): written always, the degree priced
               "critic.ulysses_sequence_parallel_size": "critic_ulysses_sequence_parallel_size"}
# a reward model (verl 0.9.1: its own engine, reward.reward_model.*; the legacy reward_model.* keys are migrated
# there by experimental/reward_loop migrate_legacy_reward_impl, and check reads both)
RM = "reward.reward_model."
REWARD_KEYS = {RM + "rollout.tensor_model_parallel_size": "reward_model_tp",
               RM + "rollout.gpu_memory_utilization": "reward_model_gpu_memory_utilization"}
# its own resource pool (written with it only; verl's trainer otherwise sets n_gpus_per_node / nnodes to the trainer's)
POOL_KEYS = {RM + "enable_resource_pool": "reward_model_enable_resource_pool",
             RM + "n_gpus_per_node": "reward_model_n_gpus_per_node", RM + "nnodes": "reward_model_nnodes"}
# on its own pool the engine must stay awake: RewardModelManager sleeps it at start under free_cache_engine (true by
# default) and the streaming path that scores there never wakes it (cost_models/rl_reward.py)
POOL_AWAKE = RM + "rollout.free_cache_engine"
# the launch environment verl's workers get: Ray's job-wide env_vars (ray_env below), added with Hydra's `+`
RAY_ENV = "ray_kwargs.ray_init.runtime_env.env_vars."
ENV_KEYS = {RAY_ENV + "OMP_NUM_THREADS": "omp_num_threads"}
# request fields verl has no key for: written as the planner's flags in the comment line
COMMENTED = ("gpu", "gpu_memory", "cpu_ram_per_node", "internode_gbps", "intra_node_gb_per_s", "pcie_gb_per_s",
             "power_limit_w", "host_cores_per_node", "host_memory_gb_per_s", "host_thread_gb_per_s", "omp_num_threads",
             "engine_version", "mean_prompt_len", "mean_response_len")
# verl 0.9's defaults (verl/trainer/config/_generated_ppo_trainer.yaml) where they differ from the request's: a
# script that leaves a key out runs verl's value, and check prices that
VERL_DEFAULTS = {"data.max_prompt_length": 512, "data.max_response_length": 512, "data.train_batch_size": 1024,
                 A + "rollout.n": 1, A + "actor.ppo_mini_batch_size": 256, A + "ref.fsdp_config.param_offload": False,
                 "algorithm.adv_estimator": "gae"}
ADV_ESTIMATORS = {"grpo": "grpo", "ppo": "gae"}   # algorithm.adv_estimator (verl core_algos.AdvantageEstimator)
# verl 0.9.1's critic where a script leaves it out (critic/dp_critic.yaml strategy, engine/fsdp.yaml model_dtype):
# check prices these (--emit verl writes the priced ones always)
CRITIC_DEFAULTS = {"critic.strategy": "fsdp", "critic.fsdp.model_dtype": "fp32"}
# model.lora.merge (trainer/config/model/hf_model.yaml, default False): written and read for a LoRA actor only
LORA_MERGE = A + "model.lora.merge"
# model.target_modules (hf_model.yaml, default all-linear; cost_models/rl_lora_targets.py): a LoRA actor's, as priced
TARGET_MODULES = A + "model.target_modules"
# SGLang's LoRA pool slots: verl 0.9.1 merges rollout.engine_kwargs.sglang into SGLang's ServerArgs as is
# (async_sglang_server.py launch_server: **engine_kwargs, then enable_lora / max_lora_rank / lora_target_modules,
# which leave it alone); rollout.yaml declares engine_kwargs.sglang empty, so the override adds the key: `+`
MAX_LORAS = A + "rollout.engine_kwargs.sglang.max_loras_per_batch"


def hydra_value(value) -> str:
    """As verl's example scripts write values (Hydra's override grammar reads True / False, [a,b] a list: quoted for
    the shell, whose globbing would read the brackets)."""
    text = str(value)
    return shlex.quote(text) if text.startswith("[") else text


def target_modules_value(settings, model) -> str:
    """model.target_modules as priced, in Hydra's words: all-linear, or the list of the attention projections."""
    value = verl_value(settings.lora_targets, model)
    return value if isinstance(value, str) else "[" + ",".join(value) + "]"


def overrides(r, model_path: str, settings, model) -> list[tuple[str, object]]:
    """Every priced knob as (verl key, value), in the order of verl's examples; `settings`: the priced RlSettings
    (the critic's strategy and dtype as resolved, the LoRA targets), `model` its ModelSpec."""
    mini = r.ppo_mini_batch_size or r.train_batch
    out = [("algorithm.adv_estimator", ADV_ESTIMATORS[r.algorithm]), (A + "model.path", model_path)]
    out += [(k, getattr(r, f)) for k, f in KEYS.items()]
    out += [(A + "actor.ppo_mini_batch_size", mini), (A + "actor.fsdp_config.model_dtype", r.actor_dtype),
            # a reference exists only with a KL term (verl ray_trainer: use_kl_loss or use_kl_in_reward); the
            # plan prices one, as verl's GRPO examples run (kl_loss_coef 0.001, low_var_kl)
            (A + "actor.use_kl_loss", True),
            # verl 0.9 computes the update's entropy only when asked (ray_trainer._update_actor)
            (A + "actor.calculate_entropy", r.entropy),
            (A + "model.lora_rank", r.lora_rank if r.finetune == "lora" else 0)]
    if r.finetune == "lora":
        out += [(TARGET_MODULES, target_modules_value(settings, model)), (LORA_MERGE, settings.lora_merge)]
    if r.engine == "sglang" and r.max_loras_per_batch not in (None, SGLANG_MAX_LORAS_PER_BATCH):
        out.append(("+" + MAX_LORAS, r.max_loras_per_batch))
    if r.use_dynamic_bsz:
        budget = r.log_prob_max_token_len_per_gpu or r.ppo_max_token_len_per_gpu
        out += [(A + "actor.ppo_max_token_len_per_gpu", r.ppo_max_token_len_per_gpu),
                (A + "rollout.log_prob_max_token_len_per_gpu", budget),
                (A + "ref.log_prob_max_token_len_per_gpu", budget)]
    else:
        micro = r.log_prob_micro_batch_size_per_gpu or r.ppo_micro_batch_size_per_gpu
        out += [(A + "actor.ppo_micro_batch_size_per_gpu", r.ppo_micro_batch_size_per_gpu),
                (A + "rollout.log_prob_micro_batch_size_per_gpu", micro),
                (A + "ref.log_prob_micro_batch_size_per_gpu", micro)]
    if r.algorithm == "ppo":  # the critic: the actor's model and batch, its own strategy and dtype as priced
        out += [("critic.model.path", model_path), ("critic.strategy", settings.critic_strategy),
                ("critic.fsdp.model_dtype", settings.critic_dtype),
                ("critic.model.enable_gradient_checkpointing", r.gradient_checkpointing),
                ("critic.model.use_remove_padding", r.use_remove_padding)]
        out += [(k, getattr(r, f)) for k, f in CRITIC_KEYS.items() if getattr(r, f) is not None]
        if r.critic_ulysses_sequence_parallel_size is None:
            out.append(("critic.ulysses_sequence_parallel_size", r.ulysses_sequence_parallel_size))
        out.append(("critic.ppo_max_token_len_per_gpu", r.ppo_max_token_len_per_gpu) if r.use_dynamic_bsz else
                   ("critic.ppo_micro_batch_size_per_gpu", r.ppo_micro_batch_size_per_gpu))
    if r.reward_model is not None:   # served by the actor's engine kind at the data's lengths (rl_reward.py)
        out += [(RM + "enable", True), (RM + "model_path", r.reward_model), (RM + "rollout.name", r.engine),
                *((k, getattr(r, f)) for k, f in REWARD_KEYS.items()),
                (RM + "rollout.prompt_length", r.prompt_len), (RM + "rollout.response_length", r.response_len)]
        if r.reward_model_enable_resource_pool:
            out += [*((k, getattr(r, f)) for k, f in POOL_KEYS.items()), (POOL_AWAKE, False)]
    c = r.cluster
    per_node = c.gpus_per_node or min(c.gpus, 8)
    out += [("trainer.n_gpus_per_node", per_node), ("trainer.nnodes", c.gpus // per_node)]
    return out


def ray_env(estimate) -> list[tuple[str, str]]:
    """The variables verl's workers must run with (a CPU optimizer step's threads, common.cpu_step_threads: the actor's
    or the critic's CPUOffloadPolicy) as (override, shell word). verl 0.9.1's main_ppo merges
    ray_kwargs.ray_init.runtime_env over get_ppo_ray_runtime_env()'s into ray.init, and Ray merges those job-wide
    env_vars key by key into each worker's own runtime_env (RayWorkerGroup._create_worker's RANK, WORLD_SIZE...;
    ray/runtime_env/runtime_env.py _merge_runtime_env) on every node; Ray's default of 1 (set_omp_num_threads_if_unset)
    applies only where unset. Ray takes strings only: Hydra's quoted "8", quoted again for the shell."""
    m = estimate.memory
    cpu_step = m.actor.on_host or (m.critic is not None and m.critic.on_host)
    env = cpu_step_threads(estimate.cluster, cpu_step, "ray")
    return [("+" + RAY_ENV + name, shlex.quote(json.dumps(value))) for name, value in env.items()]


def emit_verl(estimate) -> str:
    """The launch script for an RlEstimate (planner/rl/evaluate.py)."""
    r, m = estimate.request, estimate.model
    notes = [
        f"verl GRPO/PPO launch for {m.name} on {estimate.cluster.n_gpus} x {estimate.cluster.gpu.id}, priced by "
        f"fsdp-plan: peak {estimate.memory.peak.reserved_bytes / GiB:.1f} GiB per GPU in "
        f"{estimate.memory.peak.name}",
        "verl 0.9 keys (verl/trainer/config/ppo_trainer.yaml); data.train_files / val_files are verl's GSM8K "
        "defaults: add yours, with the reward",
        "MODEL_PATH is the planner's model name: set your checkpoint's path or Hub id (check reads the model from "
        "the fsdp-plan line below)", *([] if estimate.fits else ["does NOT fit: " + "; ".join(estimate.reasons)])]
    wrapped = [part for n in notes for part in textwrap.wrap(n, LINE_WIDTH - 2)]
    lines = ["#!/usr/bin/env bash", _comment(wrapped), f"# {MARK} {planner_flags(r, COMMENTED)}",
             "set -euo pipefail", "", f"MODEL_PATH={shlex.quote(str(r.model))}", "",
             "python3 -m verl.trainer.main_ppo \\"]
    for key, value in overrides(r, "$MODEL_PATH", estimate.settings, m):
        lines.append(f"    {key}={hydra_value(value)} \\")
    lines += [f"    {key}={word} \\" for key, word in ray_env(estimate)]
    lines.append('    "$@"')
    return "\n".join(lines) + "\n"
