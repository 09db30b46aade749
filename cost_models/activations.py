"""Activation memory: what autograd saves for backward, and what the backward holds on top, per token.

Korthikanti et al. 2022 give s*b*h*(34 + 5*a*s/h) bytes per GPT layer with 16-bit activations. Real
implementations differ from the textbook block, so the counts here are assembled tensor by tensor from
the Hugging Face implementations (transformers 5, the code users run), as listed by
torch.autograd.graph.saved_tensors_hooks on each model type and checked against the trace tier
(benchmarks/memory_accuracy.py, docs/accuracy.md). c = bytes of the compute dtype; per token of the
micro-batch; h hidden, q = heads x head_dim, kv = kv heads x head_dim, f FFN width, a heads, s sequence.

- Norms. LayerNorm saves its input (c*h) and the linear layers save its output (c*h). Hugging Face's
  RMSNorm upcasts to fp32: it saves the fp32 input (4h), the normalised tensor cast back (c*h) and the
  output (c*h). A parallel block (GPT-NeoX) feeds both LayerNorms from one input, saved once. Gemma's
  (1 + w) RMSNorm and OLMo 2's apply the weight in fp32 (norm "rmsnorm_fp32"): the normalised tensor is
  saved in fp32 (4h + 4h). Gemma 2/3 put a norm before and after each sublayer (norm_layout "sandwich":
  four norms, two outputs saved); OLMo 2 only after (the sublayers' inputs are saved instead: same count).
  q/k norms (Qwen3, Gemma 3 per head; OLMo 2 over q_dim and kv_dim) save what a norm of that width saves.
- Attention, SDPA (flash / memory-efficient kernels): the q, k, v the kernel reads, its output (which
  is also the o-projection's input) and an fp32 logsumexp (4a). Separate projections with rotary
  (Llama, Mistral, Qwen2): the rotated q and k replace the projections, c*(q + 2kv). A fused qkv
  projection is saved whole because v is a view of it, c*(q + 2kv); with rotary (GPT-NeoX, Phi-3,
  Falcon) the rotated q and k are new tensors, + c*(q + kv), built (b, heads, s, d)-contiguous by a cat,
  so the kernel's output comes out in that layout and .transpose(1, 2).contiguous() copies it, + c*q.
- Attention, eager: softmax probabilities of a*s per token: Llama-style models take the softmax in fp32
  and cast it back (4 + c bytes; 4 in fp32), GPT-2 in the compute dtype (c); the P @ V output is copied
  into the o-projection's input (c*q); Llama-style models repeat k and v per query head (3*c*q in all).
  Attention dropout (p > 0) keeps a 1-byte mask and the dropped probabilities (1 + c), which replace
  the fp32 softmax's cast copy. Score soft-capping (Gemma 2) saves the tanh output (c).
- Attention of its own kind: DeepSeek's latent attention and router (activations_mla.py), gpt-oss's
  sinks (activations_sinks.py).
- Sliding windows no longer than the sequence, SDPA: each windowed layer saves an (s, s) mask, and k and v
  repeated per query head (transformers' repeat_kv when a mask is passed); alternating families (Gemma
  2/3, gpt-oss) pay this in their windowed layers only, averaged over the blocks.
- MLP: SwiGLU saves gate, act(gate), up and their product (4*c*f, fused or not); native GELU/SiLU its
  input and output (2*c*f); ReLU its output (c*f); GPT-2's gelu_new is Python ops: x, x^3 term, tanh,
  the product and fc2's input (5*c*f).
- Dropout (p > 0) on the residual branches and embeddings: one 1-byte mask per element (CUDA's fused
  dropout; the trace tier uses the same kernel choice).
- Root: the final norm, the LM head's input, the labels (8 B); rotary cos/sin tables (per sequence,
  shared by all layers); logits: see logits_bytes_per_token.

The backward of a block holds, on top of what is saved: the incoming gradient (c*h) and the gradients
of its widest op. For the MLP that is the gradient of fc2's input and of the two factors of the gated
product (3*c*f, while fc2's saved input c*f is already freed); eager attention holds the probabilities'
gradient in fp32 next to the saved softmax output. See backward_working_bytes_per_token.

LoRA (lora_rank > 0; adapters on ModelSpec.lora_shapes: the attention projections, or all-linear): autograd
saves a tensor only for a gradient someone needs, and frozen weights need none. So a frozen linear does
not save its input, and a frozen norm weight does not keep the normalised tensor it multiplies (frozen
RMSNorm saves just its fp32 input, 4h; LayerNorm its input, c*h). The attention norm's output is still
saved, by the q/k/v adapters' lora_A; an MLP without adapters keeps only what its activation function needs
(SwiGLU: gate, act(gate), up; GELU/SiLU its input; ReLU its output; gelu_new its four Python-op tensors),
not its norm's output nor fc2's input; with adapters (all-linear) the gate / up (fc1) adapters' lora_A saves
the norm's output and the down (fc2) adapter's its input, as a full fine-tune's linears do (peft 0.21
tuners/lora/layer.py Linear.forward: lora_A(dropout(x)), the dropout an identity at lora_dropout 0, so x
itself); the root keeps the final norm's input, not the LM head's. Each adapter saves its lora_A output (r
values) for lora_B. Nothing before the first adapter needs a gradient: the embedding dropout keeps no mask,
the first block's first norm (and a parallel block's frozen MLP) saves nothing (first_block_lora_savings).

Ignored: per-token scalars smaller than a hidden vector other than the logsumexp (norm statistics), the
allocator's 512-byte rounding. The trace tier (`fsdp-plan trace`) measures the exact figure.
"""

