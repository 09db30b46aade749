"""LoRA's dropout (peft's lora_dropout > 0): what each adapter's nn.Dropout saves for backward, per token of a block.

peft 0.21 tuners/lora/layer.py Linear.forward computes lora_B(lora_A(dropout(x))) * scaling with one dropout per
adapted linear (nn.Identity at lora_dropout 0: activations.py's LoRA prices that). With p > 0 each adapter's dropout
makes its own output, which its lora_A saves instead of x, and CUDA's fused kernel (torch.native_dropout, the trace
tier's choice too: calibration/gpu_run_choices.py) saves a one-byte bool mask of x's shape when x needs a gradient.
So per adapter of input width `in`, per token:

- the mask, in bytes: except where x needs no gradient, block 0's adapters reading the block's normed input (its
  attention's input projections; a parallel block's MLP input projections too), nothing before them training;
- the dropout's output, in the dtype the adapter sees: where the adapters share their input (FSDP2's gathered
  adapters, in the compute dtype) each saves c x in of its own, and the inputs only adapters saved are freed
  (fsdp1_adapters.inputs_kept_by_adapters_only: the norms' outputs, the down projection's input, o's input where it
  is a copy: o_input_copied); where each adapter already saves its own copy (FSDP1's adapter units, peft casting x to
  the adapters' dtype: fsdp1_adapters.py), the dropout's output replaces that copy, nothing more.

The backward frees them adapter by adapter: the o-projection's and the MLP's before the attention's backward, the
down projection's before the activation's (memory_shape.py adjusts those two moments).

Measured (2026-12-07, a real CPU step, transformers' tiny Llama h 128, f 352, 2 blocks, 256 tokens, rank 8; the
saved tensors by storage and calibration.memtrack's peak, both moving by the same bytes; the CUDA kernel choice):
all-linear +5,952 B a token at fp32, +3,904 at bf16, +1,856 where peft casts x to fp32 adapters (with or without
autocast); attention only +3,712 / +2,176 / +640; GPT-NeoX (parallel block, fused rotary) and Phi-3 (fused
projections) too; the figures below to the byte (tests/unit/test_lora_dropout.py).
Ignored: the dropout's output and mask in flight while its adapter's forward runs (the down projection's: the
in-flight moment in memory_shape.py counts them), torch's CPU kernel (a mask in x's dtype, not the CUDA run priced).
With checkpointing a block's recompute of its down projection can lead: priced over (docs/accuracy.md, LoRA's dropout).
"""

from __future__ import annotations

from .activations import _FUSED_ROTARY_FAMILIES, uses_s2_attention
from .fsdp1_adapters import inputs_kept_by_adapters_only
from .model_spec import ModelSpec
from .specs import Attention


def o_input_copied(model: ModelSpec, attention: Attention) -> bool:
    """The o-projection reads a copy of the attention's output that only its adapter saves: eager's P @ V copy, or a
    fused rotary family's output copied into (b, s, heads x d) (activations._attention_bytes)."""
    return uses_s2_attention(model, attention) or model.family in _FUSED_ROTARY_FAMILIES


def saved_bytes_per_token(model: ModelSpec, compute_bytes: int, copies: bool, o_copied: bool) -> int:
    """Bytes a block saves more per token with LoRA's dropout on (every adapter's mask and output, less the inputs
    only adapters kept); copies: each adapter already saves its own copy of its input (fsdp1_adapters.casts_inputs
    under FSDP1's adapter units); o_copied: o_input_copied."""
    return _added(model, compute_bytes, copies, model.lora_shapes, inputs_kept_by_adapters_only(model, o_copied))


def freed_before_attention_backward_bytes_per_token(model: ModelSpec, compute_bytes: int, copies: bool,
                                                    o_copied: bool) -> int:
    """Of saved_bytes_per_token, what the o-projection's and the MLP's adapters saved: their backward, before the
    attention's, frees it (activations_backward.attention_freed_before_backward_bytes_per_token's moment)."""
    kept = inputs_kept_by_adapters_only(model, o_copied) - model.hidden_size  # less the attention norm's output
    return _added(model, compute_bytes, copies, model.lora_shapes[len(model.lora_target_shapes) - 1:], kept)


def _added(model: ModelSpec, c: int, copies: bool, shapes, kept: int) -> int:
    """The masks of these adapters' inputs, and unless they replace copies their outputs less the inputs kept."""
    inputs = sum(n_in for n_in, _ in shapes)
    return inputs + (0 if copies else c * (inputs - kept))


def first_block_masks_bytes_per_token(model: ModelSpec) -> int:
    """The masks block 0 does not save (its adapters on the block's normed input: that input needs no gradient)."""
    first = sum(n_in for n_in, _ in model.lora_target_shapes[:-1])  # q / k / v (or fused qkv), not o
    if model.parallel_block and model.lora_mlp:
        first += sum(n_in for n_in, _ in model.mlp_linear_shapes[:-1])
    return first


def down_projection_bytes_per_token(model: ModelSpec, compute_bytes: int, copies: bool) -> int:
    """What the MLP output projection's adapter dropout saves (mask and, unless it replaces a copy, output): not
    there yet while the frozen base's forward runs (memory_shape.py's in-flight moment); freed, with its lora_A's
    backward, before the activation's backward (activations_backward.mlp_backward_working_bytes_per_token frees the
    projection's saved input: the output here; the mask is freed too)."""
    f = model.ffn_hidden_size
    return f + (0 if copies else compute_bytes * f)
