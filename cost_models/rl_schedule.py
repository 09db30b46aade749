"""Which phases an RL framework runs, in its order, and what its engine and reference hold between them, as data that
rl_phases.py and rl_time.py read: verl's (every phase rl_phases builds, in PHASES' order) and TRL 1.16's
GRPOTrainer with vLLM colocated, each rule read from TRL's installed code:

- order (grpo_trainer.py _prepare_inputs: a generation every steps_per_generation x num_iterations micro-steps):
  the weight sync (_generate_single_turn: sync_weights when global_step moved), the generation, the old log-probs,
  the reference's (_generate_and_score_completions), then the micro-steps (update, gradients accumulated) with an
  optimizer step every gradient_accumulation_steps (transformers' Trainer), the checkpoint at save_steps. A priced
  step is the longer of a generation's micro-steps and an optimizer step's (trl_cycle): with steps_per_generation x
  num_iterations below gradient_accumulation_steps, several generations (each its old / reference passes) per
  optimizer step, one sync (global_step moves once) - one a generation with the colocated engine asleep
  (generate() pushes the weights again after a level-2 sleep);
- the old log-probs (_generate_and_score_completions): when gradient_accumulation_steps % (steps_per_generation x
  num_iterations) != 0, or with vLLM and vllm_importance_sampling_correction (GRPOConfig's default True: with vLLM
  they always run); else _compute_loss uses per_token_logps.detach();
- the reference (GRPOTrainer.__init__): only when beta != 0 (GRPOConfig's default 0.0); with PEFT the actor with
  its adapter disabled (use_adapter(model, None)), else a second model built with the actor's model_init_kwargs
  (its dtype: rl_actor.reference_bytes) and sharded by trl/models/utils.py prepare_fsdp: FSDP2 fully_shard on the
  root alone - one unit, whose forward gathers the whole model in the compute dtype beside the all-gather's buffer
  while it copies out (traced: tests/unit/test_rl_trl.py) - or FSDP1 with accelerate's auto-wrap policy (the
  actor's units); offloaded with the actor (accelerate's fsdp_offload_params: rl_settings.RlSettings._trl);
- the engine (generation/vllm_generation.py VLLMGeneration._init_vllm): built in GRPOTrainer.__init__, before the
  Trainer's train loop shards the actor (accelerator.prepare; transformers' Trainer leaves an FSDP model off the
  device) and before prepare_fsdp shards the reference: its KV budget and start check see none of the trainer's
  states. vllm_enable_sleep_mode (False by default): without it the engine's weights and KV cache stay on the GPU
  through every phase; with it sleep(level=2) after its start and after each generation, and the sync wakes the
  weights only (sync_weights: wake_up(tags=["weights"])), generate() the KV cache after (tags=["kv_cache"]).
  vllm_mode="server": no engine on the trainer's GPUs at any phase (rl_trl_server.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .rl_batch import BatchPlan
from .rl_settings import RlSettings


@dataclass(frozen=True)
class Schedule:
    phases: tuple[str, ...] | None = None   # the phases run, in order; None: every phase rl_phases builds (verl)
    engine_first: bool = False      # the engine starts before the trainer's states reach the GPU
    engine_idle: bool = False       # its weights and KV cache stay on the GPU outside generation (no sleep)
    sync_wakes_kv: bool = False     # the weight sync holds the KV cache too
    log_prob_passes: int = 2        # forward-only passes over the step's sequences: the old log-probs, the reference
    updates_per_generation: int = 1     # passes of the update over one generation batch
    whole_reference: bool = False   # the reference's forward gathers it whole (one FSDP2 unit)
    # TRL (trl_cycle): generations in a priced step, its update's (micro-steps, optimizer steps: its iterations
    # counted; None: the batch plan's mini-batches, updates_per_generation times) and its weight syncs
    generations: float = 1.0
    update_steps: tuple[float, float] | None = None
    syncs: float = 1.0
    engine_on_trainer: bool = True  # False: TRL's vLLM server, on GPUs of its own


def trl_steps(batch: BatchPlan) -> tuple[int, int]:
    """(gradient_accumulation_steps, steps_per_generation) in TRL's terms: micro-steps per optimizer step and per
    generation (planner/emit/trl.py writes them from the same batch plan): a rank's sequences of a mini-batch and of
    a generation over those of a micro-batch."""
    accumulation = max(1, batch.micro_batches_per_mini)
    return accumulation, max(1, batch.step_seqs_per_rank * accumulation // max(1, batch.mini_batch_seqs_per_rank))


def trl_cycle(settings: RlSettings, batch: BatchPlan) -> tuple[float, float, float]:
    """(generations, micro-steps, optimizer steps) in one priced step of TRL: a generation batch serves
    steps_per_generation x num_iterations micro-steps (grpo_trainer.py _prepare_inputs: generate_every), an optimizer
    step takes gradient_accumulation_steps; the step is the longer of the two, so one of generations and optimizer
    steps is 1 (an average where neither divides the other)."""
    accumulation, per_generation = trl_steps(batch)
    served = per_generation * settings.num_iterations
    micro_steps = max(served, accumulation)
    return micro_steps / served, micro_steps, micro_steps / accumulation


def trl_old_log_probs(settings: RlSettings, batch: BatchPlan) -> bool:
    """grpo_trainer.py _generate_and_score_completions: the old log-probs' condition."""
    accumulation, per_generation = trl_steps(batch)
    return accumulation % (per_generation * settings.num_iterations) != 0 or settings.importance_sampling


