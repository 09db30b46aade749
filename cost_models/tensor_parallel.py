"""Tensor parallelism: what one rank of a TP group holds and computes (Megatron-LM's plan as torchtitan and
transformers' base_model_tp_plan apply it; shared/reference/parallelism.md).

The Llama-style plan splits q/k/v, gate and up column-wise and o and down row-wise: each rank has n_heads / tp heads
(KV heads / tp; one KV head replicated for a tp above them, which mesh_rules refuses and only `fsdp-plan check`
prices) and ffn / tp of the MLP; norms (and a row-wise layer's bias) stay replicated. The embedding is split
row-wise over the vocabulary (torchtitan; transformers' tp_plan keeps it replicated) and the head column-wise; with
loss parallel (torchtitan's default with sequence parallel) the cross-entropy runs on vocab / tp logits per rank,
without it (transformers' tp_plan, `colwise_gather_output`) the logits are gathered to the full vocabulary. Routed
experts are split over tp only without expert parallelism (ep = 1); with ep > 1 EP borrows the TP ranks
(torchtitan's etp = 1).

`local_model` gives the per-rank ModelSpec: the memory ledger and the operator-level step time then read the
per-rank parameters and the narrower matmuls as they read any model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import comm
from .activations import _norm_bytes
from .identity_memo import IdentityMemo
from .operators import MemoryOp, _n_norms
from .quick_init import quick_init
from .specs import FsdpConfig, ModelSpec


def _norm_params(model: ModelSpec) -> int:
    """A block's replicated parameters: its norms' weights (and q/k norms). LayerNorm's biases included."""
    per_norm = 2 if model.norm == "layernorm" else 1
    qk = {"": 0, "head": 2 * model.head_dim, "full": model.q_dim + model.kv_dim}.get(model.qk_norm, 0)
    return _n_norms(model) * per_norm * model.hidden_size + qk


