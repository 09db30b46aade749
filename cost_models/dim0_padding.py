"""FSDP2's dim-0 padding of the dense parameters: a block's projections and norms, and the root's tables.

FSDP2 shards every parameter on dim 0 with torch.chunk semantics and pads each rank's shard to rank 0's chunk,
ceil(rows / d) rows (torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_param.py:298-316, _init_sharded_param:
padded_sharded_param_size, the sharded storage new_zeros of it). What follows from it, per tensor:
- the sharded parameter's storage, the all-gather input (that storage) and the all-gather output (d of them, which the
  unsharded parameter is a view of): d x ceil(rows / d) rows;
- the reduce-scatter input, each gradient padded to d x ceil(rows / d) rows, and its output, the sharded gradient's
  storage, that / d (_fsdp_collectives.py:592-603 foreach_reduce, _fsdp_common.py:129 _get_dim0_padded_size);
- the optimizer's states, zeros_like the rank's shard: rank 0's is the full chunk (the busiest rank);
- not the gradients autograd makes: the parameters' real shapes.
So everything FSDP holds counts d x ceil(rows / d) rows of a tensor; a tensor of rows >= d gains at most d - 1 rows,
one of rows < d is padded to d rows (Mixtral's 256-row q / o on 512 ranks: 2x). cost_models/moe.py pads the MoE's
tensors of few rows (stacked experts, router, shared-expert gate) the same way; this module pads the rest: a block's
attention (q / k / v / o, fused qkv, DeepSeek's MLA projections), its MLP or shared expert, its norms, and the
root's embedding and head. A TP rank's slice (tensor_parallel.local_model) is what FSDP shards: its rows are the
slice's (q / k / v / gate / up column-wise: the rank's heads and ffn / tp; o / down row-wise: h).
LoRA's adapters are padded too (adapter_tensors: lora_A's rank rows; 16 rows gather d at d > 16). Not padded here:
biases, sinks, position tables (at most d - 1 elements each), an MoE's router and stacked-expert adapters, and a
layout the spec's widths do not account for (block_tensors gives () where the listed tensors exceed the block's
count). FSDP1's flat parameters pad each unit's concatenation to a multiple of d instead (< d elements): priced as
FSDP2's, as the stacked experts were.
"""

from __future__ import annotations

from .identity_memo import IdentityMemo
from .model_spec import FUSED_GATE_UP_FAMILIES, ModelSpec
from .moe import rows_per_rank

# families whose q / k / v are one (q + 2 kv, h) linear (cost_models/operators.py's fused attention)
_FUSED_QKV = frozenset({"gpt2", "gpt_neox", "phi3", "falcon", "bloom", "mpt"})
_CONV1D = frozenset({"gpt2"})  # transformers' Conv1D stores (in, out): dim 0 is the input


def _linears(model: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) of a block's attention and dense MLP (or shared expert) linears."""
    h, q, kv = model.hidden_size, model.q_dim, model.kv_dim
    if model.kv_lora_rank:  # DeepSeek's MLA (modeling_deepseek_v3: q_a / q_b or q_proj, kv_a_proj_with_mqa, kv_b)
        heads, rope, latent = model.n_heads, model.qk_rope_head_dim, model.kv_lora_rank
        qr = model.q_lora_rank
        attention = ([(h, qr), (qr, heads * model.head_dim)] if qr else [(h, heads * model.head_dim)]) + [
            (h, latent + rope), (latent, heads * (model.head_dim - rope + model.v_head_dim)),
            (heads * model.v_head_dim, h)]
    elif model.family in _FUSED_QKV:
        attention = [(h, q + 2 * kv), (q, h)]
    else:
        attention = [(h, q), (h, kv), (h, kv), (q, h)]
    moe = model.moe
    if moe is None:
        mlp = list(model.mlp_linear_shapes)
    elif moe.shared_ffn_size:
        fs = moe.shared_ffn_size
        gate_up = [(h, 2 * fs)] if model.family in FUSED_GATE_UP_FAMILIES else [(h, fs), (h, fs)]
        mlp = gate_up + [(fs, h)] if model.gated_mlp else [(h, fs), (fs, h)]
    else:
        mlp = []
    return attention + mlp


