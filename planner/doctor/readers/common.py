"""What every setup reader shares (planner/doctor/readers/ dispatches to the readers, which import this, never
its __init__.py): the UserSetup record they return and the value readers that accept values the way people write
them ("FULL_SHARD", "ShardingStrategy.FULL_SHARD", 1; true / "yes"; integers). Anything unreadable raises
PlannerError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.fsdp1_adapters import AdapterUnits
from cost_models.specs import FsdpConfig, Sharding

from planner.errors import PlannerError

# the dtype names a setup file spells (torch's without its prefix, and FsdpConfig's short ones) -> FsdpConfig's:
# the readers' one table (automodel.py adds its "auto", python_qlora.py torch's prefix and bitsandbytes' uint8)
DTYPES = {"float32": "fp32", "fp32": "fp32", "float": "fp32", "bfloat16": "bf16", "bf16": "bf16",
          "float16": "fp16", "fp16": "fp16", "half": "fp16"}
_STRATEGY_NUMBERS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                     "5": "HYBRID_SHARD_ZERO2"}


@dataclass(frozen=True)
class UserSetup:
    config: FsdpConfig
    fsdp_version: int = 1
    source: str = "flags"
    dialect: str = "flags"                  # what it was read from: flags | accelerate | kwargs | hf-trainer | torchtitan
    #                                         | automodel | axolotl | fsdp2-code | fsdp1-code | lightning (python_code.py)
    explicit: frozenset = frozenset()       # keys the user wrote (FSDP argument names)
    wrap: str = "block"                     # block | size | none | custom
    use_orig_params: bool = False           # FSDP1's default
    adapter_units: AdapterUnits | None = None  # FSDP1: each LoRA adapter a unit (cost_models/fsdp1_adapters.py):
    #                                         CAST, --emit fsdp1's CustomPolicy(lora_unit); AUTOCAST, HF Trainer's and
    #                                         accelerate's FSDP1 (peft's wrap policy, autocast)
    sync_module_states: bool = False
    init: str = "all"                       # all ranks load | rank0 (cpu_ram_efficient_loading) | meta | dcp (meta
    #                                         init, then each rank reads its shard: torchtitan)
    state_dict_type: str | None = None      # how checkpoints are saved: FULL_STATE_DICT | SHARDED_STATE_DICT |
    #                                         ASYNC_SHARDED_STATE_DICT (torchtitan's async DCP) | SAVE_PRETRAINED
    #                                         (HF save_pretrained / save_model in a script) | ...
    #                                         (None: not stated; priced as the plan's sharded DCP save)
    save_state_dict_on_host: bool = True    # FSDP1's sharded state dict of the save, and of the resume, offloaded
    resume_state_dict_on_host: bool = True  # to host as it is made (accelerate's ShardedStateDictConfig(
    #                                         offload_to_cpu=True) default, --emit fsdp1's StateDictOptions(
    #                                         cpu_offload=True)); False: a script's get_state_dict without it (on the
    #                                         GPU: cost_models/outside_step.py _fsdp1_dcp)
    grad_scaler: str | None = None          # sharded | plain | none | None (not stated)
    reduce_dtype: str | None = None         # as written, when mixed precision is set
    n_processes: int | None = None          # cluster size written in an accelerate config
    n_machines: int | None = None
    fsdp2_removed: tuple[str, ...] = ()     # FSDP1-only keys found in an FSDP2 config
    use_cache: bool | None = None           # model.config.use_cache as the training runs (None: not stated)
    compile_dynamic: bool = False           # torch.compile with dynamic shapes (dynamic=True, dynamo_use_dynamic)
    unexpressed: tuple[str, ...] = ()       # settings asked for that the dialect cannot express (selective-op)
    seq_len: int | None = None              # tokens per sequence, where the setup says (torchtitan's training.seq_len)
    checkpoint_regathers: bool = False      # the recompute all-gathers each checkpointed block again: a reentrant
    #                                         checkpoint around FSDP1 units (HF Trainer's own, use_reentrant: true)
    model: str | None = None                # the model the setup names (torchtitan 0.3's --module / --config)
    pipeline: object = None                 # torchtitan's pipeline settings (pipeline.PipelineSettings)
    training: tuple = ()                    # (request knob, value) pairs the file fixes (Automodel: routing, optimizer)
    qlora: object = None                    # a Python file's QLoRA loading (python_qlora.QloraSetup), else None
    attention_from: str = "config"          # where config.attention comes from: config (the reader's, or its trainer's
    #                                         own: flags, kwargs, torchtitan, Automodel) | code (the file sets
    #                                         attn_implementation) | comment (accelerate's YAML: a comment accelerate
    #                                         ignores) | unstated (check prices transformers' default for the model)
    notes: tuple[str, ...] = field(default=())


def _strip(value) -> str:
    text = str(value).strip()
    for prefix in ("ShardingStrategy.", "BackwardPrefetch.", "torch.", "StateDictType."):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def _dtype(key: str, value) -> str:
    """A dtype as people write it ("torch.bfloat16", "bf16", "half") -> fp32 | bf16 | fp16."""
    text = _strip(value).lower()
    if text not in DTYPES:
        raise PlannerError(key, f"unknown dtype {value!r}; choose one of: float32, bfloat16, float16")
    return DTYPES[text]


def _bool(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1", "on"):
        return True
    if text in ("false", "no", "0", "off", "none", "null", ""):
        return False
    raise PlannerError(key, f"expected true or false, got {value!r}")


def _strategy(key: str, value) -> Sharding:
    text = _strip(value).upper().lstrip("_")
    text = _STRATEGY_NUMBERS.get(text, text)
    try:
        return Sharding(text)
    except ValueError:
        raise PlannerError(key, f"unknown sharding strategy {value!r}; choose one of: "
                                f"{', '.join(s.value for s in Sharding)}") from None


def accelerate_degrees(parallel: dict, prefix: str) -> dict:
    """tp / cp of accelerate's ParallelismConfig (keys without their parallelism_config_ prefix) as FsdpConfig
    fields: accelerate runs TP as transformers' tp_plan, so without sequence parallel. sp_size (DeepSpeed's
    Ulysses) is not FSDP's and is refused."""
    if _int(parallel, "sp_size", 1) > 1:
        raise PlannerError(f"{prefix}sp_size", "DeepSpeed's sequence parallel (Ulysses) is not planned by fsdp-plan; "
                                               "set it to 1 (context parallel: cp_size)")
    tp, cp = _int(parallel, "tp_size", 1), _int(parallel, "cp_size", 1)
    for key, value in (("tp_size", tp), ("cp_size", cp)):
        if value < 1:
            raise PlannerError(f"{prefix}{key}", f"must be >= 1, got {value}")
    return {"tp": tp, "cp": cp, **({"sequence_parallel": False} if tp > 1 else {})}


