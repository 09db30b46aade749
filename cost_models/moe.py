"""Mixture-of-experts blocks: what FSDP2 really shards and gathers, and what the routed experts save.

Sharding. transformers 5 stores a sparse layer's routed experts as stacked tensors (experts x out x in:
gate_up_proj, down_proj) and the router as an (experts, h) weight. FSDP2 shards every parameter along
dim 0 into chunks of ceil(rows / d) rows, pads each rank's chunk to that size, and all-gathers the padded
chunks (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: padded_sharded_param_size, and an
all-gather output of d x the padded shard that the unsharded parameter is a view of). Rank 0 always
holds a full chunk, so with E experts on d > E ranks it holds one whole expert of each stacked tensor,
ranks E..d-1 hold padding, and every all-gather, gathered block and reduce-scatter moves d rows per
stacked tensor instead of E: d / E times the real size. The same holds for any parameter whose dim 0
is not a multiple of d; for the dense parameters of a block (dim 0 = h, q, kv, f: thousands of rows)
it is at most d - 1 rows per tensor and ignored here. Fix: shard the stacked tensors on a dimension d
divides (FSDP2's shard_placement_fn; a non-zero dim must divide evenly), or a smaller shard group
(HYBRID_SHARD shards inside a node).

Activations: transformers' default experts implementation `grouped_mm`
(transformers/integrations/moe.py, grouped_mm_experts_forward) sorts the b x s x k routed token rows by
expert and runs one grouped matmul per projection. Tensor by tensor (saved_tensors_hooks on Mixtral and
Qwen3-MoE, and the trace tier), per token, k = experts per token, E experts, f expert width, c the
compute dtype, w the routing weights' width (fp32 for Mixtral and DeepSeek, c for Qwen):
- router: the fp32 softmax over E (4E), the top-k indices (8k), with renormalisation the top-k values
  and their sum (4k + 4); its input is the block's second norm output, counted with the norms;
- per routed row (k per token): the gathered token (c*h, the up projection's input), the gate|up output
  (2c*f, which act(gate) and the product both read), act(gate) and the product (the down projection's
  input) (2c*f), the expert output (c*h, kept for the routing weight's gradient), the row's routing
  weight (w) and three int64 index vectors (the sort permutation, the token index, the inverse
  permutation: 24 B).
Under LoRA (frozen experts) the two grouped matmuls keep no input for a weight gradient: c*h + c*f less
per row.

Backward moments, above the block's saved tensors, each with the weight gradients alive then (checked
tensor by tensor with torch dispatch on Mixtral and Qwen2-MoE blocks, and against the trace tier):
- un-permuting: the incoming gradient (c*h), its expansion to the k rows, the zeros it is scattered into
  and the scattered gradient (3 x k*h in the weighted outputs' dtype: fp32 with fp32 routing weights);
  with fp32 routing weights the weighted product's backward then holds two fp32 products and the cast
  back to c (k*h*c more, the inverse permutation freed; under activation checkpointing the recomputed
  expert output and weights are already dropped by then);
- the experts' activation backward: the gradients of the product, of act(gate) and of up (3 x k*c*f),
  the product and the expert output already freed, with the stacked down projection's weight gradient;
- the up projection's backward: its output's and input's gradients, the rest of the routed rows freed,
  with every routed expert's weight gradient (the largest at small micro-batches);
- the second RMSNorm's backward after the whole MLP: four fp32 (b*s, h) temporaries (+ the cast to c),
  every MLP weight gradient accumulated;
- shared experts: Qwen's gated one runs its backward last (its output's gradient waits through the
  routed backward), DeepSeek's first (a dense MLP's moment; its saved tensors gone before the routed
  backward).
Ignored: per-micro-batch scalars (the E group offsets), DeepSeek's grouped sigmoid router (priced as a
softmax router), leading dense blocks at their own index (priced as sparse at the moment they run).
"""

from __future__ import annotations

from .fsdp_options import DIM1_PLACEMENT
from .identity_memo import IdentityMemo
from .specs import BackwardMoment, ModelSpec, MoeSpec

INDEX_BYTES = 8  # int64 routing indices
_MOMENTS = IdentityMemo(limit=256)  # (model, c, lora, recomputed) -> backward_moments: read by every ledger's shape


# ---------------------------------------------------------------- sharding with padding