def block_tensors(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(rows, elements per row) of a block's dense parameters FSDP2 pads on dim 0 (moe.small_dim0_tensors aside):
    its linears' weights and its norms' weights (and LayerNorm's biases); () where they exceed the block's count."""
    h = model.hidden_size
    conv = model.family in _CONV1D
    tensors = [(i, o) if conv else (o, i) for i, o in _linears(model)]
    if model.kv_lora_rank:
        tensors += [(model.q_lora_rank, 1)] * bool(model.q_lora_rank) + [(model.kv_lora_rank, 1)]
    from .operators import _n_norms  # (operators imports the model's specs: late, as tensor_parallel reads it)

    tensors += [(h, 1)] * (_n_norms(model) * (2 if model.norm == "layernorm" else 1))
    tensors += {"head": [(model.head_dim, 1)] * 2, "full": [(model.q_dim, 1), (model.kv_dim, 1)]}.get(model.qk_norm, [])
    moe = model.moe
    small = sum(n * per_row for n, per_row in moe.stacked_expert_tensors) + moe.router_params if moe else 0
    if sum(rows * per_row for rows, per_row in tensors) > model.block_params - small:
        return ()
    return tuple(tensors)


def adapter_tensors(model: ModelSpec, rank: int) -> tuple[tuple[int, int], ...]:
    """(rows, elements per row) of a block's peft lora.Linear adapters: lora_A (rank, in) and lora_B (out, rank) of
    each adapted linear (ModelSpec.lora_shapes; an MoE's router and stacked-expert adapters not listed): at a shard
    group above the rank, lora_A's rank rows are padded to d."""
    return tuple(t for i, o in model.lora_shapes for t in ((rank, i), (o, rank)))


def padding_elements(tensors, d: int) -> int:
    """Elements FSDP2 adds to these (rows, elements per row) tensors at shard group d: (d x ceil(rows / d) - rows)
    rows of each."""
    return sum((d * rows_per_rank(rows, d) - rows) * per_row for rows, per_row in tensors) if d > 1 else 0


_BLOCK = IdentityMemo(limit=1024)   # (model, d) -> padding: the search prices thousands of configurations


def block_padding_elements(model: ModelSpec, d: int) -> int:
    """Elements of one block's dense parameters' dim-0 padding at shard group d (an MoE's sparse block: its attention,
    shared expert and norms; moe.block_gathered_elements pads the rest)."""
    if d <= 1:
        return 0
    return _BLOCK.get(model, (d,), lambda: padding_elements(block_tensors(model), d))


_ADAPTERS = IdentityMemo(limit=1024)   # (model, rank, d) -> padding


def adapter_padding_elements(model: ModelSpec, rank: int, d: int) -> int:
    """Elements of one block's LoRA adapters' dim-0 padding at shard group d (adapter_tensors: lora_A's rank rows)."""
    if d <= 1:
        return 0
    return _ADAPTERS.get(model, (rank, d), lambda: padding_elements(adapter_tensors(model, rank), d))


def root_tensors(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(rows, elements per row) of the root's tables: the token embedding (its vocabulary rows; a TP rank's slice)
    and an untied head; the final norm's weight."""
    h = model.hidden_size
    # embedding_params // h counts position / token-type rows too: the vocabulary's rows, where vocab_size is the
    # vocabulary's. A value model's vocab_size is its head's one label (rl_critic.value_model), not its table's rows.
    table_rows = model.embedding_params // h
    emb_rows = table_rows if model.vocab_size == 1 else min(model.vocab_size, table_rows)
    head = ((model.head_params // h, h),) if model.head_params else ()
    return ((emb_rows, h),) * bool(emb_rows) + head + ((h, 1),) * bool(model.root_other_params >= h)


def root_padding_elements(model: ModelSpec, d: int) -> tuple[int, int]:
    """(embedding's, the rest's) elements of the root's dim-0 padding at shard group d: the edge units split them
    (edge_units.py: the embedding a unit of its own, the final norm and head another)."""
    if d <= 1:
        return 0, 0
    tensors = root_tensors(model)
    emb = padding_elements(tensors[:1], d) if model.embedding_params >= model.hidden_size else 0
    return emb, padding_elements(tensors, d) - emb


def stage_root_padding_elements(model: ModelSpec, d: int, embedding: bool, head: bool) -> int:
    """Elements of a pipeline stage root's dim-0 padding at shard group d: the embedding's on the stage holding it,
    the head's and the final norm's on the last; a last stage without the embedding holds its own copy of a tied
    table (pipeline_stage_pieces' tied_copy: torchtitan's per-stage model copies), padded as the embedding."""
    emb, rest = root_padding_elements(model, d)
    return emb * embedding + (rest + emb * (model.tied_embeddings and not embedding)) * head


__all__ = ["block_tensors", "adapter_tensors", "padding_elements", "block_padding_elements",
           "adapter_padding_elements", "root_tensors", "root_padding_elements",
           "stage_root_padding_elements"]
