"""Read the trainers' dialects back for `fsdp-plan check`: Hugging Face TrainingArguments (JSON/YAML with `fsdp`,
`fsdp_config`, the batch and precision keys) and torchtitan job settings (a TOML job file, or a list of
--section.option flags). The mirror of planner/emit_trainers.py: what it emits reads back as the plan's
FsdpConfig (tests/doctor/test_roundtrip.py).

Defaults are the trainers' own (an absent per_device_train_batch_size is HF's 8; an absent
activation_checkpoint.mode is torchtitan's selective every-2), so a file is priced as it would run. A value the
trainer would refuse, or a setting fsdp-plan cannot price, raises one PlannerError naming the key.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from cost_models.specs import SELECTIVE_OP, FsdpConfig, Precision, Sharding

from .emit_torchtitan import preset_of
from .errors import PlannerError
from .setups_pipeline import torchtitan_pipeline
from .setups_common import UserSetup, _bool, _int, _int_or_none, _strategy, _strip, accelerate_degrees

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


def _positive_int(data: dict, key: str, default: int) -> int:
    value = _int(data, key, default)
    if value < 1:
        raise PlannerError(key, f"must be >= 1, got {value}")
    return value


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
    config = FsdpConfig(
        sharding=sharding, precision=precision,
        offload=_bool("fsdp_config.cpu_offload", fsdp.get("cpu_offload", False)), ac_every=ac_every,
        micro_batch=_positive_int(data, "per_device_train_batch_size", 8),  # HF's default
        grad_accum=_positive_int(data, "gradient_accumulation_steps", 1),
        backward_prefetch=prefetch, forward_prefetch=forward_prefetch, limit_all_gathers=limit, compile=compiles,
        compile_loss=False,  # the model's own loss, in its forward: eager (a compute_loss_func is code, not an argument)
        **mesh,
    )
    return UserSetup(
        config=config, fsdp_version=version, source=source, dialect="hf-trainer",
        explicit=frozenset(str(k).removeprefix("fsdp_") for k in data.get("fsdp_config") or {}),
        wrap=HF_WRAP[policy],
        use_orig_params=version == 2 or _bool("fsdp_config.use_orig_params", fsdp.get("use_orig_params", True)),
        # FSDP2: accelerate broadcasts rank 0's state dict itself when only rank 0 loads it (cpu_ram_efficient_loading)
        sync_module_states=rank0 if version == 2 else _bool("fsdp_config.sync_module_states",
                                                            fsdp.get("sync_module_states", True)),
        init="rank0" if rank0 else "all",
        grad_scaler="sharded" if fp16 else None,  # accelerate adds the ShardedGradScaler for fp16
        n_processes=replicas * shard * config.tp * config.cp if shard else None,
        n_machines=replicas if replicas > 1 else None,
        use_cache=_bool("use_cache", data.get("use_cache", False)),  # TrainingArguments' default: off
        unexpressed=(SELECTIVE_OP,) if ac_every == SELECTIVE_OP else (),
        notes=(ac_note,) if ac_note else (), checkpoint_regathers=regathers,
    )


# ---------------------------------------------------------------- torchtitan

_FLAG = re.compile(r"--[A-Za-z_][\w-]*\.[\w.-]+")
# torchtitan 0.3: the config function (--module M --config C) and a component chosen by a subcommand
_CONFIG_FUNCTION = re.compile(r"--(module|config)(=.*)?$")
_SUBCOMMAND = re.compile(r"(activation-checkpoint):([\w-]+)$")
# booleans fsdp-plan reads, in the names of torchtitan 0.3, 0.2 and 0.1 (--name / --section.no-name on the command
# line)
TORCHTITAN_BOOLS = ("compile.enable", "training.compile", "training.enable_cpu_offload",
                    "quantize.linear.float8.enable_fsdp_float8_all_gather", "float8.enable_fsdp_float8_all_gather",
                    "compile.enable_async_tensor_parallel", "parallelism.enable_async_tensor_parallel",
                    "parallelism.enable_sequence_parallel", "parallelism.disable_loss_parallel",
                    "training.disable_cuda_graphs")
# options whose value is a list of lists (tyro's form: one word per inner list, its items comma-joined)
TORCHTITAN_LISTS = ("parallelism.module_fqns_per_model_part",)


def _flatten(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _parse_flags(text: str) -> dict:
    """{section.option: value} of --section.option=value / --section.option value / --flag / --section.no-flag."""
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise PlannerError("config", f"cannot split the flags: {exc}") from None
    out, i = {}, 0
    while i < len(tokens):
        token = tokens[i]
        function, subcommand = _CONFIG_FUNCTION.match(token), _SUBCOMMAND.match(token)
        if subcommand:  # 0.3's activation-checkpoint:selective | full | none | memory-budget
            out[subcommand.group(1).replace("-", "_")] = subcommand.group(2)
            i += 1
            continue
        if function:  # 0.3's --module llama3 / --config=llama3_8b
            if function.group(2):
                out[function.group(1)] = function.group(2)[1:]
            elif i + 1 < len(tokens):
                out[function.group(1)] = tokens[i + 1]
                i += 1
            else:
                raise PlannerError(function.group(1), "needs a value (torchtitan 0.3: --module llama3 --config "
                                                      "llama3_8b)")
            i += 1
            continue
        if not _FLAG.match(token):
            raise PlannerError("config", f"{token!r} is not a torchtitan --section.option flag")
        name, eq, value = token[2:].partition("=")
        section, _, option = name.rpartition(".")
        name = f"{section}.{option.replace('-', '_')}"
        negated = f"{section}.{option[3:].replace('-', '_')}"
        if not eq and option[:3] in ("no-", "no_") and negated in TORCHTITAN_BOOLS:
            name, value = negated, False
        elif name in TORCHTITAN_LISTS:  # --x a,b c or --x=a,b c: every word up to the next flag
            words = [value] if eq else []
            while i + 1 < len(tokens) and not tokens[i + 1].startswith("--") and not _SUBCOMMAND.match(tokens[i + 1]):
                i += 1
                words.append(tokens[i])
            value = words
        elif not eq and (i + 1 == len(tokens) or tokens[i + 1].startswith("--")):
            value = True
        elif not eq:
            i += 1
            value = tokens[i]
        out[name] = value
        i += 1
    return out


def torchtitan_settings(text: str, path: Path) -> dict | None:
    """{section.option: value} of a torchtitan TOML job file (a .toml path) or flag list (text whose first word is a
    --section.option flag); None when the text is neither (JSON / YAML)."""
    if path.suffix == ".toml":
        import tomllib

        try:
            return _flatten(tomllib.loads(text))
        except tomllib.TOMLDecodeError as exc:
            raise PlannerError("config", f"{path} is not valid TOML: {exc}") from None
    try:
        first = shlex.split(text.replace("\\\n", " "), comments=True)[:1]
    except ValueError:
        return None
    return _parse_flags(text) if first and (_FLAG.match(first[0]) or _CONFIG_FUNCTION.match(first[0])) else None


def _choice(settings: dict, key: str, choices: tuple[str, ...], default: str) -> str:
    value = str(settings.get(key, default)).strip().lower()
    if value not in choices:
        raise PlannerError(key, f"unknown value {settings[key]!r}; choose one of: {', '.join(choices)}")
    return value


def _first(settings: dict, *keys: str):
    """(key, value) of the first key present (torchtitan 0.2's name, then 0.1's), else (the first key, None)."""
    return next(((k, settings[k]) for k in keys if k in settings), (keys[0], None))


def _list(value) -> list[str]:
    """A list of names: a TOML array, or a flag's comma-separated text."""
    if value is None:
        return []
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


