"""`fsdp-plan check` on FSDP2 and FSDP1 code (planner/doctor/readers/python_code.py dispatches here): the forms
planner/emit/code/ writes, read back into the FsdpConfig they were written from.

FSDP2 (emit_fsdp2, mesh.py, pipeline.py): fully_shard(block, **block_kwargs) in a loop over the blocks, then
fully_shard(model, **fsdp_kwargs); reshard_after_forward True / False (FULL_SHARD / SHARD_GRAD_OP), an int group
on the blocks (the plan's reshard_after_forward); the mesh from init_device_mesh's shape, (world,) or (world // S,
S) with ("dp_replicate", "dp_shard") for HSDP (S 1: NO_SHARD), or the MESH_SHAPE / MESH_DIMS constants with tp, cp,
pp beside them and EP_MESH_SHAPE for the experts. Under a pipeline the snippet keeps blocks gathered whatever the
strategy (fsdp_options.fully_shard_options, torchtitan's default), where FULL_SHARD and SHARD_GRAD_OP run and are
priced alike: it reads FULL_SHARD (HYBRID_SHARD), the one of each pair the search tries (planner/search/pipeline.py).
FSDP1 (emit_fsdp1): FullyShardedDataParallel's keyword arguments and apply_activation_checkpointing's check_fn.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import replace

from cost_models import fsdp_options
from cost_models.pipeline import blocks_per_stage, stage_rank
from cost_models.schedules import Schedule
from cost_models.fsdp1_adapters import AdapterUnits
from cost_models.specs import FsdpConfig, Sharding

from planner.doctor.readers import python_shared as shared
from planner.doctor.readers.common import UserSetup, _strategy, hsdp_fields
from planner.doctor.readers.python_checkpoint import checkpoint_fields
from planner.doctor.readers.python_ast import WORLD, Snippet, dotted
from planner.errors import PlannerError

FULLY_SHARD_ARGS = ("mesh", "reshard_after_forward", "mp_policy", "offload_policy", "shard_placement_fn")
MESH_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FSDP1_ARGS = ("sharding_strategy", "mixed_precision", "cpu_offload", "backward_prefetch", "forward_prefetch",
              "limit_all_gathers", "auto_wrap_policy", "use_orig_params", "sync_module_states", "device_id",
              "device_mesh")
PIPELINE_CONSTANTS = ("STAGE_BLOCKS", "STAGES_OF_RANK", "N_MICROBATCHES", "MICROBATCH_SIZE", "SEQ_LEN")


def from_fsdp2(s: Snippet) -> UserSetup:
    shards = shared.calls(s, "fully_shard")
    for call in shards:
        shared.only(call, FULLY_SHARD_ARGS, "fully_shard")
    roots = [c for c in shards if not c.looped]  # the root: fully_shard(model) after the blocks' loop
    if not roots:
        raise PlannerError("fully_shard", "no fully_shard(model, ...) outside the blocks' loop: fsdp-plan check "
                                          "reads the root unit (embeddings, final norm, head) from it")
    root = roots[-1]
    experts = [c for c in shards if c.looped and c.arg_name() == "experts"]
    blocks = [c for c in shards if c.looped and c not in experts]
    unit = blocks[-1] if blocks else root
    reshard, group = _reshard(s, unit)
    dims = mesh_dims(s)
    pipeline = _pipeline(s, dims.get("pp", 1))
    offload = root.kwargs.get("offload_policy") is not None and not (
        isinstance(root.kwargs["offload_policy"], ast.Constant) and root.kwargs["offload_policy"].value is None)
    precision, reduce = shared.precision_of(*shared.dtype_kwargs(s, root.kwargs.get("mp_policy"), "mp_policy"),
                                          shared.stored_dtype(s), "mp_policy")
    wrappers = shared.calls(s, "checkpoint_wrapper")
    compiled, compile_loss = shared.compiles(s)
    float8, gather = shared.float8(s, fsdp2=True)
    mesh = _mesh_fields(s, dims)
    attention, attention_from = shared.attention(s)
    config = FsdpConfig(
        sharding=_sharding(dims, reshard or pipeline.get("pp", 1) > 1), precision=precision, reduce_dtype=reduce,
        offload=offload, ac_every=shared.checkpointing(s, wrappers, max((c.every for c in wrappers), default=0)),
        compile=compiled, compile_loss=compile_loss, float8=float8, fp8_all_gather=gather,
        reshard_after_forward=group, expert_units=bool(experts), expert_shard_dim=_placement(root),
        **mesh, **pipeline, **shared.liger(s), **attention)
    sizes = list(dims.values())
    # HSDP: the shard group as written; where dp_shard is left to the world size, a replica per machine
    group, machines = hsdp_fields(config.sharding, dims.get("dp_replicate") if _count(dims.get("dp_replicate"))
                                  else 2, dims.get("dp_shard"), config.cp, config.tp)
    config = replace(config, **group)
    return UserSetup(
        config=config, fsdp_version=2, source=s.source, dialect="fsdp2-code",
        explicit=frozenset(k for c in shards for k in c.kwargs), wrap="block" if blocks else "none",
        use_orig_params=True, **checkpoint_fields(s),  # every rank loads unless rank 0's weights are broadcast
        n_processes=math.prod(sizes) if all(isinstance(n, int) for n in sizes) else None,
        n_machines=machines if _count(dims.get("dp_replicate")) else None,
        use_cache=_use_cache(s), seq_len=s.constants.get("SEQ_LEN") if config.pp > 1 else None,
        grad_scaler=shared.grad_scaler(s), attention_from=attention_from,
        training=shared.optimizer(s, offload))


def _reshard(s: Snippet, unit) -> tuple[bool, int]:
    """(bool reshard_after_forward, the int group or 0) of the blocks' unit (fully_shard's default: True)."""
    node = unit.kwargs.get("reshard_after_forward")
    value = True if node is None else s.value(node, "reshard_after_forward")
    if isinstance(value, bool):
        return value, 0
    if isinstance(value, int) and value >= 2:
        return True, value
    raise PlannerError("reshard_after_forward", f"{value!r}: give True, False or a group of >= 2 ranks")


def mesh_dims(s: Snippet) -> dict:
    """{dim name: size (WORLD where the snippet leaves it to the world size)} of the data / model mesh."""
    meshes = [c for c in shared.calls(s, "init_device_mesh")
              if not (len(c.node.args) > 1 and dotted(c.node.args[1]) == "EP_MESH_SHAPE")]
    if not meshes:
        return {"dp_shard": WORLD}  # fully_shard's default mesh: every rank
    call = meshes[0]
    shape_node = call.node.args[1] if len(call.node.args) > 1 else call.kwargs.get("mesh_shape")
    if shape_node is None or "mesh_dim_names" not in call.kwargs:
        raise PlannerError("init_device_mesh", "give the mesh's shape and mesh_dim_names (torchtitan's names: "
                                               f"{', '.join(MESH_NAMES)})")
    shape = s.value(shape_node, "mesh_shape")
    names = s.value(call.kwargs["mesh_dim_names"], "mesh_dim_names")
    if not isinstance(shape, tuple) or not isinstance(names, tuple) or len(shape) != len(names):
        raise PlannerError("mesh_dim_names", f"{names!r} does not name each dimension of the mesh {shape!r}")
    for name, size in zip(names, shape):
        if name not in MESH_NAMES:
            raise PlannerError("mesh_dim_names", f"unknown dimension {name!r}; choose from: {', '.join(MESH_NAMES)}")
        if size != WORLD and not _count(size):
            raise PlannerError("mesh_shape", f"{name} {size!r}: give each dimension an integer >= 1")
    return dict(zip(names, shape))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _sharding(dims: dict, reshard: bool) -> Sharding:
    """The strategy of a mesh: replicas without a shard group: NO_SHARD; replicas of one: HYBRID (ZeRO-2 without
    resharding); one shard group: FULL_SHARD / SHARD_GRAD_OP (the torchtitan reader's rule)."""
    replicate, shard, cp = dims.get("dp_replicate", 1), dims.get("dp_shard", 1), dims.get("cp", 1)
    if replicate != 1 and shard == 1 and cp == 1:
        return Sharding.NO_SHARD
    if replicate != 1:
        return Sharding.HYBRID_SHARD if reshard else Sharding.HYBRID_SHARD_ZERO2
    return Sharding.FULL_SHARD if reshard else Sharding.SHARD_GRAD_OP


def _mesh_fields(s: Snippet, dims: dict) -> dict:
    """tp (sequence parallel: SequenceParallel in the plan; async TP: inductor's micro-pipeline switch), cp
    (context_parallel around the step), ep (EP_MESH_SHAPE's third dimension, experts whole)."""
    tp, cp = dims.get("tp", 1), dims.get("cp", 1)
    for degree, name, what in ((tp, "parallelize_module", "tp"), (cp, "context_parallel", "cp")):
        if (degree > 1) != shared.called(s, name):
            raise PlannerError(what, f"the mesh has {what} {degree} but the snippet "
                                     f"{'never calls' if degree > 1 else 'calls'} {name}: they must agree")
    ep_shape = s.constants.get("EP_MESH_SHAPE")
    if (ep_shape is not None) != shared.called(s, "apply_expert_parallelism"):
        raise PlannerError("ep", "expert parallelism needs both EP_MESH_SHAPE (dp_replicate, efsdp, ep, etp) and "
                                 "apply_expert_parallelism, as --emit fsdp2 writes them")
    if ep_shape is not None and (not isinstance(ep_shape, tuple) or len(ep_shape) != 4 or ep_shape[3] != 1
                                 or not all(_count(n) for n in ep_shape)):
        raise PlannerError("EP_MESH_SHAPE", f"{ep_shape!r}: give (dp_replicate, efsdp, ep, 1); expert tensor "
                                            "parallelism is not planned by fsdp-plan")
    for call in shared.calls(s, "apply_expert_parallelism"):  # transformers' token movement: its all-to-all
        how = call.kwargs.get("ep_implementation")
        if how is None or s.value(how, "ep_implementation") != "all_to_all":
            raise PlannerError("ep_implementation", "fsdp-plan reads transformers' expert parallel with "
                                                    "ep_implementation=\"all_to_all\" (moe_dispatch all-to-all)")
    micro_tp = s.attr_assigns.get("torch._inductor.config._micro_pipeline_tp")
    return {"tp": tp, "cp": cp, "ep": ep_shape[2] if ep_shape else 1,
            "sequence_parallel": shared.called(s, "SequenceParallel") or tp == 1,
            "async_tp": micro_tp is not None and s.value(micro_tp, "_micro_pipeline_tp") is True}


def _pipeline(s: Snippet, pp: int) -> dict:
    """pp, the schedule class, stages per rank, microbatch and microbatches (pipeline.py's constants)."""
    if pp == 1:
        return {}
    missing = [name for name in PIPELINE_CONSTANTS if name not in s.constants]
    if missing:
        raise PlannerError(missing[0], f"the mesh has pp {pp}: fsdp-plan check reads the pipeline from "
                                       f"{', '.join(PIPELINE_CONSTANTS)} as --emit fsdp2 writes them")
    schedules = [sc for sc in Schedule if shared.called(s, sc.torch_class)]
    if len(schedules) != 1:
        raise PlannerError("pp_schedule", "build one schedule of: " + ", ".join(sc.torch_class for sc in Schedule))
    for name in ("MICROBATCH_SIZE", "N_MICROBATCHES", "SEQ_LEN"):
        if not _count(s.constants[name]):
            raise PlannerError(name, f"{s.constants[name]!r}: give an integer >= 1")
    of_rank = s.constants["STAGES_OF_RANK"]
    if (not isinstance(of_rank, list) or not all(isinstance(r, list) for r in of_rank) or len(of_rank) != pp
            or len({len(stages) for stages in of_rank}) != 1):
        raise PlannerError("STAGES_OF_RANK", f"{of_rank!r}: give each of the {pp} pipeline ranks the same number "
                                             "of stages")
    _priced_split(s.constants["STAGE_BLOCKS"], of_rank, pp, schedules[0])
    return {"pp": pp, "pp_schedule": schedules[0], "pp_stages_per_rank": len(of_rank[0]),
            "micro_batch": s.constants["MICROBATCH_SIZE"], "grad_accum": s.constants["N_MICROBATCHES"]}


def _priced_split(blocks, of_rank: list, pp: int, schedule: Schedule) -> None:
    """STAGE_BLOCKS and STAGES_OF_RANK are the split the estimate prices (cost_models/pipeline.py: the blocks as even
    as they go, the end stages one fewer first; torch's loop or v placement), else one line."""
    pairs = blocks if isinstance(blocks, list) and all(isinstance(b, tuple) and len(b) == 2 for b in blocks) else None
    if pairs is None or [first for first, _ in pairs] != [sum(n for _, n in pairs[:i]) for i in range(len(pairs))]:
        raise PlannerError("STAGE_BLOCKS", f"{blocks!r}: give each stage's (first block, count), in order from 0")
    counts = tuple(n for _, n in pairs)
    even = blocks_per_stage(sum(counts), len(counts))
    if counts != even:
        raise PlannerError("STAGE_BLOCKS", f"{', '.join(map(str, counts))} blocks per stage is not the split "
                                           f"fsdp-plan prices ({', '.join(map(str, even))}); write that split")
    placed = [[i for i in range(len(counts)) if stage_rank(i, pp, schedule) == r] for r in range(pp)]
    if of_rank != placed:
        raise PlannerError("STAGES_OF_RANK", f"{of_rank!r}: {schedule.torch_class} places the stages as {placed!r}")


def _placement(root) -> int:
    """expert_shard_dim 1 when the kwargs carry fsdp_options' dim-1 shard_placement_fn (any shard group)."""
    node = root.kwargs.get("shard_placement_fn")
    if node is None:
        return 0
    ours = ast.unparse(ast.parse(fsdp_options.DIM1_PLACEMENT, mode="eval").body)
    if not isinstance(node, ast.Lambda) or re.sub(r"% \d+", "% d", ast.unparse(node.body)) != ours:
        raise PlannerError("shard_placement_fn", "fsdp-plan prices one placement: stacked experts on dim 1 where the "
                                                 f"group does not divide them ({fsdp_options.DIM1_PLACEMENT})")
    return 1


def _use_cache(s: Snippet) -> bool | None:
    node = s.attr_assigns.get("model.config.use_cache")
    return None if node is None else bool(s.value(node, "use_cache"))


# ---------------------------------------------------------------- FSDP1

def from_fsdp1(s: Snippet) -> UserSetup:
    wrappers = [c for c in shared.calls(s, "FullyShardedDataParallel") if c.arg_name() == "model"]
    if len(wrappers) != 1:
        raise PlannerError("FullyShardedDataParallel", "wrap the model once: FSDP(model, auto_wrap_policy=...) "
                                                       "(fsdp-plan check reads the units from the policy)")
    call = wrappers[0]
    shared.only(call, FSDP1_ARGS, "FullyShardedDataParallel")
    kw = {k: s.value(v, k) for k, v in call.kwargs.items() if k not in ("mixed_precision", "cpu_offload",
                                                                         "auto_wrap_policy", "device_id",
                                                                         "device_mesh")}
    precision, reduce = shared.precision_of(*shared.dtype_kwargs(s, call.kwargs.get("mixed_precision"),
                                                             "mixed_precision"), shared.stored_dtype(s),
                                          "mixed_precision")
    offload = shared.cpu_offload(s, call.kwargs.get("cpu_offload"))
    wrap, lora = _wrap_policy(call.kwargs.get("auto_wrap_policy"))
    saved = checkpoint_fields(s)  # its save and resume (FSDP1 loads by sync_module_states, read above)
    compiled, compile_loss = shared.compiles(s)
    float8, _ = shared.float8(s, fsdp2=False)
    attention, attention_from = shared.attention(s)
    config = FsdpConfig(
        sharding=_strategy("sharding_strategy", kw.get("sharding_strategy", "FULL_SHARD")), precision=precision,
        reduce_dtype=reduce, offload=offload,
        ac_every=shared.checkpointing(s, shared.calls(s, "checkpoint_wrapper"), _checkpointed_every(s)),
        backward_prefetch=shared.backward_prefetch(kw.get("backward_prefetch", "BackwardPrefetch.BACKWARD_PRE")),
        forward_prefetch=bool(kw.get("forward_prefetch", False)),
        limit_all_gathers=bool(kw.get("limit_all_gathers", True)), compile=compiled, compile_loss=compile_loss,
        float8=float8, **shared.liger(s), **attention)
    if "device_mesh" in call.kwargs:  # HYBRID_SHARD's (dp_replicate, dp_shard) init_device_mesh
        dims = mesh_dims(s)
        config = replace(config, **hsdp_fields(config.sharding, 2, dims.get("dp_shard"))[0])
    return UserSetup(
        config=config, fsdp_version=1, source=s.source, dialect="fsdp1-code", explicit=frozenset(call.kwargs),
        wrap=wrap, use_orig_params=bool(kw.get("use_orig_params", False)),
        adapter_units=AdapterUnits.CAST if lora else None,
        sync_module_states=bool(kw.get("sync_module_states", False)), use_cache=_use_cache(s),
        grad_scaler=shared.grad_scaler(s), attention_from=attention_from,
        training=shared.optimizer(s, offload) + ((("finetune", "lora"),) if lora else ()),
        **{k: saved[k] for k in ("state_dict_type", "save_state_dict_on_host", "resume_state_dict_on_host")})


def _wrap_policy(node) -> tuple[str, bool]:
    """(wrap, LoRA): ModuleWrapPolicy / a set of block classes: one unit per block; emit_fsdp1's
    CustomPolicy(lora_unit): blocks and each adapter; none: the root alone."""
    if node is None:
        return "none", False
    name = dotted(node.func) if isinstance(node, ast.Call) else None
    if name == "ModuleWrapPolicy" or isinstance(node, ast.Set):
        return "block", False
    if name == "CustomPolicy" and node.args and dotted(node.args[0]) == "lora_unit":
        return "block", True
    raise PlannerError("auto_wrap_policy", f"{ast.unparse(node)}: fsdp-plan check reads ModuleWrapPolicy({{Block}}) "
                                           "and --emit fsdp1's CustomPolicy(lora_unit)")


def _checkpointed_every(s: Snippet) -> int:
    """K of the set apply_activation_checkpointing's check_fn tests (`m in checkpointed`), 0 for every block."""
    for call in shared.calls(s, "apply_activation_checkpointing"):
        shared.only(call, ("checkpoint_wrapper_fn", "check_fn", "auto_wrap_policy"), "apply_activation_checkpointing")
        check = call.kwargs.get("check_fn")
        body = check.body if isinstance(check, ast.Lambda) else None
        if not (isinstance(body, ast.Compare) and isinstance(body.ops[0], ast.In)
                and isinstance(body.comparators[0], ast.Name) and body.comparators[0].id in s.every_of):
            raise PlannerError("check_fn", "fsdp-plan check reads check_fn=lambda m: m in <a set of blocks built "
                                           "with `if i % K == 0` or without a condition>")
        return s.every_of[body.comparators[0].id]
    return 0