from __future__ import annotations

from . import activations_mla, activations_sinks, attention_flex, moe, operators
from .operators import window_masks
from .loss_memory import (_loss_bytes, forward_logits_bytes_per_token, logits_bytes_per_token,  # noqa: F401
                          logits_reserved_extra_bytes_per_token, loss_events)
from .kernels import EAGER as EAGER_KERNELS, Kernels
from .specs import Attention, ModelSpec

# Llama-like families of the table (planner/models/family_table.py, moe_families.py): separate q/k/v
# projections, rotary, fp32 softmax in eager; their norms, q/k norms and soft-capping are ModelSpec fields.
_TABLE_FAMILIES = {"qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "phi", "starcoder2", "mixtral", "qwen2_moe",
                   "qwen3_moe"}
# Families whose eager attention softmax runs in fp32 (HF: softmax(..., dtype=torch.float32)).
_FP32_SOFTMAX_FAMILIES = {"llama", "mistral", "qwen2", "phi3", "gpt_neox", "falcon", "generic", *_TABLE_FAMILIES}
# Separate q/k/v projections, rotary applied elementwise (rotated q/k keep the projection's layout).
_SEPARATE_QKV_FAMILIES = {"llama", "mistral", "qwen2", "generic", *_TABLE_FAMILIES}
# Fused qkv projection with rotary through a cat: rotated copies, and a copy of the attention output.
_FUSED_ROTARY_FAMILIES = {"gpt_neox", "phi3", "falcon"}
# Families a traced block profile prices in preference to their formula (activations_mla.py, activations_sinks.py:
# within 0.1% of the shipped profiles on the presets' own shapes, tests/unit/test_shipped_profiles.py) where
# one is shipped (the presets) or transformers is installed to trace it (planner/models/block_profiles.py): the
# profile also carries the block's traced operator inventory (step time) and its checkpoint-held inputs (rotary
# tables, masks), which the formula does not count for them; the formula prices a config.json without either.
PROFILED_FAMILIES = {"deepseek_v2", "deepseek_v3", "gpt_oss"}
# Families with ALiBi position bias: SDPA gets a float mask, so fused kernels may not be used.
ALIBI_FAMILIES = {"bloom", "mpt"}
# Families whose activation function is written in Python ops (saves several f-sized tensors).
PYTHON_OP_ACTIVATIONS = {"gelu_new", "gelu_pytorch_tanh_python", "quick_gelu"}
ROTARY_FAMILIES = {"llama", "mistral", "qwen2", "phi3", "gpt_neox", "falcon", "generic", *_TABLE_FAMILIES}
# Families whose rotary cos/sin tables stay fp32 (OLMo 2 rotates in fp32 and casts the result back).
_FP32_ROTARY_FAMILIES = {"olmo2"}
LOGSUMEXP_BYTES = 4  # fp32 per head and token, saved by the fused attention kernels