SUBCOMMAND_CHECKPOINTING = {"selective": SELECTIVE_OP, "full": 1, "none": 0}


def is_torchtitan_03(settings: dict) -> bool:
    """0.3's spellings: a config function (--module / --config) or the activation-checkpoint subcommand."""
    return any(key in settings for key in ("module", "config", "activation_checkpoint"))


def _torchtitan_checkpointing(settings: dict) -> int | str:
    """0.3: the activation-checkpoint subcommand (absent: the config function's own, SelectiveAC, op level, in
    every config torchtitan ships); 0.2: activation_checkpoint.mode and selective_ac_option (absent: selective
    every 2)."""
    if "activation_checkpoint" in settings or is_torchtitan_03(settings):
        choice = str(settings.get("activation_checkpoint", "selective"))
        if choice == "memory-budget":
            raise PlannerError("activation-checkpoint", "memory-budget (compile's min-cut) is not priced by "
                                                        "fsdp-plan; choose activation-checkpoint:none, full or "
                                                        "selective")
        if choice not in SUBCOMMAND_CHECKPOINTING:
            raise PlannerError("activation-checkpoint", f"unknown subcommand {choice!r}; choose one of: "
                                                        "selective, full, none, memory-budget")
        return SUBCOMMAND_CHECKPOINTING[choice]
    mode = _choice(settings, "activation_checkpoint.mode", ("none", "selective", "full", "memory_budget"), "selective")
    if mode == "memory_budget":
        raise PlannerError("activation_checkpoint.mode", "memory_budget (compile's min-cut) is not priced by "
                                                         "fsdp-plan; choose none, full or selective")
    if mode != "selective":
        return 1 if mode == "full" else 0
    option = str(settings.get("activation_checkpoint.selective_ac_option", "2")).strip().lower()
    if option == "op":
        return SELECTIVE_OP
    if not option.isdigit():
        raise PlannerError("activation_checkpoint.selective_ac_option", f"unknown value {option!r}; choose op or an "
                                                                        "integer K (every K-th block)")
    return max(int(option), 1)  # torchtitan: 0 checkpoints every block, like 1


