"""QLoRA's frozen base: bitsandbytes 4-bit linears (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of
Quantized LLMs", arXiv:2305.14314), as FSDP holds, gathers and runs them. Pure sizing functions (bytes, counts).

What bitsandbytes 0.50 stores for each block linear of n = in x out weights (Params4bit, checked against real
tensors in tests/distributed/test_torchrun_qlora.py):
- the packed weights: two 4-bit codes a byte, n / 2 bytes, viewed as bnb_4bit_quant_storage (a (n/2/width, 1)
  tensor: the FSDP parameter, sharded and all-gathered like any other);
- its QuantState, an attribute of the module and not a parameter, so FSDP neither shards nor gathers it: every
  rank holds all of it. absmax, one per block of 64 weights: fp32 (4 B: 0.5 bits a weight), or with double
  quantization 8-bit (1 B) plus an fp32 absmax per 256 of those blocks and an fp32 offset (0.127 bits a weight:
  8/64 + 32/(64 x 256), the paper's section 3); the 16-entry fp32 4-bit code table, and with double quantization
  the 256-entry fp32 8-bit table of the second state.
Layers left unquantized (transformers' BitsAndBytesConfig skips the embeddings and lm_head; norms and biases
are no Linear) stay in the compute dtype.

In each linear's forward and backward the whole weight exists dequantized, one linear at a time, never saved
(bitsandbytes 0.50.2, read in its code): autograd/_functions.py MatMul4Bit.forward runs gemm_4bit and keeps only
`ctx.tensors = (None, B)`, the packed weight (the base needs no weight gradient, so not even the input is saved);
gemm_4bit past the fused kernel's range (backends/cuda/ops.py: M > 1536 tokens, and at fewer where
_gemm_4bit_use_custom_cuda says so; backends/default/ops.py _gemm_4bit_default_impl on CPU) is
_dequant_linear_fallback: the nested absmax dequantized (fp32, n / 64 x 4 B) and offset into a second such tensor,
the weight dequantized into an (out, in) tensor of the compute dtype, then F.linear; all three freed on return.
MatMul4Bit.backward dequantizes again (functional.dequantize_4bit: the absmax dequantized and offset in place, freed
on return, before the matmul writes the input gradient). So the forward holds weight + 2 absmax + output
(forward_in_flight_bytes; the CPU default keeps one absmax: dequantize_blockwise's output dies at the add), the
backward weight + max(absmax, input gradient) (backward_in_flight_bytes). In the ledger (memory.py): the MLP's output
projection in the last block's backward, beside the incoming gradient (below the MLP's own peak when 2 x tokens >
h), the attention's q / o projection on top of the attention backward's working set, and the last block's output
projection in its forward (below its backward unless tokens < h / 16 with double quantization).
Only dense blocks whose weights are
those of ModelSpec.lora_target_shapes (attention) and the MLP: an MoE's stacked experts are no nn.Linear.
Ignored: per-tensor padding of n / 2 to the storage width (n is even and a multiple of 64 for every preset).
"""

from __future__ import annotations

from .model_spec import ModelSpec

BLOCKSIZE = 64          # weights per absmax (BitsAndBytesConfig's 4-bit blocksize; bnb Params4bit default)
NESTED_BLOCKSIZE = 256  # absmax values per fp32 second-level scale under double quantization
CODE_ENTRIES = 16       # fp32 values of the nf4 / fp4 code table (one per QuantState)
NESTED_CODE_ENTRIES = 256  # fp32 values of the 8-bit dynamic map of the nested state
FP32_BYTES = 4


