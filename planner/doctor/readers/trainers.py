"""Read Hugging Face TrainingArguments back for `fsdp-plan check` (JSON/YAML with `fsdp`, `fsdp_config`, the batch
and precision keys; torchtitan's settings: planner/doctor/readers/torchtitan.py). The mirror of planner/emit/trainers.py:
what it emits reads back as the plan's FsdpConfig (tests/doctor/test_roundtrip.py).

Defaults are the Trainer's own (an absent per_device_train_batch_size is HF's 8), so a file is priced as it would
run. A value the
trainer would refuse, or a setting fsdp-plan cannot price, raises one PlannerError naming the key.
"""

from __future__ import annotations

from dataclasses import replace

from cost_models.fsdp1_adapters import AdapterUnits
from cost_models.specs import SELECTIVE_OP, FsdpConfig, Precision, Sharding

from planner.emit import attention as attn
from planner.emit.optimizer import from_hf_optim
from planner.emit.kernels import from_hf_liger
from planner.errors import PlannerError
from planner.doctor.readers.common import (UserSetup, _bool, _int, _int_or_none, _positive_int, _strategy, _strip,
                                           accelerate_degrees, hsdp_fields)
from planner.doctor.readers import python_qlora

# ---------------------------------------------------------------- Hugging Face TrainingArguments

# Top-level keys only TrainingArguments has (accelerate configs and FSDP kwargs files use none of them).
HF_MARKERS = ("fsdp", "per_device_train_batch_size", "gradient_accumulation_steps", "output_dir", "bf16", "fp16")
# fsdp_config keys transformers reads (5.x; the 4.x ones it still accepts), without the optional fsdp_ prefix.
HF_FSDP_KEYS = ("version", "reshard_after_forward", "cpu_offload", "activation_checkpointing",
                "cpu_ram_efficient_loading", "state_dict_type", "auto_wrap_policy", "transformer_layer_cls_to_wrap",
                "min_num_params", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
                "limit_all_gathers", "xla", "xla_fsdp_settings", "xla_fsdp_grad_ckpt", "xla_fsdp_v2")
HF_LEGACY_OPTIONS = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload",
                     "auto_wrap")
HF_WRAP = {"TRANSFORMER_BASED_WRAP": "block", "SIZE_BASED_WRAP": "size", "NO_WRAP": "none"}


def is_hf_trainer(data: dict) -> bool:
    return any(key in data for key in HF_MARKERS)


def _hf_fsdp_on(data: dict) -> list[str]:
    """The legacy strategy words of `fsdp` ([] for fsdp=True); PlannerError when FSDP is off."""
    value = data.get("fsdp")
    if value is True:
        return []
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "yes", "1", "on"):
            return []
        if text not in ("", "false", "no", "0", "off", "none", "null"):
            return value.split()
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    elif value is not None and value is not False and value != []:
        raise PlannerError("fsdp", f"expected true (or the legacy words {' '.join(HF_LEGACY_OPTIONS)}), got {value!r}")
    raise PlannerError("fsdp", "FSDP is off in these TrainingArguments; fsdp-plan check reads FSDP setups "
                               "(fsdp=True with fsdp_config)")


def _hf_fsdp_config(data: dict, legacy: list[str]) -> dict:
    """fsdp_config without fsdp_ prefixes, the legacy strategy words applied as transformers 5 does
    (TrainingArguments._apply_legacy_fsdp_to_config: setdefault, so fsdp_config wins)."""
    raw = data.get("fsdp_config") or {}
    if not isinstance(raw, dict):
        raise PlannerError("fsdp_config", "must be a mapping of FSDP settings (a path to a JSON file is not followed: "
                                          "inline its contents)")
    config = {str(k).removeprefix("fsdp_"): v for k, v in raw.items()}
    unknown = sorted(set(config) - set(HF_FSDP_KEYS))
    if unknown:
        raise PlannerError(f"fsdp_config.{unknown[0]}", f"not a key transformers reads (it would be ignored); "
                                                        f"known: {', '.join(HF_FSDP_KEYS)}")
    version = _int(config, "version", 2)
    if version not in (1, 2):
        raise PlannerError("fsdp_config.version", f"must be 1 or 2, got {version}")
    for item in legacy:
        word = item.strip().lower()
        if word not in HF_LEGACY_OPTIONS:
            raise PlannerError("fsdp", f"unknown option {item!r}; choose from: {', '.join(HF_LEGACY_OPTIONS)}")
        if word == "offload":
            config.setdefault("cpu_offload", True)
        elif word != "auto_wrap" and version == 2:
            if word not in ("full_shard", "shard_grad_op"):
                raise PlannerError("fsdp", f"{word} is FSDP1 only in transformers 5: set fsdp_config version 1, or "
                                           "use full_shard / shard_grad_op")
            config.setdefault("reshard_after_forward", word == "full_shard")
        elif word != "auto_wrap":
            config.setdefault("reshard_after_forward", word)
    config["version"] = version
    return config


