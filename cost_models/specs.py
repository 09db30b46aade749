"""The planner's vocabulary: frozen dataclasses validated on construction.

ModelSpec (what is trained), GpuSpec and ClusterSpec (where), TrainingSpec (how much data, which
optimizer, full or LoRA fine-tuning) and FsdpConfig (the FSDP knobs a candidate sets). Bad values raise
SpecError naming the field and the valid choices; the CLI turns that into one line and exit code 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .schedules import Schedule


class SpecError(ValueError):
    """A field holds a value the planner cannot use. `field` names it, the message says what is valid."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _choices(enum_cls) -> str:
    return ", ".join(m.value for m in enum_cls)


def parse_enum(enum_cls, value, field_name: str):
    """Enum member from its value (case-insensitive), or SpecError listing the valid values."""
    if isinstance(value, enum_cls):
        return value
    text = str(value).strip()
    for member in enum_cls:
        if member.value.lower() == text.lower() or member.name.lower() == text.lower().replace("-", "_"):
            return member
    raise SpecError(field_name, f"unknown value {value!r}; choose one of: {_choices(enum_cls)}")


class Sharding(str, Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @property
    def is_hybrid(self) -> bool:
        return self in (Sharding.HYBRID_SHARD, Sharding.HYBRID_SHARD_ZERO2)

    @property
    def reshards_after_forward(self) -> bool:
        """FULL_SHARD-like strategies free gathered params after each unit's forward (ZeRO-3)."""
        return self in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)


class Precision(str, Enum):
    FP32 = "fp32"            # everything fp32 (no TF32: PyTorch's default for matmuls)
    BF16 = "bf16"            # fp32 master params, bf16 compute, fp32 gradient reduction
    BF16_PURE = "bf16-pure"  # params, grads, optimizer state and reduction all bf16
    FP16 = "fp16"            # fp32 master params, fp16 compute, fp32 reduction, ShardedGradScaler

    @property
    def compute_dtype(self) -> str:
        return {"fp32": "fp32", "bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16"}[self.value]

    @property
    def param_dtype(self) -> str:
        """dtype of the stored (sharded) parameters and their gradients."""
        return "bf16" if self is Precision.BF16_PURE else "fp32"

    @property
    def reduce_dtype(self) -> str:
        return "bf16" if self is Precision.BF16_PURE else "fp32"

    @property
    def mixed(self) -> bool:
        """True when compute uses a cast copy of the stored params (FSDP MixedPrecision)."""
        return self in (Precision.BF16, Precision.FP16)


class Optimizer(str, Enum):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"               # with momentum
    ADAMW_8BIT = "adamw-8bit"  # bitsandbytes-style: two 1-byte states per parameter

    def state_bytes_per_param(self, param_dtype: str) -> float:
        """Persistent optimizer state per trainable parameter (ZeRO paper, formulas.md)."""
        width = 4 if param_dtype == "fp32" else 2
        return {"adamw": 2 * width, "adam": 2 * width, "sgd": width, "adamw-8bit": 2}[self.value]


class Attention(str, Enum):
    SDPA = "sdpa"    # fused kernels: no s^2 score storage
    EAGER = "eager"  # explicit softmax(QK^T): stores a*s^2 scores per sequence and layer


class Finetune(str, Enum):
    FULL = "full"
    LORA = "lora"


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