def _torchtitan_mesh(settings: dict) -> dict:
    """tp / cp / ep (pp: setups_pipeline), async TP (0.3: compile.enable_async_tensor_parallel; 0.2: under
    parallelism) and sequence parallel (0.3's parallelism.enable_sequence_parallel; 0.2 always with TP)."""
    async_key, async_value = _first(settings, "compile.enable_async_tensor_parallel",
                                    "parallelism.enable_async_tensor_parallel")
    if _bool("parallelism.disable_loss_parallel", settings.get("parallelism.disable_loss_parallel", False)):
        raise PlannerError("parallelism.disable_loss_parallel", "a gathered head under torchtitan's sequence parallel "
                                                                "is not priced by fsdp-plan; leave it false")
    return {
        "tp": _positive_int(settings, "parallelism.tensor_parallel_degree", 1),
        "cp": _positive_int(settings, "parallelism.context_parallel_degree", 1),
        "ep": _positive_int(settings, "parallelism.expert_parallel_degree", 1),
        "async_tp": _bool(async_key, async_value or False),
        "sequence_parallel": _bool("parallelism.enable_sequence_parallel",
                                   settings.get("parallelism.enable_sequence_parallel", True)),
    }


def from_torchtitan(settings: dict, source: str = "torchtitan") -> UserSetup:
    """torchtitan job settings as {section.option: value} (torchtitan_settings): 0.3's (the config function, the
    activation-checkpoint subcommand, compile.enable_async_tensor_parallel; Float8 in a config function whose name
    says float8), 0.2's names, and 0.1's spellings of compile (training.compile) and Float8 ([float8], converter
    "float8"). The mesh: tensor, context and expert parallel degrees beside the data-parallel ones."""
    for option in ("expert_tensor_parallel_degree",):
        if _int(settings, f"parallelism.{option}", 1) > 1:
            raise PlannerError(f"parallelism.{option}", "expert tensor parallelism is not planned by fsdp-plan; set it "
                                                        "to 1 (experts split over ep, borrowing tp's ranks)")
    mesh = _torchtitan_mesh(settings)
    replicas = _positive_int(settings, "parallelism.data_parallel_replicate_degree", 1)
    shard = _int(settings, "parallelism.data_parallel_shard_degree", -1)
    if shard == 0 or shard < -1:
        raise PlannerError("parallelism.data_parallel_shard_degree", f"must be -1 (the rest) or >= 1, got {shard}")
    reshard = _choice(settings, "parallelism.fsdp_reshard_after_forward", ("default", "always", "never"),
                      "default") != "never"
    if shard == 1 and mesh["cp"] == 1 and (replicas > 1 or mesh["tp"] == 1):
        sharding = Sharding.NO_SHARD  # DDP over the replicas (FSDP2 shards over dp_shard x cp: nothing here)
    elif replicas > 1:
        sharding = Sharding.HYBRID_SHARD if reshard else Sharding.HYBRID_SHARD_ZERO2
    else:
        sharding = Sharding.FULL_SHARD if reshard else Sharding.SHARD_GRAD_OP
    param = _choice(settings, "training.mixed_precision_param", ("bfloat16", "float32"), "bfloat16")
    _choice(settings, "training.mixed_precision_reduce", ("float32",), "float32")
    pure = _choice(settings, "training.dtype", ("bfloat16", "float32"), "float32") == "bfloat16"
    precision = Precision.BF16_PURE if pure else Precision.BF16 if param == "bfloat16" else Precision.FP32
    micro_batch = _positive_int(settings, "training.local_batch_size" if "training.local_batch_size" in settings
                                else "training.batch_size", 8)  # batch_size: before local_batch_size
    pipeline = torchtitan_pipeline(settings, micro_batch)
    global_batch = _int(settings, "training.global_batch_size", -1)
    grad_accum = 1
    if global_batch > 0:
        if shard < 1:
            raise PlannerError("training.global_batch_size", "needs parallelism.data_parallel_shard_degree >= 1 to "
                                                             "give the accumulation steps (-1 is the world size, which "
                                                             "the file does not say)")
        grad_accum, rest = divmod(global_batch, micro_batch * replicas * shard)
        if rest or not grad_accum:
            raise PlannerError("training.global_batch_size", f"{global_batch} is not a multiple of local_batch_size x "
                                                             f"data-parallel degree = {micro_batch * replicas * shard}")
        if pipeline.pp > 1 and grad_accum > 1:
            raise PlannerError("training.global_batch_size", f"{grad_accum} schedule steps of accumulation on top of the "
                                                             "pipeline are not priced by fsdp-plan; set it to "
                                                             "local_batch_size x data-parallel degree = "
                                                             f"{micro_batch * replicas * shard}")
    if pipeline.pp > 1:  # the pipeline microbatch, and the local batch's microbatches as the accumulation
        micro_batch, grad_accum = pipeline.microbatch_size, micro_batch // pipeline.microbatch_size
    compile_key, compile_value = _first(settings, "compile.enable", "training.compile")
    # compile.components (0.2, 0.3): torchtitan's default ["model", "loss"]; 0.1's training.compile was blocks only
    components = _list(settings.get("compile.components", ["model", "loss"])) if compile_key == "compile.enable" \
        else ["model"]
    compiles = _bool(compile_key, compile_value or False) and "model" in components
    converters = _list(settings.get("model.converters"))
    if any(c in ("mx", "quantize.linear.mx") for c in converters) or "mxfp8" in str(settings.get("config", "")):
        raise PlannerError("model.converters", "MX (MXFP8) linears are not priced by fsdp-plan; float8 is")
    # 0.3: Float8 is a converter inside the config function (llama3_debugmodel_float8, deepseek_v3_671b_float8, the
    # one --emit torchtitan writes), whose name says so; its recipes are rowwise, without the FP8 all-gather
    float8 = any(c in ("float8", "quantize.linear.float8") for c in converters) or "float8" in str(
        settings.get("config", ""))
    gather_key, gather = _first(settings, "quantize.linear.float8.enable_fsdp_float8_all_gather",
                                "float8.enable_fsdp_float8_all_gather")
    fp8_all_gather = float8 and sharding is not Sharding.NO_SHARD and _bool(gather_key, gather or False)
    config = FsdpConfig(
        sharding=sharding, precision=precision,
        offload=_bool("training.enable_cpu_offload", settings.get("training.enable_cpu_offload", False)),
        ac_every=_torchtitan_checkpointing(settings), micro_batch=micro_batch, grad_accum=grad_accum,
        compile=compiles, compile_loss="loss" in components, float8=float8, fp8_all_gather=fp8_all_gather, **mesh,
        pp=pipeline.pp, pp_schedule=pipeline.schedule,
        pp_stages_per_rank=pipeline.stages_per_rank(0) if pipeline.parts else 0,  # else: the model's blocks (check)
    )
    seq_len = _positive_int(settings, "training.seq_len", 2048)
    hybrid = sharding.is_hybrid
    return UserSetup(
        config=config, fsdp_version=2, source=source, dialect="torchtitan", explicit=frozenset(settings), wrap="block",
        # torchtitan builds on the meta device, then every rank initialises its shards alike (DTensor's RNG) or
        # loads them from a checkpoint: as if every rank built the same weights, nothing to broadcast
        use_orig_params=True, init="all",
        n_processes=replicas * shard * config.cp * config.tp * config.pp if shard >= 1 else None,
        n_machines=replicas if hybrid else None,  # HSDP: one replica per machine, so the shard group is a node
        use_cache=False,  # torchtitan's models keep no KV cache in training
        seq_len=seq_len, model=preset_of(settings.get("module"), settings.get("config")),
        pipeline=pipeline if pipeline.pp > 1 else None,
    )