def linear_shapes(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(in, out) of every linear of one block that bitsandbytes quantizes: the attention projections
    (lora_target_shapes: q, k, v, o) and the MLP's (mlp_linear_shapes: gate, up, down; or fc1, fc2)."""
    return tuple(model.lora_target_shapes) + model.mlp_linear_shapes


def quantized_per_block(model: ModelSpec) -> int:
    """Weights of one block stored in 4 bits."""
    return sum(i * o for i, o in linear_shapes(model))


def unsupported_reason(model: ModelSpec) -> str | None:
    """Why QLoRA cannot be priced for this model, or None."""
    if model.moe is not None or model.kv_lora_rank:
        return "QLoRA is priced for dense blocks (the MoE's stacked experts and MLA's projections are no " \
               "bitsandbytes Linear4bit)"
    if not model.lora_target_shapes or quantized_per_block(model) > model.block_params:
        return "the model spec does not name its block linears (lora_target_shapes)"
    return None


def packed_bytes(n_weights: int) -> int:
    """Two 4-bit codes a byte."""
    return n_weights // 2


def quant_state_bytes(n_weights: int, double_quant: bool) -> int:
    """One linear's QuantState: absmax per 64 weights (fp32, or 8-bit with an fp32 scale per 256 blocks and an
    fp32 offset) and the code tables."""
    blocks = -(-n_weights // BLOCKSIZE)
    if not double_quant:
        return blocks * FP32_BYTES + CODE_ENTRIES * FP32_BYTES
    nested = -(-blocks // NESTED_BLOCKSIZE)
    return blocks + (nested + 1 + CODE_ENTRIES + NESTED_CODE_ENTRIES) * FP32_BYTES


def replicated_bytes(model: ModelSpec, double_quant: bool) -> int:
    """Every block linear's QuantState: on every rank, neither sharded nor gathered by FSDP."""
    return model.n_layers * sum(quant_state_bytes(i * o, double_quant) for i, o in linear_shapes(model))


def saving_bytes(n_quantized: int, dense_bytes: int) -> int:
    """Bytes saved by storing n_quantized weights packed rather than at dense_bytes each."""
    return n_quantized * dense_bytes - packed_bytes(n_quantized)


def absmax_dequantized_bytes(n_weights: int, double_quant: bool) -> int:
    """The nested absmax dequantized for one linear (fp32, one per 64 weights); none without double quantization."""
    return -(-n_weights // BLOCKSIZE) * FP32_BYTES if double_quant else 0


def forward_in_flight_bytes(n_in: int, n_out: int, compute_bytes: int, double_quant: bool, tokens: int) -> int:
    """What one linear's forward allocates beside its input (bitsandbytes' _dequant_linear_fallback, see the module
    docstring): the weight dequantized, the absmax dequantized and offset (two tensors) and the output. Where the
    fused kernel runs instead (a few hundred tokens or less), only the output: an upper bound there."""
    n = n_in * n_out
    return n * compute_bytes + 2 * absmax_dequantized_bytes(n, double_quant) + tokens * n_out * compute_bytes



def backward_in_flight_bytes(n_in: int, n_out: int, compute_bytes: int, double_quant: bool, tokens: int) -> int:
    """What one linear's backward allocates beside its incoming gradient (MatMul4Bit.backward): the weight
    dequantized, with first the absmax dequantized (freed on return) and then the input gradient the matmul writes."""
    n = n_in * n_out
    return n * compute_bytes + max(absmax_dequantized_bytes(n, double_quant), tokens * n_in * compute_bytes)


def dequantized_attention_bytes(model: ModelSpec, compute_bytes: int) -> int:
    """The largest attention projection dequantized in its backward (q or o: q_dim x h), on top of the
    attention backward's working set (the q, k, v gradients and the input gradient)."""
    return max(i * o for i, o in model.lora_target_shapes) * compute_bytes


def dequantize_bytes_moved_per_block(model: ModelSpec, compute_bytes: int, double_quant: bool) -> int:
    """HBM traffic of dequantizing one block's linears once: read the packed weights and absmax, write the
    weights in the compute dtype (memory-bound: a few integer ops a weight)."""
    n = quantized_per_block(model)
    absmax = sum(quant_state_bytes(i * o, double_quant) for i, o in linear_shapes(model))
    return packed_bytes(n) + absmax + n * compute_bytes


def refusals(model: ModelSpec, training, config) -> list:
    """What QLoRA cannot run here (cost_models/mesh_rules.mesh_refusals lists them with the mesh's): a model
    whose blocks are not priced, packed weights stored in another dtype than the compute dtype (FSDP flattens,
    casts and gathers them with the rest), Float8 linears (torchao does not convert bitsandbytes' Linear4bit)."""
    from .feasibility import Refusal

    if not training.quantized:
        return []
    out = []
    why = unsupported_reason(model)
    if why is not None:
        out.append(Refusal("finetune", "qlora-model-not-priced", f"{model.name}: {why}", "use --finetune lora",
                           priced=False))
    if training.quant_storage == "uint8":
        out.append(Refusal("quant_storage", "qlora-integer-quant-storage", "uint8 quant storage under FSDP: the "
                           "packed weights are flattened and gathered with the unit's bf16 / fp32 parameters, and "
                           "FSDP2 trains with loss 0 and a NaN gradient norm (accelerate issue 3983)",
                           f"use --quant-storage {config.precision.compute_dtype} (the compute dtype)", priced=False))
    elif training.quant_storage != config.precision.compute_dtype:
        out.append(Refusal("quant_storage", "qlora-storage-not-compute-dtype", f"quant storage "
                           f"{training.quant_storage} under {config.precision.value} precision: FSDP casts or "
                           f"flattens the packed weights with the {config.precision.compute_dtype} parameters, which "
                           "corrupts their 4-bit codes or fails", f"use --quant-storage "
                           f"{config.precision.compute_dtype}, or a precision computing in {training.quant_storage}",
                           priced=False))
    if config.float8 or config.fp8_all_gather:
        out.append(Refusal("float8", "qlora-with-float8", "Float8 linears with a 4-bit base: the frozen linears are "
                           "bitsandbytes Linear4bit, which torchao's Float8 conversion does not take",
                           "drop --float8 with --finetune qlora", priced=False))
    return out


def stored_base_bytes(model: ModelSpec, dense_bytes: int) -> int:
    """The whole frozen base as stored: the block linears packed, the rest (embeddings, head, norms) at dense_bytes
    each, without the QuantStates (replicated_bytes). What a QLoRA model's loading, offload or checkpoint of the
    base holds, in place of n_params x dense_bytes."""
    return model.n_params * dense_bytes - model.n_layers * saving_bytes(quantized_per_block(model), dense_bytes)