def _positive(field_name: str, value, allow_zero: bool = False) -> None:
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise SpecError(field_name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts MLP of a model's sparse blocks (Mixtral, Qwen-MoE, DeepSeek, gpt-oss).

    transformers 5 stores a sparse layer's routed experts as stacked tensors (experts x out x in, e.g.
    gate_up_proj and down_proj), which FSDP2 shards along dim 0 = the expert index: with fewer experts
    than ranks a rank holds whole experts and the rest is padding (cost_models/moe.py). A model whose
    first `n_dense_layers` blocks have a dense MLP (DeepSeek's first_k_dense_replace) keeps
    ModelSpec.block_params for the sparse block and `dense_block_params` for those.
    """

    n_experts: int                  # routed experts per sparse layer
    experts_per_token: int          # top-k: routed experts each token visits
    expert_ffn_size: int            # intermediate width of one routed expert
    expert_params: int              # parameters of one routed expert (its slice of the stacked tensors)
    stacked_expert_tensors: tuple[tuple[int, int], ...] = ()  # (dim 0 = n_experts, elements per expert) of each stacked tensor
    router_params: int = 0          # per sparse layer: the router's weight (+ bias)
    shared_ffn_size: int = 0        # total intermediate width of the always-active shared expert(s); 0 = none
    shared_params: int = 0          # per sparse layer: the shared expert(s) (+ their gate)
    n_dense_layers: int = 0         # blocks with a dense MLP instead (DeepSeek's leading ones, Llama 4's interleaved)
    first_sparse_layer: int = 0     # index of the first sparse block (= n_dense_layers when the dense ones lead)
    dense_layers: tuple[int, ...] = ()  # the dense blocks' indices; () = the first n_dense_layers when they lead
    #                                     (first_sparse_layer == n_dense_layers), else spread evenly
    dense_block_params: int = 0     # parameters of one of those dense blocks
    dense_ffn_size: int = 0         # their MLP width
    renormalise_top_k: bool = True    # the top-k routing weights are divided by their sum (Mixtral; norm_topk_prob)
    fp32_routing_weights: bool = False  # they stay fp32, so the weighted expert outputs are fp32 (Mixtral, DeepSeek)
    router_kind: str = "softmax"      # softmax (fp32, over all experts) then top-k | topk_softmax (gpt-oss: top-k
    #                                   logits, then a compute-dtype softmax over those k)
    expert_activation: str = "swiglu"  # swiglu | clamped_swiglu (gpt-oss: clamp, x * sigmoid(alpha x), (up + 1) x glu)
    expert_bias: bool = False         # biased expert projections (gpt-oss): the sorted expert ids are kept for them

    def __post_init__(self):
        for name in ("n_experts", "experts_per_token", "expert_ffn_size", "expert_params"):
            _positive(f"model.moe.{name}", getattr(self, name))
        if self.experts_per_token > self.n_experts:
            raise SpecError("model.moe.experts_per_token",
                            f"{self.experts_per_token} is more than n_experts={self.n_experts}")
        if self.n_dense_layers and not self.dense_block_params:
            raise SpecError("model.moe.dense_block_params", "must be > 0 when n_dense_layers > 0")
        if self.dense_layers and (len(set(self.dense_layers)) != self.n_dense_layers or min(self.dense_layers) < 0):
            raise SpecError("model.moe.dense_layers", f"{self.dense_layers!r} must be n_dense_layers="
                                                      f"{self.n_dense_layers} distinct indices >= 0")
        for name, valid in (("router_kind", ("softmax", "topk_softmax")), ("expert_activation", ("swiglu", "clamped_swiglu"))):
            if getattr(self, name) not in valid:
                raise SpecError(f"model.moe.{name}", f"{getattr(self, name)!r}; choose one of: {', '.join(valid)}")

    @property
    def routed_params(self) -> int:
        """All routed experts of one sparse layer."""
        return self.n_experts * self.expert_params

    @property
    def inactive_params(self) -> int:
        """Routed-expert parameters of one sparse layer a token does not visit."""
        return (self.n_experts - self.experts_per_token) * self.expert_params


@dataclass(frozen=True)
class BackwardMoment:
    """One moment of a block's backward, above what is live when it starts: gradient bytes of the block's
    weights accumulated by then, and activation bytes = const + tokens x (per_token + per_token_per_seq x s)
    (const: token-independent temporaries such as a weight gradient before it is accumulated)."""

    grad_bytes: int
    const_bytes: float
    per_token: float
    per_token_per_seq: float
    experts_done: bool = False  # MoE: after the routed experts' backward (an expert unit has resharded by then)

    def activation_bytes(self, tokens: int, seq_len: int) -> float:
        return self.const_bytes + tokens * (self.per_token + self.per_token_per_seq * seq_len)


@dataclass(frozen=True)
class TracedOperators:
    """One block's operators counted in a traced forward and backward (calibration/block_ops.py), per token:
    the forward's matmuls as (n, k, rows per token, count) - the backward's two products per weight are
    priced from them -, the attention kernel's forward FLOPs, and the HBM bytes every other non-view op
    read and wrote in forward and in backward."""

    matmuls: tuple[tuple[int, int, float, int], ...]
    attention_flops_per_token: float
    attention_reference_flops: float
    memory_forward_bytes_per_token: float
    memory_backward_bytes_per_token: float


@dataclass(frozen=True)
class ActivationTerms:
    """One block's activation memory for one (compute dtype, attention), fitted from traces of the real
    block (calibration/block_profile.py); tokens = micro-batch x seq_len."""

    saved_per_token: float              # what the block saves for backward, per token
    saved_per_token_per_seq: float      # ... the part that grows with the sequence (scores, masks)
    backward_moments: tuple[BackwardMoment, ...]  # candidates for the block's backward peak
    dense: "ActivationTerms | None" = None  # an MoE model's dense blocks (MoeSpec.n_dense_layers), profiled apart
    # The blocks' inputs besides the hidden states (masks, rotary tables, positions), which activation
    # checkpointing keeps alive to the backward: bytes = a*s + b_*b*s + q*s^2 + qb*b*s^2, coefficients in
    # that order (micro-batch b, sequence s).
    checkpoint_held: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    operators: TracedOperators | None = None  # the block's operator inventory (step time), traced with it

    def checkpoint_held_bytes(self, micro_batch: int, seq_len: int) -> float:
        a, ab, q, qb = self.checkpoint_held
        return seq_len * (a + ab * micro_batch) + seq_len * seq_len * (q + qb * micro_batch)

    def saved_bytes_per_token(self, seq_len: int) -> float:
        return self.saved_per_token + self.saved_per_token_per_seq * seq_len

    def backward_peak(self, tokens: int, seq_len: int) -> tuple[float, int]:
        """(activation bytes, gradient bytes) at the moment of the block's backward where their sum peaks,
        above the block's saved tensors and everything live before its backward."""
        best = max(self.backward_moments, key=lambda m: m.activation_bytes(tokens, seq_len) + m.grad_bytes)
        return best.activation_bytes(tokens, seq_len), best.grad_bytes


@dataclass(frozen=True)
class ActivationProfile:
    """Per-block activation memory traced from the real model (planner/models/generic.py): used instead
    of the per-family formulas of activations.py for families that have none. Keyed by
    (compute dtype, attention)."""

    terms: tuple[tuple[str, str, ActivationTerms], ...]
    source: str = ""                    # how it was made: layers and points traced, seconds, cache key

    def get(self, compute_dtype: str, attention: str) -> ActivationTerms | None:
        for dtype, attn, terms in self.terms:
            if dtype == compute_dtype and attn == attention:
                return terms
        return None


@dataclass(frozen=True)
class ModelSpec:
    """A decoder (or encoder) transformer: L identical blocks plus a root (embeddings, final norm, head).

    Parameter counts are exact (they equal sum(p.numel()) of the torch model built from the same
    config); the shape fields drive FLOPs and activation memory.
    """

    name: str
    family: str              # HF model_type for activation accounting: llama, mistral, qwen2, phi3, gpt2, gpt_neox, opt, bloom, falcon, mpt, bert; generic
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    block_params: int        # parameters of one block
    embedding_params: int    # token (+ position, token-type) embedding tables
    head_params: int         # untied output projection (0 when tied to the embeddings)
    root_other_params: int   # final norm, pooler, MLM transform: root params that are not embeddings/head
    block_class: str         # module class repeated L times: the auto-wrap unit
    gated_mlp: bool = False          # SwiGLU-style: gate and up projections
    norm: str = "layernorm"          # layernorm | rmsnorm (eager, fp32 upcast) | fused_rmsnorm | rmsnorm_fp32
    #                                  (the weight applied in fp32 too: Gemma's (1 + w), OLMo 2)
    norm_layout: str = "pre"         # pre | sandwich (norms before and after each sublayer: Gemma 2/3) | post (OLMo 2)
    qk_norm: str = ""                # "" | head (q, k normed over head_dim: Qwen3, Gemma 3) | full (q_dim, kv_dim: OLMo 2)
    activation: str = "gelu"         # silu | gelu | gelu_new | relu | gelu_tanh
    parallel_block: bool = False     # attention and MLP read the same normed input (GPT-J/NeoX/Falcon)
    tied_embeddings: bool = False
    dropout: bool = False            # dropout with p > 0 in training (masks are saved for backward)
    attention_dropout: bool | None = None  # dropout on the attention probabilities; None = as `dropout` (Phi-2: off)
    causal: bool = True              # False for encoders (BERT): no causal LM loss shift
    lora_target_shapes: tuple[tuple[int, int], ...] = ()  # (in, out) of each block linear LoRA adapts
    max_seq_len: int = 0             # 0 = unknown / unlimited (rotary, ALiBi)
    sliding_window: int = 0          # attention window in tokens (Mistral 7B v0.1: 4096); 0 = full attention
    full_attention_layers: int = 0   # with a window: layers that still attend fully (Gemma 2/3, gpt-oss alternate)
    attn_softcap: bool = False       # tanh soft-capping of the attention scores (Gemma 2)
    logit_softcap: bool = False      # tanh soft-capping of the logits (Gemma 2)
    moe: MoeSpec | None = None       # mixture-of-experts shape of the sparse blocks; None = dense
    attention_choices: tuple[str, ...] = ("sdpa", "eager")  # implementations the family runs (Gemma 2: eager only)
    activation_profile: ActivationProfile | None = None     # traced per-block activations (families without a formula)

    def __post_init__(self):
        for name in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_size",
                     "vocab_size", "block_params"):
            _positive(f"model.{name}", getattr(self, name))
        for name in ("embedding_params", "head_params", "root_other_params"):
            _positive(f"model.{name}", getattr(self, name), allow_zero=True)
        if self.n_heads % self.n_kv_heads:
            raise SpecError("model.n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if self.moe is not None and self.moe.n_dense_layers >= self.n_layers:
            raise SpecError("model.moe.n_dense_layers", f"{self.moe.n_dense_layers} leaves no sparse block of "
                                                        f"n_layers={self.n_layers}")
        if self.moe is not None and self.moe.dense_layers and max(self.moe.dense_layers) >= self.n_layers:
            raise SpecError("model.moe.dense_layers", f"{self.moe.dense_layers!r} has an index >= "
                                                      f"n_layers={self.n_layers}")
        unknown = set(self.attention_choices) - {a.value for a in Attention}
        if not self.attention_choices or unknown:
            raise SpecError("model.attention_choices", f"{self.attention_choices!r}; choose from: {_choices(Attention)}")

    @property
    def root_params(self) -> int:
        """Parameters outside the repeated blocks: they form the root FSDP unit."""
        return self.embedding_params + self.head_params + self.root_other_params

    @property
    def n_dense_layers(self) -> int:
        return self.moe.n_dense_layers if self.moe else 0

    def dense_block_indices(self) -> frozenset[int]:
        """Which blocks have a dense MLP: MoeSpec.dense_layers, else the leading ones, else spread evenly."""
        moe = self.moe
        if moe is None or not moe.n_dense_layers:
            return frozenset()
        if moe.dense_layers:
            return frozenset(moe.dense_layers)
        if moe.first_sparse_layer == moe.n_dense_layers:
            return frozenset(range(moe.n_dense_layers))
        L, nd = self.n_layers, moe.n_dense_layers
        return frozenset(i for i in range(L) if (i + 1) * nd // L > i * nd // L)

    @property
    def total_block_params(self) -> int:
        """All repeated blocks: the sparse ones at block_params, leading dense ones (MoE) at their own size."""
        dense = self.n_dense_layers
        return (self.n_layers - dense) * self.block_params + (dense * self.moe.dense_block_params if dense else 0)

    @property
    def n_params(self) -> int:
        return self.total_block_params + self.root_params

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: the routed experts it does not visit left out (= n_params
        for dense models). FLOPs scale with these."""
        if self.moe is None:
            return self.n_params
        return self.n_params - (self.n_layers - self.n_dense_layers) * self.moe.inactive_params

    def summary_dict(self) -> dict:
        """The model as JSON output names it: size, active size (MoE) and which activation model prices it."""
        out = {"name": self.name, "n_params": self.n_params}
        if self.moe is not None:
            out["active_params"] = self.active_params
        out["priced_by"] = self.priced_by
        if self.activation_profile is not None:
            out["activation_profile"] = self.activation_profile.source
        return out

    @property
    def priced_by(self) -> str:
        """Which activation model prices this spec: the family's formulas or a traced block profile."""
        return "block memory profile" if self.activation_profile is not None and self.activation_profile.terms \
            else "formula"

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    def lora_params_per_block(self, rank: int) -> int:
        return sum(rank * (i + o) for i, o in self.lora_target_shapes)


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator and the usual server it comes in (planner/catalog/gpus.json, with sources).

    The fields after `source` describe what the cost model does not read yet (the architecture, the
    scale-up domain, the host link, the NICs; planner/hardware.py sizes nodes by default_gpus_per_node);
    their defaults keep every older construction valid. Bandwidths are per GPU and direction unless per node.
    """

    id: str
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    peak_flops: dict = field(default_factory=dict)  # dtype -> dense FLOP/s ("bf16", "fp16", "fp32", "fp8")
    intra_node_bus_bytes_per_s: float = 0.0          # NCCL bus bandwidth inside a node
    pcie_bytes_per_s: float = 25e9                   # host<->device, per direction, per GPU, as copies reach it
    default_internode_gbit_per_s: float = 1600.0     # per node, all NICs together
    default_cpu_ram_bytes_per_node: int = 0          # the usual server for this GPU; 0 = unknown
    source: str = ""
    architecture: str = ""                           # ampere, hopper, ada, blackwell, volta, cdna3, cdna4; "" = unknown
    default_gpus_per_node: int = 8                   # GPUs in the usual server (GB200: a compute tray of 4)
    scale_up_domain_gpus: int = 0                    # GPUs joined by NVLink / Infinity Fabric (HGX 8, NVL72 72);
    #                                                  1 = none (PCIe only); 0 = unknown: taken as the node
    scale_up_link: str = ""                          # e.g. "NVLink4 over NVSwitch"
    scale_up_peak_bytes_per_s: float = 0.0           # datasheet peak of that link; 0 = none or unknown
    host_link: str = ""                              # "PCIe Gen5 x16", "NVLink-C2C" (GH200, GB200)
    host_link_peak_bytes_per_s: float = 0.0          # datasheet peak (pcie_bytes_per_s is what copies reach)
    nics_per_node: int = 0                           # 0 = unknown
    nic: str = ""                                    # e.g. "8 x 400 Gb/s NDR InfiniBand (ConnectX-7)"
    matmul_efficiency: float = 0.0                   # best measured large bf16 GEMM / bf16 peak; 0 = unknown
    attention_efficiency: float = 0.0                # SDPA flash kernel fwd+bwd / bf16 peak (long s, head dim 128); 0 = unknown

    def __post_init__(self):
        _positive("gpu.memory_bytes", self.memory_bytes)
        _positive("gpu.hbm_bytes_per_s", self.hbm_bytes_per_s)
        _positive("gpu.intra_node_bus_bytes_per_s", self.intra_node_bus_bytes_per_s)
        _positive("gpu.pcie_bytes_per_s", self.pcie_bytes_per_s)
        _positive("gpu.default_gpus_per_node", self.default_gpus_per_node)
        for name in ("scale_up_domain_gpus", "scale_up_peak_bytes_per_s", "host_link_peak_bytes_per_s",
                     "nics_per_node", "matmul_efficiency", "attention_efficiency"):
            _positive(f"gpu.{name}", getattr(self, name), allow_zero=True)

    def supports(self, dtype: str) -> bool:
        return self.peak_flops.get(dtype, 0) > 0

    def priced_peak_flops(self, dtype: str) -> float:
        """The dense peak the step time prices `dtype` at: a dtype the GPU lacks runs emulated, at the fp32
        rate (evaluate rejects it anyway)."""
        return self.peak_flops.get(dtype) or self.peak_flops["fp32"]


@dataclass(frozen=True)
class ClusterSpec:
    gpu: GpuSpec
    n_gpus: int
    gpus_per_node: int
    internode_bytes_per_s: float     # per node, shared by its GPUs
    cpu_ram_bytes_per_node: int = 0  # 0 = unknown: offload RAM is reported, not checked
    scale_up_domain_gpus: int = 0    # GPUs of this cluster in one NVLink / Infinity Fabric domain (a 72-GPU
    #                                  GB200 NVL72 cluster: 72); 0 = the node. A process group inside it
    #                                  runs on the fast tier (fast_tier_gpus)

    def __post_init__(self):
        _positive("gpus", self.n_gpus)
        _positive("gpus_per_node", self.gpus_per_node)
        _positive("internode_gbps", self.internode_bytes_per_s)
        _positive("cpu_ram_per_node", self.cpu_ram_bytes_per_node, allow_zero=True)
        _positive("scale_up_domain_gpus", self.scale_up_domain_gpus, allow_zero=True)
        if self.gpus_per_node > self.n_gpus:
            raise SpecError("gpus_per_node", f"{self.gpus_per_node} is more than gpus={self.n_gpus}")
        if self.scale_up_domain_gpus > self.n_gpus:
            raise SpecError("scale_up_domain_gpus", f"{self.scale_up_domain_gpus} is more than gpus={self.n_gpus}")

    @property
    def n_nodes(self) -> int:
        return -(-self.n_gpus // self.gpus_per_node)

    @property
    def scale_up_gpus(self) -> int:
        """GPUs that share one scale-up domain here: the domain's size, else (0, unknown) the node's."""
        return self.scale_up_domain_gpus or self.gpus_per_node

    @property
    def fast_tier_gpus(self) -> int:
        """GPUs a process group can span on the intra-node tier (GpuSpec.intra_node_bus_bytes_per_s): the
        node (PCIe parts too: their bus figure is PCIe's), or the larger scale-up domain (GB200 NVL72: 72
        GPUs over NVLink across 18 trays of 4)."""
        return max(self.gpus_per_node, self.scale_up_domain_gpus)


@dataclass(frozen=True)
class TrainingSpec:
    seq_len: int = 2048
    global_batch: int | None = None   # sequences per optimizer step; None = micro-batch x GPUs x accumulation
    optimizer: Optimizer = Optimizer.ADAMW
    finetune: Finetune = Finetune.FULL
    lora_rank: int = 16
    # expert parallelism: the busiest rank's routed rows over the mean (1 = balanced routing, what is priced by
    # default); it scales that rank's grouped-GEMM rows, their saved activations and the all-to-all it waits on
    routing_imbalance: float = 1.0

    def __post_init__(self):
        _positive("seq_len", self.seq_len)
        if not isinstance(self.routing_imbalance, (int, float)) or self.routing_imbalance < 1:
            raise SpecError("routing_imbalance", f"must be >= 1 (the busiest rank's rows over the mean), got "
                                                 f"{self.routing_imbalance!r}")
        if self.global_batch is not None:
            _positive("global_batch", self.global_batch)
        _positive("lora_rank", self.lora_rank)
        object.__setattr__(self, "optimizer", parse_enum(Optimizer, self.optimizer, "optimizer"))
        object.__setattr__(self, "finetune", parse_enum(Finetune, self.finetune, "finetune"))

    @property
    def adapter_rank(self) -> int:
        """The LoRA rank when fine-tuning with LoRA, else 0 (what the activation formulas take)."""
        return self.lora_rank if self.finetune is Finetune.LORA else 0

    def grad_accum_for(self, micro_batch: int, data_parallel: int) -> int | None:
        """Micro-steps that reach the global batch (1 without one); None when micro_batch x the data-parallel
        ranks (the GPUs over tp x cp x pp) does not divide it."""
        if self.global_batch is None:
            return 1
        per_step = micro_batch * data_parallel
        return None if self.global_batch % per_step else self.global_batch // per_step


REDUCE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class FsdpConfig:
    """One candidate: the knobs FSDP exposes, plus micro-batch and accumulation.

    Wrapping is one unit per repeated block plus the root (torchtitan's layout), which is what every
    emitted config does; with expert_units an MoE model's routed experts (the module holding a sparse
    block's stacked expert tensors) are a unit of their own inside their block's.
    """

    sharding: Sharding = Sharding.FULL_SHARD
    precision: Precision = Precision.BF16
    offload: bool = False
    ac_every: int = 0                 # 0 none, 1 every block, K every K-th block
    micro_batch: int = 1
    grad_accum: int = 1
    attention: Attention = Attention.SDPA
    backward_prefetch: bool = True    # BackwardPrefetch.BACKWARD_PRE (FSDP2 always prefetches)
    forward_prefetch: bool = False
    limit_all_gathers: bool = True    # FSDP1 rate limiter: at most two all-gathers in flight
    expert_shard_dim: int = 0         # FSDP2: 0 shards every parameter on dim 0 (stacked experts padded to a multiple
    #                                   of the shard group); 1 shards the stacked expert matrices on dim 1 when the
    #                                   group does not divide the experts (shard_placement_fn), unpadded
    expert_units: bool = False        # MoE: each sparse block's routed experts wrapped as their own FSDP unit
    reduce_dtype: str | None = None   # gradient reduction dtype (fp32 | bf16); None: the precision's own
    # torchtitan's selective op-level checkpointing in every block (published.md): matmul, SDPA and max outputs
    # saved except every second matmul, everything else recomputed; ac_every is 0 with it. Construct with
    # ac_every="selective-op" (the CLI's --activation-checkpointing value) or selective_op_ac=True.
    selective_op_ac: bool = False
    compile: bool = False             # torch.compile of each block (torchtitan compiles per block)
    compile_loss: bool = True         # with compile, the loss too (torchtitan's compile.components default
    #                                   ["model", "loss"]): one fused cross-entropy kernel, no fp32 logits
    float8: bool = False              # torchao Float8 linears (dynamic tensorwise scaling) on FP8 tensor cores
    fp8_all_gather: bool = False      # with float8, FSDP2 all-gathers the Float8 linears' weights in FP8 (1 byte)
    reshard_after_forward: int = 0    # FSDP2 int: after forward keep params sharded over this many ranks (a
    #                                   divisor of the shard group, e.g. the node) and all-gather only among
    #                                   them in backward; 0: the strategy's own (FULL_SHARD: the whole group)
    # The device mesh beside FSDP (cost_models/mesh.py, torchtitan's layout): tensor, context, expert and pipeline
    # degrees; the data-parallel degrees follow from the strategy and the GPUs left (mesh.mesh_of).
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    async_tp: bool = False            # torchtitan's async TP: TP collectives overlapped with the matmuls (compile)
    sequence_parallel: bool = True    # with tp: norms and residuals on s/tp tokens, loss parallel (torchtitan);
    #                                   False: transformers' tp_plan (accelerate, HF Trainer): activations
    #                                   replicated between blocks, the head colwise with its logits gathered
    # Pipeline stages (cost_models/pipeline.py): with pp > 1 the local batch (global batch / data-parallel ranks)
    # is split into grad_accum microbatches of micro_batch sequences, all run by one schedule step.
    pp_schedule: Schedule = Schedule.ONE_F_ONE_B
    pp_stages_per_rank: int = 0       # V stages on each pipeline rank; 0: the schedule's own (1, looped ones 2)

    def __post_init__(self):
        if isinstance(self.ac_every, str) and self.ac_every.strip().lower() == SELECTIVE_OP:
            object.__setattr__(self, "ac_every", 0)
            object.__setattr__(self, "selective_op_ac", True)
        object.__setattr__(self, "sharding", parse_enum(Sharding, self.sharding, "sharding"))
        object.__setattr__(self, "precision", parse_enum(Precision, self.precision, "precision"))
        object.__setattr__(self, "attention", parse_enum(Attention, self.attention, "attention"))
        object.__setattr__(self, "ac_every", parse_activation_checkpointing(self.ac_every))
        _positive("micro_batch", self.micro_batch)
        _positive("grad_accum", self.grad_accum)
        if not self.compile:  # compile_loss means nothing without compile: one spelling, so configs compare equal
            object.__setattr__(self, "compile_loss", True)
        if self.expert_shard_dim not in (0, 1):
            raise SpecError("expert_shard_dim", f"{self.expert_shard_dim!r}; choose 0 (dim 0, padded) or 1")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise SpecError("reduce_dtype", f"{self.reduce_dtype!r}; choose one of: {', '.join(REDUCE_DTYPES)}")
        if self.selective_op_ac and self.ac_every:
            raise SpecError("activation_checkpointing", f"{SELECTIVE_OP} checkpoints every block by op; "
                            f"it cannot be combined with {format_activation_checkpointing(self.ac_every)}")
        if self.fp8_all_gather and not self.float8:
            raise SpecError("fp8_all_gather", "needs float8 (the FP8 all-gather moves Float8 linears' weights)")
        if self.fp8_all_gather and self.sharding is Sharding.NO_SHARD:
            raise SpecError("fp8_all_gather", "NO_SHARD all-gathers nothing; choose FULL_SHARD, SHARD_GRAD_OP or a "
                                              "HYBRID_SHARD strategy")
        if self.reshard_after_forward < 0 or self.reshard_after_forward == 1:
            raise SpecError("reshard_after_forward", f"{self.reshard_after_forward}; give a group of >= 2 ranks "
                            "(a divisor of the shard group), or 0 for the strategy's own")
        for name in ("tp", "cp", "ep", "pp"):
            check_degree(name, getattr(self, name))
        if self.ep > 1:  # expert parallelism puts each rank's experts in a unit of their own (on the efsdp mesh)
            object.__setattr__(self, "expert_units", True)
        if self.tp == 1:  # sequence parallel means nothing without TP: one spelling, so configs compare equal
            object.__setattr__(self, "sequence_parallel", True)
        if self.async_tp and self.tp == 1:
            raise SpecError("async_tp", "needs tensor parallelism (tp >= 2)")
        if self.async_tp and not self.compile:
            raise SpecError("async_tp", "needs torch.compile (torchtitan's async TP runs on compiled blocks): add compile")
        if self.async_tp and not self.sequence_parallel:
            raise SpecError("async_tp", "overlaps the sequence-parallel all-gathers and reduce-scatters; it needs "
                                        "sequence_parallel")
        object.__setattr__(self, "pp_schedule", parse_enum(Schedule, self.pp_schedule, "pp_schedule"))
        self._check_pipeline()
        if self.cp > 1 and self.sharding is Sharding.NO_SHARD:
            raise SpecError("cp", "FSDP2 shards over dp_shard x cp even without data parallelism: with cp > 1 "
                                  "choose FULL_SHARD, SHARD_GRAD_OP or a HYBRID_SHARD strategy, not NO_SHARD")
        if self.reshard_after_forward and self.sharding not in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD):
            raise SpecError("reshard_after_forward", f"an int group needs FULL_SHARD or HYBRID_SHARD, not "
                            f"{self.sharding.value} (which keeps params gathered after forward)")

    def _check_pipeline(self) -> None:
        """The schedule's own shape (torch.distributed.pipelining.schedules raises on each of these); the rules
        on blocks and microbatches are in cost_models/pipeline.py."""
        schedule, v = self.pp_schedule, self.pp_stages_per_rank
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise SpecError("pp_stages_per_rank", f"must be an integer >= 1 (0: the schedule's own), got {v!r}")
        if self.pp == 1:  # no pipeline: one spelling, so configs compare equal
            object.__setattr__(self, "pp_schedule", Schedule.ONE_F_ONE_B)
            object.__setattr__(self, "pp_stages_per_rank", 1)
            return
        if v == 0:
            object.__setattr__(self, "pp_stages_per_rank", v := schedule.default_stages_per_rank)
        if v > 1 and not schedule.looped:
            looped = ", ".join(s.value for s in Schedule if s.looped)
            raise SpecError("pp_stages_per_rank", f"{v} needs a looped schedule ({looped}); {schedule.value} runs "
                                                  "one stage per rank")
        if schedule.v_shaped and v != 2:
            raise SpecError("pp_stages_per_rank", f"{schedule.value} runs exactly 2 stages per rank (a V), got {v}")

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: pp x stages per rank."""
        return self.pp * self.pp_stages_per_rank

    @property
    def pp_microbatches(self) -> int:
        """Microbatches one schedule step runs (1 without a pipeline)."""
        return self.grad_accum if self.pp > 1 else 1

    @property
    def gradient_reduce_dtype(self) -> str:
        """dtype of the reduce-scatter / all-reduce of gradients: the override, else the precision's."""
        return self.reduce_dtype or self.precision.reduce_dtype

    @property
    def activation_checkpointing(self) -> str:
        return format_activation_checkpointing(self.ac_every, self.selective_op_ac)

    @property
    def loss_compiled(self) -> bool:
        """The cross-entropy runs compiled (fused; activations.loss_events)."""
        return self.compile and self.compile_loss

    @property
    def checkpoints(self) -> bool:
        """Any activation checkpointing (block-level or selective op-level)."""
        return bool(self.ac_every or self.selective_op_ac)

    @property
    def model_parallel(self) -> int:
        """Ranks of one data-parallel rank's model copy: tp x cp x pp (they see the same sequences)."""
        return self.tp * self.cp * self.pp

    def data_parallel_size(self, cluster: ClusterSpec) -> int:
        """Ranks that see different sequences (dp_replicate x dp_shard): the GPUs over tp x cp x pp."""
        return max(1, cluster.n_gpus // self.model_parallel)

    def dp_degrees(self, n_gpus: int, gpus_per_node: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard): FULL_SHARD-like strategies shard over all data-parallel ranks, HYBRID ones
        over those of a node (the node's GPUs over tp x cp), NO_SHARD over none; the rest replicates."""
        dp = max(1, n_gpus // self.model_parallel)
        if self.sharding is Sharding.NO_SHARD:
            return dp, 1
        shard = max(1, min(dp, gpus_per_node // (self.tp * self.cp))) if self.sharding.is_hybrid else dp
        return dp // shard, shard

    def dp_shard_size(self, cluster: ClusterSpec) -> int:
        return self.dp_degrees(cluster.n_gpus, cluster.gpus_per_node)[1]

    def shard_group_size(self, cluster: ClusterSpec) -> int:
        """d: ranks that share one copy of the model state (FSDP's dp_shard x cp)."""
        return self.dp_shard_size(cluster) * self.cp

    def replicate_group_size(self, cluster: ClusterSpec) -> int:
        """r: copies of the model state (data-parallel replicas of the shard group, dp_replicate)."""
        return self.dp_degrees(cluster.n_gpus, cluster.gpus_per_node)[0]

    def to_dict(self) -> dict:
        return {
            "sharding": self.sharding.value,
            "precision": self.precision.value,
            "offload": self.offload,
            "activation_checkpointing": self.activation_checkpointing,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "attention": self.attention.value,
            "backward_prefetch": self.backward_prefetch,
            "forward_prefetch": self.forward_prefetch,
            "limit_all_gathers": self.limit_all_gathers,
            **({"expert_shard_dim": self.expert_shard_dim} if self.expert_shard_dim else {}),
            **({"expert_units": True} if self.expert_units else {}),
            **({"reduce_dtype": self.reduce_dtype} if self.reduce_dtype else {}),
            **({"compile": True} if self.compile else {}),
            **({"compile_loss": False} if self.compile and not self.compile_loss else {}),
            **({"float8": True} if self.float8 else {}),
            **({"fp8_all_gather": True} if self.fp8_all_gather else {}),
            **({"reshard_after_forward": self.reshard_after_forward} if self.reshard_after_forward else {}),
            "tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp,
            **({"async_tp": True} if self.async_tp else {}),
            **({"sequence_parallel": False} if self.tp > 1 and not self.sequence_parallel else {}),
            **({"pp_schedule": self.pp_schedule.value, "pp_stages_per_rank": self.pp_stages_per_rank}
               if self.pp > 1 else {}),
        }