def schedule_of(settings: RlSettings, engine_version: str, batch: BatchPlan) -> Schedule:
    if settings.framework != "trl":   # verl 0.8-era: wake_up() wakes the KV cache too (rl_phases.py docstring)
        return Schedule(sync_wakes_kv=engine_version == "0.8")
    old, ref = trl_old_log_probs(settings, batch), settings.beta != 0
    phases = ("init", "weight_sync", "rollout") + ("log_prob",) * old + ("ref_log_prob",) * ref + (
        "update", "optimizer_step", "checkpoint")
    generations, micro_steps, optimizer_steps = trl_cycle(settings, batch)
    colocated = not settings.server
    return Schedule(phases=phases, engine_first=colocated, engine_idle=colocated and not settings.sleep_mode,
                    sync_wakes_kv=colocated and not settings.sleep_mode, log_prob_passes=old + ref,
                    updates_per_generation=settings.num_iterations,
                    whole_reference=ref and not settings.lora and settings.strategy == "fsdp2",
                    generations=generations, update_steps=(micro_steps, optimizer_steps),
                    syncs=generations if colocated and settings.sleep_mode else 1.0, engine_on_trainer=colocated)


# What TRL's engine runs whatever the request says (vllm_generation.py _init_vllm; trl/import_utils.py accepts vLLM
# 0.22-0.31: rollout_engine.py's "current" rule); max_num_seqs: trl_max_num_seqs
TRL_ENGINE = dict(version="current", max_num_batched_tokens=4096, enforce_eager=False)


def trl_max_num_seqs(micro_batch: int, tp: int, batch: BatchPlan) -> int:
    """GRPOTrainer.__init__: per_device_train_batch_size x vllm_tensor_parallel_size x steps_per_generation."""
    return micro_batch * tp * trl_steps(batch)[1]


# The request's knobs (planner/rl/request.py) TRL does not read: what it runs instead (None: derived, or no value of
# its own) and where it says so. planner/rl/evaluate.py refuses a value set that TRL does not run; TRL_CANNOT too
# under --emit trl (planner/emit/trl.py).
TRL_CANNOT = {
    "algorithm": ("grpo", "TRL's GRPOTrainer runs GRPO only"),
    "engine": ("vllm", "TRL generates with vLLM"),
    "ulysses_sequence_parallel_size": (1, "grpo_config.py refuses sp_size > 1"),
    "use_dynamic_bsz": (False, "TRL packs no token budgets"),
}
# TRL_SETS' knobs a vLLM server takes from its own command line (vllm_mode="server": trl vllm-serve forwards them to
# vllm serve; TRL passes none)
TRL_SERVER_OWN = ("max_num_seqs", "max_num_batched_tokens", "enforce_eager")
TRL_SETS = {
    **TRL_CANNOT,
    "engine_version": ("current", "TRL 1.16 runs vLLM 0.22-0.31 (trl/import_utils.py)"),
    "max_num_seqs": (None, "per_device_train_batch_size x vllm_tensor_parallel_size x steps_per_generation "
                           "(grpo_trainer.py)"),
    "max_num_batched_tokens": (4096, "vllm_generation.py passes 4096"),
    "enforce_eager": (False, "vllm_generation.py leaves vLLM's CUDA graphs on"),
    "sleep_level": (2, "vllm_generation.py sleeps at level 2 (--vllm-enable-sleep-mode)"),
    "log_prob_micro_batch_size_per_gpu": (None, "the log-prob passes run per_device_train_batch_size sequences at a "
                                                "time (grpo_trainer.py)"),
    "use_remove_padding": (False, "TRL pads prompts and completions to the generation batch's longest"),
    "entropy": (True, "the update's fused head always computes it (rl_trl_head.py)"),
    "entropy_chunking": (False, "the fused head tiles the vocabulary itself (rl_trl_head.py)"),
    "use_torch_compile": (None, "verl's compiled entropy; TRL's fused head is its own kernel"),
    "ref_param_offload": (None, "accelerate's fsdp_offload_params offloads the reference with the actor: "
                                "--param-offload --optimizer-offload"),
    "offload_policy": (None, "accelerate's fsdp_offload_params: --param-offload --optimizer-offload"),
    "fsdp_size": (-1, "accelerate shards over every process"),
    "layered_summon": (False, "verl's FSDP1 LoRA sync; TRL merges the adapters and sends one tensor at a time"),
    "lora_merge": (True, "verl's model.lora.merge; TRL merges the adapters at every sync (vllm_generation.py "
                         "merge_adapter), priced so"),
    "use_shm": (False, "verl's /dev/shm copy"),
    "load_format": ("auto", "TRL's vLLM loads the checkpoint from disk (vllm_generation.py passes no load_format)"),
    "reward_model": (None, "TRL's reward models run inside the trainer, not priced here"),
}
