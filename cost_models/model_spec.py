"""What is trained: ModelSpec, its mixture-of-experts MLP (MoeSpec) and the traced activation profile a
family without a formula is priced by (ActivationProfile, ActivationTerms, BackwardMoment, TracedOperators).
cost_models/specs.py re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import moe_lora_targets
from .identity_memo import IdentityMemo
from .spec_values import Attention, LoraTargets, SpecError, check_positive, enum_choices, parse_enum


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
    #                                   logits, then a compute-dtype softmax over those k) | sigmoid (DeepSeek-V3)
    expert_activation: str = "swiglu"  # swiglu | clamped_swiglu (gpt-oss: clamp, x * sigmoid(alpha x), (up + 1) x glu)
    expert_bias: bool = False         # biased expert projections (gpt-oss): the sorted expert ids are kept for them
    fp32_router_input: bool = False   # the router runs on an fp32 copy of its input (DeepSeek's routers)
    router_groups: int = 0            # group-limited routing (DeepSeek n_group; 0 = none): a group's score is its
    #                                   max (softmax) or top-2 sum (sigmoid), topk_group groups are kept
    router_topk_groups: int = 0

    def __post_init__(self):
        for name in ("n_experts", "experts_per_token", "expert_ffn_size", "expert_params"):
            check_positive(f"model.moe.{name}", getattr(self, name))
        if self.experts_per_token > self.n_experts:
            raise SpecError("model.moe.experts_per_token",
                            f"{self.experts_per_token} is more than n_experts={self.n_experts}")
        if self.n_dense_layers and not self.dense_block_params:
            raise SpecError("model.moe.dense_block_params", "must be > 0 when n_dense_layers > 0")
        if self.dense_layers and (len(set(self.dense_layers)) != self.n_dense_layers or min(self.dense_layers) < 0):
            raise SpecError("model.moe.dense_layers", f"{self.dense_layers!r} must be n_dense_layers="
                                                      f"{self.n_dense_layers} distinct indices >= 0")
        for name, valid in (("router_kind", ("softmax", "topk_softmax", "sigmoid")),
                            ("expert_activation", ("swiglu", "clamped_swiglu"))):
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

    def without_operators(self) -> "ActivationProfile":
        """The same memory terms without the traced operator inventory (the step time then prices the structure)."""
        return replace(self, terms=tuple((d, a, replace(t, operators=None)) for d, a, t in self.terms))


# Families whose MLP gate and up projections are one linear (h, 2f): Phi-3's gate_up_proj
FUSED_GATE_UP_FAMILIES = {"phi3"}


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
    rope: str = "eager"              # eager (the family's own ops) | fused (one kernel each way: TE's fused RoPE,
    #                                  a compiled or Triton rotation, as a trainer's own model runs it)
    qk_norm: str = ""                # "" | head (q, k normed over head_dim: Qwen3, Gemma 3) | full (q_dim, kv_dim: OLMo 2)
    activation: str = "gelu"         # silu | gelu | gelu_new | relu | gelu_tanh
    parallel_block: bool = False     # attention and MLP read the same normed input (GPT-J/NeoX/Falcon)
    tied_embeddings: bool = False
    dropout: bool = False            # dropout with p > 0 in training (masks are saved for backward)
    attention_dropout: bool | None = None  # dropout on the attention probabilities; None = as `dropout` (Phi-2: off)
    causal: bool = True              # False for encoders (BERT): no causal LM loss shift
    lora_target_shapes: tuple[tuple[int, int], ...] = ()  # (in, out) of the attention projections LoRA adapts
    lora_targets: LoraTargets = LoraTargets.ATTENTION  # those only, or all-linear: the MLP's too (lora_shapes)
    max_seq_len: int = 0             # 0 = unknown / unlimited (rotary, ALiBi)
    sliding_window: int = 0          # attention window in tokens (Mistral 7B v0.1: 4096); 0 = full attention
    full_attention_layers: int = 0   # with a window: layers that still attend fully (Gemma 2/3, gpt-oss alternate)
    attn_softcap: bool = False       # tanh soft-capping of the attention scores (Gemma 2)
    logit_softcap: bool = False      # tanh soft-capping of the logits (Gemma 2)
    moe: MoeSpec | None = None       # mixture-of-experts shape of the sparse blocks; None = dense
    attention_choices: tuple[str, ...] = ("sdpa", "eager")  # implementations the family runs (Gemma 2: eager only)
    eager_softmax_fp32: bool | None = None  # eager attention's softmax in fp32; None: the family's (activations.py)
    # DeepSeek's multi-head latent attention (kv_lora_rank > 0): head_dim is the q/k width, qk_nope + qk_rope
    kv_lora_rank: int = 0            # kv_a_proj's latent width (0 = not MLA)
    q_lora_rank: int = 0             # q_a_proj's rank (0 = a plain q_proj: V2-Lite)
    qk_rope_head_dim: int = 0        # the rotated part of each q/k head
    v_head_dim: int = 0              # each value head's width
    activation_profile: ActivationProfile | None = None     # traced per-block activations (families without a formula)
    lora_activation_profile: ActivationProfile | None = None  # the same traced under LoRA (generic families)
    # FSDP units as the trainer wraps the model (torchtitan 0.3's apply_fsdp_to_decoder): the embedding a unit of its
    # own, resharded after forward, and [final norm, head] another, kept gathered to its backward, where the rest
    # wrap the root (embedding, norm, head; FSDP2 keeps it gathered from forward to the end of backward). Tied
    # embeddings stay one unit either way (torchtitan groups them): see split_edge_units
    edge_units: bool = False

    def __post_init__(self):
        for name in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_size",
                     "vocab_size", "block_params"):
            check_positive(f"model.{name}", getattr(self, name))
        for name in ("embedding_params", "head_params", "root_other_params"):
            check_positive(f"model.{name}", getattr(self, name), allow_zero=True)
        if self.n_heads % self.n_kv_heads:
            raise SpecError("model.n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if self.moe is not None and self.moe.n_dense_layers >= self.n_layers:
            raise SpecError("model.moe.n_dense_layers", f"{self.moe.n_dense_layers} leaves no sparse block of "
                                                        f"n_layers={self.n_layers}")
        if self.moe is not None and self.moe.dense_layers and max(self.moe.dense_layers) >= self.n_layers:
            raise SpecError("model.moe.dense_layers", f"{self.moe.dense_layers!r} has an index >= "
                                                      f"n_layers={self.n_layers}")
        if self.rope not in ("eager", "fused"):
            raise SpecError("model.rope", f"{self.rope!r}; choose one of: eager, fused")
        object.__setattr__(self, "lora_targets", parse_enum(LoraTargets, self.lora_targets, "lora_targets"))
        if self.lora_targets is LoraTargets.ALL_LINEAR and self.moe is not None and (
                why := moe_lora_targets.unpriced_reason(self)):
            raise SpecError("lora_targets", why)
        unknown = set(self.attention_choices) - {a.value for a in Attention}
        if not self.attention_choices or unknown:
            raise SpecError("model.attention_choices", f"{self.attention_choices!r}; choose from: {enum_choices(Attention)}")

    @property
    def split_edge_units(self) -> bool:
        """The embedding and [final norm, head] are FSDP units apart from the root (edge_units, untied)."""
        return self.edge_units and not self.tied_embeddings and self.head_params > 0

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
        if self.lora_mlp:
            out["lora_targets"] = self.lora_targets.value
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

    @property
    def mlp_linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of the MLP's linears, in module order: gate, up, down (SwiGLU; Phi-3's gate_up_proj fused, as
        its qkv_proj is: planner/models/family_table.py fused_projections) or fc1, fc2."""
        h, f = self.hidden_size, self.ffn_hidden_size
        if self.gated_mlp and self.family in FUSED_GATE_UP_FAMILIES:
            return (h, 2 * f), (f, h)
        return ((h, f), (h, f), (f, h)) if self.gated_mlp else ((h, f), (f, h))

    @property
    def lora_mlp(self) -> bool:
        """LoRA adapts the MLP's linears too (all-linear): their inputs are saved, for the adapters' gradients."""
        return self.lora_targets is LoraTargets.ALL_LINEAR

    @property
    def lora_shapes(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of every block linear peft's lora.Linear adapts: the attention's, and under all-linear a dense
        MLP's (an MoE's router and stacked experts are ParamWrappers instead: lora_tensor_elements)."""
        if self.lora_moe:  # a shared expert's linears (moe_lora_targets.shared_expert_shapes)
            return tuple(self.lora_target_shapes) + moe_lora_targets.shared_expert_shapes(self)
        return tuple(self.lora_target_shapes) + (self.mlp_linear_shapes if self.lora_mlp else ())

    @property
    def shared_expert_gated(self) -> bool:
        """Qwen-MoE's shared expert is scaled by sigmoid(Linear(h -> 1)): its parameters are the MLP's + h."""
        moe, h = self.moe, self.hidden_size
        fs = moe.shared_ffn_size if moe is not None else 0
        return bool(fs) and moe.shared_params - (3 if self.gated_mlp else 2) * h * fs == h

    @property
    def lora_moe(self) -> bool:
        """all-linear on an MoE: peft's router and stacked-expert adapters (cost_models/moe_lora.py)."""
        return self.lora_mlp and self.moe is not None

    def lora_tensor_elements(self, rank: int) -> list[int]:
        """Elements of each adapter tensor of a block, lora_A then lora_B: every lora_shapes linear's, then an MoE's
        router and stacked experts' under all-linear (moe_lora_targets.adapter_tensor_elements)."""
        linears = [n for i, o in self.lora_shapes for n in (rank * i, o * rank)]
        return linears + (moe_lora_targets.adapter_tensor_elements(self, rank) if self.lora_moe else [])

    def lora_params_per_block(self, rank: int) -> int:
        """A (for an MoE: sparse) block's adapter elements."""
        return sum(self.lora_tensor_elements(rank))

    def lora_dense_delta(self, rank: int, tensors: bool = False) -> int:
        """What an MoE's dense blocks add to n_layers sparse blocks' adapter elements (tensors: adapter tensors):
        under all-linear their MLP's lora.Linear adapters, not the router's and stacks' (dense_block_spec)."""
        if not self.n_dense_layers:
            return 0
        dense, count = dense_block_spec(self), (len if tensors else sum)
        return self.n_dense_layers * (count(dense.lora_tensor_elements(rank)) - count(self.lora_tensor_elements(rank)))

    def lora_params(self, rank: int) -> int:
        """Every block's adapter elements (peft's trainable parameters)."""
        return self.n_layers * self.lora_params_per_block(rank) + self.lora_dense_delta(rank)


_DENSE_BLOCK_SPECS = IdentityMemo(limit=256)   # ParamCounts.of reads it at every shard group the search prices


def dense_block_spec(model: ModelSpec) -> ModelSpec | None:
    """The leading dense blocks of an MoE model (DeepSeek's first_k_dense_replace) as a dense ModelSpec,
    or None when every block is sparse."""
    moe = model.moe
    if moe is None or not moe.n_dense_layers:
        return None
    return _DENSE_BLOCK_SPECS.get(model, (), lambda: _dense_block_spec(model))


def _dense_block_spec(model: ModelSpec) -> ModelSpec:
    moe = model.moe
    profile = model.activation_profile  # a traced profile's dense-block terms become the dense spec's own
    if profile is not None:
        profile = ActivationProfile(terms=tuple((d, a, t.dense or t) for d, a, t in profile.terms), source=profile.source)
    return replace(model, moe=None, block_params=moe.dense_block_params,
                   ffn_hidden_size=moe.dense_ffn_size or model.ffn_hidden_size, activation_profile=profile)