def rows_per_rank(rows: int, d: int) -> int:
    """FSDP2's chunk of an (rows, ...) parameter on d ranks: what rank 0 holds, padding included."""
    return -(-rows // d)


def small_dim0_tensors(model: ModelSpec, dim1: bool = False) -> tuple[tuple[int, int], ...]:
    """(rows, elements per row) of the tensors of a sparse block whose dim 0 is small enough to pad: the
    stacked experts and the router's weight (+ bias), both E rows, and Qwen's shared-expert gate (1 row).
    dim1: without the stacked expert matrices, which shard_placement_fn then shards on dim 1 unpadded."""
    moe = model.moe
    router = ((moe.n_experts, moe.router_params // moe.n_experts),) if moe.router_params else ()
    gate = ((1, model.hidden_size),) if model.shared_expert_gated else ()
    stacked = tuple(t for t in moe.stacked_expert_tensors if not (dim1 and _is_matrix(model, t)))
    return stacked + router + gate


def _is_matrix(model: ModelSpec, tensor: tuple[int, int]) -> bool:
    """A stacked (E, out, in) expert matrix rather than a stacked bias: h x f or h x 2f per expert."""
    return tensor[1] in (model.hidden_size * model.moe.expert_ffn_size, 2 * model.hidden_size * model.moe.expert_ffn_size)


def _small_elements(model: ModelSpec, dim1: bool = False) -> int:
    return sum(rows * per_row for rows, per_row in small_dim0_tensors(model, dim1))


def padded_shard_elements(model: ModelSpec, d: int, dim1: bool = False) -> int:
    """Elements rank 0 holds of those tensors: ceil(rows / d) rows of each."""
    return sum(rows_per_rank(rows, d) * per_row for rows, per_row in small_dim0_tensors(model, dim1))


def padding_factor(model: ModelSpec, d: int, dim1: bool = False) -> float:
    """Gathered (padded) over real size of the experts, router and gate at shard group d: 1 when d divides E."""
    real = _small_elements(model, dim1)
    return d * padded_shard_elements(model, d, dim1) / real if real else 1.0


def block_shard_elements(model: ModelSpec, d: int, dim1: bool = False) -> float:
    """Rank 0's elements of one sparse block's parameters: the dense ones / d, the small-dim-0 ones padded."""
    if model.moe is None:
        return model.block_params / d
    return (model.block_params - _small_elements(model, dim1)) / d + padded_shard_elements(model, d, dim1)


def block_gathered_elements(model: ModelSpec, d: int, dim1: bool = False) -> int:
    """Elements of one sparse block's all-gather output (= its unsharded parameters' storage, padding
    included) and of its reduce-scatter input. dim1: the stacked expert matrices sharded on dim 1."""
    if model.moe is None or d <= 1:
        return model.block_params
    return model.block_params - _small_elements(model, dim1) + d * padded_shard_elements(model, d, dim1)


def experts_gathered_elements(model: ModelSpec, d: int, dim1: bool = False) -> int:
    """Elements of the routed experts' all-gather output when they are an FSDP unit of their own
    (FsdpConfig.expert_units): the stacked tensors, padded to d x ceil(E / d) rows on dim 0 (the expert
    matrices unpadded when sharded on dim 1); 0 for a dense model."""
    if model.moe is None:
        return 0
    return sum(rows * per_row if d <= 1 or (dim1 and _is_matrix(model, (rows, per_row)))
               else d * rows_per_rank(rows, d) * per_row for rows, per_row in model.moe.stacked_expert_tensors)


def dim1_elements(model: ModelSpec, d: int) -> int:
    """Elements of one sparse block that shard_placement_fn puts on dim 1 at shard group d: the stacked
    expert matrices when d does not divide E (their all-gather is copied out through a temporary)."""
    if model.moe is None or model.moe.n_experts % d == 0:
        return 0
    return sum(rows * per_row for rows, per_row in model.moe.stacked_expert_tensors if _is_matrix(model, (rows, per_row)))


def dim1_shardable(model: ModelSpec, d: int) -> bool:
    """Whether sharding the stacked experts on dim 1 removes their padding at shard group d: their dim 1
    (h, or the expert width f / 2f) divides evenly, as FSDP2 requires off dim 0."""
    moe = model.moe
    return (moe is not None and d > 1 and padding_factor(model, d) > 1 and model.hidden_size % d == 0
            and moe.expert_ffn_size % d == 0)


# ---------------------------------------------------------------- activations (grouped_mm experts)

def router_bytes_per_token(moe: MoeSpec, c: int) -> int:
    """The router's saved tensors: fp32 softmax over E, top-k indices, renormalised top-k values and sum;
    gpt-oss's (topk_softmax) the top-k indices and the softmax over those k, in the compute dtype."""
    k = moe.experts_per_token
    if moe.router_kind == "topk_softmax":
        return INDEX_BYTES * k + c * k
    return 4 * moe.n_experts + INDEX_BYTES * k + ((4 * k + 4) if moe.renormalise_top_k else 0)


def _routing_weight_bytes(moe: MoeSpec, c: int) -> int:
    return 4 if moe.fp32_routing_weights else c


def _expert_activation_bytes(model: ModelSpec, c: int, lora: bool) -> int:
    """Per routed row: what the expert's activation keeps (SwiGLU: the gate|up output and act(gate);
    gpt-oss's clamped SwiGLU also the clamped gate, x * sigmoid(alpha x) and up + 1; a plain activation its
    input) and the down projection's input (not under LoRA)."""
    f = model.moe.expert_ffn_size
    down_input = 0 if lora else c * f
    if model.moe.expert_activation == "clamped_swiglu":
        return 6 * c * f + down_input   # gate|up (2f), clamp(gate), sigmoid, glu, up + 1
    return (3 * c * f if model.gated_mlp else c * f) + down_input


def _shared_expert_bytes(model: ModelSpec, c: int, lora: bool) -> int:
    """Always-active shared expert(s): a dense MLP of shared_ffn_size (gated like the routed ones); with
    Qwen's sigmoid gate also the gate (c) and the shared output it scales (c*h)."""
    fs = model.moe.shared_ffn_size
    if not fs:
        return 0
    gate = c * model.hidden_size + c if model.shared_expert_gated else 0
    return (3 * c * fs if model.gated_mlp else c * fs) + (0 if lora else c * fs) + gate


def mlp_bytes_per_token(model: ModelSpec, c: int, lora: bool = False) -> int:
    """Saved bytes per token of the MoE MLP (router, routed rows, shared experts), excluding its normed
    input (counted with the norms)."""
    moe = model.moe
    h, k = model.hidden_size, moe.experts_per_token
    gathered_input = 0 if lora else c * h
    indices = (4 if moe.expert_bias else 3) * INDEX_BYTES   # + the sorted expert ids the bias gathers read
    per_row = (gathered_input + _expert_activation_bytes(model, c, lora) + c * h
               + _routing_weight_bytes(moe, c) + indices)
    return router_bytes_per_token(moe, c) + k * per_row + _shared_expert_bytes(model, c, lora)


def weighted_output_bytes(moe: MoeSpec, c: int) -> int:
    """dtype width of expert output x routing weight: fp32 routing weights promote it to fp32."""
    return max(c, _routing_weight_bytes(moe, c))


def backward_moments(model: ModelSpec, c: int, lora: bool = False, recomputed: bool = False) -> tuple[BackwardMoment, ...]:
    """The MoE MLP backward's candidate peaks, each as bytes per token above the block's saved tensors
    and the bytes of the block's weight gradients alive then (module docstring):
    - un-permuting the weighted expert outputs (no weight gradient yet);
    - the experts' activation backward (the stacked down projection's gradient);
    - the up projection's backward (every routed expert's gradient: at small micro-batches the peak).
    Frozen experts (LoRA) compute no weight gradients. recomputed (activation checkpointing): a recomputed
    tensor is dropped by the checkpoint as its node unpacks it, so the fp32 product's backward has already
    let go of the expert output and the routing weights when it casts its gradient back."""
    return _MOMENTS.get(model, (c, lora, recomputed), lambda: _backward_moments(model, c, lora, recomputed))


def _backward_moments(model: ModelSpec, c: int, lora: bool, recomputed: bool) -> tuple[BackwardMoment, ...]:
    moe = model.moe
    h, f, k = model.hidden_size, moe.expert_ffn_size, moe.experts_per_token
    wo = weighted_output_bytes(moe, c)
    unpermute = c * h + 3 * k * h * wo
    if wo != c:  # the fp32 product's backward: two fp32 products and the cast back, inverse permutation freed
        product = unpermute + k * h * c - INDEX_BYTES * k
        if recomputed:
            product -= k * (c * h + _routing_weight_bytes(moe, c))
        unpermute = max(unpermute, product)
    up_width = 2 * f if model.gated_mlp else f
    act_grads = (3 if model.gated_mlp else 2) * c * k * f
    down_input = 0 if lora else c * k * f
    activation = c * h + act_grads - c * k * h - INDEX_BYTES * k - down_input  # expert output, inverse perm freed
    # up projection's backward: its output's gradient and the input's, the rest of the routed rows freed
    up = c * h + k * (c * up_width + c * h) - k * (_expert_activation_bytes(model, c, lora) + c * h + INDEX_BYTES)
    routed = [unpermute, activation, up]
    shared = []
    fs = moe.shared_ffn_size
    if fs and model.shared_expert_gated:
        # Qwen: the gated shared output was computed last, so its gradient (c*h) waits for the shared MLP's
        # backward, which runs after the routed experts' (it was computed first). Its act(gate) backward
        # then holds that gradient, the block input's accumulated one and two f-sized gradients, with every
        # routed weight gradient and its own two (up, down) accumulated; of what the MoE MLP saved only the
        # gate projection's output is left.
        routed = [m + c * h for m in routed]
        if model.gated_mlp:
            grads = 0 if lora else (moe.routed_params + moe.router_params + 2 * h * fs + h) * c
            last = 2 * c * h + 2 * c * fs - (mlp_bytes_per_token(model, c, lora) - c * fs)
            shared = [BackwardMoment(grads, 0, last, 0, experts_done=True)]
    elif fs:
        # DeepSeek: the shared experts ran after the routed ones, so their backward comes first (a dense
        # MLP's moment: the incoming gradient and its activation's gradients, its down projection's weight
        # gradient) and their saved tensors are gone when the routed backward starts
        acts = (3 if model.gated_mlp else 2) * c * fs - (0 if lora else c * fs)
        shared = [BackwardMoment(0 if lora else h * fs * c, 0, c * h + acts, 0)]
        routed = [m - _shared_expert_bytes(model, c, lora) for m in routed]
    unpermute, activation, up = routed
    moments = [BackwardMoment(0, 0, unpermute, 0)] + shared
    if not lora:
        down_grad = moe.n_experts * h * f * c   # accumulated; the up projection's is not yet (a temporary)
        moments += [BackwardMoment(down_grad, 0, activation, 0),
                    BackwardMoment(down_grad, moe.routed_params * c - down_grad, up, 0)]
    else:
        moments.append(BackwardMoment(0, 0, activation, 0))
    if model.norm == "rmsnorm":
        # the MLP done (its saved tensors freed, every weight gradient accumulated), its RMSNorm's backward
        # in fp32: four (b*s, h) fp32 temporaries at the pow backward (+ the cast of its gradient to c)
        norm = 16 * h + (c * h if c != 4 else 0)
        moments.append(BackwardMoment(0 if lora else mlp_param_elements(model) * c, 0,
                                      norm - mlp_bytes_per_token(model, c, lora), 0, experts_done=True))
    return tuple(moments)


def mlp_backward_working_bytes_per_token(model: ModelSpec, c: int, lora: bool = False) -> int:
    """Bytes per token the MoE MLP's backward holds above the block's saved tensors at its largest
    moment (weight gradients aside: see backward_moments)."""
    return max(m.per_token for m in backward_moments(model, c, lora))


def forward_unpermute_bytes_per_token(model: ModelSpec, c: int, lora: bool = False) -> int:
    """Bytes per token the MoE MLP's forward holds at its un-permute (transformers 5.24 integrations/moe.py:528,
    weighted_out[inv_perm]) beyond the block's saved tensors: the weighted rows (moe.py:524, saved by nothing) and
    their un-permuted copy (2 k h wo), the router's logits (returned), top-k weights, the sorted expert ids (moe.py:440)
    and histc's input (moe.py:448); under LoRA (frozen router and experts) also the router's input and the gathered
    rows (moe.py:441), locals that nothing saves; less what the shared experts save after the routed ones (DeepSeek's
    run after, Qwen's before but for their sigmoid gate). Traced: docs/accuracy.md "2026-12-08: the padded experts'
    forward copy-out"."""
    moe = model.moe
    h, k = model.hidden_size, moe.experts_per_token
    wo, w = weighted_output_bytes(moe, c), _routing_weight_bytes(moe, c)
    logits = moe.n_experts * (4 if moe.fp32_router_input else c)
    locals_ = (c * h + k * c * h) if lora else (c * h if moe.fp32_router_input and c != 4 else 0)
    later = (c if moe.shared_ffn_size else 0) if model.shared_expert_gated else _shared_expert_bytes(model, c, lora)
    return 2 * k * h * wo + logits + k * (w + INDEX_BYTES + 4) + locals_ - later


def mlp_param_elements(model: ModelSpec) -> int:
    """Parameters of one sparse layer's MLP: routed experts, router, shared experts."""
    moe = model.moe
    return moe.routed_params + moe.router_params + moe.shared_params


# ---------------------------------------------------------------- findings

def padding_note(model: ModelSpec, d: int, compute_bytes: int) -> str | None:
    """The padding finding and its fix, when the experts' count does not divide the shard group."""
    moe = model.moe
    if moe is None or d <= 1 or moe.n_experts % d == 0:
        return None
    n_sparse = model.n_layers - moe.n_dense_layers
    rows = rows_per_rank(moe.n_experts, d)
    holders = rows_per_rank(moe.n_experts, rows)  # ranks holding at least one real expert row
    extra = (block_gathered_elements(model, d) - model.block_params) * compute_bytes
    group = max(n for n in range(1, d + 1) if moe.n_experts % n == 0 and d % n == 0)
    return (f"{moe.n_experts} experts on a shard group of {d}: FSDP2 shards the stacked expert tensors on dim 0 "
            f"(the expert index), so rank 0 holds {rows} expert(s) of each, {d - holders} of {d} ranks hold only "
            f"padding, and every sparse block's all-gather, gathered copy and reduce-scatter is "
            f"{padding_factor(model, d):.1f}x its experts' size (+{extra / 2**30:.2f} GiB per gathered block, "
            f"{n_sparse} sparse blocks; counted). Fix: shard the stacked expert matrices on dim 1 (fully_shard's "
            f"shard_placement_fn=lambda p: {DIM1_PLACEMENT.replace('% d', f'% {d}')}: the plan's expert_shard_dim=1, "
            f"searched when dim 1 divides evenly, as FSDP2 requires off dim 0), or use a shard group that "
            f"divides {moe.n_experts} (HYBRID_SHARD with shard groups of {group})")


def comm_bound_note(model: ModelSpec, exposed_comm_s: float, step_s: float, padding: float,
                    sharding: str, micro_batch: int) -> str | None:
    """Why an MoE step waits on communication and what helps: FSDP all-gathers every expert of a block,
    while each token computes with k of E. None when less than a fifth of the step is exposed collectives."""
    moe = model.moe
    if moe is None or step_s <= 0 or exposed_comm_s < 0.2 * step_s:
        return None
    active = model.active_params / model.n_params
    helps = [f"a larger micro-batch (now {micro_batch}; compute grows with the tokens, the all-gathers do not)"]
    if sharding in ("FULL_SHARD", "HYBRID_SHARD"):
        helps.append(f"{'HYBRID_SHARD_ZERO2' if sharding == 'HYBRID_SHARD' else 'SHARD_GRAD_OP'} (one all-gather "
                     "per micro-step instead of two, if the gathered blocks fit)")
    if not sharding.startswith("HYBRID"):
        helps.append("HYBRID_SHARD (all-gathers inside a node; only the gradient all-reduce crosses nodes)")
    if padding > 1:
        helps.append(f"no padding ({padding:.1f}x now: shard_placement_fn, or a shard group dividing "
                     f"{moe.n_experts})")
    return (f"communication-bound: {exposed_comm_s:.3f} s of the {step_s:.3f} s step waits on collectives. FSDP "
            f"all-gathers all {moe.n_experts} experts of every block while each token computes with "
            f"{moe.experts_per_token} of them ({100 * active:.0f}% of the parameters active), so a step moves "
            f"{1 / active:.1f}x the bytes a dense model of the same FLOPs would. What helps: " + "; ".join(helps))


def active_block_params(model: ModelSpec) -> int:
    """Parameters one token's forward uses in a sparse block (FLOPs): the block without the experts it skips."""
    if model.moe is None:
        return model.block_params
    return model.block_params - model.moe.inactive_params


__all__ = ["rows_per_rank", "small_dim0_tensors", "padded_shard_elements", "padding_factor", "block_shard_elements",
           "block_gathered_elements", "experts_gathered_elements", "dim1_elements", "dim1_shardable",
           "router_bytes_per_token", "mlp_bytes_per_token",
           "backward_moments", "mlp_backward_working_bytes_per_token", "mlp_param_elements", "padding_note",
           "comm_bound_note", "active_block_params"]
