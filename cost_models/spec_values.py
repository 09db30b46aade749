"""The values every spec field is checked against: SpecError (the field and what is valid), the enums of the
planner's vocabulary (sharding, precision, optimizer, attention, fine-tuning, kernels), activation checkpointing's
spellings and the degree / positivity checks (cost_models/specs.py re-exports them)."""

from __future__ import annotations

from enum import Enum


class SpecError(ValueError):
    """A field holds a value the planner cannot use. `field` names it, the message says what is valid."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def enum_choices(enum_cls) -> str:
    return ", ".join(m.value for m in enum_cls)


def parse_enum(enum_cls, value, field_name: str):
    """Enum member from its value (case-insensitive), or SpecError listing the valid values."""
    if isinstance(value, enum_cls):
        return value
    text = str(value).strip()
    for member in enum_cls:
        if member.value.lower() == text.lower() or member.name.lower() == text.lower().replace("-", "_"):
            return member
    raise SpecError(field_name, f"unknown value {value!r}; choose one of: {enum_choices(enum_cls)}")


class Sharding(str, Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @property
    def is_hybrid(self) -> bool:
        return self in _HYBRID

    @property
    def reshards_after_forward(self) -> bool:
        """FULL_SHARD-like strategies free gathered params after each unit's forward (ZeRO-3)."""
        return self in _RESHARDING


class Precision(str, Enum):
    FP32 = "fp32"            # everything fp32 (no TF32: PyTorch's default for matmuls)
    BF16 = "bf16"            # fp32 master params, bf16 compute, fp32 gradient reduction
    BF16_PURE = "bf16-pure"  # params, grads, optimizer state and reduction all bf16
    FP16 = "fp16"            # fp32 master params, fp16 compute, fp32 reduction, ShardedGradScaler

    @property
    def compute_dtype(self) -> str:
        return _COMPUTE_DTYPE[self]

    @property
    def param_dtype(self) -> str:
        """dtype of the stored (sharded) parameters and their gradients."""
        return "bf16" if self is _BF16_PURE else "fp32"

    @property
    def reduce_dtype(self) -> str:
        return "bf16" if self is _BF16_PURE else "fp32"

    @property
    def mixed(self) -> bool:
        """True when compute uses a cast copy of the stored params (FSDP MixedPrecision)."""
        return self in _MIXED


# what the properties above read, made once (a search reads them ~100,000 times: a member looked up on its class, or a
# dict built per call, cost ~10x a set's or dict's lookup)
_HYBRID = frozenset({Sharding.HYBRID_SHARD, Sharding.HYBRID_SHARD_ZERO2})
_RESHARDING = frozenset({Sharding.FULL_SHARD, Sharding.HYBRID_SHARD})
_COMPUTE_DTYPE = {Precision.FP32: "fp32", Precision.BF16: "bf16", Precision.BF16_PURE: "bf16", Precision.FP16: "fp16"}
_BF16_PURE = Precision.BF16_PURE
_MIXED = frozenset({Precision.BF16, Precision.FP16})


class Optimizer(str, Enum):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"               # with momentum
    ADAMW_8BIT = "adamw-8bit"  # bitsandbytes-style: two 1-byte states per parameter

    def state_bytes_per_param(self, param_dtype: str) -> float:
        """Persistent optimizer state per trainable parameter (ZeRO paper, formulas.md): states of the stored
        params' width (adamw-8bit: two 1-byte states whatever the width)."""
        states, width = _STATES[self]
        return states * (width or (4 if param_dtype == "fp32" else 2))


# (states, bytes each; 0: the stored params' width) of each optimizer
_STATES = {Optimizer.ADAMW: (2, 0), Optimizer.ADAM: (2, 0), Optimizer.SGD: (1, 0), Optimizer.ADAMW_8BIT: (2, 1)}


class OptimizerImpl(str, Enum):
    """How torch.optim runs the step (the foreach= / fused= keywords; cost_models/optimizer_step.py prices each):
    foreach (one multi-tensor kernel per op over every parameter: torch's default on CUDA), fused (one kernel
    for the whole update, torch._fused_adamw_ / _fused_sgd_: HF Trainer's and torchtitan 0.3's default) or
    for-loop (foreach=False: parameter by parameter; torch's default for CPU tensors, hence for a CPU-offloaded
    step). adamw-8bit runs bitsandbytes' own per-parameter kernel whatever is asked: it is spelled fused."""

    FOREACH = "foreach"
    FUSED = "fused"
    FOR_LOOP = "for-loop"

    @classmethod
    def torch_default(cls, offload: bool) -> "OptimizerImpl":
        """What torch.optim runs without foreach= / fused=: foreach on CUDA parameters, for-loop on CPU ones
        (torch/optim/optimizer.py _default_to_fused_or_foreach)."""
        return cls.FOR_LOOP if offload else cls.FOREACH


class Attention(str, Enum):
    SDPA = "sdpa"    # fused kernels: no s^2 score storage
    EAGER = "eager"  # explicit softmax(QK^T): stores a*s^2 scores per sequence and layer
    FLEX = "flex"    # torch.nn.attention.flex_attention, compiled: q, k, v, out, logsumexp saved; block-sparse masks


class AttentionKernel(str, Enum):
    """The kernel behind fused (SDPA-style) attention; its time is priced per GPU architecture
    (cost_models/attention_kernels.py, planner/catalog/gpus.json attention_kernels). The same saved set each."""

    FLASH2 = "flash2"  # PyTorch SDPA's flash backend (FlashAttention-2): what torch picks first on A100 / H100
    CUDNN = "cudnn"    # Transformer Engine's cuDNN fused attention (NeMo Automodel's attn: te), Hopper wgmma/TMA
    FA3 = "fa3"        # flash-attention 3 (Hopper only: wgmma, TMA, warp specialisation)


