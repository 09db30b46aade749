"""Read an axolotl 0.21 config YAML back for `fsdp-plan check` (the mirror of planner/emit/axolotl.py, whose docstring
names the keys and the axolotl source they come from). Defaults are axolotl's own, so a file is priced as it would
run: micro_batch_size 1, gradient_accumulation_steps 1, sequence_len 512, bf16 auto, optimizer adamw_torch_fused
(utils/schemas/training.py, config.py), reshard_after_forward true (FSDP2's), state_dict_type SHARDED_STATE_DICT
(accelerate's FSDP2 default), and QLoRA's BitsAndBytesConfig as loaders/model.py builds it before
bnb_config_kwargs: nf4, double quantization, storage bfloat16, compute in the model's dtype. A value the cost model
cannot price, or that axolotl refuses, raises one PlannerError naming the key.
"""

from __future__ import annotations

from dataclasses import replace

from cost_models.specs import FsdpConfig, Precision

from planner.doctor.readers import peft_targets, python_qlora
from planner.doctor.readers.common import (UserSetup, _bool, _int, _int_or_none, _positive_int, _strip, fsdp2_sharding,
                                          hsdp_fields)
from planner.emit import attention
from planner.emit.optimizer import from_hf_optim
from planner.errors import PlannerError

# axolotl's FSDPConfig fields (utils/schemas/fsdp.py), without the fsdp_ prefix its validator strips
FSDP_KEYS = ("fsdp_version", "version", "activation_checkpointing", "offload_params", "cpu_ram_efficient_loading",
             "cpu_offload_pin_memory", "state_dict_type", "final_state_dict_type", "auto_wrap_policy",
             "transformer_layer_cls_to_wrap", "min_num_params", "reshard_after_forward", "mixed_precision_policy")
WRAP = {"TRANSFORMER_BASED_WRAP": "block", "SIZE_BASED_WRAP": "size"}
# its deprecated attention switches (config.py) -> attn_implementation; flash_attention_2 runs the FlashAttention-2
# kernel that PyTorch's SDPA runs on A100 / H100 (its flash backend): priced as sdpa
FLAGS = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "flex_attention": "flex_attention",
         "eager_attention": "eager"}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def is_axolotl(data: dict) -> bool:
    """An axolotl config: base_model beside one of its own keys (HF TrainingArguments name no base_model)."""
    return "base_model" in data and any(k in data for k in ("micro_batch_size", "sequence_len", "datasets",
                                                            "adapter", "fsdp_version"))


def _fsdp(data: dict) -> dict:
    if data.get("fsdp"):
        raise PlannerError("fsdp", "axolotl 0.21 no longer reads the top-level fsdp list (FSDP1): use fsdp_config")
    raw = data.get("fsdp_config")
    if not raw:
        raise PlannerError("fsdp_config", "missing: without it axolotl does not run FSDP; fsdp-plan check reads FSDP "
                                          "setups")
    if not isinstance(raw, dict):
        raise PlannerError("fsdp_config", "must be a mapping of FSDP settings")
    fsdp = {(k if k == "fsdp_version" else str(k).removeprefix("fsdp_")): v for k, v in raw.items()}
    unknown = sorted(set(fsdp) - set(FSDP_KEYS))
    if unknown:
        raise PlannerError(f"fsdp_config.{unknown[0]}", f"not a key axolotl 0.21 reads; known: {', '.join(FSDP_KEYS)}")
    for key, value in (("fsdp_version", data.get("fsdp_version")), ("fsdp_config.fsdp_version",
                       fsdp.get("fsdp_version", fsdp.get("version")))):
        if value is not None and str(value) != "2":
            raise PlannerError(key, f"{value!r}: axolotl 0.21 runs FSDP2 only (FSDP1 was removed); set 2")
    return fsdp


