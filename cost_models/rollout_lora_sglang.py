"""The GPU memory SGLang preallocates to serve LoRA adapters (server arg enable_lora), per GPU of the engine: its
LoRA memory pool.

verl 0.9.1 starts SGLang so where the actor's LoRA is served as an adapter (model.lora_rank > 0, model.lora.merge
off): workers/rollout/sglang_rollout/async_sglang_server.py launch_server adds enable_lora=True,
max_lora_rank=lora_rank_of(model_config) (the rank itself: no rounding, unlike vLLM's get_vllm_max_lora_rank) and
lora_target_modules=sglang_lora_target_modules(model.target_modules) (sglang_rollout/utils.py: "all-linear" ->
["all"], a list as is); it leaves max_loras_per_batch, lora_backend and the pool's dtype to SGLang (8 slots,
srt/arg_groups/fields/lora.py Lora.max_loras_per_batch; the model's dtype).

What SGLang 0.5.23 allocates (python/sglang/srt/lora/):
- lora_manager.py LoRAManager.init_lora_shapes: "all" is auto_detect_lora_target_modules(base model) (utils.py:
  every LinearBase's leaf name normalised - q/k/v -> qkv_proj, gate/up -> gate_up_proj - so qkv_proj, o_proj,
  gate_up_proj, down_proj for the dense families here) plus EMBEDDING_NAMES (embed_tokens, lm_head), whatever the
  adapter holds; a list is get_normalized_target_modules of its names.
- mem_pool.py LoRAMemoryPool.init_buffers: for every target, every layer, one A and one B buffer of
  max_loras_per_batch slots in the pool's dtype, zeroed:
  get_lora_A_shape (S, rank x get_stacked_multiply, in), get_lora_B_shape (S, out, rank); stacked multiply 3 for
  qkv_proj, 2 for gate_up_proj (utils.py get_stacked_multiply: one rank-r A per packed projection). in / out from
  the base layer on this rank (_dense_local_dim: input_size_per_partition of the row-parallel o_proj / down_proj,
  the sum of output_partition_sizes of the column-parallel ones - QKVParallelLinear's K and V as the rank's KV
  heads, max(1, kv_heads // tp): _column_parallel_lora_b_per_rank_dim says the same). These are the slices of
  rollout_lora.block_slices unpacked (q, k, v and gate, up apart: one A each), so the blocks share its shapes.
  The embedding (get_embedding_lora_A_shape: (S, rank, vocab + lora_added_tokens_size), not split by TP;
  get_embedding_lora_B_shape: (S, hidden, rank)) and the head ((S, rank, hidden); B (S, vocab rows, rank): the
  rank's rows of the ParallelLMHead, get_lm_head_lora_b_shard_size(shard_indices.num_org_elements) - the whole
  vocabulary at TP 1 or where the head is tied to the embedding, no ParallelLMHead to read). init_buffers calls
  init_embedding_buffer for embedding_A/B_buffer (where embed_tokens is a target) and again for lm_head_A/B_buffer
  (where lm_head is), each time over every EMBEDDING_NAMES target: under "all" each vocabulary buffer is allocated
  twice (seen in the pool SGLang builds: benchmarks/sglang_lora_check.py).
  lora_added_tokens_size is 0 here (inferred from the adapters loaded at start: verl loads none), so no
  new_embeddings_buffer.
- The pool is built in ModelRunner.initialize -> maybe_init_lora_manager, after load_model and before the
  scheduler's alloc_memory_pool sizes the KV cache (mem_cache/kv_cache_configurator.py _profile_available_bytes:
  the free memory then, less pre_model_load_memory x (1 - mem_fraction_static)): like the weights, it comes out
  of the KV pool byte for byte. It is allocated outside every torch_memory_saver region (only the weights', the
  KV cache's and the CUDA graphs' are tagged), so release_memory_occupation never frees it: it stays on the GPU
  in every phase.
Not priced: the LoRA backend's batch metadata (lora/backend/chunked_backend.py, csgmv: int32 rows of the CUDA
graphs' batch sizes and tokens, allocated with the graphs after the KV cache, inside the (1 - fraction) slack).
"""

from __future__ import annotations

from .model_spec import ModelSpec
from .rollout_lora import LoraBuffers, block_slices
from .spec_values import SpecError

