"""What `fsdp-plan rl estimate` is asked: one verl GRPO configuration, each knob declared once (planner/request's
knob(): type, default, flag, help) with verl's own name (actor_rollout_ref.* / data.*, dashes for dots)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from planner.request.groups import ClusterRequest
from planner.request.knobs import knob, knob_table

from ..errors import PlannerError


@dataclass(frozen=True)
class RlRequest:
    model: object = knob(None, "--model", "-m", help="Preset name, HF config.json, or a directory holding one",
                         cli_type=str)
    cluster: ClusterRequest = field(default_factory=ClusterRequest)
    # data.* and the batch (verl's names)
    prompt_len: int = knob(1024, "--prompt-len", help="data.max_prompt_length, tokens")
    response_len: int = knob(1024, "--response-len", help="data.max_response_length, tokens")
    mean_prompt_len: int | None = knob(None, "--mean-prompt-len", help="The data's mean prompt length (with "
                                       "remove-padding the forward holds real lengths; default: the maximum)")
    mean_response_len: int | None = knob(None, "--mean-response-len", help="The mean response length (default: "
                                         "the maximum)")
    train_batch: int = knob(256, "--train-batch", help="data.train_batch_size: prompts per step")
    rollout_n: int = knob(8, "--rollout-n", help="rollout.n: responses per prompt")
    ppo_mini_batch_size: int | None = knob(None, "--ppo-mini-batch-size", help="actor.ppo_mini_batch_size, prompts "
                                           "(default: the train batch)")
    ppo_micro_batch_size_per_gpu: int = knob(4, "--ppo-micro-batch-size-per-gpu", help="Sequences per update "
                                             "micro-batch per GPU")
    log_prob_micro_batch_size_per_gpu: int | None = knob(None, "--log-prob-micro-batch-size-per-gpu",
                                                         help="Sequences per log-prob micro-batch (default: the "
                                                         "update's)")
    use_dynamic_bsz: bool = knob(False, "--use-dynamic-bsz/--no-use-dynamic-bsz", help="Pack micro-batches to a "
                                 "token budget")
    ppo_max_token_len_per_gpu: int = knob(16384, "--ppo-max-token-len-per-gpu", help="Update token budget per GPU "
                                          "(x the Ulysses degree per micro-batch)")
    log_prob_max_token_len_per_gpu: int | None = knob(None, "--log-prob-max-token-len-per-gpu", help="Log-prob "
                                                      "token budget (default: the update's)")
    ulysses_sequence_parallel_size: int = knob(1, "--ulysses-sequence-parallel-size", help="Ulysses degree")
    use_remove_padding: bool = knob(True, "--use-remove-padding/--no-use-remove-padding", help="Pack real lengths")
    algorithm: str = knob("grpo", "--algorithm", help="algorithm.adv_estimator: grpo (no critic) or ppo (gae: a "
                          "critic, the actor's model with a value head, in its own worker)")
    # the actor (actor_rollout_ref.actor.* / model.*)
    framework: str = knob("verl", "--framework", help="verl (its FSDP workers) or trl (TRL 1.16's GRPOTrainer, "
                          "accelerate's FSDP): its phases, reference, engine and log-prob head")
    strategy: str = knob("fsdp", "--strategy", help="actor.strategy: fsdp (FSDP1) or fsdp2")
    actor_dtype: str = knob("fp32", "--actor-dtype", help="fsdp_config.model_dtype: fp32 (verl's 2025 default) or "
                            "bf16")
    finetune: str = knob("full", "--finetune", help="full or lora (on --lora-targets)")
    lora_rank: int = knob(32, "--lora-rank", help="model.lora_rank")
    lora_targets: str = knob("all-linear", "--lora-targets", help="model.target_modules, the linears LoRA adapts: "
                             "all-linear (verl's default: every block linear, an MoE's router and experts too) or "
                             "attention (the attention projections alone, written as their list: [q_proj,k_proj,"
                             "v_proj,o_proj]; the list, comma-separated, reads the same; Llama 4 and gpt-oss are "
                             "priced with attention only)")
    lora_merge: bool | None = knob(None, "--lora-merge/--no-lora-merge", help="model.lora.merge: verl merges the "
                                   "adapters into the base at each weight sync and sends the whole merged weights "
                                   "(the engine serves no adapter and sleeps at level 2), not the adapters (default: "
                                   "`rl` tries both, `rl estimate` and check price verl's False)")
    param_offload: bool = knob(False, "--param-offload/--no-param-offload", help="Actor params on the host "
                               "between phases")
    optimizer_offload: bool = knob(False, "--optimizer-offload/--no-optimizer-offload", help="Adam states on the "
                                   "host between updates")
    offload_policy: bool = knob(False, "--offload-policy/--no-offload-policy", help="fsdp_config.offload_policy: "
                                "FSDP2's CPUOffloadPolicy, the actor's params, grads and Adam states on the host, "
                                "the optimizer step on the CPU (verl ignores it under --strategy fsdp)")
    ref_param_offload: bool = knob(True, "--ref-param-offload/--no-ref-param-offload", help="The reference on the "
                                   "host (FSDP CPUOffload)")
    gradient_checkpointing: bool = knob(True, "--gradient-checkpointing/--no-gradient-checkpointing",
                                        help="model.enable_gradient_checkpointing")
    entropy: bool = knob(True, "--entropy/--no-entropy", help="The entropy computed in the update (verl: "
                         "actor.calculate_entropy, which --emit verl writes; the old log-prob pass always "
                         "computes it, the reference's never)")
    entropy_chunking: bool = knob(False, "--entropy-chunking/--no-entropy-chunking",
                                  help="actor.entropy_from_logits_with_chunking")
    use_torch_compile: bool = knob(True, "--use-torch-compile/--no-use-torch-compile", help="actor.use_torch_compile: "
                                   "the entropy compiled (eager holds 7 [tokens, vocab] tensors at its backward)")
    fsdp_size: int = knob(-1, "--fsdp-size", help="fsdp_config.fsdp_size: -1 all GPUs, 1 no sharding")
    critic_param_offload: bool = knob(False, "--critic-param-offload/--no-critic-param-offload", help="PPO: "
                                      "critic.fsdp.param_offload (verl 0.9; critic.model.fsdp_config before)")
    critic_optimizer_offload: bool = knob(False, "--critic-optimizer-offload/--no-critic-optimizer-offload",
                                          help="PPO: critic.fsdp.optimizer_offload")
    critic_offload_policy: bool = knob(False, "--critic-offload-policy/--no-critic-offload-policy", help="PPO: "
                                       "critic.fsdp.offload_policy, the critic's own FSDP2 CPUOffloadPolicy: its "
                                       "params, grads and Adam states on the host, its optimizer step on the CPU "
                                       "(the critic's param / optimizer offload forced off; ignored under "
                                       "critic strategy fsdp)")
    critic_strategy: str | None = knob(None, "--critic-strategy", help="PPO: critic.strategy, fsdp or fsdp2 "
                                       "(default: the actor's --strategy, and --emit verl writes it; verl's own "
                                       "default, in a script that leaves it out, is fsdp)")
    critic_dtype: str | None = knob(None, "--critic-dtype", help="PPO: critic.fsdp.model_dtype, fp32 or bf16 "
                                    "(default: the actor's --actor-dtype, and --emit verl writes it; verl's own "
                                    "default is fp32)")
    critic_ulysses_sequence_parallel_size: int | None = knob(None, "--critic-ulysses-sequence-parallel-size",
                                                             help="PPO: critic.ulysses_sequence_parallel_size "
                                                             "(default: the actor's)")
    reward_model: object = knob(None, "--reward-model", help="reward_model.model.path (reward_model.enable): a "
                                "preset or config.json, served by its own engine on the same GPUs; default none",
                                cli_type=str)
    reward_model_tp: int = knob(2, "--reward-model-tp", help="reward_model.rollout.tensor_model_parallel_size")
    reward_model_gpu_memory_utilization: float = knob(0.5, "--reward-model-gpu-memory-utilization",
                                                      help="reward_model.rollout.gpu_memory_utilization")
    reward_model_enable_resource_pool: bool = knob(
        False, "--reward-model-enable-resource-pool/--no-reward-model-enable-resource-pool",
        help="reward_model.enable_resource_pool: the reward engine on GPUs of its own (--reward-model-n-gpus-per-node "
             "x --reward-model-nnodes beside the --gpus trainers), scoring each response as it finishes, beside the "
             "rollout")
    reward_model_n_gpus_per_node: int = knob(8, "--reward-model-n-gpus-per-node",
                                             help="reward_model.n_gpus_per_node: its own pool's GPUs per node")
    reward_model_nnodes: int = knob(1, "--reward-model-nnodes", help="reward_model.nnodes: its own pool's nodes "
                                    "(verl's default 0 refuses to start with a pool)")
    use_shm: bool = knob(False, "--use-shm/--no-use-shm", help="model.use_shm: the model copied to /dev/shm")
    # the rollout engine (actor_rollout_ref.rollout.*)
    engine: str = knob("vllm", "--engine", help="rollout.name: vllm or sglang")
    engine_version: str = knob("current", "--engine-version", help="vllm: 0.8 (0.8.x) or current (>= 0.10); "
                               "sglang: current")
    gpu_memory_utilization: float = knob(0.5, "--gpu-memory-utilization", help="vLLM: of total memory; SGLang: "
                                         "of free memory at start")
    rollout_tp: int = knob(2, "--rollout-tp", help="rollout.tensor_model_parallel_size")
    max_num_seqs: int = knob(256, "--max-num-seqs", help="rollout.max_num_seqs")
    max_num_batched_tokens: int = knob(8192, "--max-num-batched-tokens", help="rollout.max_num_batched_tokens")
    enforce_eager: bool = knob(False, "--enforce-eager/--no-enforce-eager", help="No CUDA graphs")
    max_loras_per_batch: int | None = knob(None, "--max-loras-per-batch", help="SGLang serving the LoRA adapter: "
                                           "rollout.engine_kwargs.sglang.max_loras_per_batch, its LoRA pool's "
                                           "adapter slots (default: `rl estimate` and check price SGLang's 8, which "
                                           "verl leaves; `rl` takes 1, verl serving one adapter)")
    sleep_level: int | None = knob(None, "--sleep-level", help="The engine's sleep level: 1 (its weights backed up "
                                   "to the host) or 2 (discarded). The framework decides it (verl 0.9.1: 1 for a LoRA "
                                   "adapter, else 2; TRL: 2): another one is noted and priced as it runs")
    layered_summon: bool = knob(False, "--layered-summon/--no-layered-summon", help="rollout.layered_summon: FSDP1 "
                                "LoRA's weight sync gathers one unit at a time, not the whole model")
    load_format: str = knob("dummy", "--load-format", help="rollout.load_format: dummy (verl's default: the engine "
                            "starts with random weights and a LoRA adapter's first sync sends the base from every "
                            "rank's host), auto, safetensors or pt (the engine loads the checkpoint from disk; "
                            "needed with --layered-summon)")
    # TRL 1.16's GRPOConfig keys (--framework trl only; unset: TRL's defaults): cost_models/rl_schedule.py
    beta: float | None = knob(None, "--beta", help="TRL: GRPOConfig.beta, the KL coefficient (default 0.0: no "
                              "reference model and no reference pass)")
    num_iterations: int | None = knob(None, "--num-iterations", help="TRL: GRPOConfig.num_iterations, updates per "
                                      "generation batch (default 1)")
    vllm_importance_sampling_correction: bool | None = knob(
        None, "--vllm-importance-sampling-correction/--no-vllm-importance-sampling-correction",
        help="TRL: the old log-prob pass runs whatever the batch (default on)")
    vllm_enable_sleep_mode: bool | None = knob(None, "--vllm-enable-sleep-mode/--no-vllm-enable-sleep-mode",
                                               help="TRL: the engine asleep (level 2) outside generation (default "
                                               "off: its weights and KV cache stay on the GPU)")
    vllm_mode: str | None = knob(None, "--vllm-mode", help="TRL: GRPOConfig.vllm_mode, colocate (default: vLLM in the "
                                 "trainer processes) or server (`trl vllm-serve` on GPUs of its own: --rollout-tp x "
                                 "--vllm-server-data-parallel-size of them beside the --gpus trainers; "
                                 "--gpu-memory-utilization, --max-num-seqs, --max-num-batched-tokens and "
                                 "--enforce-eager are its vllm serve flags)")
    vllm_server_host: str | None = knob(None, "--vllm-server-host", help="TRL server mode: GRPOConfig.vllm_server_host"
                                        "; 0.0.0.0 (TRL's default) or a loopback address puts the server on the "
                                        "trainer's first node (weights over its NVLink), any other host on a node of "
                                        "its own (over the network)")
    vllm_server_data_parallel_size: int | None = knob(None, "--vllm-server-data-parallel-size", help="TRL server "
                                                      "mode: trl vllm-serve --data-parallel-size, engine replicas of "
                                                      "--rollout-tp GPUs (default 1; TRL: above 1 for MoE only)")


RL_KNOBS = tuple(knob_table(RlRequest))


def rl_request(model=None, gpus=None, **knobs) -> RlRequest:
    """An RlRequest from knobs by name (the cluster's routed to its group); an unknown name is one line."""
    table = knob_table(RlRequest)
    for name in knobs:
        if name not in table or name == "model":
            raise PlannerError(name, f"unknown argument; valid: {', '.join(n for n in table if n != 'model')}")
    cluster = {n: v for n, v in knobs.items() if table[n].group == "cluster"}
    top = {n: v for n, v in knobs.items() if table[n].group == ""}
    return RlRequest(model=model, cluster=dataclasses.replace(ClusterRequest(), **cluster, gpus=gpus), **top)
