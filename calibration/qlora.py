"""QLoRA as the cost model prices it (cost_models/qlora.py): a transformers checkpoint loaded with bitsandbytes'
4-bit base (BitsAndBytesConfig), LoRA adapters by peft on the block linears of ModelSpec.lora_shapes.

    config = bnb_config(training, precision)          # transformers.BitsAndBytesConfig
    model = load_qlora(path, spec, training, precision)

The storage dtype (bnb_4bit_quant_storage) and the compute dtype follow the TrainingSpec and the precision; the
unquantized layers load in the compute dtype (under fp32, fp32) and the adapters in the parameter dtype, as
calibration/lora.py lays out LoRA (peft's autocast_adapter_dtype). Needs bitsandbytes, transformers and peft.
"""

from __future__ import annotations

import torch
from torch import nn

from cost_models.specs import ModelSpec, Precision, TrainingSpec, parse_enum

from .apply import TORCH_DTYPES
from .lora import lora_dtypes, lora_target_names

STORAGE_DTYPES = {**TORCH_DTYPES, "uint8": torch.uint8}


def bnb_config(training: TrainingSpec, precision: Precision | str):
    """transformers.BitsAndBytesConfig of the training's quantization, computing in the precision's dtype."""
    from transformers import BitsAndBytesConfig

    precision = parse_enum(Precision, precision, "precision")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=training.quant.value,
                              bnb_4bit_use_double_quant=training.double_quant,
                              bnb_4bit_quant_storage=STORAGE_DTYPES[training.quant_storage],
                              bnb_4bit_compute_dtype=TORCH_DTYPES[precision.compute_dtype])


def load_qlora(path: str, spec: ModelSpec, training: TrainingSpec, precision: Precision | str) -> nn.Module:
    """The causal LM at `path` (a saved transformers checkpoint) with its block linears in 4 bits, frozen, and
    rank training.lora_rank adapters on the lora_shapes linears of every block."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    precision = parse_enum(Precision, precision, "precision")
    frozen_dtype, adapter_dtype = lora_dtypes(precision)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config(training, precision),
                                                 dtype=frozen_dtype, device_map="cpu")
    block = model.model.layers[0]
    targets = lora_target_names(block, spec.lora_shapes)  # Linear4bit is an nn.Linear
    config = LoraConfig(r=training.lora_rank, lora_alpha=2 * training.lora_rank, lora_dropout=training.lora_dropout,
                        bias="none", target_modules=targets)
    model = get_peft_model(model, config, autocast_adapter_dtype=adapter_dtype == torch.float32)
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != adapter_dtype:
            param.data = param.data.to(adapter_dtype)
    return model


def quant_state_bytes(model: nn.Module) -> int:
    """Bytes of every Linear4bit's QuantState on this rank (absmax, code tables, the nested state), each
    storage once: what FSDP neither shards nor gathers."""
    seen, total = set(), 0
    for module in model.modules():
        state = getattr(module, "quant_state", None) or getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None or type(module).__name__ != "Linear4bit":
            continue
        tensors = [state.absmax, state.code] + ([state.offset, state.state2.absmax, state.state2.code]
                                                if state.nested else [])
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total