def _norm_bytes(model: ModelSpec, c: int, lora: bool = False, width: int = 0, fused: bool = False) -> int:
    """Saved bytes per token of one norm (over `width`, default the hidden size), without its output: for
    RMSNorm the fp32 upcast and the normalised tensor the weight multiplies - cast back to c, or fp32 for
    rmsnorm_fp32 (Gemma's (1 + w), OLMo 2) - only the upcast when the weight is frozen; for LayerNorm and
    fused RMSNorm kernels (fused: Liger's, TE's; kernels.py) the input."""
    w = width or model.hidden_size
    if fused:
        return c * w
    if model.norm == "rmsnorm":
        return 4 * w + (0 if lora else c * w)
    if model.norm == "rmsnorm_fp32":
        return 4 * w + (0 if lora else 4 * w)
    return c * w


def _frozen_mlp(model: ModelSpec, lora: bool) -> bool:
    """Under LoRA, an MLP without adapters (attention targets): its linears save no input."""
    return lora and not model.lora_mlp


def _norms_bytes(model: ModelSpec, c: int, lora: bool = False, fused: bool = False) -> int:
    """Both norms of a block with the outputs the linear layers save (under LoRA without MLP adapters only
    the attention norm's, which the q/k/v adapters read)."""
    h = model.hidden_size
    norm = _norm_bytes(model, c, lora, fused=fused)
    outputs = 1 if _frozen_mlp(model, lora) else 2
    if model.parallel_block and model.family == "falcon":
        return norm + c * h                            # one norm feeds attention and MLP
    if model.parallel_block:
        return norm + outputs * c * h                  # two norms of one input: the input saved once
    if model.norm_layout == "sandwich":
        # four norms; only the two before the sublayers have outputs the linears save (the two after feed
        # the residual adds)
        return 4 * norm + outputs * c * h
    # pre-norms: the two norm outputs; post-norms (OLMo 2): the two sublayer inputs, saved by the linears
    return 2 * norm + outputs * c * h


def _qk_norm_bytes(model: ModelSpec, c: int, lora: bool = False) -> int:
    """q and k norms (Qwen3, Gemma 3: per head over head_dim; OLMo 2: over q_dim and kv_dim): each saves
    what a norm of that width saves, plus its fp32 statistics (per head, or per token); the projections'
    outputs they read are not saved (the norm's fp32 upcast is a copy), so nothing else changes."""
    if not model.qk_norm:
        return 0
    stats = 4 * (model.n_heads + model.n_kv_heads if model.qk_norm == "head" else 2)
    return _norm_bytes(model, c, lora, width=model.q_dim) + _norm_bytes(model, c, lora, width=model.kv_dim) + stats


def _windowed_layers(model: ModelSpec) -> tuple[int, int]:
    """(layers with the sliding window, n_layers): alternating families window only some layers."""
    return model.n_layers - model.full_attention_layers, model.n_layers


def _softmax_bytes(model: ModelSpec, c: int) -> int:
    """Eager attention's softmax output: fp32 where the model's eager attention asks for it (the generic reader reads
    it off the module: Llama 4's eager_attention_forward does not), else the family's rule."""
    fp32 = model.eager_softmax_fp32
    return 4 if (model.family in _FP32_SOFTMAX_FAMILIES if fp32 is None else fp32) else c


def _attention_dropout(model: ModelSpec) -> bool:
    return model.dropout if model.attention_dropout is None else model.attention_dropout


def uses_s2_attention(model: ModelSpec, attention: Attention) -> bool:
    return attention is Attention.EAGER or model.family in ALIBI_FAMILIES


