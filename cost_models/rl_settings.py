"""The FSDP side's knobs of a verl (or TRL) RL job as verl names them, checked on construction (SpecError names the
field): what cost_models/rl_*.py read of the request."""

from __future__ import annotations

from dataclasses import dataclass

from .spec_values import Finetune, Precision, SpecError, parse_enum

ALGORITHMS = ("grpo", "ppo")
ACTOR_DTYPES = {"fp32": Precision.BF16, "bf16": Precision.BF16_PURE}  # stored dtype -> FSDP mixed precision
STRATEGIES = ("fsdp", "fsdp2")
FRAMEWORKS = ("verl", "trl")

@dataclass(frozen=True)
class RlSettings:
    """The FSDP side's knobs as verl names them (actor_rollout_ref.actor.* / ref.* / model.*)."""

    strategy: str = "fsdp"             # actor.strategy: fsdp (FSDP1) | fsdp2 (how each wraps: rl_strategy.py)
    framework: str = "verl"            # verl | trl (GRPOTrainer with accelerate's FSDP)
    actor_dtype: str = "fp32"          # fsdp_config.model_dtype: fp32 master weights (2025 default) or bf16
    finetune: Finetune = Finetune.FULL
    lora_rank: int = 32                # model.lora_rank, target_modules all-linear
    param_offload: bool = False
    optimizer_offload: bool = False
    ref_param_offload: bool = True     # FSDP1's reference: CPUOffload(offload_params=True)
    gradient_checkpointing: bool = True
    entropy: bool = True               # entropy computed in log-prob / update (entropy_coeff != 0 or logged)
    entropy_chunking: bool = False     # actor.entropy_from_logits_with_chunking
    entropy_compile: bool = True       # actor.use_torch_compile: entropy_from_logits compiled (verl's default)
    fsdp_size: int = -1                # fsdp_config.fsdp_size: -1 all GPUs, 1 each GPU holds the whole actor
    sleep_level: int = 1               # vLLM sleep mode: 1 weights to host, 2 discarded
    use_shm: bool = False              # model.use_shm: the checkpoint copied to /dev/shm
    algorithm: str = "grpo"            # algorithm.adv_estimator: grpo (no critic) | ppo (gae: a critic)
    critic_param_offload: bool = False     # critic.model.fsdp_config.param_offload
    critic_optimizer_offload: bool = False
    layered_summon: bool = False       # rollout.layered_summon: FSDP1 LoRA's sync gathers one unit at a time
    offload_policy: bool = False       # fsdp_config.offload_policy: FSDP2's CPUOffloadPolicy (host_offload)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise SpecError("strategy", f"unknown value {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
        if self.framework not in FRAMEWORKS:
            raise SpecError("framework", f"unknown value {self.framework!r}; choose one of: {', '.join(FRAMEWORKS)}")
        if self.actor_dtype not in ACTOR_DTYPES:
            raise SpecError("actor_dtype", f"unknown value {self.actor_dtype!r}; choose one of: fp32, bf16")
        object.__setattr__(self, "finetune", parse_enum(Finetune, self.finetune, "finetune"))
        if self.finetune is Finetune.QLORA:
            raise SpecError("finetune", "qlora is not a verl mode; choose one of: full, lora")
        if self.algorithm not in ALGORITHMS:
            raise SpecError("algorithm", f"unknown value {self.algorithm!r}; choose one of: {', '.join(ALGORITHMS)}")
        if self.sleep_level not in (1, 2):
            raise SpecError("sleep_level", f"must be 1 or 2, got {self.sleep_level}")
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise SpecError("fsdp_size", f"must be -1 (all GPUs) or >= 1, got {self.fsdp_size}")
        if self.host_offload:  # verl forces the manual offloads off (FSDPEngine._build_fsdp_module, fsdp2 branch)
            object.__setattr__(self, "param_offload", False)
            object.__setattr__(self, "optimizer_offload", False)

    @property
    def host_offload(self) -> bool:
        """verl 0.9.1 reads offload_policy in its FSDP2 branch only (CPUOffloadPolicy(pin_memory=True): the actor's
        params, grads and Adam states on the host, the optimizer step on the CPU); FSDP1's ignores it."""
        return self.offload_policy and self.strategy == "fsdp2" and self.framework == "verl"

    @property
    def lora(self) -> bool:
        return self.finetune is Finetune.LORA

    @property
    def ppo(self) -> bool:
        return self.algorithm == "ppo"