class Finetune(str, Enum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"  # LoRA on a bitsandbytes 4-bit base (Dettmers et al. 2023; cost_models/qlora.py prices it)

    @property
    def adapters(self) -> bool:
        """Only LoRA adapters train (the base is frozen): lora and qlora."""
        return self is not Finetune.FULL


class LoraTargets(str, Enum):
    """The linears LoRA adapts, in its users' words. ATTENTION: the attention projections (q, k, v, o as the family
    names them: ModelSpec.lora_target_shapes), an upper bound of peft's own default (LoraConfig(target_modules=None):
    its per-family table, q_proj and v_proj for Llama; TRL's ModelConfig and HF's examples inherit it). ALL_LINEAR:
    every linear of a block, the MLP's too (peft's target_modules="all-linear", axolotl's lora_target_linear, the
    QLoRA paper's setup, verl's default)."""

    ATTENTION = "attention"
    ALL_LINEAR = "all-linear"


class QuantType(str, Enum):
    """bitsandbytes' 4-bit data types (BitsAndBytesConfig bnb_4bit_quant_type): NormalFloat4 or plain FP4."""

    NF4 = "nf4"
    FP4 = "fp4"


# bnb_4bit_quant_storage: the dtype the packed 4-bit bytes are stored as. FSDP flattens / all-gathers every
# parameter of a unit in one dtype, so it must be the compute dtype's (accelerate issue 3983: uint8 under FSDP2
# trains with loss 0 and a NaN gradient norm); uint8 is bitsandbytes' own default.
QUANT_STORAGE_DTYPES = ("bf16", "fp16", "fp32", "uint8")


class Kernel(str, Enum):
    """The kernel of a memory-bound op class (RMSNorm, RoPE, SwiGLU; cost_models/kernels.py prices each)."""

    EAGER = "eager"  # the model's own PyTorch ops (transformers' modelling code); fused by inductor under compile
    LIGER = "liger"  # Liger Kernel 0.8.5: LigerRMSNorm, liger_rotary_pos_emb, LigerSwiGLUMLP (Triton)
    TE = "te"        # Transformer Engine 2.x: te.RMSNorm, fused RoPE (apply_rotary_pos_emb fused=True), te.ops.SwiGLU


class LossKernel(str, Enum):
    """The loss's implementation (cost_models/kernels.py): the model's own cross-entropy (fp32 upcast, or one
    inductor kernel with compile_loss), torchtitan 0.3's ChunkedLossWrapper, or Liger's fused linear
    cross-entropy (the head's matmul and the loss in chunks, the logits never whole)."""

    EAGER = "eager"
    CHUNKED = "chunked"
    LIGER = "liger"


class MoeDispatch(str, Enum):
    """How a sparse block's tokens reach the expert-parallel ranks (cost_models/expert_parallel.py prices each):
    NCCL all-to-all of every routed row (transformers' AllToAllEP, torchtitan), or DeepEP's normal-mode dispatch
    / combine kernels, which send a token once per destination rank, as NeMo Automodel's GroupedExpertsDeepEP
    runs them (Megatron's flex token dispatcher: fused permute / unpermute, the weighted SwiGLU)."""

    ALL_TO_ALL = "all-to-all"
    DEEPEP = "deepep"


class Routing(str, Enum):
    """The router of an MoE model: learned (a gate matmul, softmax / sigmoid, top-k), or NeMo Automodel's
    FakeBalancedGate (benchmark runs: token t takes experts (t k + j) mod E, weights 1 / k; no matmul, balanced)."""

    LEARNED = "learned"
    ROUND_ROBIN = "round-robin"


SELECTIVE_OP = "selective-op"  # torchtitan's op-level policy in every block (FsdpConfig.selective_op_ac)


def parse_activation_checkpointing(value) -> int:
    """'none' -> 0, 'full' -> 1, 'every-K' -> K (checkpoint one block in every K). 'selective-op' is not
    a block count: FsdpConfig reads it into selective_op_ac."""
    if isinstance(value, int):
        if value < 0:
            raise SpecError("activation_checkpointing", "must be none, full or every-K with K >= 1")
        return value
    text = str(value).strip().lower()
    if text in ("none", "no", "off", "0"):
        return 0
    if text in ("full", "all", "1"):
        return 1
    if text.startswith("every-") and text[6:].isdigit() and int(text[6:]) >= 1:
        return int(text[6:])
    if text == SELECTIVE_OP:
        raise SpecError("activation_checkpointing", f"{SELECTIVE_OP} is not a block count: FsdpConfig(ac_every="
                        f"'{SELECTIVE_OP}') sets selective_op_ac")
    raise SpecError("activation_checkpointing",
                    f"unknown value {value!r}; choose one of: none, full, every-K (K >= 1), {SELECTIVE_OP}")


def format_activation_checkpointing(ac_every: int, selective_op: bool = False) -> str:
    if selective_op:
        return SELECTIVE_OP
    return {0: "none", 1: "full"}.get(ac_every, f"every-{ac_every}")


def check_degree(field_name: str, value) -> None:
    """A mesh degree (tp, cp, ep, pp, dp_shard, ...): an integer >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(field_name, f"must be an integer >= 1, got {value!r}")


def check_positive(field_name: str, value, allow_zero: bool = False) -> None:
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise SpecError(field_name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_probability(field_name: str, value) -> float:
    """A dropout probability (peft's lora_dropout): a number 0 <= p < 1, as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise SpecError(field_name, f"must be a probability 0 <= p < 1, got {value!r}")
    return float(value)