SGLANG_MAX_LORAS_PER_BATCH = 8   # srt/arg_groups/fields/lora.py Lora.max_loras_per_batch (verl leaves it)
DEFAULT_VOCAB_PADDING_SIZE = 64  # srt/layers/vocab_parallel_embedding.py: the head's vocabulary rows padded to it
BLOCK_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
EMBEDDING_NAMES = ("embed_tokens", "lm_head")
# LoRAManager.init_lora_shapes for lora_target_modules ["all"] (verl's all-linear) on a dense gated-MLP model
ALL_TARGETS = frozenset(BLOCK_TARGETS + EMBEDDING_NAMES)
# utils.py get_normalized_target_modules: PEFT names -> the pool's (the rest keep their own)
NORMALIZED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj"}


def sglang_target_modules(target_modules: str | list[str]) -> frozenset[str]:
    """The pool's targets for verl's model.target_modules: "all-linear" -> SGLang's "all" (ALL_TARGETS, the
    embedding and head included); a list of module names normalised (get_normalized_target_modules)."""
    if isinstance(target_modules, str):
        if target_modules not in ("all-linear", "all"):
            raise SpecError("target_modules", f"{target_modules!r}: SGLang serves all-linear or a list of modules "
                                              "(verl's sglang_lora_target_modules raises on a regex)")
        return ALL_TARGETS
    names = frozenset(NORMALIZED.get(n.split(".")[-1], n.split(".")[-1]) for n in target_modules)
    unknown = names - ALL_TARGETS
    if unknown:
        raise SpecError("target_modules", f"{sorted(unknown)}; priced for: {', '.join(sorted(ALL_TARGETS))}")
    return names


def head_rows_per_rank(vocab: int, tp: int) -> int:
    """Rank 0's vocabulary rows of SGLang's ParallelLMHead (vocab_parallel_embedding.py VocabParallelEmbedding
    __init__: padding_size x tp where pad_vocab_size(vocab) does not divide by tp; _get_indices: the padded
    vocabulary / tp, capped at the real one) - the largest of the ranks'."""
    pad = DEFAULT_VOCAB_PADDING_SIZE
    if -(-vocab // pad) * pad % tp:
        pad *= tp
    return min(-(-vocab // pad) * pad // tp, vocab)


def sglang_lora_pool(model: ModelSpec, tp: int, max_lora_rank: int, dtype_bytes: int = 2,
                     max_loras_per_batch: int = SGLANG_MAX_LORAS_PER_BATCH,
                     targets: frozenset[str] = ALL_TARGETS) -> LoraBuffers:
    """The bytes of SGLang's LoRA memory pool on TP rank 0 (module docstring): max_loras_per_batch slots of
    max_lora_rank for `targets` (the pool's names), dtype of `dtype_bytes`."""
    if not model.gated_mlp:
        raise SpecError("finetune", "SGLang's LoRA pool is priced for gated-MLP blocks (gate_up_proj, down_proj)")
    r, slots = max_lora_rank, max_loras_per_batch
    (q, k, v, gate, up), (o, down) = block_slices(model, tp, packed=False)
    by_target = {"qkv_proj": (q, k, v), "o_proj": (o,), "gate_up_proj": (gate, up), "down_proj": (down,)}
    per_layer = sum(r * i + out * r for name in targets & by_target.keys() for i, out in by_target[name])
    vocab, h = model.vocab_size, model.hidden_size
    embed = (r * vocab + h * r) if "embed_tokens" in targets else 0
    head_rows = vocab if model.tied_embeddings else head_rows_per_rank(vocab, tp)
    head = (r * h + head_rows * r) if "lm_head" in targets else 0
    # init_buffers fills the embedding's dicts (embedding_A/B_buffer) where embed_tokens is a target and the head's
    # (lm_head_A/B_buffer) where lm_head is, each with a buffer for every embedding name targeted: both named, each
    # buffer is allocated twice
    copies = ("embed_tokens" in targets) + ("lm_head" in targets)
    return LoraBuffers(blocks_bytes=model.n_layers * slots * per_layer * dtype_bytes,
                       vocab_bytes=copies * slots * (embed + head) * dtype_bytes, metadata_bytes=0)