def _hf_replicas(data: dict) -> tuple[int, int | None, dict]:
    """(dp_replicate_size, dp_shard_size or None, {tp, cp, ...} as FsdpConfig fields) of TrainingArguments'
    parallelism_config (accelerate's ParallelismConfig as a mapping; the parallelism_config_ prefix of accelerate
    configs accepted)."""
    raw = data.get("parallelism_config") or {}
    if not isinstance(raw, dict):
        raise PlannerError("parallelism_config", "must be a mapping like {dp_replicate_size: 2, dp_shard_size: 8}")
    parallel = {str(k).removeprefix("parallelism_config_"): v for k, v in raw.items()}
    replicas, shard = _int(parallel, "dp_replicate_size", 1), _int_or_none(parallel, "dp_shard_size")
    mesh = accelerate_degrees(parallel, "parallelism_config.")  # refuses what fsdp-plan does not plan
    if replicas < 1 or (shard is not None and shard < 1):
        raise PlannerError("parallelism_config", f"sizes must be >= 1, got dp_replicate_size={replicas}, "
                                                 f"dp_shard_size={shard}")
    if replicas > 1 and shard == 1:
        raise PlannerError("parallelism_config.dp_shard_size", "1 with replicas is plain DDP, which accelerate refuses "
                                                               "here: use dp_shard_size > 1 (HSDP), or FSDP1 no_shard")
    return replicas, shard, mesh


