"""Read torchtitan job settings back for `fsdp-plan check`: a TOML job file (0.1 / 0.2 names) or a list of
--section.option flags (0.3's --module / --config and the activation-checkpoint:X subcommand too). The mirror of
planner/emit/torchtitan/job.py: what it emits reads back as the plan's FsdpConfig (tests/doctor/test_roundtrip.py).

Defaults are torchtitan's own (an absent activation_checkpoint.mode is selective every-2, local batch 8), so a file
is priced as it would run. A value torchtitan would refuse, or a setting fsdp-plan cannot price, raises one
PlannerError naming the key.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from dataclasses import replace

from cost_models.specs import SELECTIVE_OP, FsdpConfig, Precision, Sharding

from planner.emit.kernels import from_torchtitan_loss
from planner.emit import optimizer
from planner.emit.torchtitan.job import preset_of
from planner.errors import PlannerError
from planner.doctor.readers.common import UserSetup, _bool, _int, _positive_int, fsdp2_sharding, hsdp_fields
from planner.doctor.readers.pipeline import torchtitan_pipeline

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
                    "training.disable_cuda_graphs", "checkpoint.enable")
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
# checkpoint.async_mode (0.2 and 0.3) -> UserSetup.state_dict_type: DCP, or DCP staging a host copy first
ASYNC_MODES = {"disabled": "SHARDED_STATE_DICT", "async": "ASYNC_SHARDED_STATE_DICT",
               "async_with_pinned_mem": "ASYNC_SHARDED_STATE_DICT"}


def _save(settings: dict) -> str | None:
    """How checkpoint.* saves (None: checkpointing off, priced as the plan's DCP save)."""
    if not _bool("checkpoint.enable", settings.get("checkpoint.enable", False)):
        return None
    return ASYNC_MODES[_choice(settings, "checkpoint.async_mode", tuple(ASYNC_MODES), "disabled")]


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
    """tp / cp / ep (pp: pipeline.py), async TP (0.3: compile.enable_async_tensor_parallel; 0.2: under
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
    else:
        sharding = fsdp2_sharding(replicas > 1, reshard)
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
        # loss.num_chunks: 0.3's chunked loss (planner/emit/kernels.py); without it a 0.3 job still runs its config
        # function's loss, which every 0.3 model config sets to ChunkedLossWrapper (models/*/config_registry.py)
        **(from_torchtitan_loss(settings) or ({"loss_kernel": "chunked"} if is_torchtitan_03(settings) else {})),
        pp=pipeline.pp, pp_schedule=pipeline.schedule,
        pp_stages_per_rank=pipeline.stages_per_rank(0) if pipeline.parts else 0,  # else: the model's blocks (check)
    )
    seq_len = _positive_int(settings, "training.seq_len", 2048)
    group, machines = hsdp_fields(sharding, replicas, shard if shard >= 1 else None, config.cp, config.tp)
    config = replace(config, **group)
    return UserSetup(
        config=config, fsdp_version=2, source=source, dialect="torchtitan", explicit=frozenset(settings), wrap="block",
        # torchtitan builds on the meta device, then every rank initialises its shards alike (DTensor's RNG) or
        # loads them from a checkpoint (DCP): nothing to broadcast, no full copy in host RAM
        use_orig_params=True, init="dcp", state_dict_type=_save(settings),
        n_processes=replicas * shard * config.cp * config.tp * config.pp if shard >= 1 else None,
        n_machines=machines,  # HSDP with data_parallel_shard_degree -1: one replica per machine
        use_cache=False,  # torchtitan's models keep no KV cache in training
        seq_len=seq_len, model=preset_of(settings.get("module"), settings.get("config")),
        pipeline=pipeline if pipeline.pp > 1 else None,
        training=optimizer.from_torchtitan(settings),  # optimizer.implementation (default fused), name
    )
