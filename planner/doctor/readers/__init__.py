"""Read a user's existing FSDP setup: an accelerate config, or a JSON/YAML file of FSDP1 kwargs or FSDP2
`fully_shard` arguments (Hugging Face TrainingArguments: planner/doctor/readers/trainers.py; torchtitan job settings:
planner/doctor/readers/torchtitan.py).
read_setup tells them apart by content. The result is an FsdpConfig (what the cost model prices) plus the settings
the cost model does not price but the doctor checks (wrap policy, use_orig_params, init, scaler...).

Values are accepted the way people write them: "FULL_SHARD", "ShardingStrategy.FULL_SHARD", 1;
"bfloat16", "torch.bfloat16", "bf16". Anything unreadable raises PlannerError naming the key.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from cost_models.fsdp1_adapters import AdapterUnits
from cost_models.specs import SELECTIVE_OP, FsdpConfig, Precision, Sharding

from planner.doctor.readers import automodel, axolotl, python_code, torchtitan, trl_grpo, verl
from planner.doctor.readers import trainers
from planner.emit import attention
from planner.errors import PlannerError
from planner.doctor.readers.common import (UserSetup, _bool, _dtype, _int, _int_or_none, _strategy, _strip,
                                          accelerate_degrees, fsdp2_sharding, hsdp_fields)

# FSDP1 arguments that FSDP2's fully_shard no longer has, and what replaced them.
FSDP2_REMOVED = {
    "sharding_strategy": "reshard_after_forward (True = FULL_SHARD, False = SHARD_GRAD_OP) and a 2-D mesh for HSDP",
    "backward_prefetch": "nothing: FSDP2 always prefetches the next unit in backward (explicit control: "
                         "module.set_modules_to_backward_prefetch)",
    "use_orig_params": "nothing: FSDP2 always keeps the original parameters (DTensor per parameter)",
    "limit_all_gathers": "nothing: FSDP2 bounds in-flight all-gathers by itself",
    "forward_prefetch": "module.set_modules_to_forward_prefetch",
    "auto_wrap_policy": "calling fully_shard on each block, then the root",
    "cpu_offload": "offload_policy=CPUOffloadPolicy()",
    "mixed_precision": "mp_policy=MixedPrecisionPolicy(...)",
    "sync_module_states": "loading a full state dict with set_model_state_dict(..., broadcast_from_rank0=True)",
}



def _precision_from_dtypes(param_dtype: str | None, reduce_dtype: str | None, model_dtype: str = "fp32") -> Precision:
    if param_dtype is None or param_dtype == "fp32":
        return Precision.BF16_PURE if model_dtype == "bf16" else Precision.FP32
    return Precision.FP16 if param_dtype == "fp16" else Precision.BF16


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise PlannerError("config", f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise PlannerError("config", f"{path} is not UTF-8 text") from None


def _parse(path: Path, text: str) -> dict:
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # yaml.YAMLError / json.JSONDecodeError: both mean "not readable"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PlannerError("config", f"{path} is not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: "
                                     f"{first}") from None
    if not isinstance(data, dict):
        raise PlannerError("config", f"{path} must hold a mapping of settings, got {type(data).__name__}")
    return data


def read_rl_setup(path, gpus: int | None = None):
    """An RL job - a verl launch script, overrides or YAML (verl.py), a TRL GRPOConfig (trl_grpo.py) - as an
    RlSetup, else None (read_setup's kinds; an unreadable file is read_setup's to report). `gpus`: the command
    line's, which TRL's per-process batch needs."""
    path = Path(path)
    text = _read(path)
    if path.suffix in (".py", ".toml"):
        return None
    if path.suffix not in (".yaml", ".yml", ".json"):
        return verl.from_verl_script(text, str(path)) if verl.is_verl_script(text) else None
    docs = trl_grpo.documents(path, text)
    if docs and verl.is_verl_yaml(docs[0]):
        return verl.from_verl_yaml(docs[0], str(path), text)
    if docs and trl_grpo.is_trl_grpo(docs[0]):
        return trl_grpo.from_trl_grpo(docs, str(path), text, gpus)
    return None


def read_setup(path) -> UserSetup:
    """By content: Python code (a .py file, or text calling fully_shard / FSDP / FSDPStrategy: python_code.py),
    torchtitan settings (a .toml job file, or --section.option flags), a NeMo Automodel recipe, an axolotl config
    (base_model), an accelerate config (has `distributed_type`), HF TrainingArguments (`fsdp`,
    per_device_train_batch_size, ...), an accelerate config again (`fsdp_config` alone), else FSDP kwargs."""
    path = Path(path)
    text = _read(path)
    if python_code.is_python_code(text, path.suffix):  # --emit fsdp2 / fsdp1 / lightning code, read with ast
        return python_code.from_python(text, source=str(path))
    settings = torchtitan.torchtitan_settings(text, path)
    if settings is not None:
        return torchtitan.from_torchtitan(settings, source=str(path))
    data = _parse(path, text)
    if automodel.is_automodel(data):  # a NeMo Automodel recipe YAML
        return automodel.from_automodel(data, source=str(path))
    if axolotl.is_axolotl(data):  # an axolotl config YAML (before TrainingArguments: it has their batch keys too)
        return axolotl.from_axolotl(data, source=str(path))
    if "distributed_type" not in data and trainers.is_hf_trainer(data):
        return trainers.from_hf_trainer(data, source=str(path))
    if "fsdp_config" in data or "distributed_type" in data:
        return from_accelerate(data, source=str(path), text=text)
    return from_kwargs(data, source=str(path))


def from_accelerate(data: dict, source: str = "accelerate config", text: str = "") -> UserSetup:
    """accelerate's YAML: top-level mixed_precision/num_processes/num_machines, FSDP keys under fsdp_config. The
    attention has no key (the training script loads the model): it is read from the comment line --emit accelerate
    writes (`# attn_implementation: flex_attention ...`, planner/emit/attention.py), so the round trip prices what
    was planned, and check says the script must set it (rules_techniques.attention_unset); no such line: unstated,
    priced as transformers' default."""
    if str(data.get("distributed_type", "FSDP")).upper() != "FSDP":
        raise PlannerError("distributed_type", f"{data.get('distributed_type')!r} is not FSDP; "
                                               "fsdp-plan check reads FSDP configs")
    fsdp = data.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise PlannerError("fsdp_config", "must be a mapping of fsdp_* keys")
    version = _int(fsdp, "fsdp_version", 1)
    if version not in (1, 2):
        raise PlannerError("fsdp_version", f"must be 1 or 2, got {version}")
    mixed = str(data.get("mixed_precision", "no")).lower()
    if mixed not in ("no", "bf16", "fp16", "fp8"):
        raise PlannerError("mixed_precision", f"unknown value {mixed!r}; choose one of: no, bf16, fp16, fp8")
    precision = {"no": Precision.FP32, "bf16": Precision.BF16, "fp16": Precision.FP16}.get(mixed, Precision.BF16)
    fp8 = data.get("fp8_config") or {}
    if not isinstance(fp8, dict):
        raise PlannerError("fp8_config", "must be a mapping like {backend: AO}")
    # accelerate's torchao (AO) recipe all-gathers Float8 weights in FP8 under FSDP2 unless told otherwise
    fp8_all_gather = (mixed == "fp8" and version == 2 and str(fp8.get("backend", "AO")).upper() == "AO"
                      and _bool("fp8_config.enable_fsdp_float8_all_gather", fp8.get("enable_fsdp_float8_all_gather", True)))
    dynamo = data.get("dynamo_config") or {}
    if not isinstance(dynamo, dict):
        raise PlannerError("dynamo_config", "must be a mapping of dynamo_* keys")
    compiles = str(dynamo.get("dynamo_backend", "NO")).upper() not in ("NO", "NONE", "")
    ac = fsdp.get("fsdp_activation_checkpointing", False)
    selective = str(ac).strip().lower() == SELECTIVE_OP  # accelerate reads a bool: it cannot say this
    if version == 2:
        reshard = _bool("fsdp_reshard_after_forward", fsdp.get("fsdp_reshard_after_forward", True))
        parallel = data.get("parallelism_config") or {}
        if not isinstance(parallel, dict):
            raise PlannerError("parallelism_config", "must be a mapping of parallelism_config_* keys")
        replicas = _int(parallel, "parallelism_config_dp_replicate_size", 1) or 1
        mesh = accelerate_degrees({k.removeprefix("parallelism_config_"): v for k, v in parallel.items()},
                                  "parallelism_config.parallelism_config_")
        sharding = fsdp2_sharding(replicas > 1, reshard)
        mesh.update(hsdp_fields(sharding, replicas, _int_or_none(parallel, "parallelism_config_dp_shard_size"),
                                mesh["cp"], mesh["tp"])[0])
    else:
        raw = fsdp.get("fsdp_sharding_strategy", fsdp.get("fsdp_reshard_after_forward", "FULL_SHARD"))
        sharding = _strategy("fsdp_sharding_strategy", raw)
        mesh = {}
    prefetch = _strip(fsdp.get("fsdp_backward_prefetch", "BACKWARD_PRE")).upper()
    if prefetch not in ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH", "NONE"):
        raise PlannerError("fsdp_backward_prefetch", f"unknown value {prefetch!r}; choose one of: BACKWARD_PRE, "
                                                     "BACKWARD_POST, NO_PREFETCH")
    config = FsdpConfig(
        sharding=sharding, precision=precision,
        offload=_bool("fsdp_offload_params", fsdp.get("fsdp_offload_params", False)),
        ac_every=SELECTIVE_OP if selective else 1 if _bool("fsdp_activation_checkpointing", ac) else 0,
        backward_prefetch=prefetch in ("BACKWARD_PRE", "BACKWARD_POST"),
        forward_prefetch=_bool("fsdp_forward_prefetch", fsdp.get("fsdp_forward_prefetch", False)),
        compile=compiles, compile_loss=False, float8=mixed == "fp8", fp8_all_gather=fp8_all_gather,  # the
        # loss: inside a Hugging Face model's forward, which regional compilation leaves eager
        **mesh,
    )
    commented = attention.read_yaml_comment(text)
    if commented is not None:
        config = replace(config, **commented)
    wrap = {"TRANSFORMER_BASED_WRAP": "block", "SIZE_BASED_WRAP": "size", "NO_WRAP": "none"}.get(
        str(fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper(), "custom")
    keys = {k.removeprefix("fsdp_") for k in fsdp}
    removed = tuple(k for k in ("backward_prefetch", "use_orig_params", "forward_prefetch", "sharding_strategy")
                    if version == 2 and k in keys)
    rank0 = _bool("fsdp_cpu_ram_efficient_loading", fsdp.get("fsdp_cpu_ram_efficient_loading", False))
    return UserSetup(
        config=config, fsdp_version=version, source=source, dialect="accelerate", explicit=frozenset(keys), wrap=wrap,
        adapter_units=AdapterUnits.AUTOCAST if version == 1 else None,  # LoRA: peft's wrap policy, autocast
        use_orig_params=True if version == 2 else _bool("fsdp_use_orig_params", fsdp.get("fsdp_use_orig_params", False)),
        sync_module_states=_bool("fsdp_sync_module_states", fsdp.get("fsdp_sync_module_states", False)),
        init="rank0" if rank0 else "all",
        # accelerate's default: FULL_STATE_DICT under FSDP1, SHARDED_STATE_DICT under FSDP2 (FullyShardedDataParallelPlugin)
        state_dict_type=_strip(fsdp.get("fsdp_state_dict_type", "FULL_STATE_DICT" if version == 1 else
                                        "SHARDED_STATE_DICT")).upper(),
        grad_scaler="sharded" if precision is Precision.FP16 else None,  # accelerate adds it for fp16
        reduce_dtype=None, n_processes=_int_or_none(data, "num_processes"),
        n_machines=_int_or_none(data, "num_machines"), fsdp2_removed=removed,
        compile_dynamic=compiles and _bool("dynamo_config.dynamo_use_dynamic", dynamo.get("dynamo_use_dynamic", False)),
        unexpressed=(SELECTIVE_OP,) if selective else (),
        attention_from="unstated" if commented is None else "comment",
    )


def _is_fsdp2_kwargs(data: dict) -> bool:
    return _int(data, "fsdp_version", 0) == 2 or any(
        k in data for k in ("reshard_after_forward", "mp_policy", "offload_policy", "mesh"))


def from_kwargs(data: dict, source: str = "kwargs") -> UserSetup:
    """FSDP1 FullyShardedDataParallel kwargs, or FSDP2 fully_shard kwargs, written as JSON/YAML.

    Extra keys the code around the wrapper decides: `grad_scaler` (ShardedGradScaler / GradScaler / null),
    `model_dtype` (the dtype the model is loaded in), `init` (all / rank0 / meta), `activation_checkpointing`,
    `micro_batch`, `grad_accum`, `use_cache` (model.config.use_cache during training: true / false),
    `compile` (torch.compile per block and of the loss: true, or a mapping like {dynamic: true, loss: false}
    for blocks only), `float8` (torchao Float8
    linears), `fp8_all_gather`. FSDP2's `reshard_after_forward` may be an int group size.
    """
    known = {"sharding_strategy", "mixed_precision", "cpu_offload", "auto_wrap_policy", "backward_prefetch",
             "forward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states", "device_id",
             "param_init_fn", "reshard_after_forward", "mp_policy", "offload_policy", "mesh", "fsdp_version",
             "grad_scaler", "model_dtype", "init", "activation_checkpointing", "micro_batch", "grad_accum",
             "ignored_modules", "process_group", "device_mesh", "use_cache", "compile", "float8", "fp8_all_gather"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlannerError(unknown[0], f"not an FSDP argument fsdp-plan knows; known: {', '.join(sorted(known))}")
    version = 2 if _is_fsdp2_kwargs(data) else 1
    model_dtype = _dtype("model_dtype", data.get("model_dtype", "float32"))
    mp = data.get("mp_policy" if version == 2 else "mixed_precision")
    if mp is not None and not isinstance(mp, dict):
        raise PlannerError("mixed_precision", "must be a mapping like {param_dtype: bfloat16, reduce_dtype: float32}")
    param_dtype = _dtype("param_dtype", mp["param_dtype"]) if mp and mp.get("param_dtype") else None
    reduce_dtype = _dtype("reduce_dtype", mp["reduce_dtype"]) if mp and mp.get("reduce_dtype") else None
    precision = _precision_from_dtypes(param_dtype, reduce_dtype, model_dtype)
    reshard_group = 0
    if version == 2:
        raw = data.get("reshard_after_forward", True)
        if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 2:  # an int group: resharded after forward
            raw, reshard_group = True, raw
        reshard = _bool("reshard_after_forward", raw)
        shape = (data.get("mesh") or {}).get("shape") if isinstance(data.get("mesh"), dict) else None
        hybrid = bool(shape) and len(shape) == 2 and shape[1] > 1 and shape[0] > 1
        no_shard = bool(shape) and len(shape) == 2 and shape[1] == 1
        if no_shard:
            sharding = Sharding.NO_SHARD
        else:
            sharding = fsdp2_sharding(hybrid, reshard)
        offload = data.get("offload_policy") not in (None, False, "null", "None")
        removed = tuple(k for k in FSDP2_REMOVED if k in data)
        wrap = "block"  # fully_shard is applied per module by the user's code
    else:
        sharding = _strategy("sharding_strategy", data.get("sharding_strategy", "FULL_SHARD"))
        cpu = data.get("cpu_offload")
        offload = _bool("cpu_offload.offload_params", cpu.get("offload_params", False)) if isinstance(cpu, dict) \
            else _bool("cpu_offload", cpu if cpu is not None else False)
        removed = ()
        policy = str(data.get("auto_wrap_policy") or "").lower()
        wrap = ("none" if not policy else "size" if "size" in policy
                else "block" if any(w in policy for w in ("transformer", "modulewrap", "block", "layer")) else "custom")
    prefetch = data.get("backward_prefetch", "BACKWARD_PRE")
    scaler = data.get("grad_scaler", "unstated")
    scaler = None if scaler == "unstated" else "none" if scaler in (None, False, "null", "None") else \
        "sharded" if "sharded" in str(scaler).lower() else "plain"
    init = "meta" if data.get("param_init_fn") else str(data.get("init", "all")).lower()
    if init not in ("all", "rank0", "meta"):
        raise PlannerError("init", f"unknown value {init!r}; choose one of: all, rank0, meta")
    compile_ = data.get("compile", False)
    dynamic = isinstance(compile_, dict) and _bool("compile.dynamic", compile_.get("dynamic", False))
    config = FsdpConfig(
        sharding=sharding, precision=precision, offload=offload,
        compile=bool(compile_) if isinstance(compile_, dict) else _bool("compile", compile_),
        compile_loss=_bool("compile.loss", compile_.get("loss", True)) if isinstance(compile_, dict) else True,
        float8=_bool("float8", data.get("float8", False)),
        fp8_all_gather=_bool("fp8_all_gather", data.get("fp8_all_gather", False)), reshard_after_forward=reshard_group,
        ac_every=data.get("activation_checkpointing", "none"),
        micro_batch=_int(data, "micro_batch", 1), grad_accum=_int(data, "grad_accum", 1),
        backward_prefetch=prefetch is not None and _strip(prefetch).upper() != "NONE",
        forward_prefetch=_bool("forward_prefetch", data.get("forward_prefetch", False)),
        limit_all_gathers=_bool("limit_all_gathers", data.get("limit_all_gathers", True)),
    )
    return UserSetup(
        config=config, fsdp_version=version, source=source, dialect="kwargs", explicit=frozenset(data), wrap=wrap,
        use_orig_params=True if version == 2 else _bool("use_orig_params", data.get("use_orig_params", False)),
        sync_module_states=_bool("sync_module_states", data.get("sync_module_states", False)),
        init=init, grad_scaler=scaler, reduce_dtype=reduce_dtype, fsdp2_removed=removed,
        use_cache=_bool("use_cache", data["use_cache"]) if "use_cache" in data else None, compile_dynamic=dynamic,
    )


def model_use_cache(model) -> bool | None:
    """use_cache of the model being checked: the key of a config.json (path) or HF config dict, or an
    nn.Module's model.config.use_cache; None when the model does not say (presets, other modules)."""
    from planner.models import hf_config_of

    hf = hf_config_of(model)
    value = hf.get("use_cache") if hf is not None else getattr(getattr(model, "config", None), "use_cache", None)
    return None if value is None else _bool("use_cache", value)
