"""QLoRA in a user's Python script, for `fsdp-plan check`'s rules (planner/doctor/rules_qlora.py): transformers'
BitsAndBytesConfig(...) (its 4-bit type, double quantization, storage and compute dtypes), the dtype the model is
loaded in (from_pretrained(dtype= / torch_dtype=)), peft's get_peft_model (autocast_adapter_dtype: fp32 adapters by
default), transformers' gradient checkpointing (gradient_checkpointing_enable / gradient_checkpointing=True;
reentrant unless gradient_checkpointing_kwargs says use_reentrant False) and its input-grad hook
(enable_input_require_grads, or peft's prepare_model_for_kbit_training which calls it), and whether the ranks
load the checkpoint once: a meta device (torch.device("meta"), device_map "meta", accelerate's
init_empty_weights) or rank 0's state dict broadcast (StateDictOptions(broadcast_from_rank0=True)). And, LoRA or
QLoRA, the linears peft's LoraConfig(target_modules=...) adapts and its lora_dropout (peft_targets.py: the
lora_targets and lora_dropout knobs)."""

from __future__ import annotations

import ast

from dataclasses import dataclass

from planner.doctor.readers import common, peft_targets
from planner.doctor.readers.python_ast import Snippet
from planner.errors import PlannerError

# the readers' dtype names with and without torch's prefix, and bitsandbytes' integer storage
DTYPES = {prefix + name: short for name, short in {**common.DTYPES, "uint8": "uint8"}.items()
          for prefix in ("", "torch.")}


@dataclass(frozen=True)
class QloraSetup:
    quant_storage: str = "uint8"        # bitsandbytes' default when the script does not set it
    compute_dtype: str = "fp32"         # BitsAndBytesConfig's default bnb_4bit_compute_dtype
    base_dtype: str | None = None       # from_pretrained(dtype=...): the unquantized layers
    adapter_dtype: str | None = None    # peft: fp32 (autocast_adapter_dtype, its default) or the base's
    checkpointing: bool = False         # transformers' reentrant gradient checkpointing
    input_grads_hook: bool = False
    rank0_loading: bool = False         # meta-device init or rank 0's weights broadcast


def from_quantization_config(values: dict, **found) -> tuple[QloraSetup, tuple]:
    """(what the rules read, the training knobs it fixes) from BitsAndBytesConfig's keyword arguments as values
    (dtypes as "torch.bfloat16" or transformers' serialised "bfloat16"; bitsandbytes' defaults where absent), and
    what else the reader found (QloraSetup's other fields)."""
    dtype = lambda key, default: DTYPES.get(str(values.get(key)), default)  # noqa: E731
    setup = QloraSetup(quant_storage=dtype("bnb_4bit_quant_storage", "uint8"),
                       compute_dtype=dtype("bnb_4bit_compute_dtype", "fp32"), **found)
    training = (("finetune", "qlora"), ("quant_storage", setup.quant_storage),
                ("quant", str(values.get("bnb_4bit_quant_type") or "fp4")),  # BitsAndBytesConfig's defaults
                ("double_quant", bool(values.get("bnb_4bit_use_double_quant"))))
    return setup, training


def read_qlora(snippet: Snippet) -> tuple[QloraSetup | None, tuple]:
    """From a script: (what the rules read, the training knobs it fixes), or (None, ()) without
    BitsAndBytesConfig(load_in_4bit=True)."""
    configs = [c for c in snippet.named("BitsAndBytesConfig") if _value(snippet, c.kwargs.get("load_in_4bit"))]
    if not configs:
        return None, ()
    values = {key: _value(snippet, node) for key, node in configs[0].kwargs.items()}
    base = None
    for load in snippet.named("from_pretrained"):
        value = load.kwargs.get("dtype", load.kwargs.get("torch_dtype"))
        if value is not None:
            base = DTYPES.get(str(_value(snippet, value)))
    peft = snippet.named("get_peft_model")
    adapters = None
    if peft:  # peft's autocast_adapter_dtype (default True) makes the adapters fp32 over a bf16 / fp16 base
        adapters = base if _value(snippet, peft[0].kwargs.get("autocast_adapter_dtype")) is False else "fp32"
    checkpointing = bool(snippet.named("gradient_checkpointing_enable")) or any(
        _value(snippet, c.kwargs.get("gradient_checkpointing")) is True for c in snippet.calls)
    reentrant = not any((_value(snippet, c.kwargs.get("gradient_checkpointing_kwargs")) or {}).get("use_reentrant")
                        is False for c in snippet.calls if "gradient_checkpointing_kwargs" in c.kwargs)
    # torch.device("meta"): a literal only (the emitted snippet's torch.device(device) is a variable, not meta)
    meta = any(c.short == "device" and c.node.args and isinstance(c.node.args[0], ast.Constant)
               and c.node.args[0].value == "meta" for c in snippet.calls) or any(_value(snippet, c.kwargs.get("device_map")) == "meta"
                                              for c in snippet.named("from_pretrained", "from_config"))
    broadcast = any(_value(snippet, c.kwargs.get("broadcast_from_rank0")) is True
                    for c in snippet.named("StateDictOptions"))
    return from_quantization_config(
        values, base_dtype=base, adapter_dtype=adapters, checkpointing=checkpointing and reentrant,
        input_grads_hook=bool(snippet.named("enable_input_require_grads", "prepare_model_for_kbit_training")),
        rank0_loading=meta or broadcast or bool(snippet.named("init_empty_weights")))


def read_lora_config(snippet: Snippet) -> tuple[tuple, tuple[str, ...]]:
    """(the lora_targets and lora_dropout knobs, notes) of the script's LoraConfig(target_modules=...,
    lora_dropout=...), or ((), ()) without one."""
    configs = snippet.named("LoraConfig")
    if not configs:
        return (), ()
    dropout, notes = configs[0].kwargs.get("lora_dropout"), ()
    try:
        written = None if dropout is None else snippet.value(dropout, "lora_dropout")
    except PlannerError:  # computed in the script
        written, notes = None, (f"LoraConfig's lora_dropout={ast.unparse(dropout)} is not a literal: priced at 0 "
                                "(--lora-dropout to price it)",)
    knobs = (peft_targets.lora_dropout(written, "lora_dropout"),)
    node = configs[0].kwargs.get("target_modules")
    try:
        written = None if node is None else snippet.value(node, "target_modules")
    except PlannerError:  # computed in the script: not a literal this reader can price
        return knobs, notes + (f"LoraConfig's target_modules={ast.unparse(node)} is not a literal: LoRA priced on "
                               "the attention projections (--lora-targets all-linear for every linear)",)
    targets, more = peft_targets.lora_targets(written)
    return (("lora_targets", targets),) + knobs, notes + more


def from_model_init_kwargs(kwargs: dict, rank0_loading: bool) -> tuple[QloraSetup | None, tuple]:
    """From TRL's SFTConfig / GRPOConfig model_init_kwargs: its quantization_config (BitsAndBytesConfig.to_dict())
    and dtype. The script's adapters and checkpointing hook are not in the arguments: left unjudged."""
    config = kwargs.get("quantization_config")
    if not isinstance(config, dict) or not config.get("load_in_4bit"):
        return None, ()
    base = DTYPES.get(str(kwargs.get("dtype", kwargs.get("torch_dtype"))))
    return from_quantization_config(config, base_dtype=base, rank0_loading=rank0_loading)


def _value(snippet: Snippet, node):
    return None if node is None else snippet.value(node, "BitsAndBytesConfig")