def _probs_bytes(model: ModelSpec, c: int, seq_len: int) -> int:
    """Eager attention: softmax output (+ its cast back to c), dropout mask and dropped probabilities."""
    probs = model.n_heads * seq_len
    soft = _softmax_bytes(model, c)
    saved = probs * soft
    if model.attn_softcap:
        saved += probs * c  # tanh(scores / cap) saves its output (Gemma 2)
    if _attention_dropout(model):
        saved += probs * (1 + c)  # mask and dropped probabilities (the cast copy only feeds the dropout)
    elif soft != c:
        saved += probs * c        # the fp32 softmax's cast back, P @ V's input
    return saved


def _attention_bytes(model: ModelSpec, c: int, attention: Attention, seq_len: int, micro_batch: int = 1,
                     lora: bool = False) -> int:
    """Saved bytes per token of self-attention, excluding its (normed) input (lora: frozen q/k norms)."""
    if activations_mla.is_latent(model):  # DeepSeek's latent attention (activations_mla.py)
        return activations_mla.latent_attention_bytes(model, c, attention, seq_len, micro_batch,
                                                      lambda width: _norm_bytes(model, c, lora, width))
    if activations_sinks.has_sinks(model) and attention is not Attention.SDPA:  # gpt-oss (activations_sinks.py)
        return activations_sinks.sink_attention_bytes(model, c, seq_len, attention)
    q, kv = model.q_dim, model.kv_dim
    eager = uses_s2_attention(model, attention)
    if model.family in _SEPARATE_QKV_FAMILIES:
        qkv = 3 * c * q if eager else c * (q + 2 * kv)   # eager repeats k and v per query head
        if attention is Attention.FLEX and model.n_heads & (model.n_heads - 1):
            qkv = 3 * c * q  # transformers' flex path repeats k and v unless the heads are a power of two
    elif model.family in _FUSED_ROTARY_FAMILIES:
        qkv = c * (q + 2 * kv) + c * (q + kv)            # fused projection + rotated q and k
        if eager and (micro_batch > 1 or kv < q):
            # P @ V reads v through a batched matmul: with more than one sequence (or repeated k/v
            # heads) v is copied to a contiguous tensor and the fused projection is no longer kept.
            qkv = 3 * c * q
    else:
        qkv = c * (q + 2 * kv)                           # fused projection, q/k/v are views of it
    qkv += _qk_norm_bytes(model, c, lora)
    if eager:
        return qkv + c * q + _probs_bytes(model, c, seq_len)  # + copy of P @ V for the o-projection
    out = c * q + LOGSUMEXP_BYTES * model.n_heads
    if model.family in _FUSED_ROTARY_FAMILIES:
        out += c * q                                     # the output, copied into (b, s, heads x d)
    if window_masks(model, seq_len) and attention is not Attention.FLEX:  # flex: a BlockMask (eager_mask_bytes)
        # A window no longer than the sequence makes transformers hand SDPA an (s, s) mask, which each
        # windowed layer saves in the compute dtype; with a mask transformers repeats k and v per query
        # head (repeat_kv; a view when there is one kv head), and SDPA saves the repeated copies.
        windowed, n_layers = _windowed_layers(model)
        repeated = 2 * c * (q - kv) if model.family in _SEPARATE_QKV_FAMILIES and 1 < model.n_kv_heads else 0
        if model.family not in _SEPARATE_QKV_FAMILIES and model.family not in _FUSED_ROTARY_FAMILIES:
            repeated = c * q                             # the output, copied into (b, s, heads x d)
        out += (seq_len * c + repeated) * windowed // n_layers
    return qkv + out


def _mlp_bytes(model: ModelSpec, c: int, lora: bool = False, fused_swiglu: bool = False) -> int:
    """Saved bytes per token of the MLP, excluding its (normed) input. Under LoRA without MLP adapters the MLP
    is frozen: fc2 does not save its input."""
    if model.moe is not None:
        # router and routed token rows (cost_models/moe.py), DeepSeek's router's own (activations_mla.py)
        # experts frozen under LoRA but all-linear's (moe_lora.py: the router and stacks train through W_eff)
        frozen = _frozen_mlp(model, lora)
        return moe.mlp_bytes_per_token(model, c, frozen) + activations_mla.router_extra_bytes(model, c, not frozen)
    f = model.ffn_hidden_size
    fc2_input = 0 if _frozen_mlp(model, lora) else c * f
    if model.gated_mlp:
        return (2 if fused_swiglu else 3) * c * f + fc2_input   # gate, act(gate) but Liger / TE, up (+ act * up)
    if model.activation in PYTHON_OP_ACTIVATIONS:
        return 4 * c * f + fc2_input   # fc1 output, x^3 term, tanh, product (+ fc2 input)
    if model.activation == "relu":
        return c * f                   # relu saves its output, which is also fc2's input
    return c * f + fc2_input           # native gelu/silu: its input (+ fc2 saves the output)


