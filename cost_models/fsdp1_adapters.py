"""LoRA / QLoRA under FSDP1 with each adapter linear a unit of its own: what the FSDP2-shaped ledger (memory.py, the
adapters inside their block's unit) does not hold. Two ways to run it (AdapterUnits): CAST, the planner's FSDP1 code
(planner/emit/code/fsdp.py emit_fsdp1: CustomPolicy, cast_forward_inputs, no autocast; calibration.apply.fsdp1_kwargs'
trainable_mixed), and AUTOCAST, HF Trainer's and accelerate's FSDP1 (peft 0.21 utils/other.py fsdp_auto_wrap_policy,
which transformers 5's Trainer puts on accelerate's plugin for a PEFT model: distributed/fsdp.py
update_fsdp_plugin_peft; the blocks and every leaf whose weight trains each a unit; accelerate 1.16's
set_mixed_precision: MixedPrecision(param, reduce, buffer dtype bf16), cast_forward_inputs left False; and
Accelerator.prepare_model runs the forward under torch.autocast). Pure sizing functions (bytes).

- Each adapter saves its own copy of its input. peft 0.21's forward (tuners/lora/layer.py Linear.forward, always;
  tuners/lora/bnb.py Linear4bit.forward, when autocast is off) casts x to lora_A.weight.dtype. Outside the adapter's
  unit that weight is FSDP1's view into the sharded flat parameter (torch 2.13 fsdp/_flat_param.py
  _use_sharded_views), in the parameter dtype: with fp32 masters x becomes an fp32 copy, cast back to the compute
  dtype, a new tensor that lora_A's linear saves for its weight gradient: under CAST by the unit's pre-forward
  (fsdp/_runtime_utils.py _pre_forward, MixedPrecision(cast_forward_inputs=True): fsdp_options.fsdp1_mixed_precision
  for LoRA), under AUTOCAST by autocast's cast of linear's input to bf16 (the unsharded weight already bf16: FSDP's
  param_dtype). So q, k and v save three copies of the normed input where under FSDP2 they share it (the original,
  read by frozen linears only, is freed), and o saves a copy of the attention output beside the one SDPA keeps
  (eager attention's P @ V copy is kept by o's adapter alone: the copy replaces it). With adapters in the compute
  dtype (pure bf16, fp32) nothing is cast; under AUTOCAST bitsandbytes' layer casts nothing either (requires_conversion
  = not torch.is_autocast_enabled(): CUDA's flag, on under HF's autocast on a GPU), so QLoRA there saves no copy.
- The block's unit holds only its frozen weights: its all-gather (prefetched, and unsharded in its backward) leaves
  the adapters out; each adapter is gathered on its own as its forward or backward reaches it, r x (in + out) values
  at a time (not counted).
- No all-gather output beside the unsharded block: FSDP1 all-gathers into the unit's padded unsharded flat parameter,
  of which the original parameters are views (fsdp/_flat_param.py FlatParamHandle.unshard, _all_gather_flat_param),
  where FSDP2 copies its all-gather output out into the parameters and frees it later (memory.py's forward moment).
- The previous block is prefetched only in the attention's backward: FSDP1's BACKWARD_PRE prefetches the unit before
  the current one in post-forward order (fsdp/_exec_order_utils.py get_handle_to_backward_prefetch): a block's own
  pre-backward prefetches its last adapter, and its first adapter's (q's lora_A) the block below, when the q
  projection's backward comes, after SDPA's. So the MLP's backward moment holds no prefetched block; the attention's
  does (an upper bound: taken at the attention backward's peak).
Measured (CAST): 2-rank gloo QLoRA, h 256, 128 tokens a sequence (tests/distributed/test_torchrun_qlora.py): the loss
backward holds six more (2, 128, 256) bf16 tensors than FSDP2's, three a block, and the last block's all-gather
28,672 B less (its adapters, 14,336 values in bf16); the ledger with both terms within 0.1% of the real peak.
Plain LoRA (peft on calibration.reference's Llama, bf16 mixed, 2 x 128 tokens, one-off 2026-12-06): FSDP1's peak
above FSDP2's by 757,760 B at h 256 and 1,515,520 B at h 512, these terms' figures to the byte.
Measured (AUTOCAST, 2026-12-06; tests/distributed/test_torchrun_autocast_lora.py, a tiny transformers Llama wrapped
as accelerate wraps it, 2 gloo ranks, 2 x 128 tokens, the loss backward): plain LoRA 9,427,912 B real against
9,425,664 (h 256, V 512: -0.02%) and 25,137,992 against 25,099,776 (h 512, V 1024: -0.15%), where the FSDP2-shaped
ledger gave -4.7% and +5.7%; QLoRA (h 256, peft's autocast check read as on a GPU) 6,910,112 with the QuantStates,
786,560 B below the same model under CAST (the six copies, 786,432 B): 6,903,768 (-0.09%), the copies left out
where casts_inputs says (memory_shape.py; with them: 7,690,200, +11.3%).
All-linear (the MLP's linears adapted too, 2026-12-07, the same file, h 256, 2 x 32 and 2 x 128 tokens): the gate /
up / down adapters' copies of their inputs, the MLP norm's output and the down projection's input then kept by
adapters only: 5,853,432 B real against 5,861,120 (+0.13%, a block's backward). The fp32 copy peft's x holds
while an adapter runs (tokens x in x 4 B) sets the peak in the last block's down projection's forward, beside every
saved tensor (memory.py's forward moment: activations.lora_output_projection_in_flight_bytes_per_token): 10,198,004
against 10,193,664 (-0.04%, V 256).
Not priced: Lightning's FSDPStrategy as emitted (auto_wrap_policy={Block}: the adapters inside their block's unit,
which FSDP1 flattens only in one dtype, fsdp/_flat_param.py "uniform dtype": an fp32 model, FSDP2-shaped adapters),
the fp32 copy of an attention adapter's input in the forward (below the down projection's moment), FSDP1's
per-parameter alignment padding.
"""