def _precision(data: dict) -> Precision:
    """bf16 / fp16 as axolotl resolves them (utils/config/__init__.py resolve_dtype): bf16 defaults to auto, bf16
    where the GPU has it (priced so), unless fp16 is set."""
    fp16 = _bool("fp16", data.get("fp16") or False)
    raw = data.get("bf16", "auto")
    bf16 = not fp16 if str(raw).lower() == "auto" else _bool("bf16", raw)
    if bf16 and fp16:
        raise PlannerError("bf16", "bf16 and fp16 are both true; choose one")
    return Precision.BF16 if bf16 else Precision.FP16 if fp16 else Precision.FP32


def _checkpointing(data: dict, fsdp: dict) -> tuple[int, bool]:
    """(ac_every, reentrant outside the units): FSDP's own (fsdp_config) or transformers' (gradient_checkpointing,
    reentrant only where its kwargs say use_reentrant: true); offloading to CPU or disk is not priced."""
    if _bool("fsdp_config.activation_checkpointing", fsdp.get("activation_checkpointing", False)):
        return 1, False
    value = data.get("gradient_checkpointing", False)
    if str(value).lower() in ("offload", "offload_disk"):
        raise PlannerError("gradient_checkpointing", f"{value}: activation offloading is not priced by fsdp-plan; "
                                                     "choose true or false")
    if not _bool("gradient_checkpointing", value):
        return 0, False
    kwargs = data.get("gradient_checkpointing_kwargs") or {}
    return 1, isinstance(kwargs, dict) and kwargs.get("use_reentrant") is True


def _attention(data: dict) -> tuple[dict, str]:
    """({"attention": ...} or {}, UserSetup.attention_from): attn_implementation, else a deprecated switch, else
    unstated (transformers' default)."""
    name = data.get("attn_implementation") or next((hf for key, hf in FLAGS.items() if data.get(key) is True), None)
    if name is None:
        return {}, "unstated"
    return attention.from_hf_name("sdpa" if name == "flash_attention_2" else name, "attn_implementation"), "code"


def _finetune(data: dict, precision: Precision, rank0: bool, reentrant: bool) -> tuple[tuple, object, tuple]:
    """((knob, value) pairs, QloraSetup or None, notes) of adapter / load_in_4bit / lora_* / bnb_config_kwargs."""
    adapter = str(data.get("adapter") or "").strip().lower()
    if _bool("load_in_8bit", data.get("load_in_8bit", False)):
        raise PlannerError("load_in_8bit", "an 8-bit base is not priced by fsdp-plan; choose load_in_4bit (qlora)")
    if not adapter:
        return (("finetune", "full"),), None, ()
    if adapter not in ("lora", "qlora"):
        raise PlannerError("adapter", f"unknown value {adapter!r}; choose one of: lora, qlora (or none: full)")
    quantized = adapter == "qlora"
    if quantized and not _bool("load_in_4bit", data.get("load_in_4bit", False)):
        raise PlannerError("load_in_4bit", "adapter qlora loads no 4-bit base without load_in_4bit: true")
    # lora_target_linear: every linear but the output layer (loaders/adapter.py find_all_linear_names), beside the list
    targets, notes = peft_targets.lora_targets(
        data.get("lora_target_modules"), _bool("lora_target_linear", data.get("lora_target_linear") or False))
    knobs = (("finetune", adapter), ("lora_rank", _positive_int(data, "lora_r", 8)),  # peft's LoraConfig r
             ("lora_targets", targets), peft_targets.lora_dropout(data.get("lora_dropout"), "lora_dropout"))
    if not quantized:
        return knobs, None, notes
    kwargs = data.get("bnb_config_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise PlannerError("bnb_config_kwargs", "must be a mapping of BitsAndBytesConfig arguments")
    compute = DTYPE_NAMES[precision.compute_dtype]
    values = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True, "bnb_4bit_quant_storage": "bfloat16",
              "bnb_4bit_compute_dtype": compute, **{k: _strip(v) for k, v in kwargs.items()}}
    quant = str(values["bnb_4bit_quant_type"]).lower()
    if quant not in ("nf4", "fp4"):
        raise PlannerError("bnb_config_kwargs.bnb_4bit_quant_type", f"unknown value {quant!r}; choose nf4 or fp4")
    values["bnb_4bit_use_double_quant"] = _bool("bnb_config_kwargs.bnb_4bit_use_double_quant",
                                                values["bnb_4bit_use_double_quant"])
    adapters = precision.compute_dtype if data.get("peft_autocast_adapter_dtype") is False else "fp32"
    setup, qlora_knobs = python_qlora.from_quantization_config(
        values, base_dtype=precision.compute_dtype, adapter_dtype=adapters, checkpointing=reentrant,
        rank0_loading=rank0)
    return knobs + qlora_knobs[1:], setup, notes  # its finetune pair is the one above