def lora_adapter_bytes(model: ModelSpec, c: int, lora_rank: int) -> int:
    """Each adapter's lora_A output (r values), saved for lora_B's weight gradient."""
    return len(model.lora_shapes) * lora_rank * c


def block_bytes_per_token(model: ModelSpec, compute_bytes: int, attention: Attention, seq_len: int,
                          micro_batch: int = 1, lora_rank: int = 0, kernels: Kernels = EAGER_KERNELS) -> int:
    """Bytes one block saves for backward per token of the micro-batch (lora_rank > 0: LoRA fine-tuning)."""
    c, lora = compute_bytes, lora_rank > 0
    saved = _norms_bytes(model, c, lora, kernels.fused_norm)
    saved += _attention_bytes(model, c, attention, seq_len, micro_batch, lora)
    saved += _mlp_bytes(model, c, lora, kernels.fused_swiglu) + lora_adapter_bytes(model, c, lora_rank)
    if model.dropout:
        saved += 2 * model.hidden_size  # residual dropout masks after attention and MLP (1 byte each)
    return saved


def checkpointed_block_bytes_per_token(model: ModelSpec, compute_bytes: int) -> int:
    """A checkpointed block keeps only its input (non-reentrant checkpoint)."""
    return compute_bytes * model.hidden_size


def selective_op_held_bytes_per_token(model: ModelSpec, compute_bytes: int, attention: Attention, seq_len: int,
                                      lora_rank: int = 0) -> int:
    """What a block keeps from its forward to its backward under torchtitan's selective op-level policy
    (published.md): its input (the non-reentrant checkpoint's), and the cached outputs of the ops it must
    save - every other aten.mm (operators.selective_op_saved_elements) and the SDPA kernel's output and
    logsumexp. Eager attention's batched products (aten.bmm) and softmax are not on the list: recomputed."""
    c = compute_bytes
    saved = c * model.hidden_size + c * operators.selective_op_saved_elements(model, seq_len, lora_rank)
    if not uses_s2_attention(model, attention):
        saved += c * model.q_dim + LOGSUMEXP_BYTES * model.n_heads
    return round(saved)


def input_saved_by_first_norm(model: ModelSpec, compute_bytes: int, fused_norm: bool = False) -> bool:
    """Whether the block's first norm saves the block input itself (LayerNorm; RMSNorm in fp32, where the
    upcast is a no-op), or the block starts with its attention (post-norms, OLMo 2): then a recomputed
    checkpointed block's saved input is that same tensor."""
    return (fused_norm or model.norm not in ("rmsnorm", "rmsnorm_fp32") or compute_bytes == 4
            or model.norm_layout == "post")


def root_bytes_per_token(model: ModelSpec, compute_bytes: int, lora: bool = False, fused_norm: bool = False) -> int:
    """Final norm, the output head's input (not with a frozen head: LoRA), the labels (int64) and the
    embedding dropout mask."""
    c, h = compute_bytes, model.hidden_size
    saved = _norm_bytes(model, c, lora, fused=fused_norm) + (0 if lora else c * h) + 8
    if model.dropout and not lora:
        saved += h
    return saved


def first_block_lora_savings(model: ModelSpec, compute_bytes: int, fused_norm: bool = False) -> int:
    """Under LoRA the first block's input needs no gradient (frozen embeddings), so its first norm saves
    nothing, nor does a parallel block's MLP branch (it reads the block input, not the attention's
    output): bytes per token the first block saves less than block_bytes_per_token says (unless
    checkpointed). A post-norm block (OLMo 2) has no norm before its attention: nothing to save. A parallel
    block's MLP with adapters (all-linear) saves as in any block: its adapters' outputs need gradients. Not where
    the trainer calls PEFT's enable_input_require_grads (verl: memory.estimate_memory's input_requires_grad)."""
    savings = _norm_bytes(model, compute_bytes, lora=True, fused=fused_norm) if model.norm_layout != "post" else 0
    if model.parallel_block and not model.lora_mlp:
        savings += _mlp_bytes(model, compute_bytes, lora=True)
    return savings