def _hf_checkpointing(data: dict, fsdp: dict) -> tuple[int | str, bool]:
    """(ac_every, reentrant outside the units): FSDP's own checkpointing (fsdp_config, every block, inside the
    units) or TrainingArguments' own (activation_checkpointing, formerly gradient_checkpointing; its kwargs'
    every_n_layers), which checkpoints each block's call from outside its unit. That is reentrant when the kwargs
    say use_reentrant: true, or pass other checkpoint keys without it (torch.utils.checkpoint's default);
    transformers 5 passes use_reentrant=False when they are empty."""
    ac = fsdp.get("activation_checkpointing", False)
    if str(ac).strip().lower() == SELECTIVE_OP:  # transformers reads a bool: it cannot say this
        return SELECTIVE_OP, False
    if _bool("fsdp_config.activation_checkpointing", ac):
        return 1, False
    key = "activation_checkpointing" if data.get("activation_checkpointing") is not None else "gradient_checkpointing"
    if not _bool(key, data.get(key, False)):
        return 0, False
    kwargs = data.get(f"{key}_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise PlannerError(f"{key}_kwargs", "must be a mapping like {every_n_layers: 2}")
    every = _int(kwargs, "every_n_layers", 1)
    if every < 1:
        raise PlannerError(f"{key}_kwargs.every_n_layers", f"must be >= 1, got {every}")
    rest = {k: v for k, v in kwargs.items() if k not in ("every_n_layers", "offload")}
    reentrant = _bool(f"{key}_kwargs.use_reentrant", rest["use_reentrant"]) if "use_reentrant" in rest else bool(rest)
    return every, reentrant


def _hf_attention(data: dict) -> tuple[dict, str]:
    """({"attention": ...} or {}, UserSetup.attention_from): TrainingArguments has no attention field; a file
    parsed with it can carry attn_implementation beside it (TRL's ModelConfig, a script's ModelArguments) or in
    model_init_kwargs (TRL's SFTConfig / GRPOConfig, --emit hf-trainer's dict). Neither: unstated."""
    kwargs = data.get(attn.KWARGS) or {}
    if not isinstance(kwargs, dict):
        raise PlannerError(attn.KWARGS, "must be a mapping like {attn_implementation: flex_attention}")
    for key, value in ((f"{attn.KWARGS}.attn_implementation", kwargs.get("attn_implementation")),
                       ("attn_implementation", data.get("attn_implementation"))):
        if value is not None:
            return attn.from_hf_name(value, key), "code"
    return {}, "unstated"


def from_hf_trainer(data: dict, source: str = "TrainingArguments") -> UserSetup:
    """TrainingArguments as JSON/YAML (HfArgumentParser's files, TrainingArguments.to_dict()): `fsdp` (True, or the
    deprecated strategy words), `fsdp_config`, `parallelism_config` (HSDP), per_device_train_batch_size,
    gradient_accumulation_steps, bf16/fp16, torch_compile, activation_checkpointing. Other TrainingArguments
    keys are not FSDP's and are left alone."""
    fsdp = _hf_fsdp_config(data, _hf_fsdp_on(data))
    version = fsdp["version"]
    bf16, fp16 = _bool("bf16", data.get("bf16", False)), _bool("fp16", data.get("fp16", False))
    if bf16 and fp16:
        raise PlannerError("bf16", "bf16 and fp16 are both true; choose one")
    precision = Precision.BF16 if bf16 else Precision.FP16 if fp16 else Precision.FP32
    replicas, shard, mesh = _hf_replicas(data) if version == 2 else (1, None, {})
    if version == 2:
        reshard = _bool("fsdp_config.reshard_after_forward", fsdp.get("reshard_after_forward", True))
        sharding = ((Sharding.HYBRID_SHARD if reshard else Sharding.HYBRID_SHARD_ZERO2) if replicas > 1
                    else Sharding.FULL_SHARD if reshard else Sharding.SHARD_GRAD_OP)
        prefetch, forward_prefetch, limit = True, False, True  # FSDP2 prefetches and bounds its all-gathers itself
    else:
        sharding = _strategy("fsdp_config.reshard_after_forward", fsdp.get("reshard_after_forward", "full_shard"))
        prefetch = _strip(fsdp.get("backward_prefetch", "NO_PREFETCH")).upper()  # transformers' FSDP1 default
        if prefetch not in ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"):
            raise PlannerError("fsdp_config.backward_prefetch", f"unknown value {prefetch!r}; choose one of: "
                                                                "BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH")
        prefetch = prefetch != "NO_PREFETCH"
        forward_prefetch = _bool("fsdp_config.forward_prefetch", fsdp.get("forward_prefetch", False))
        limit = _bool("fsdp_config.limit_all_gathers", fsdp.get("limit_all_gathers", True))
    policy = str(fsdp.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy not in HF_WRAP:
        raise PlannerError("fsdp_config.auto_wrap_policy", f"unknown value {policy!r}; choose one of: "
                                                           f"{', '.join(HF_WRAP)}")
    ac_every, reentrant_outside = _hf_checkpointing(data, fsdp)
    # FSDP1 re-gathers a unit whose forward a reentrant checkpoint reruns in backward (its pre-forward hook sees
    # no backward yet); FSDP2's hooks and a non-reentrant checkpoint do not (tests/distributed/test_hf_checkpointing)
    regathers = reentrant_outside and version == 1
    ac_note = ("TrainingArguments' own activation checkpointing (reentrant) checkpoints outside the FSDP1 units: "
               "each block is all-gathered again for its recompute (fsdp_config's activation_checkpointing does "
               "not)") if regathers else None
    rank0 = _bool("fsdp_config.cpu_ram_efficient_loading", fsdp.get("cpu_ram_efficient_loading", False))
    compiles = _bool("torch_compile", data.get("torch_compile", False)) or any(
        data.get(k) is not None for k in ("torch_compile_backend", "torch_compile_mode"))
    attention, attention_from = _hf_attention(data)
    config = FsdpConfig(
        sharding=sharding, precision=precision,
        offload=_bool("fsdp_config.cpu_offload", fsdp.get("cpu_offload", False)), ac_every=ac_every,
        micro_batch=_positive_int(data, "per_device_train_batch_size", 8),  # HF's default
        grad_accum=_positive_int(data, "gradient_accumulation_steps", 1),
        backward_prefetch=prefetch, forward_prefetch=forward_prefetch, limit_all_gathers=limit, compile=compiles,
        compile_loss=False,  # the model's own loss, in its forward: eager (a compute_loss_func is code, not an argument)
        **from_hf_liger(data),  # use_liger_kernel / liger_kernel_config (planner/emit/kernels.py)
        **mesh, **attention,
    )
    group, machines = hsdp_fields(sharding, replicas, shard, config.cp, config.tp)
    config = replace(config, **group)
    optim, optim_notes = from_hf_optim(data, config.offload)
    qlora, qlora_knobs = python_qlora.from_model_init_kwargs(data.get(attn.KWARGS) or {}, rank0)
    return UserSetup(
        config=config, fsdp_version=version, source=source, dialect="hf-trainer",
        # FSDP1: a PEFT model's adapters in units of their own, under autocast (fsdp1_adapters.AdapterUnits)
        adapter_units=AdapterUnits.AUTOCAST if version == 1 else None,
        explicit=frozenset(str(k).removeprefix("fsdp_") for k in data.get("fsdp_config") or {}),
        wrap=HF_WRAP[policy],
        use_orig_params=version == 2 or _bool("fsdp_config.use_orig_params", fsdp.get("use_orig_params", True)),
        # FSDP2: accelerate broadcasts rank 0's state dict itself when only rank 0 loads it (cpu_ram_efficient_loading)
        sync_module_states=rank0 if version == 2 else _bool("fsdp_config.sync_module_states",
                                                            fsdp.get("sync_module_states", True)),
        init="rank0" if rank0 else "all",
        state_dict_type=_strip(fsdp.get("state_dict_type", "FULL_STATE_DICT" if version == 1 else
                                        "SHARDED_STATE_DICT")).upper(),  # accelerate's defaults
        grad_scaler="sharded" if fp16 else None,  # accelerate adds the ShardedGradScaler for fp16
        n_processes=replicas * shard * config.tp * config.cp if shard else None,
        n_machines=machines,
        use_cache=_bool("use_cache", data.get("use_cache", False)),  # TrainingArguments' default: off
        unexpressed=(SELECTIVE_OP,) if ac_every == SELECTIVE_OP else (),
        notes=((ac_note,) if ac_note else ()) + optim_notes, checkpoint_regathers=regathers,
        training=optim + qlora_knobs,  # the optimizer `optim` runs (planner/emit/optimizer.py); QLoRA's base
        qlora=qlora, attention_from=attention_from,
    )