from __future__ import annotations

from enum import Enum

from .model_spec import ModelSpec


class AdapterUnits(str, Enum):
    """FSDP1 with each adapter a unit of its own (memory.estimate_memory's fsdp1_adapter_units; True reads as CAST)."""

    CAST = "cast"          # the planner's FSDP1 code: each unit casts its inputs, no autocast
    AUTOCAST = "autocast"  # HF Trainer / accelerate: peft's wrap policy, the forward under torch.autocast


def casts_inputs(units, quantized: bool) -> bool:
    """Whether peft casts an adapter's input to the adapters' dtype under these units: always under CAST; under
    AUTOCAST plain LoRA's layer still does (tuners/lora/layer.py Linear.forward), bitsandbytes' does not."""
    return units is not AdapterUnits.AUTOCAST or not quantized


def saved_copies_bytes_per_token(model: ModelSpec, compute_bytes: int, mixed: bool, s2_attention: bool) -> int:
    """What a block saves per token on top of the FSDP2-shaped LoRA ledger (activations.py: the attention norm's
    output kept once for the q / k / v adapters; the o-projection's input, SDPA's saved output, or under eager
    attention P @ V's copy; all-linear: the MLP norm's output kept once for the gate / up adapters, the down
    projection's input for its adapter): each adapter's own copy of its input, less the originals only adapters
    kept (the normed inputs; eager's P @ V copy; the down projection's input, which the activation function does
    not save, but ReLU's output is its own saved tensor). mixed: adapters stored in another dtype than the compute
    dtype; s2_attention: eager attention (activations.uses_s2_attention)."""
    if not mixed or not model.lora_target_shapes:
        return 0
    copies = sum(n_in for n_in, _ in model.lora_shapes)
    return compute_bytes * (copies - inputs_kept_by_adapters_only(model, s2_attention))


def inputs_kept_by_adapters_only(model: ModelSpec, o_input_copied: bool) -> int:
    """Values per token of a block's tensors that only its adapters' lora_A save, where the adapters share their
    inputs (FSDP2-shaped): the attention norm's output; the o-projection's input where it is a copy of the attention's
    output (o_input_copied: eager's P @ V copy; SDPA saves its own output); and under all-linear the MLP norm's
    output (not Falcon's one shared norm) and the down projection's input (not ReLU's output, which ReLU saves
    itself). An adapter's own copy of its input (FSDP1's adapter units) or its dropout's output (lora_dropout.py)
    frees them."""
    kept = model.hidden_size + (model.lora_target_shapes[-1][0] if o_input_copied else 0)
    if model.lora_mlp:
        shared_norm = model.parallel_block and model.family == "falcon"  # one norm feeds attention and MLP
        kept += (0 if shared_norm else model.hidden_size) + (0 if model.activation == "relu" else model.ffn_hidden_size)
    return kept


def block_adapter_bytes(model: ModelSpec, lora_rank: int, compute_bytes: int) -> int:
    """A block's adapters in the compute dtype: what its unit's all-gather leaves out under FSDP1's adapter units."""
    return model.lora_params_per_block(lora_rank) * compute_bytes