def fsdp2_sharding(hybrid: bool, reshard: bool) -> Sharding:
    """FSDP2's strategy from a read mesh: HSDP where it has replicas, resharding after forward or not."""
    if hybrid:
        return Sharding.HYBRID_SHARD if reshard else Sharding.HYBRID_SHARD_ZERO2
    return Sharding.FULL_SHARD if reshard else Sharding.SHARD_GRAD_OP


def hsdp_fields(sharding: Sharding, replicas, shard, cp: int = 1, tp: int = 1) -> tuple[dict, int | None]:
    """({"shard_group_gpus": dp_shard x cp x tp} or {}, machines or None) of a read (dp_replicate, dp_shard) mesh:
    HSDP's shard group as written (check reads a node's worth as the default, feasibility.node_shard_group); where
    dp_shard is left to the ranks (None, or the world size), a replica per machine (the shard group a node)."""
    if not sharding.is_hybrid or not isinstance(replicas, int) or replicas <= 1:
        return {}, None
    if not isinstance(shard, int):
        return {}, replicas
    return {"shard_group_gpus": shard * cp * tp}, None


def _int_or_none(data: dict, key: str) -> int | None:
    if data.get(key) is None:
        return None
    value = data[key]
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise PlannerError(key, f"expected an integer, got {value!r}") from None


def _int(data: dict, key: str, default: int) -> int:
    """An integer field; missing or null: the default."""
    value = _int_or_none(data, key)
    return default if value is None else value


def _positive_int(data: dict, key: str, default: int) -> int:
    value = _int(data, key, default)
    if value < 1:
        raise PlannerError(key, f"must be >= 1, got {value}")
    return value
