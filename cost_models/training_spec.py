"""TrainingSpec: how much data, which optimizer and how torch runs it, full or LoRA / QLoRA fine-tuning, MoE routing.
A frozen dataclass validated on construction (bad values raise SpecError naming the field); cost_models/specs.py
re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

from .spec_values import (QUANT_STORAGE_DTYPES, Finetune, Optimizer, OptimizerImpl, QuantType, Routing, SpecError,
                          check_positive, check_probability, parse_enum)


@dataclass(frozen=True)
class TrainingSpec:
    seq_len: int = 2048
    global_batch: int | None = None   # sequences per optimizer step; None = micro-batch x GPUs x accumulation
    optimizer: Optimizer = Optimizer.ADAMW
    # how torch runs the step (cost_models/optimizer_step.py): foreach, fused or for-loop; adamw-8bit is always
    # fused (bitsandbytes' kernel): one spelling, so specs compare equal
    optimizer_impl: OptimizerImpl = OptimizerImpl.FOREACH
    finetune: Finetune = Finetune.FULL
    lora_rank: int = 16
    # peft's lora_dropout: p > 0 puts an nn.Dropout on each adapter's input, whose mask and output are saved
    # (cost_models/lora_dropout.py); 0 is nn.Identity
    lora_dropout: float = 0.0
    # QLoRA's base (finetune qlora; cost_models/qlora.py): bitsandbytes' 4-bit type, double quantization of the
    # absmax (on: 0.127 bits a weight, off: 0.5) and bnb_4bit_quant_storage (the compute dtype's under FSDP)
    quant: QuantType = QuantType.NF4
    double_quant: bool = True
    quant_storage: str = "bf16"
    # expert parallelism: the busiest rank's routed rows over the mean (1 = balanced routing, what is priced by
    # default); it scales that rank's grouped-GEMM rows, their saved activations and the all-to-all it waits on
    routing_imbalance: float = 1.0
    # the router: learned, or Automodel's FakeBalancedGate (round-robin: balanced, no gate matmul; expert_parallel.py)
    routing: Routing = Routing.LEARNED

    def __post_init__(self):
        check_positive("seq_len", self.seq_len)
        object.__setattr__(self, "routing", parse_enum(Routing, self.routing, "routing"))
        if self.routing is Routing.ROUND_ROBIN and self.routing_imbalance != 1:
            raise SpecError("routing_imbalance", "round-robin routing is balanced by construction: leave "
                                                 "routing_imbalance at 1")
        if not isinstance(self.routing_imbalance, (int, float)) or self.routing_imbalance < 1:
            raise SpecError("routing_imbalance", f"must be >= 1 (the busiest rank's rows over the mean), got "
                                                 f"{self.routing_imbalance!r}")
        if self.global_batch is not None:
            check_positive("global_batch", self.global_batch)
        check_positive("lora_rank", self.lora_rank)
        object.__setattr__(self, "lora_dropout", check_probability("lora_dropout", self.lora_dropout))
        object.__setattr__(self, "optimizer", parse_enum(Optimizer, self.optimizer, "optimizer"))
        impl = parse_enum(OptimizerImpl, self.optimizer_impl, "optimizer_impl")
        object.__setattr__(self, "optimizer_impl", OptimizerImpl.FUSED if self.optimizer is Optimizer.ADAMW_8BIT
                           else impl)
        object.__setattr__(self, "finetune", parse_enum(Finetune, self.finetune, "finetune"))
        object.__setattr__(self, "quant", parse_enum(QuantType, self.quant, "quant"))
        if self.quant_storage not in QUANT_STORAGE_DTYPES:
            raise SpecError("quant_storage", f"unknown value {self.quant_storage!r}; choose one of: "
                                             f"{', '.join(QUANT_STORAGE_DTYPES)}")
        if not isinstance(self.double_quant, bool):
            raise SpecError("double_quant", f"must be true or false, got {self.double_quant!r}")

    @property
    def quantized(self) -> bool:
        """The frozen base's linears are bitsandbytes 4-bit (QLoRA)."""
        return self.finetune is Finetune.QLORA

    def to_dict(self) -> dict:
        """The training as the outputs name it (the JSON's "training"); keys at their defaults left out where
        marked in planner/schemas/common.py's Training."""
        return {"seq_len": self.seq_len,
                **({"global_batch": self.global_batch} if self.global_batch is not None else {}),
                "optimizer": self.optimizer.value, "optimizer_impl": self.optimizer_impl.value,
                "finetune": self.finetune.value,
                **({"lora_rank": self.lora_rank} if self.finetune.adapters else {}),
                **({"lora_dropout": self.lora_dropout} if self.adapter_dropout else {}),
                **({"quant": self.quant.value, "double_quant": self.double_quant, "quant_storage": self.quant_storage}
                   if self.quantized else {}),
                **({"routing_imbalance": self.routing_imbalance} if self.routing_imbalance != 1 else {}),
                **({"routing": self.routing.value} if self.routing is not Routing.LEARNED else {})}

    @property
    def adapter_rank(self) -> int:
        """The LoRA rank when fine-tuning with LoRA or QLoRA, else 0 (what the activation formulas take)."""
        return self.lora_rank if self.finetune.adapters else 0

    @property
    def adapter_dropout(self) -> float:
        """peft's lora_dropout when fine-tuning with LoRA or QLoRA, else 0."""
        return self.lora_dropout if self.finetune.adapters else 0.0

    def grad_accum_for(self, micro_batch: int, data_parallel: int) -> int | None:
        """Micro-steps that reach the global batch (1 without one); None when micro_batch x the data-parallel
        ranks (the GPUs over tp x cp x pp) does not divide it."""
        if self.global_batch is None:
            return 1
        per_step = micro_batch * data_parallel
        return None if self.global_batch % per_step else self.global_batch // per_step