def local_kv_heads(model: ModelSpec, tp: int) -> int:
    """KV heads per rank: n_kv_heads / tp, or 1 (replicated) when tp exceeds them (refused by mesh_rules: no
    dialect replicates them; kept so that `fsdp-plan check` can price a user's tp)."""
    return max(1, model.n_kv_heads // tp)


_LOCAL = IdentityMemo(limit=256)   # (model, tp, ep, sp) -> its slice


def local_model(model: ModelSpec, config: FsdpConfig) -> ModelSpec:
    """The ModelSpec one rank of a TP group of config.tp holds (the model itself when tp = 1)."""
    if config.tp == 1:
        return model
    return _LOCAL.get(model, (config.tp, config.ep, config.sequence_parallel), lambda: _local_model(model, config))


def _local_model(model: ModelSpec, config: FsdpConfig) -> ModelSpec:
    tp = config.tp
    kv_local = local_kv_heads(model, tp)
    replicated = _norm_params(model)
    moe = model.moe
    routed = (moe.n_experts * moe.expert_params + moe.router_params) if moe is not None else 0
    dense_part = model.block_params - replicated - routed
    # the extra KV heads each rank holds when they are replicated (k and v projections, head_dim x h each)
    kv_extra = 2 * (kv_local * tp - model.n_kv_heads) * model.head_dim * model.hidden_size // tp
    block = replicated + dense_part // tp + kv_extra
    local_moe = moe
    if moe is not None:
        experts_split = config.ep == 1  # with EP the TP ranks hold whole experts (etp = 1)
        local_moe = replace(
            moe,
            expert_ffn_size=moe.expert_ffn_size // tp if experts_split else moe.expert_ffn_size,
            expert_params=moe.expert_params // tp if experts_split else moe.expert_params,
            stacked_expert_tensors=tuple((n, e // tp) for n, e in moe.stacked_expert_tensors) if experts_split
            else moe.stacked_expert_tensors,
            shared_ffn_size=moe.shared_ffn_size // tp,
            shared_params=moe.shared_params // tp,
            dense_block_params=(replicated + (moe.dense_block_params - replicated) // tp)
            if moe.dense_block_params else 0,
            dense_ffn_size=moe.dense_ffn_size // tp,
        )
        block += moe.router_params + (moe.n_experts * local_moe.expert_params)
    return replace(
        model,
        n_heads=model.n_heads // tp,
        n_kv_heads=kv_local,
        ffn_hidden_size=max(1, model.ffn_hidden_size // tp),
        vocab_size=model.vocab_size // tp if config.sequence_parallel else model.vocab_size,
        block_params=block,
        # torchtitan shards the embedding over the vocabulary; transformers' tp_plan leaves it replicated
        embedding_params=model.embedding_params // tp if config.sequence_parallel else model.embedding_params,
        head_params=model.head_params // tp,
        moe=local_moe,
    )


# --- step time: TP's collectives per block and at the root (issue 17 item 3) ------------------------------------
#
# Megatron-LM's plan with sequence parallel (Korthikanti et al. 2022, section 4.2.2; torchtitan's
# parallelize_llama): between the column-wise and row-wise halves of attention and of the MLP the activations are
# replicated, elsewhere sharded on the sequence. Per block and micro-batch, forward: the attention input and the
# MLP input are all-gathered (Shard(1) -> Replicate), the row-wise o and down outputs reduce-scattered (Partial ->
# Shard(1)); backward: the same four with the roles swapped (the gradient of an all-gather is a reduce-scatter);
# each moves the full b x s x h activation. Without sequence parallel (transformers' tp_plan): the o and down
# outputs all-reduced forward, the attention and MLP input gradients all-reduced backward. Recompute repeats
# what the checkpointed forward re-runs: all four (two all-reduces) under full checkpointing; under torchtitan's
# selective op-level policy the reduce-scatter outputs are on its save list and the all-gathers are not, and
# the recomputed k and up products need the gathered inputs: two all-gathers (without SP: the all-reduce after
# o, whose output the recomputed up product needs).
#
# Float8 tensorwise with TP (torchtitan's parallelize_llama of 2025, `enable_float8_tensorwise_tp`: torchao's
# Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput, "float8 all-gather with TP is only
# supported for tensorwise"; torchtitan 0.3.0 no longer carries it): the inputs are cast before the forward
# all-gather and the output gradients before the backward all-gather, so every all-gather moves 1 byte per
# element; the reduce-scatters move the compute dtype. Rowwise recipes gather in bf16 (not priced).
#
# DTensor's collectives on the sequence dimension (dim 1 of (b, s, h)) run NCCL on dim 0 and reorder
# (torch.distributed._functional_collectives): reduce_scatter_single cats its input's chunks to dim 0 first,
# all_gather_single re-cats its output along dim 1 (a view only when b = 1, torch._utils._maybe_view_chunk_cat):
# one more read and write of the message per collective (memory-bound; sequence_parallel_copy_bytes).
#
# Root: with sequence parallel the row-wise embedding's output is reduce-scattered to Shard(1) and the final
# norm's output all-gathered for the column-wise head (their gradients the other way), and loss parallel
# all-reduces three (b, s) fp32 statistics of the vocab-sharded logits (max, sum of exponentials, the target's
# logit); without it the embedding's output is all-reduced, the head's logits all-gathered to the full vocabulary
# (colwise_gather_output) and the head's input gradient all-reduced.
#
# Async TP (torchtitan enable_async_tensor_parallel: symmetric-memory micro-pipelining of all-gather + matmul and
# matmul + reduce-scatter, compile only) hides each collective behind the products it is fused with: forward
# the attention input's all-gather behind q/k/v, o's reduce-scatter behind o, the MLP input's behind gate/up,
# down's behind down; backward the output-gradient all-gathers behind o's and down's two backward products and
# the input-gradient reduce-scatters behind the q/k/v and gate/up input-gradient products; recompute's
# all-gathers behind the recomputed products that read them. Exposed: max(0, collective - its products) each.
# Ignored: the loss-parallel statistics' overlap, NVLS / in-switch reductions, the chunked products' own shape
# penalty under async TP.

TP_ATTENTION_IN = ("q", "k", "v", "qkv")
TP_MLP_IN = ("gate", "up", "fc1", "shared gate", "shared up")
TP_ATTENTION_OUT = ("o",)
TP_MLP_OUT = ("down", "fc2", "shared down")
HEAD = ("output head",)


@quick_init
@dataclass(frozen=True)
class TpCollective:
    """One collective of a TP group for one micro-batch: message_bytes is the full (unsharded) tensor."""

    name: str
    kind: str                      # "all-gather", "reduce-scatter" or "all-reduce"
    phase: str                     # "forward", "backward" or "recompute"
    message_bytes: float
    fused_with: tuple[str, ...] = ()  # the products async TP decomposes it with (operators.Matmul names)
    product_passes: float = 0.0       # in forward-product units: 1 forward (or an input gradient), 2 both backward


def block_collectives(model: ModelSpec, config: FsdpConfig, tokens: int, c: int) -> tuple[TpCollective, ...]:
    """One block's TP collectives for `tokens` tokens per TP rank (b x s: TP ranks share their tokens)."""
    if config.tp == 1:
        return ()
    act = tokens * model.hidden_size * c
    gather = tokens * model.hidden_size * (1 if config.float8 else c)  # Float8 TP gathers FP8 inputs/gradients
    full_ac = bool(config.ac_every)   # the checkpointed share of blocks is applied by the caller
    if config.sequence_parallel:
        out = [TpCollective("attention input", "all-gather", "forward", gather, TP_ATTENTION_IN, 1),
               TpCollective("o output", "reduce-scatter", "forward", act, TP_ATTENTION_OUT, 1),
               TpCollective("MLP input", "all-gather", "forward", gather, TP_MLP_IN, 1),
               TpCollective("down output", "reduce-scatter", "forward", act, TP_MLP_OUT, 1),
               TpCollective("down output gradient", "all-gather", "backward", gather, TP_MLP_OUT, 2),
               TpCollective("MLP input gradient", "reduce-scatter", "backward", act, TP_MLP_IN, 1),
               TpCollective("o output gradient", "all-gather", "backward", gather, TP_ATTENTION_OUT, 2),
               TpCollective("attention input gradient", "reduce-scatter", "backward", act, TP_ATTENTION_IN, 1)]
        if full_ac:
            out += [replace(x, phase="recompute") for x in out[:4]]
        elif config.selective_op_ac:
            out += [replace(out[0], phase="recompute", fused_with=("k",)),
                    replace(out[2], phase="recompute", fused_with=("up",))]
        return tuple(out)
    out = [TpCollective("o output", "all-reduce", "forward", act),
           TpCollective("down output", "all-reduce", "forward", act),
           TpCollective("MLP input gradient", "all-reduce", "backward", act),
           TpCollective("attention input gradient", "all-reduce", "backward", act)]
    if full_ac:
        out += [replace(x, phase="recompute") for x in out[:2]]
    elif config.selective_op_ac:
        out.append(replace(out[0], phase="recompute"))
    return tuple(out)


def root_collectives(model: ModelSpec, config: FsdpConfig, tokens: int, c: int) -> tuple[TpCollective, ...]:
    """The embedding's, the head's and the loss's TP collectives for one micro-batch (model: the full model)."""
    if config.tp == 1:
        return ()
    act = tokens * model.hidden_size * c
    if config.sequence_parallel:
        stats = 3 * tokens * 4  # loss parallel: per-token max, sum of exponentials, target logit (fp32)
        return (TpCollective("embedding output", "reduce-scatter", "forward", act),
                TpCollective("head input", "all-gather", "forward", act, HEAD, 1),
                TpCollective("loss-parallel statistics", "all-reduce", "forward", stats),
                TpCollective("head input gradient", "reduce-scatter", "backward", act, HEAD, 1),
                TpCollective("embedding output gradient", "all-gather", "backward", act))
    return (TpCollective("embedding output", "all-reduce", "forward", act),
            TpCollective("logits (colwise_gather_output)", "all-gather", "forward", tokens * model.vocab_size * c),
            TpCollective("head input gradient", "all-reduce", "backward", act))


def collective_s(x: TpCollective, n_ranks: int, tier) -> float:

    run = {"all-gather": comm.all_gather_s, "reduce-scatter": comm.reduce_scatter_s,
           "all-reduce": comm.all_reduce_s}[x.kind]
    return run(x.message_bytes, n_ranks, tier)


def sequence_parallel_copy_bytes(collectives: tuple[TpCollective, ...], tp: int, micro_batch: int) -> float:
    """HBM bytes of DTensor's reordering around sequence-dimension collectives: each rank reads and writes the
    gathered output (all-gather, unless the micro-batch is 1: a view) or the input it scatters (reduce-scatter)
    once more (module notes above)."""
    if tp == 1:
        return 0.0
    kinds = ("all-gather", "reduce-scatter") if micro_batch > 1 else ("reduce-scatter",)
    return sum(2 * x.message_bytes for x in collectives if x.kind in kinds)


SEQUENCE_SHARDED_OPS = ("norm ", "residual adds", "dropout")  # operators.py names: s / tp tokens with SP


def sequence_parallel_ops(ops, tp: int):
    """A block's operators as a TP rank with sequence parallel runs them: the norms, residual adds and dropout
    on s / tp tokens (Korthikanti et al. 2022), everything between the all-gather and the reduce-scatter on the
    rank's heads / MLP slice (already narrower in local_model). A traced inventory cannot be split: unchanged."""

    if tp == 1 or ops.traced:
        return ops

    def shard(op: MemoryOp) -> MemoryOp:
        if not op.name.startswith(SEQUENCE_SHARDED_OPS) or op.name.startswith("q/k"):
            return op
        return MemoryOp(op.name, op.forward_bytes / tp, op.backward_bytes / tp, op.fused_forward_bytes / tp,
                        op.fused_backward_bytes / tp)

    return replace(ops, memory_ops=tuple(shard(op) for op in ops.memory_ops))


@dataclass(frozen=True)
class TpTime:
    """Seconds of TP's collectives per micro-batch: per block (forward; backward with its recompute) and the root,
    all of them and the part not hidden (everything without async TP), and the memory-bound reordering copies."""

    block_forward_s: float = 0.0
    block_forward_exposed_s: float = 0.0
    block_backward_s: float = 0.0
    block_backward_exposed_s: float = 0.0
    block_copy_forward_s: float = 0.0
    block_copy_backward_s: float = 0.0
    root_s: float = 0.0
    root_exposed_s: float = 0.0
    root_copy_s: float = 0.0

    @property
    def block_s(self) -> float:
        return self.block_forward_s + self.block_backward_s

    @property
    def block_exposed_s(self) -> float:
        return self.block_forward_exposed_s + self.block_backward_exposed_s


def step_seconds(model: ModelSpec, config: FsdpConfig, tokens: int, c: int, tier, rates, products: dict,
                 recompute_share: float) -> TpTime:
    """TP's seconds for one micro-batch of `tokens` per rank. products: forward seconds of each product a TP rank
    runs (operators.Matmul name -> s; async TP hides collectives behind them); recompute_share: the fraction of
    blocks whose forward is recomputed (1 with selective op-level or full checkpointing of every block)."""
    if config.tp == 1:
        return TpTime()
    tp = config.tp

    def priced(collectives):
        total, exposed = {"forward": 0.0, "backward": 0.0}, {"forward": 0.0, "backward": 0.0}
        for x in collectives:
            share = recompute_share if x.phase == "recompute" else 1.0
            phase = "forward" if x.phase == "forward" else "backward"
            s = collective_s(x, tp, tier)
            hidden = x.product_passes * sum(products.get(n, 0.0) for n in x.fused_with) if config.async_tp else 0.0
            total[phase] += share * s
            exposed[phase] += share * max(0.0, s - hidden)
        return total, exposed

    block = block_collectives(model, config, tokens, c)
    root = root_collectives(model, config, tokens, c)
    (bt, be), (rt, re) = priced(block), priced(root)
    copies = {"forward": 0.0, "backward": 0.0}
    if config.sequence_parallel:
        for x in block:
            share = recompute_share if x.phase == "recompute" else 1.0
            copies["forward" if x.phase == "forward" else "backward"] += share * rates.memory_s(
                sequence_parallel_copy_bytes((x,), tp, config.micro_batch))
    root_copy = rates.memory_s(sequence_parallel_copy_bytes(root, tp, config.micro_batch)) \
        if config.sequence_parallel else 0.0
    return TpTime(bt["forward"], be["forward"], bt["backward"], be["backward"], copies["forward"],
                  copies["backward"], rt["forward"] + rt["backward"], re["forward"] + re["backward"], root_copy)


# ---------------------------------------------------------------- memory terms (cost_models/memory.py reads them)
# Measured against the trace tier (calibration/tensor_parallel.py applies the plan; benchmarks/memory_accuracy.py
# --mesh), itself equal to a real gloo run of a tiny Llama to the byte (tests/distributed/test_torchrun_mesh.py).

def sequence_parallel(config: FsdpConfig) -> bool:
    """Whether the residual stream is sharded over the sequence (torchtitan's TP with tp > 1)."""
    return config.tp > 1 and config.sequence_parallel


def embedding_grad_extra_params(model: ModelSpec, config: FsdpConfig) -> int:
    """Elements the embedding's gradient holds beyond its vocabulary shard (model: a TP rank's). Under sequence
    parallel torchtitan shards the embedding row-wise over the vocabulary, but DTensor's embedding_dense_backward has
    no vocabulary-sharded strategy (torch/distributed/tensor/_ops/_embedding_ops.py, torch 2.13: column-wise, batch-
    sharded to Partial, or Partial): with the ids replicated it all-gathers the output gradient and makes the whole
    V x h table, Replicate, which FSDP2 keeps as the unit's unsharded gradient (accumulated across a pipeline's
    microbatches) until its reduce-scatter takes the rank's rows. Traced, and on 4 gloo ranks (pp 2 x tp 2, tests/
    distributed/test_emit_pp_sp_torchrun.py): a [256, 64] fp32 gradient, 65,536 B, beside the 32,768 B shard."""
    return model.embedding_params * (config.tp - 1) if sequence_parallel(config) else 0


def loss_parallel(config: FsdpConfig) -> bool:
    """Whether the loss runs as loss parallel on vocab / tp logits (torchtitan's with sequence parallel), eager."""
    return sequence_parallel(config) and not config.loss_compiled


def residual_stream_bytes_per_token(model: ModelSpec, compute_bytes: int, lora: bool = False) -> int:
    """Saved bytes per token of a block that live on the residual stream: its norms (the fp32 upcast and
    the normalised tensor each RMSNorm saves; activations._norm_bytes) and the residual dropout masks. With
    sequence parallel they are saved for s / tp tokens only. What the norms' outputs feed - the column-wise
    q/k/v and gate/up linears - is saved after the all-gather, for every token (the gathered linear inputs:
    they stay at full tokens in the per-rank formula)."""

    stream = _n_norms(model) * _norm_bytes(model, compute_bytes, lora)
    if model.dropout:
        stream += 2 * model.hidden_size  # 1-byte masks after attention and MLP
    return stream


def root_stream_bytes_per_token(model: ModelSpec, compute_bytes: int, lora: bool = False) -> int:
    """The root's saved bytes per token on the residual stream: the final norm's and the embedding dropout
    mask (the head's gathered input and the int64 labels stay at full tokens)."""

    return _norm_bytes(model, compute_bytes, lora) + (model.hidden_size if model.dropout and not lora else 0)


def sequence_parallel_saved_bytes(model: ModelSpec, compute_bytes: int, tp: int, block: int, checkpointed: int,
                                  root: int, lora: bool = False, selective_op: bool = False) -> tuple[int, int, int]:
    """(block, checkpointed block, root) saved bytes per token of the micro-batch under sequence parallel, from
    the per-rank formulas at full tokens (`model` is local_model's): the residual-stream parts on s / tp
    tokens (residual_stream_bytes_per_token, root_stream_bytes_per_token), a checkpointed block's input - a
    residual-stream tensor - on s / tp. Korthikanti et al. 2022 (Table 2): with TP + SP everything shrinks by
    tp; here the gathered inputs of the column-wise linears are kept whole, as torch's ColwiseParallel saves
    them (sbh per linear group), which Megatron's SP avoids only by re-gathering them in backward."""
    stream = residual_stream_bytes_per_token(model, compute_bytes, lora)
    root_stream = root_stream_bytes_per_token(model, compute_bytes, lora)
    held = _per_rank(checkpointed, tp)
    if selective_op:
        # torchtitan's policy keeps every other matmul's output - column-wise ones narrow, row-wise ones' partial
        # sums h wide, all on the gathered full tokens - and the reduce-scatter outputs of o and down (on its save
        # list); only the block's input is a residual-stream tensor on s / tp tokens
        hidden = compute_bytes * model.hidden_size
        held = checkpointed - hidden + _per_rank(hidden, tp) + 2 * _per_rank(hidden, tp)
    return (block - stream + _per_rank(stream, tp), held, root - root_stream + _per_rank(root_stream, tp))


def _per_rank(bytes_per_token: int, tp: int) -> int:
    return -(-bytes_per_token // tp)
