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
  heads, max(1, kv_heads // tp): _column_parallel_lora_b_per_rank_dim says the same). The attention's are
  rollout_lora.attention_slices unfused (q, k, v apart: one A each, Phi-3's fused qkv_proj too: attention_elements).
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
- A mixture of experts (the model holds a FusedMoE: Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss, DeepSeek-V2 / V3):
  auto_detect_lora_target_modules names every FusedMoE gate_up_proj and down_proj (the router, "gate", and Qwen2-MoE's
  shared_expert_gate are not in _KNOWN_LORA_TARGET_MODULES: never adapted). mem_pool.py init_buffer allocates for
  each of the two, for every layer (the dense ones too): a 4D expert buffer "<name>_moe" (S, experts, rank x
  stacked, in) / (S, experts, out, rank), every routed expert (_get_num_local_experts: no expert parallelism) at
  moe_intermediate_size (else intermediate_size) / moe_tp_size (= tp without EP); and a 3D one "<name>" only where
  the config has shared experts (shared_expert_intermediate_size or n_shared_experts), shaped by the layer's own
  linear (_dense_local_dim): the shared expert's on a sparse layer, the MLP's on a dense one (DeepSeek's leading
  blocks). LoRAManager.init_lora_modules wraps the FusedMoE (FusedMoEWithLoRA, layers.py) where both are targets;
  with the default csgmv backend and MoE runner it runs on the legacy Triton path: SGLang refuses nothing here.
- Llama 4 (models/llama4.py Llama4ForCausalLM; models/mllama4.py Llama4ForConditionalGeneration, the published
  checkpoints' class, wraps it): the FusedMoE (Llama4MoE.experts, num_local_experts of config.intermediate_size) on
  the MoE blocks, a LlamaMLP shared expert beside it (shared_expert.gate_up_proj / down_proj) and a LlamaMLP of
  intermediate_size_mlp on the dense blocks of interleave_moe_layer_step; the router (ReplicatedLinear "router") is no
  known target. auto_detect gives qkv_proj, o_proj, gate_up_proj, down_proj: init_buffer allocates the 4D expert
  buffers on every layer and, as the config has neither shared_expert_intermediate_size nor n_shared_experts, no 3D
  gate_up_proj / down_proj buffer - yet init_lora_modules wraps every dense and shared-expert gate_up_proj /
  down_proj (their leaf names are targets), and LoRAManager.init_state's update_lora_info then asks the pool for them
  (lora_manager.py:672 -> mem_pool.py get_tensor: KeyError 'gate_up_proj', or 'down_proj' on a list naming only
  down_proj) at the engine's start, after the pool is allocated. Llama4ForConditionalGeneration fails earlier, in the
  pool: its get_hidden_dim (mllama4.py:1000) knows qkv_proj, o_proj, gate_up_proj, down_proj and raises
  NotImplementedError for gate_up_proj_moe. Priced as Llama4ForCausalLM allocates it (the attention's buffers as a
  dense model's, 4D experts on every layer, the vocabulary's) and refused (adapter_refusals) wherever gate_up_proj or
  down_proj is a target; attention alone (q, k, v, o) starts under either class: priced, no refusal.
- MLA (DeepSeek-V2 / V3, use_mla): auto_detect normalises q_a_proj / kv_a_proj_with_mqa to
  fused_qkv_a_proj_with_mqa (REPLICATED_LINEAR_LORA_NAMES: whole on every rank; stacked 2: A 2 x rank, B q_lora_rank
  + kv_lora_rank + qk_rope_head_dim), q_b_proj (B the rank's heads x (qk_nope + qk_rope)), kv_b_proj (A kv_lora_rank,
  B the rank's heads x (qk_nope + v)), o_proj (A the rank's heads x v). DeepSeek-V2-Lite (no q_lora_rank) has a
  q_proj, which normalises to qkv_proj: its buffer is sized by get_default_hidden_dim for a dense qkv_proj (A 3 x rank
  by hidden; B head_dim x (heads + 2 x KV heads) / tp, head_dim transformers' DeepseekV2Config.head_dim =
  qk_rope_head_dim) and never read (no module is named qkv_proj, so nothing is wrapped), nor is kv_a_proj_with_mqa
  (only a module named fused_qkv_a_proj_with_mqa is): both buffers are allocated all the same. Its adapter then
  never loads (adapter_refusals: SGLang's loader raises on a q_proj without v_proj).
  On a CUDA GPU SGLang fuses DeepSeek-V3's one shared expert into the FusedMoE (deepseek_v2.py
  shared_experts_fusion_disable_reason); the pool is sized from the config, not the FusedMoE, so its bytes are the
  same (the sparse layers' 3D buffers fall back to get_default_hidden_dim's moe_intermediate_size x n_shared_experts).
- The LoRA backend's batch metadata where CUDA graphs are captured (verl's enforce_eager is SGLang's
  disable_cuda_graph), at the decode graph's largest batch, max_running_requests at most (verl passes max_num_seqs;
  SGLang's own cuda_graph_max_bs may be lower: priced at max_num_seqs, a bound): lora/backend/chunked_backend.py
  (csgmv, the default lora_backend) init_decode_cuda_graph_batch_info, one token a request: seg_lens,
  weight_indices, permutation, req_weight_indices (batch), seg_indptr, req_seg_indptr (batch + 1), int32, and
  lora_ranks / scalings (slots, int32 / fp32) - 6 KiB at 256; allocated with the graphs after the KV cache is sized,
  counted here with the pool (less than one token's KV: the token count moves by one at most). On a mixture of
  experts whose FusedMoE is wrapped (gate_up_proj and down_proj both targets), lora_manager.py
  init_lora_cuda_graph_moe_buffers, before the KV cache is sized: base_backend.py init_cuda_graph_moe_buffers for
  the first FusedMoEWithLoRA only (lora_manager.py:1202-1244, its loop breaks there: "Layers reuse these buffers
  sequentially"), int32 - sorted_token_ids_lora (slots x padded, padded = batch x top-k + experts x 63 rounded up to
  64), expert_ids_lora (slots x padded / 64), three rows of slots, cumsum_buffer (slots x (experts + 1)), token_mask
  (slots x batch x top-k), token_lora_mapping (batch); the decode runner may shrink it later
  (resize_cuda_graph_moe_buffers), not below this start. DeepSeek-V3's shared expert fused on a GPU adds one expert
  and one top-k slot (a few KiB, not priced). Per-batch metadata outside graphs (torch.empty per forward) and the MoE
  LoRA kernels' intermediates are transient, inside the (1 - fraction) slack: not priced.
"""

from __future__ import annotations

from .feasibility import Refusal
from .model_spec import ModelSpec
from .moe_lora_targets import is_llama4
from .rollout_lora import MLA_FAMILIES, LoraBuffers, attention_slices
from .spec_values import SpecError

SGLANG_MAX_LORAS_PER_BATCH = 8   # srt/arg_groups/fields/lora.py Lora.max_loras_per_batch (verl leaves it)
DEFAULT_VOCAB_PADDING_SIZE = 64  # srt/layers/vocab_parallel_embedding.py: the head's vocabulary rows padded to it
BLOCK_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
EMBEDDING_NAMES = ("embed_tokens", "lm_head")
MLA_TARGETS = ("fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj")
# LoRAManager.init_lora_shapes for lora_target_modules ["all"] (verl's all-linear) on a dense gated-MLP model, a
# mixture of experts without MLA too (auto_detect_lora_target_modules: FusedMoE -> gate_up_proj, down_proj)
ALL_TARGETS = frozenset(BLOCK_TARGETS + EMBEDDING_NAMES)
KNOWN_TARGETS = ALL_TARGETS | frozenset(MLA_TARGETS)
# utils.py get_normalized_target_modules: PEFT names -> the pool's (the rest keep their own)
NORMALIZED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj", "q_a_proj": "fused_qkv_a_proj_with_mqa",
              "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa"}
# SGLang model classes whose MoE LoRA pool is read (no get_hidden_dim of their own; benchmarks/sglang_lora_check.py
# builds each): qwen3_moe.py, qwen2_moe.py, mixtral.py, gpt_oss.py, deepseek_v2.py (V3 its subclass); and Llama 4
# (is_llama4: family "generic"), llama4.py / mllama4.py
MOE_FAMILIES = frozenset({"qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"}) | MLA_FAMILIES
INT32 = 4
MOE_BLOCK_M = 64   # lora/backend/base_backend.py init_cuda_graph_moe_buffers block_size_m


def all_targets(model: ModelSpec) -> frozenset[str]:
    """SGLang's "all" for the model (init_lora_shapes: auto_detect_lora_target_modules + EMBEDDING_NAMES): MLA's
    projections in place of qkv_proj, DeepSeek-V2-Lite's q_proj (no q_lora_rank) normalised to qkv_proj."""
    if not model.kv_lora_rank:
        return ALL_TARGETS
    query = "q_b_proj" if model.q_lora_rank else "qkv_proj"
    return frozenset({query, "fused_qkv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj",
                      *EMBEDDING_NAMES})


def sglang_target_modules(target_modules: str | list[str], model: ModelSpec | None = None) -> frozenset[str]:
    """The pool's targets for verl's model.target_modules: "all-linear" -> SGLang's "all" (all_targets of the model,
    a dense one's where none is given: the embedding and head included); a list of module names normalised
    (get_normalized_target_modules)."""
    if isinstance(target_modules, str):
        if target_modules not in ("all-linear", "all"):
            raise SpecError("target_modules", f"{target_modules!r}: SGLang serves all-linear or a list of modules "
                                              "(verl's sglang_lora_target_modules raises on a regex)")
        return all_targets(model) if model is not None else ALL_TARGETS
    names = frozenset(NORMALIZED.get(n.split(".")[-1], n.split(".")[-1]) for n in target_modules)
    unknown = names - KNOWN_TARGETS
    if unknown:
        raise SpecError("target_modules", f"{sorted(unknown)}; priced for: {', '.join(sorted(KNOWN_TARGETS))}")
    return names


def head_rows_per_rank(vocab: int, tp: int) -> int:
    """Rank 0's vocabulary rows of SGLang's ParallelLMHead (vocab_parallel_embedding.py VocabParallelEmbedding
    __init__: padding_size x tp where pad_vocab_size(vocab) does not divide by tp; _get_indices: the padded
    vocabulary / tp, capped at the real one) - the largest of the ranks'."""
    pad = DEFAULT_VOCAB_PADDING_SIZE
    if -(-vocab // pad) * pad % tp:
        pad *= tp
    return min(-(-vocab // pad) * pad // tp, vocab)


def _ab(stacked: int, fan_in: int, fan_out: int, r: int) -> int:
    """One slot's A (rank x stacked, in) and B (out, rank) elements: mem_pool.py get_lora_A_shape / get_lora_B_shape."""
    return r * (stacked * fan_in + fan_out)


def attention_elements(model: ModelSpec, tp: int, r: int, name: str) -> int:
    """One layer's, one slot's elements of an attention target (module docstring), on TP rank 0."""
    h, heads = model.hidden_size, model.n_heads // tp
    if not model.kv_lora_rank:
        column, (o_in, _) = attention_slices(model, tp)   # q, k, v apart: one A each
        return {"qkv_proj": _ab(3, h, sum(out for _, out in column), r), "o_proj": _ab(1, o_in, h, r)}.get(name, 0)
    rope, nope, v = model.qk_rope_head_dim, model.head_dim - model.qk_rope_head_dim, model.v_head_dim
    if name == "q_b_proj" and not model.q_lora_rank:
        raise SpecError("target_modules", "q_b_proj: the model has no q_lora_rank (SGLang's lora/utils.py "
                                          "get_default_hidden_dim reads config.q_lora_rank, None: it raises); its "
                                          "query is q_proj, or use all-linear")
    # qkv_proj (V2-Lite's q_proj): a dense qkv_proj's shape at transformers' head_dim (qk_rope_head_dim), KV heads
    # as QKVParallelLinear's (_column_parallel_lora_b_per_rank_dim)
    qkv_out = heads * rope + 2 * max(1, model.n_kv_heads // tp) * rope
    return {"qkv_proj": _ab(3, h, qkv_out, r), "o_proj": _ab(1, heads * v, h, r),
            "fused_qkv_a_proj_with_mqa": _ab(2, h, model.q_lora_rank + model.kv_lora_rank + rope, r),
            "q_b_proj": _ab(1, model.q_lora_rank, heads * model.head_dim, r),
            "kv_b_proj": _ab(1, model.kv_lora_rank, heads * (nope + v), r)}.get(name, 0)


def mlp_elements(model: ModelSpec, tp: int, r: int, name: str) -> int:
    """Every layer's elements, one slot, of gate_up_proj (stacked 2) or down_proj (module docstring): a dense
    model's MLP; a mixture of experts' 4D expert buffers on every layer and, where it has shared experts, the 3D ones
    shaped by each layer's linear (the shared expert's, or a dense block's MLP)."""
    h, L = model.hidden_size, model.n_layers

    def linear(f: int) -> int:   # MergedColumnParallelLinear gate_up (out split) or RowParallelLinear down (in)
        return _ab(2, h, 2 * (f // tp), r) if name == "gate_up_proj" else _ab(1, f // tp, h, r)
    if model.moe is None:
        return L * linear(model.ffn_hidden_size)
    moe, dense = model.moe, model.n_dense_layers
    # init_buffer's has_shared_experts reads the config's shared_expert_intermediate_size / n_shared_experts: Llama
    # 4's has neither (its shared expert and dense MLPs get no 3D buffer: adapter_refusals)
    shared = (dense * linear(moe.dense_ffn_size) + (L - dense) * linear(moe.shared_ffn_size)
              if moe.shared_ffn_size and not is_llama4(model) else 0)
    return shared + L * moe.n_experts * linear(moe.expert_ffn_size)


def start_refusals(model: ModelSpec, targets: frozenset[str] | None = None) -> list[Refusal]:
    """What SGLang raises at its start serving LoRA of `targets` (the pool's names; None: "all"): Llama 4 with
    gate_up_proj or down_proj a target (module docstring; benchmarks/sglang_lora_check.py runs LoRAManager's
    init_lora_modules and update_lora_info on SGLang 0.5.23's own classes)."""
    targets = all_targets(model) if targets is None else targets
    if not (is_llama4(model) and targets & {"gate_up_proj", "down_proj"}):
        return []
    return [Refusal("lora_merge", "engine-lora-start",
                    "SGLang: its LoRA pool holds no buffer for Llama 4's dense and shared-expert MLPs (no "
                    "shared-expert key in the config) while it wraps them: LoRAManager.update_lora_info raises "
                    "KeyError 'gate_up_proj' at the engine's start (Llama4ForConditionalGeneration: get_hidden_dim "
                    "NotImplementedError for gate_up_proj_moe)",
                    "--lora-merge (model.lora.merge: the merged weights sent, no adapter), or target_modules of the "
                    "attention alone (q_proj, k_proj, v_proj, o_proj)")]


def adapter_refusals(model: ModelSpec, targets: frozenset[str] | None = None) -> list[Refusal]:
    """What SGLang refuses of verl's adapter (`targets` as start_refusals'): at its start (start_refusals), or when
    it loads the adapter (each weight sync: load_lora_adapter_from_tensors -> lora/lora.py
    LoRAAdapter._normalize_weights): normalize_qkv_proj stacks every q_proj with its v_proj (and k_proj, or zeros
    shaped as v_proj's), so an MLA model with a q_proj (no q_lora_rank: DeepSeek-V2-Lite) and no v_proj raises
    KeyError on it (benchmarks/sglang_lora_check.py's environment, on SGLang 0.5.23's own function) and the adapter
    never loads."""
    refusals = start_refusals(model, targets)
    if model.kv_lora_rank and not model.q_lora_rank:
        refusals.append(Refusal(
            "lora_merge", "engine-lora-adapter",
            "SGLang: its LoRA loader (lora/lora.py normalize_qkv_proj) stacks the adapter's q_proj with a v_proj, "
            "which MLA without q_lora_rank has none of: KeyError at the first weight sync",
            "--lora-merge (model.lora.merge: the merged weights sent, no adapter) or --engine vllm"))
    return refusals


def csgmv_graph_metadata_bytes(slots: int, max_bs: int) -> int:
    """chunked_backend.py init_decode_cuda_graph_batch_info at one token a request (module docstring)."""
    return INT32 * (6 * max_bs + 2 + 2 * slots)


def moe_graph_buffers_bytes(model: ModelSpec, slots: int, max_bs: int) -> int:
    """base_backend.py init_cuda_graph_moe_buffers for `max_bs` tokens (module docstring)."""
    experts, tokens = model.moe.n_experts, max_bs * model.moe.experts_per_token
    padded = -(-(tokens + experts * (MOE_BLOCK_M - 1)) // MOE_BLOCK_M) * MOE_BLOCK_M
    return INT32 * (slots * (padded + padded // MOE_BLOCK_M + 3 + experts + 1 + tokens) + max_bs)


def sglang_lora_pool(model: ModelSpec, tp: int, max_lora_rank: int, dtype_bytes: int = 2,
                     max_loras_per_batch: int = SGLANG_MAX_LORAS_PER_BATCH,
                     targets: frozenset[str] | None = None, max_bs: int = 0) -> LoraBuffers:
    """The bytes of SGLang's LoRA memory pool on TP rank 0 (module docstring): max_loras_per_batch slots of
    max_lora_rank for `targets` (the pool's names; None: SGLang's "all" for the model), dtype of `dtype_bytes`; and
    the backend's CUDA-graph metadata at the decode graph's largest batch `max_bs` (0: no CUDA graphs)."""
    if not model.gated_mlp:
        raise SpecError("finetune", "SGLang's LoRA pool is priced for gated-MLP blocks (gate_up_proj, down_proj); "
                                    f"{model.family}'s MLP is not")
    if model.moe is not None and model.family not in MOE_FAMILIES and not is_llama4(model):
        read = ", ".join(sorted(MOE_FAMILIES)) + ", Llama 4"
        raise SpecError("finetune", f"SGLang's LoRA pool is priced for the MoE classes read ({read}); "
                                    f"{model.family}'s is not")
    if model.kv_lora_rank and model.family not in MLA_FAMILIES:
        raise SpecError("finetune", f"SGLang's LoRA pool is priced for DeepSeek's MLA; {model.family}'s is not")
    targets = all_targets(model) if targets is None else targets
    r, slots = max_lora_rank, max_loras_per_batch
    blocks = sum(model.n_layers * attention_elements(model, tp, r, name) for name in targets
                 if name not in ("gate_up_proj", "down_proj") + EMBEDDING_NAMES)
    blocks += sum(mlp_elements(model, tp, r, name) for name in targets & {"gate_up_proj", "down_proj"})
    vocab, h = model.vocab_size, model.hidden_size
    embed = (r * vocab + h * r) if "embed_tokens" in targets else 0
    head_rows = vocab if model.tied_embeddings else head_rows_per_rank(vocab, tp)
    head = (r * h + head_rows * r) if "lm_head" in targets else 0
    # init_buffers fills the embedding's dicts (embedding_A/B_buffer) where embed_tokens is a target and the head's
    # (lm_head_A/B_buffer) where lm_head is, each with a buffer for every embedding name targeted: both named, each
    # buffer is allocated twice
    copies = ("embed_tokens" in targets) + ("lm_head" in targets)
    return LoraBuffers(blocks_bytes=slots * blocks * dtype_bytes,
                       vocab_bytes=copies * slots * (embed + head) * dtype_bytes,
                       metadata_bytes=graph_metadata_bytes(model, targets, slots, max_bs))


def graph_metadata_bytes(model: ModelSpec, targets: frozenset[str], slots: int, max_bs: int) -> int:
    """The backend's CUDA-graph metadata for `slots` at the decode graph's largest batch `max_bs` (0: no CUDA graphs):
    csgmv's rows, and the MoE routing buffers where the FusedMoE is wrapped (module docstring)."""
    if not max_bs:
        return 0
    metadata = csgmv_graph_metadata_bytes(slots, max_bs)
    if model.moe is not None and {"gate_up_proj", "down_proj"} <= targets:   # FusedMoEWithLoRA
        metadata += moe_graph_buffers_bytes(model, slots, max_bs)
    return metadata


def one_slot_bytes(model: ModelSpec, pool: LoraBuffers, slots: int, max_bs: int,
                   targets: frozenset[str] | None = None) -> int:
    """What a decode step reads of a pool of `slots` (sglang_lora_pool of the same targets and max_bs): one slot's
    buffers (every buffer is slots x one slot's) and the graph metadata at one slot."""
    targets = all_targets(model) if targets is None else targets
    return (pool.blocks_bytes + pool.vocab_bytes) // slots + graph_metadata_bytes(model, targets, 1, max_bs)
