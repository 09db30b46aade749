"""Activation memory: what autograd saves for backward, per token, per block.

Korthikanti et al. 2022 give s*b*h*(34 + 5*a*s/h) bytes per GPT layer with 16-bit activations. Real
implementations differ from the textbook block, so the count here is assembled from the ops of the
Hugging Face implementations (the models users actually run), tensor by tensor:

- a LayerNorm saves its input; an eager RMSNorm (HF, torchtitan's "rmsnorm") upcasts to fp32 and saves
  the fp32 input and the normalised low-precision tensor it multiplies by the weight; a fused RMSNorm
  kernel (norm "fused_rmsnorm", torchtitan's Triton kernel) saves its input only;
- a linear layer saves its input (shared inputs are counted once);
- fused attention (SDPA flash / memory-efficient) saves q, k, v, the output and a logsumexp; eager
  attention also saves the softmax probabilities (fp32 for Llama-style models) of shape a*s*s;
- the MLP saves its activation's input and output (a gated MLP also the up projection and product);
  GPT-2's `gelu_new` is written in Python ops and saves four f-sized tensors;
- dropout with p > 0 saves a one-byte mask per element.

Ignored: per-token scalars smaller than one hidden vector (norm statistics), rotary tables (shared by
all layers), allocator rounding. The trace tier (`fsdp-plan trace`) measures the exact figure.
"""

from __future__ import annotations

from .specs import Attention, ModelSpec

# Families whose eager attention softmax runs in fp32 (HF: softmax(..., dtype=torch.float32)).
_FP32_SOFTMAX_FAMILIES = {"llama", "mistral", "qwen2", "phi3", "gpt_neox", "falcon", "generic"}
# Families with ALiBi position bias: SDPA gets a float mask, so fused kernels may not be used.
ALIBI_FAMILIES = {"bloom", "mpt"}
# Families whose activation function is written in Python ops (saves several f-sized tensors).
PYTHON_OP_ACTIVATIONS = {"gelu_new", "gelu_pytorch_tanh_python", "quick_gelu"}


def _norm_bytes(model: ModelSpec, c: int) -> int:
    """Saved bytes per token of one norm (its input; for RMSNorm the fp32 upcast and the product)."""
    h = model.hidden_size
    if model.norm == "rmsnorm":
        return 4 * h + c * h
    # layernorm, and fused RMSNorm kernels (torchtitan's fused_rmsnorm): the input only.
    return c * h


def _mlp_bytes(model: ModelSpec, c: int) -> int:
    """Saved bytes per token of the MLP, excluding its (normed) input."""
    f = model.ffn_hidden_size
    if model.gated_mlp:
        # act(gate) saves gate; act * up saves both; down saves the product.
        return 4 * c * f
    if model.activation in PYTHON_OP_ACTIVATIONS:
        # pow saves x, tanh saves its output, the final product saves both factors, fc2 saves the result.
        return 5 * c * f
    if model.activation == "relu":
        # relu saves its output, which is also fc2's input.
        return c * f
    # native gelu/silu: saves its input; fc2 saves the output.
    return 2 * c * f


def _attention_bytes(model: ModelSpec, c: int, attention: Attention, seq_len: int) -> int:
    """Saved bytes per token of self-attention, excluding its (normed) input."""
    q, kv = model.q_dim, model.kv_dim
    saved = c * (q + 2 * kv)      # q, k, v as the attention kernel sees them (after rotary)
    saved += c * q                # attention output (kept by SDPA and as the o-projection's input)
    saved += c * q                # o-projection input: the heads merged into a contiguous tensor
    if attention is Attention.EAGER or model.family in ALIBI_FAMILIES:
        probs = model.n_heads * seq_len
        softmax_bytes = 4 if model.family in _FP32_SOFTMAX_FAMILIES else c
        saved += probs * softmax_bytes + probs * c  # softmax output, cast probabilities for P @ V
        if model.dropout:
            saved += probs * (1 + c)                # dropout mask and dropped probabilities
        saved -= c * q                              # no separate kernel output copy: P @ V is the output
    return saved


def block_bytes_per_token(model: ModelSpec, compute_bytes: int, attention: Attention, seq_len: int) -> int:
    """Bytes one block saves for backward per token of the micro-batch."""
    c = compute_bytes
    h = model.hidden_size
    shared_norm = model.parallel_block and model.family == "falcon"
    n_norms = 1 if shared_norm else 2
    saved = n_norms * (_norm_bytes(model, c) + c * h)  # each norm and the normed tensor the linears read
    saved += _attention_bytes(model, c, attention, seq_len)
    saved += _mlp_bytes(model, c)
    if model.dropout:
        saved += 2 * h  # residual dropout masks after attention and MLP
    return saved


def checkpointed_block_bytes_per_token(model: ModelSpec, compute_bytes: int) -> int:
    """A checkpointed block keeps only its input (non-reentrant checkpoint)."""
    return compute_bytes * model.hidden_size


def root_bytes_per_token(model: ModelSpec, compute_bytes: int) -> int:
    """Final norm and the output head's input."""
    return _norm_bytes(model, compute_bytes) + compute_bytes * model.hidden_size


def logits_bytes_per_token(model: ModelSpec, compute_bytes: int) -> tuple[int, int]:
    """(kept, peak) bytes per token of the logits and the loss.

    kept: the logits in the compute dtype, held by the model output through backward.
    peak: at the loss's backward, HF's loss upcasts logits to fp32, log-softmax saves an fp32 output,
    and its backward makes an fp32 gradient and the gradient of the upcast: kept + 3 fp32 copies.
    """
    v = model.vocab_size
    kept = compute_bytes * v
    return kept, kept + 3 * 4 * v


def quirks(model: ModelSpec, attention: Attention) -> list[str]:
    """Where the formulas are known to be rough for this model: say so and point to the trace tier."""
    notes = []
    if model.activation in PYTHON_OP_ACTIVATIONS:
        notes.append(f"activation {model.activation} is written in Python ops (saves several f-sized tensors); "
                     "verify activation memory with `fsdp-plan trace`")
    if model.family in ALIBI_FAMILIES and attention is Attention.SDPA:
        notes.append(f"{model.family} uses an ALiBi bias: SDPA cannot use the flash kernel and s^2 "
                     "attention memory is counted; verify with `fsdp-plan trace`")
    if model.family == "generic":
        notes.append("model architecture inferred from an nn.Module: activation memory uses a Llama-style "
                     "block; verify with `fsdp-plan trace`")
    return notes