def from_axolotl(data: dict, source: str = "axolotl config") -> UserSetup:
    """The config's FsdpConfig, the training settings it fixes (fine-tuning, optimizer) and its sequence length."""
    fsdp = _fsdp(data)
    precision = _precision(data)
    replicas, shard = _int(data, "dp_replicate_size", 1) or 1, _int_or_none(data, "dp_shard_size")
    for key in ("tensor_parallel_size", "context_parallel_size", "sequence_parallel_degree"):
        if _int(data, key, 1) > 1:
            raise PlannerError(key, "axolotl's TP (DeepSpeed AutoTP) and ring-attention context parallel are not "
                                    "priced by fsdp-plan: set 1")
    reshard = _bool("fsdp_config.reshard_after_forward", fsdp.get("reshard_after_forward", True))
    sharding = fsdp2_sharding(replicas > 1, reshard)
    policy = str(fsdp.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy not in WRAP:
        raise PlannerError("fsdp_config.auto_wrap_policy", f"unknown value {policy!r}; choose one of: "
                                                           f"{', '.join(WRAP)}")
    ac_every, reentrant = _checkpointing(data, fsdp)
    if _bool("torch_compile", data.get("torch_compile", False)):
        raise PlannerError("torch_compile", "axolotl compiles the whole model, which fsdp-plan does not price "
                                            "(it prices each block compiled): set false")
    offload = _bool("fsdp_config.offload_params", fsdp.get("offload_params", False))
    attention_fields, attention_from = _attention(data)
    config = FsdpConfig(
        sharding=sharding, precision=precision, offload=offload, ac_every=ac_every,
        micro_batch=_positive_int(data, "micro_batch_size", 1),
        grad_accum=_positive_int(data, "gradient_accumulation_steps", 1),
        compile=False, compile_loss=False, sequence_parallel=False, **attention_fields)
    group, machines = hsdp_fields(sharding, replicas, shard)
    config = replace(config, **group)
    rank0 = _bool("fsdp_config.cpu_ram_efficient_loading", fsdp.get("cpu_ram_efficient_loading", False))
    optim, optim_notes = from_hf_optim({"optim": data.get("optimizer"), "optim_args": data.get("optim_args")}, offload)
    finetune, qlora, lora_notes = _finetune(data, precision, rank0, reentrant)
    return UserSetup(
        config=config, fsdp_version=2, source=source, dialect="axolotl",
        explicit=frozenset(f"fsdp_config.{k}" for k in fsdp) | frozenset(data), wrap=WRAP[policy],
        use_orig_params=True, sync_module_states=rank0, init="rank0" if rank0 else "all",
        state_dict_type=_strip(fsdp.get("state_dict_type", "SHARDED_STATE_DICT")).upper(),
        grad_scaler="sharded" if precision is Precision.FP16 else None,  # accelerate adds it for fp16
        n_processes=replicas * shard if shard else None, n_machines=machines,
        use_cache=False,  # transformers' Trainer turns the KV cache off in training
        seq_len=_positive_int(data, "sequence_len", 512), model=str(data.get("base_model") or "") or None,
        training=optim + finetune, qlora=qlora, attention_from=attention_from, notes=optim_notes + lora_notes,
    )


__all__ = ["is_axolotl", "from_axolotl"]
