"""The FSDP side's knobs of a verl (or TRL) RL job as verl names them, checked on construction (SpecError names the
field): what cost_models/rl_*.py read of the request. TRL's GRPOConfig keys that decide its passes (beta,
num_iterations, the importance-sampling correction, sleep mode) by TRL's names; rl_schedule.py reads them."""

from __future__ import annotations

from dataclasses import dataclass

from .rl_sleep import verl_sleep_level
from .spec_values import Finetune, LoraTargets, OptimizerImpl, Precision, SpecError, parse_enum

ALGORITHMS = ("grpo", "ppo")
ACTOR_DTYPES = {"fp32": Precision.BF16, "bf16": Precision.BF16_PURE}  # stored dtype -> FSDP mixed precision
STRATEGIES = ("fsdp", "fsdp2")
FRAMEWORKS = ("verl", "trl")
VLLM_MODES = ("colocate", "server")   # TRL's GRPOConfig.vllm_mode
# rollout.load_format, passed to the engine as is (verl 0.9.1 vllm_async_server.py / async_sglang_server.py
# "load_format": self.config.load_format): dummy (rollout.yaml's default: random weights, no disk read) or a format
# vLLM and SGLang both read from disk
LOAD_FORMATS = ("dummy", "auto", "safetensors", "pt")
# what accelerate's fsdp_offload_params (TRL: --param-offload) offloads beside the actor's params and Adam states
TRL_OFFLOAD_FOLLOWERS = ("offload_policy", "ref_param_offload")