def output_projection_forward_held_bytes_per_token(model: ModelSpec, compute_bytes: int, embeddings_held: bool,
                                                   mlp_inputs_saved: bool) -> int:
    """At the forward (or a checkpointed block's recompute) of a block's MLP output projection, what the block's
    saved tensors leave out but the forward still holds, per token: the block's input (the model's loop keeps it
    until the block returns), the attention's residual sum (for the add after the MLP), the MLP's input and the
    projection's input (transformers 5 LlamaDecoderLayer / LlamaMLP.forward's locals) unless saved already
    (mlp_inputs_saved: by the MLP's adapters, all-linear, where no copy replaces them); embeddings_held: the
    embedding's output too, which transformers' model forward keeps in inputs_embeds until it returns (LlamaModel:
    `hidden_states = inputs_embeds`, then the blocks), a tensor of its own from the second block on. Measured at
    the last block's forward: tests/distributed/test_torchrun_qlora.py (a dequantized weight beside it),
    test_torchrun_autocast_lora.py (LoRA all-linear: the down projection's adapter)."""
    h = model.hidden_size
    mlp_inputs = 0 if mlp_inputs_saved else h + model.ffn_hidden_size
    return compute_bytes * (2 * h + mlp_inputs + (h if embeddings_held else 0))


def lora_output_projection_in_flight_bytes_per_token(model: ModelSpec, compute_bytes: int, copy_bytes: int) -> int:
    """peft's Linear.forward on the MLP's output projection (all-linear; peft 0.21 tuners/lora/layer.py), beside
    its input: the frozen base's output, lora_B's output scaled by alpha / r and their sum (three h-wide tensors at
    once: lora_B's own output dies at the scaling, before the add), and the input cast to the adapters' dtype
    (_cast_input_dtype: x, held until the forward returns), copy_bytes a value: a new tensor where the adapter's
    weight is seen in another dtype (FSDP1's adapter units, fsdp1_adapters.py), else 0."""
    return 3 * compute_bytes * model.hidden_size + copy_bytes * model.ffn_hidden_size


def shared_bytes(model: ModelSpec, compute_bytes: int, seq_len: int) -> int:
    """Bytes saved once per micro-batch whatever its size: the rotary cos and sin tables (s x head_dim),
    in the compute dtype (fp32 for OLMo 2)."""
    if model.family not in ROTARY_FAMILIES:
        return 0
    return 2 * seq_len * model.head_dim * (4 if model.family in _FP32_ROTARY_FAMILIES else compute_bytes)


def eager_mask_bytes(model: ModelSpec, compute_bytes: int, seq_len: int, micro_batch: int,
                     attention: Attention) -> int:
    """Eager attention gets a materialised (b, 1, s, s) causal mask in the compute dtype - two when local and
    global layers alternate (Gemma 2/3, gpt-oss: a sliding and a full mask). SDPA gets one only for a
    window no longer than the sequence: a boolean (s, s), expanded over the batch. The masks die with the
    forward unless activation checkpointing keeps them as inputs of every checkpointed block's recompute:
    count them only then."""
    windowed = window_masks(model, seq_len)
    if attention is Attention.FLEX:  # a BlockMask per mask kind (attention_flex.py), not an (s, s) tensor
        masks = 2 if model.sliding_window and 0 < model.full_attention_layers < model.n_layers else 1
        return masks * attention_flex.block_mask_bytes(seq_len, micro_batch)
    if not uses_s2_attention(model, attention):
        return seq_len * seq_len if windowed else 0
    if model.family in ALIBI_FAMILIES:
        return 0
    masks = 2 if model.sliding_window and 0 < model.full_attention_layers < model.n_layers else 1
    return masks * micro_batch * seq_len * seq_len * compute_bytes
