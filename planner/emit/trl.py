"""`--emit trl`: an RL configuration as TRL 1.16's GRPOConfig (YAML, `trl grpo --config` / GRPOConfig(**yaml))
for vLLM colocated in the trainer processes (or, vllm_mode server, the `trl vllm-serve` line as a comment:
planner/emit/trl_server.py), and the accelerate FSDP2 config that shards the actor
(planner/emit/trainers.emit_accelerate), as two YAML documents. The batch in TRL's terms (trl/trainer/
grpo_config.py __post_init__): per_device_train_batch_size completions per micro-step, gradient_accumulation_steps
micro-steps per optimizer step (verl's mini-batch), steps_per_generation micro-steps per generation (verl's
train batch); what TRL has no key for rides in the `# fsdp-plan:` line (planner/emit/rl_flags.py). The keys
that decide TRL's passes (beta, num_iterations, vllm_importance_sampling_correction, vllm_enable_sleep_mode:
cost_models/rl_schedule.py) are written as priced: the request's, else TRL's defaults for a TRL estimate, and for a
verl one what verl runs (a reference, the engine asleep)."""

from __future__ import annotations

import textwrap

import yaml

from cost_models.rl_lora_targets import verl_value
from cost_models.rl_schedule import TRL_CANNOT
from cost_models.units import GiB
from planner.emit.rl_flags import MARK, planner_flags
from planner.emit.trl_server import serve_line
from planner.errors import PlannerError
from planner.line_width import LINE_WIDTH

# request fields neither GRPOConfig nor accelerate's config holds (those TRL sets itself, rl_schedule.TRL_SETS, are not
# written: a TRL estimate holds TRL's values, and a verl plan in TRL's terms runs them)
COMMENTED = ("gpu", "gpu_memory", "cpu_ram_per_node", "internode_gbps", "intra_node_gb_per_s", "pcie_gb_per_s",
             "power_limit_w", "host_cores_per_node", "host_memory_gb_per_s", "host_thread_gb_per_s", "omp_num_threads",
             "mean_prompt_len", "mean_response_len", "finetune", "lora_rank", "lora_targets")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}   # model_init_kwargs.dtype, as transformers names them
KL_BETA = 0.001   # a verl plan's reference: a KL term, so that TRL loads it (verl's kl_loss_coef in its examples)


def refuse(r) -> None:
    """What TRL's GRPOTrainer cannot run, one line each (cost_models/rl_schedule.py TRL_CANNOT)."""
    for name, (runs, why) in TRL_CANNOT.items():
        if getattr(r, name) != runs:
            raise PlannerError(name, f"{getattr(r, name)}: {why}; valid: {runs}")


def priced_passes(r) -> dict:
    """The GRPOConfig keys that decide TRL's passes, as the estimate priced them."""
    trl = r.framework == "trl"
    return {"beta": r.beta if r.beta is not None else 0.0 if trl else KL_BETA,
            "num_iterations": r.num_iterations or 1,
            "vllm_importance_sampling_correction": r.vllm_importance_sampling_correction is not False,
            "vllm_enable_sleep_mode": r.vllm_enable_sleep_mode if r.vllm_enable_sleep_mode is not None else not trl}


def grpo_config(e) -> dict:
    """GRPOConfig's fields for the estimate (its batch plan gives the micro-steps)."""
    r, b = e.request, e.batch
    per_generation = r.train_batch * r.rollout_n // (b.data_parallel * r.ppo_micro_batch_size_per_gpu)
    # server mode (TRL's vllm_mode): the server's TP and utilization are its launch line's (trl_server.serve_line)
    engine = ({"vllm_mode": "server", **({"vllm_server_host": r.vllm_server_host} if r.vllm_server_host else {})}
              if r.vllm_mode == "server" else
              {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": r.gpu_memory_utilization,
               "vllm_tensor_parallel_size": r.rollout_tp})
    return {
        "output_dir": f"grpo-{e.model.name}",
        "use_vllm": True, **engine,
        "vllm_max_model_length": r.prompt_len + r.response_len,
        "num_generations": r.rollout_n,
        "per_device_train_batch_size": r.ppo_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": b.micro_batches_per_mini,
        "steps_per_generation": per_generation,
        "max_completion_length": r.response_len,
        "gradient_checkpointing": r.gradient_checkpointing,
        "bf16": True,
        "model_init_kwargs": {"dtype": DTYPES[r.actor_dtype]},
        **priced_passes(r),
    }


def _fsdp(e):
    from cost_models.specs import FsdpConfig

    r = e.request
    # mixed bf16 over an fp32 actor, else pure bf16; TRL's gradient_checkpointing recomputes, not accelerate's
    return FsdpConfig(sharding="FULL_SHARD", precision="bf16" if r.actor_dtype == "fp32" else "bf16-pure",
                      offload=r.param_offload, ac_every=0)


def emit_trl(e) -> str:
    from planner.emit.trainers import emit_accelerate

    r = e.request
    refuse(r)
    if r.param_offload != r.optimizer_offload:
        raise PlannerError("optimizer_offload", "accelerate's fsdp_offload_params offloads params and optimizer "
                                                "together: set --param-offload and --optimizer-offload alike")
    notes = [f"TRL GRPO for {e.model.name} on {e.cluster.n_gpus} x {e.cluster.gpu.id}, vLLM "
             f"{'server' if r.vllm_mode == 'server' else 'colocated'}, priced by "
             f"fsdp-plan: peak {e.memory.peak.reserved_bytes / GiB:.1f} GiB per GPU in {e.memory.peak.name}",
             "two files: the first document is the GRPOConfig (trl grpo --config, or GRPOConfig(**it)), the second "
             "accelerate's (accelerate launch --config_file)"]
    if r.finetune == "lora":
        targets = verl_value(e.settings.lora_targets, e.model)   # peft's LoraConfig takes verl's values
        notes.append(f"LoRA: pass peft_config=LoraConfig(r={r.lora_rank}, target_modules={targets!r}) to "
                     "GRPOTrainer")
    if r.vllm_mode == "server":
        notes.append(f"vllm_mode server: start the server first, on {r.rollout_tp * (r.vllm_server_data_parallel_size or 1)}"
                     " GPUs the trainer does not use (CUDA_VISIBLE_DEVICES), on the host vllm_server_host names "
                     "(--model: set your checkpoint's path or Hub id), with:")
    comment = "\n".join(f"# {line}" for n in notes for line in textwrap.wrap(n, LINE_WIDTH - 2))
    if r.vllm_mode == "server":
        comment += f"\n#   {serve_line(r)}"
    flags = planner_flags(r, COMMENTED)
    grpo = yaml.safe_dump(grpo_config(e), sort_keys=False, width=LINE_WIDTH)
    # a TRL estimate's own FSDP version; a verl plan in TRL's terms: FSDP2 (it holds at most FSDP1's memory)
    version = 1 if r.framework == "trl" and r.strategy == "fsdp" else 2
    accelerate = emit_accelerate(_fsdp(e), e.model, e.cluster, fsdp_version=version)
    return f"{comment}\n# {MARK} {flags}\n{grpo}---\n{accelerate}"