@dataclass(frozen=True)
class RlSettings:
    """The FSDP side's knobs as verl names them (actor_rollout_ref.actor.* / ref.* / model.*)."""

    strategy: str = "fsdp"             # actor.strategy: fsdp (FSDP1) | fsdp2 (how each wraps: rl_strategy.py)
    framework: str = "verl"            # verl | trl (GRPOTrainer with accelerate's FSDP)
    actor_dtype: str = "fp32"          # fsdp_config.model_dtype: fp32 master weights (2025 default) or bf16
    finetune: Finetune = Finetune.FULL
    lora_rank: int = 32                # model.lora_rank
    # model.target_modules as priced (rl_lora_targets.py): all-linear (verl's default) or the attention projections
    lora_targets: LoraTargets = LoraTargets.ALL_LINEAR
    param_offload: bool = False
    optimizer_offload: bool = False
    ref_param_offload: bool = True     # ref.fsdp_config.param_offload: read by TRL's mapping only (reference_offloaded)
    gradient_checkpointing: bool = True
    entropy: bool = True               # entropy computed in the update (calculate_entropy / entropy_coeff != 0)
    entropy_chunking: bool = False     # actor.entropy_from_logits_with_chunking
    entropy_compile: bool = True       # actor.use_torch_compile: entropy_from_logits compiled (verl's default)
    fsdp_size: int = -1                # fsdp_config.fsdp_size: -1 all GPUs, 1 each GPU holds the whole actor
    # the level the engine sleeps at as the framework runs it (rl_sleep.py): verl 1 for a LoRA adapter, else 2; TRL
    # 2. Another one asked is resolved here, as TRL's is (planner/rl/verl_notes.py says so)
    sleep_level: int | None = None
    use_shm: bool = False              # model.use_shm: the checkpoint copied to /dev/shm
    algorithm: str = "grpo"            # algorithm.adv_estimator: grpo (no critic) | ppo (gae: a critic)
    critic_param_offload: bool = False     # critic.fsdp.param_offload (verl 0.9; critic.model.fsdp_config before)
    critic_optimizer_offload: bool = False
    critic_offload_policy: bool = False    # critic.fsdp.offload_policy: the critic's own CPUOffloadPolicy
    # critic.strategy / critic.fsdp.model_dtype (verl 0.9.1 defaults fsdp / fp32, dp_critic.yaml and engine/fsdp.yaml:
    # what a script leaving them out runs); None: the actor's, resolved on construction (a replace() of the actor's
    # strategy or dtype keeps the critic's)
    critic_strategy: str | None = None
    critic_dtype: str | None = None
    layered_summon: bool = False       # rollout.layered_summon: FSDP1 LoRA's sync gathers one unit at a time
    # model.lora.merge: verl merges the adapters into the base at each sync and sends the whole merged weights, not
    # the adapters (rl_strategy.py, rl_sleep.py); read for a verl LoRA actor only (TRL merges always)
    lora_merge: bool = False
    offload_policy: bool = False       # fsdp_config.offload_policy: FSDP2's CPUOffloadPolicy (host_offload)
    load_format: str = "dummy"         # rollout.load_format (LOAD_FORMATS; verl's default): base_preloaded
    # TRL 1.16's GRPOConfig (trl/trainer/grpo_config.py defaults), read for framework trl only (rl_schedule.py)
    beta: float = 0.0                  # KL coefficient: a reference (and its pass) only when != 0
    num_iterations: int = 1            # updates per generation batch (GRPO's mu)
    importance_sampling: bool = True   # vllm_importance_sampling_correction: the old log-probs always computed
    sleep_mode: bool = False           # vllm_enable_sleep_mode: the engine asleep (level 2) outside generation
    vllm_mode: str = "colocate"        # colocate (vLLM in the trainer processes) | server (rl_trl_server.py)
    server_data_parallel: int = 1      # server: trl vllm-serve --data-parallel-size (its TP: the engine's)
    server_local: bool = True          # server: on the trainer's first node (vllm_server_host local, TRL's default)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise SpecError("strategy", f"unknown value {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
        if self.framework not in FRAMEWORKS:
            raise SpecError("framework", f"unknown value {self.framework!r}; choose one of: {', '.join(FRAMEWORKS)}")
        if self.actor_dtype not in ACTOR_DTYPES:
            raise SpecError("actor_dtype", f"unknown value {self.actor_dtype!r}; choose one of: fp32, bf16")
        for name, actor, valid in (("critic_strategy", self.strategy, STRATEGIES),
                                   ("critic_dtype", self.actor_dtype, tuple(ACTOR_DTYPES))):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, actor)
            elif value not in valid:
                raise SpecError(name, f"unknown value {value!r}; choose one of: {', '.join(valid)}")
        object.__setattr__(self, "finetune", parse_enum(Finetune, self.finetune, "finetune"))
        object.__setattr__(self, "lora_targets", parse_enum(LoraTargets, self.lora_targets, "lora_targets"))
        if self.finetune is Finetune.QLORA:
            raise SpecError("finetune", "qlora is not a verl mode; choose one of: full, lora")
        if self.algorithm not in ALGORITHMS:
            raise SpecError("algorithm", f"unknown value {self.algorithm!r}; choose one of: {', '.join(ALGORITHMS)}")
        if self.sleep_level is not None and self.sleep_level not in (1, 2):
            raise SpecError("sleep_level", f"must be 1 or 2, got {self.sleep_level}")
        if self.framework == "verl":
            object.__setattr__(self, "sleep_level", verl_sleep_level(self.lora_adapter))
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise SpecError("fsdp_size", f"must be -1 (all GPUs) or >= 1, got {self.fsdp_size}")
        if self.num_iterations < 1:
            raise SpecError("num_iterations", f"must be >= 1, got {self.num_iterations}")
        if self.load_format not in LOAD_FORMATS:
            raise SpecError("load_format", f"unknown value {self.load_format!r}; choose one of: "
                                           f"{', '.join(LOAD_FORMATS)}")
        if self.vllm_mode not in VLLM_MODES:
            raise SpecError("vllm_mode", f"unknown value {self.vllm_mode!r}; choose one of: {', '.join(VLLM_MODES)}")
        if self.server_data_parallel < 1:
            raise SpecError("vllm_server_data_parallel_size", f"must be >= 1, got {self.server_data_parallel}")
        if self.framework == "trl":
            self._trl()
        elif self.server:
            raise SpecError("vllm_mode", "server: TRL's; verl's engine is colocated; choose one of: colocate")
        # verl forces a worker's manual offloads off under its policy (FSDPEngine._build_fsdp_module, fsdp2 branch)
        for policy, worker in ((self.host_offload, ""), (self.critic_host_offload, "critic_")):
            if policy:
                object.__setattr__(self, worker + "param_offload", False)
                object.__setattr__(self, worker + "optimizer_offload", False)

    def _trl(self) -> None:
        """TRL's own rules: GRPO only; accelerate's fsdp_offload_params is FSDP's CPU offload of the actor and of the
        reference alike (trl/models/utils.py prepare_fsdp passes the plugin's cpu_offload), params and optimizer
        together; colocated vLLM sleeps at level 2 (trl/generation/vllm_generation.py llm.sleep(level=2))."""
        if self.algorithm != "grpo":
            raise SpecError("algorithm", f"{self.algorithm}: TRL's GRPOTrainer runs GRPO only; choose one of: grpo")
        if self.param_offload != self.optimizer_offload:
            raise SpecError("optimizer_offload", "accelerate's fsdp_offload_params offloads params and optimizer "
                                                 "together: set param_offload and optimizer_offload alike")
        policy = self.offload_policy or self.param_offload   # idempotent: a replace() keeps it
        for name, value in (*((n, policy) for n in TRL_OFFLOAD_FOLLOWERS), ("sleep_level", 2)):
            object.__setattr__(self, name, value)
        if self.server:   # vllm_enable_sleep_mode is read in colocate mode only (vllm_generation.py)
            object.__setattr__(self, "sleep_mode", False)

    @property
    def server(self) -> bool:
        """TRL's vllm_mode server: no engine on the trainer's GPUs (rl_trl_server.py)."""
        return self.vllm_mode == "server"

    @property
    def host_offload(self) -> bool:
        """verl 0.9.1 reads offload_policy in its FSDP2 branch only (CPUOffloadPolicy(pin_memory=True): the actor's
        params, grads and Adam states on the host, the optimizer step on the CPU); FSDP1's ignores it. TRL: FSDP's
        own CPU offload under either version (FSDP1's CPUOffload also steps on the CPU)."""
        return self.offload_policy and (self.strategy == "fsdp2" or self.framework == "trl")

    @property
    def critic_host_offload(self) -> bool:
        """PPO's critic under its own CPUOffloadPolicy (critic.fsdp.offload_policy): verl's critic worker runs the same
        FSDP engine, so the same rule as the actor's, under the critic's own strategy (FSDPCriticConfig.__post_init__
        hands critic.strategy to its engine config)."""
        return self.ppo and self.critic_offload_policy and self.critic_strategy == "fsdp2"

    @property
    def reference_offloaded(self) -> bool:
        """Whether the reference's params live on the host. verl (0.9.1; 2025's fsdp_workers.py alike) builds the
        reference forward_only (trainer/config/ref/dp_ref.yaml `forward_only: True`), and its FSDP engine then wraps
        it with FSDP's own offload whatever ref.fsdp_config.param_offload says (workers/engine/fsdp/
        transformer_impl.py _build_fsdp_module: FSDP1 CPUOffload(offload_params=True), FSDP2
        CPUOffloadPolicy(pin_memory=True), the manual offload forced off): always. TRL: with the actor
        (fsdp_offload_params, _trl)."""
        return self.framework == "verl" or self.ref_param_offload

    @property
    def optimizer_impl(self) -> OptimizerImpl:
        """The AdamW step each framework runs. verl: torch.optim.AdamW with neither foreach= nor fused=
        (workers/config/optimizer.py build_optimizer), so torch's default for where the states are: foreach on the
        GPU, for-loop on CPUOffloadPolicy's host shards. TRL: TrainingArguments' default optim, adamw_torch_fused
        (transformers 5 with torch >= 2.8; torch 2.13's fused AdamW runs on CPU tensors too)."""
        if self.framework == "trl":
            return OptimizerImpl.FUSED
        return OptimizerImpl.torch_default(self.host_offload)

    @property
    def lora(self) -> bool:
        return self.finetune is Finetune.LORA

    @property
    def lora_all_linear(self) -> bool:
        """LoRA on every block linear (target_modules all-linear): an MoE's router and stacked experts too."""
        return self.lora and self.lora_targets is LoraTargets.ALL_LINEAR

    @property
    def lora_merged(self) -> bool:
        """verl's LoRA with model.lora.merge: the merged base is synced and served, no adapter in the engine."""
        return self.lora and self.lora_merge and self.framework == "verl"

    @property
    def lora_adapter(self) -> bool:
        """verl's LoRA served as an adapter (model.lora.merge off): the engine keeps the base, only adapters synced."""
        return self.lora and not self.lora_merged

    @property
    def base_preloaded(self) -> bool:
        """Whether verl's engine starts with the checkpoint's weights, so a LoRA adapter's first sync sends no base:
        verl 0.9.1 engine_workers.py `self.base_sync_done: bool = "dummy" not in self.config.rollout.load_format`."""
        return "dummy" not in self.load_format

    @property
    def ppo(self) -> bool:
        return self.algorithm == "ppo"
