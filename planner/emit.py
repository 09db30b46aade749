"""Text artifacts for a chosen plan: FSDP1 and FSDP2 code, an accelerate config, a torchrun command (the trainers'
and schedulers' dialects - HF Trainer, torchtitan, PyTorchJob - are in planner/emit_trainers.py).

Pure strings (no torch import). Every choice mirrors calibration/apply.py, the code path we measure:
one FSDP unit per repeated block plus the root, mixed precision per Precision, activation checkpointing
on blocks 0, K, 2K, ... The code snippets define `apply_fsdp(model, device=None)` and look the block class
up by name, so they paste into any script that has built `model` and initialised the process group.
"""

from __future__ import annotations

from cost_models import fsdp_options, moe
from cost_models.mesh import mesh_of
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec

from . import emit_mesh as meshed
from .errors import PlannerError
from . import emit_techniques as tech

_ACCELERATE_MIXED = {Precision.FP32: "no", Precision.BF16: "bf16", Precision.FP16: "fp16", Precision.BF16_PURE: "no"}
RDZV_PORT = 29500
_YAML_WORDS = {"no", "yes", "on", "off", "true", "false", "null", "y", "n"}
# Why training turns a Hugging Face model's KV cache off (calibration.apply.disable_kv_cache does the same).
_KV_CACHE_WHY = ("no KV cache in training: left on (HF's default), each checkpointed recompute appends to it "
                 "until backward ends")


# ---------------------------------------------------------------- shared helpers

# FSDP2's reshard_after_forward in words, for the comment beside it
RESHARD_NOTE = {True: "free gathered params after forward (ZeRO-3)", False: "keep them for backward (ZeRO-2)"}


def reshard_entry(config: FsdpConfig, key: str) -> tuple[str, bool, str]:
    """FSDP2's reshard_after_forward for the plan as a (key, value, comment) config entry."""
    reshard = fsdp_options.fully_shard_options(config)["reshard_after_forward"]
    return key, reshard, RESHARD_NOTE[reshard]


def _summary(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """Comment lines naming the plan: model, cluster, every knob, and the batch it assumes."""
    offload = "params+grads on CPU, optimizer step on CPU" if config.offload else "none"
    return [
        f"FSDP plan for {model_spec.name} on {cluster.n_gpus} x {cluster.gpu.name} "
        f"({cluster.n_nodes} node(s) x {cluster.gpus_per_node})",
        f"sharding {config.sharding.value}, precision {config.precision.value}"
        f"{f' (gradients reduced in {config.reduce_dtype})' if config.reduce_dtype else ''}, offload {offload}, "
        f"activation checkpointing {config.activation_checkpointing}, attention {config.attention.value}",
        f"micro-batch {config.micro_batch} per GPU, gradient accumulation {config.grad_accum}" if config.pp == 1 else
        f"pipeline microbatch {config.micro_batch}, {config.pp_microbatches} microbatches per schedule step",
        *tech.summary_line(config),
        *mesh_summary(config, cluster),
    ]


def mesh_summary(config: FsdpConfig, cluster: ClusterSpec) -> list[str]:
    """The plan's device mesh in one line (none for data parallelism alone, so those plans emit as before)."""
    if config.tp == config.cp == config.ep == config.pp == 1:
        return []
    mesh = mesh_of(config, cluster)
    dims = " x ".join(f"{name} {size}" for name, size in mesh.used_dims())
    experts = f"; experts on efsdp {mesh.efsdp} x ep {mesh.ep}" if mesh.ep > 1 else ""
    tp = ("" if config.tp == 1 else ", TP with sequence parallel and loss parallel (torchtitan's)"
          if config.sequence_parallel else ", TP as transformers' tp_plan (no sequence parallel)")
    return [f"mesh {mesh.describe()}: {dims}{experts}{tp}"]


def _comment(lines: list[str]) -> str:
    return "\n".join(f"# {line}" for line in lines)


def _mixed_dtypes(config: FsdpConfig) -> tuple[str, str] | None:
    """(param_dtype, reduce_dtype) as torch expressions ("None" for a parameter dtype FSDP leaves alone), or
    None when FSDP must not cast (fp32, bf16-pure, without a reduce_dtype of their own)."""
    names = fsdp_options.mixed_precision_dtypes(config.precision, config.reduce_dtype)
    if names is None:
        return None
    param = names["param_dtype"]
    return ("None" if param is None else f"torch.{param}"), f"torch.{names['reduce_dtype']}"


def _fsdp1_strategy(config: FsdpConfig, cluster: ClusterSpec) -> tuple[str, str]:
    return fsdp_options.fsdp1_strategy(config, cluster.gpus_per_node)


def _preamble(config: FsdpConfig, blocks_var: str, blocks_expr: str) -> list[str]:
    """Body lines shared by both snippets: find the blocks (fail loudly on a wrong name), cast for bf16-pure."""
    lines = [f"{blocks_var} = {blocks_expr}",
             f"if not {blocks_var}:",
             "    raise ValueError(f\"no {BLOCK_CLASS} in the model: check the block class name\")",
             f"# {_KV_CACHE_WHY[0].upper()}{_KV_CACHE_WHY[1:]}",
             "if hasattr(getattr(model, \"config\", None), \"use_cache\"):  # a Hugging Face model",
             "    model.config.use_cache = False"]
    if config.precision is Precision.BF16_PURE:
        lines.append("model.to(torch.bfloat16)  # bf16-pure: params, grads, optimizer state and reductions in bf16")
    return lines


def _notes(config: FsdpConfig, training: TrainingSpec | None = None) -> list[str]:
    """Caveats that change the training loop rather than the wrapping."""
    notes = []
    if config.precision is Precision.FP16:
        notes.append("fp16 gradients underflow without loss scaling: use torch.distributed.fsdp.sharded_grad_scaler."
                     "ShardedGradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()). "
                     "bf16 needs no scaler.")
    if config.offload:
        notes.append("offload: create the optimizer after wrapping; its step runs on the CPU (often the "
                     "bottleneck), and CPU RAM per node must hold the params, grads and optimizer state.")
    if training is not None and training.finetune.value == "lora":
        notes.append("LoRA: apply the adapters (get_peft_model) before wrapping; the plan counts the frozen base in "
                     "the compute dtype (from_pretrained(dtype=torch.bfloat16)) and peft's fp32 adapters. FSDP1 needs "
                     "the adapters in units of their own (the fsdp1 snippet's CustomPolicy; HF Trainer does it for "
                     "PEFT models; plain accelerate: auto_wrap_policy=peft.utils.other.fsdp_auto_wrap_policy(model)).")
    if config.loss_compiled:
        notes.append(tech.COMPILED_LOSS_NOTE)
    if config.expert_units:
        notes.append("expert units: the plan wraps each block's routed experts (the module holding the stacked expert "
                     "tensors) as an FSDP2 unit of its own before the block, as --emit fsdp2 writes; for FSDP1 or "
                     "accelerate add that module's class to the wrap policy's classes.")
    return notes


def _ac_every_clause(config: FsdpConfig) -> str:
    return "" if config.ac_every <= 1 else f" if i % {config.ac_every} == 0"  # selective-op: every block


def _wrapper_args(config: FsdpConfig, module: str) -> str:
    """checkpoint_wrapper's arguments for one block: non-reentrant, with the selective-op policy when planned."""
    policy = ", context_fn=selective_op_context" if config.selective_op_ac else ""
    return f"{module}, checkpoint_impl=CheckpointImpl.NO_REENTRANT{policy}"


def _wrapper_call(config: FsdpConfig, module: str) -> str:
    return f"checkpoint_wrapper({_wrapper_args(config, module)})"


# ---------------------------------------------------------------- artifacts

def emit_fsdp1(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
               training: TrainingSpec | None = None) -> str:
    """Python snippet wrapping a model with FSDP1 FullyShardedDataParallel.

    LoRA: the wrap policy also gives every trainable leaf (each adapter linear) its own unit, as
    calibration.apply's trainable_mixed does: FSDP1 flattens a unit into one flat parameter, which
    needs one dtype (a bf16 base and fp32 adapters cannot share it) and gets a gradient as a whole
    (frozen weights sharing it with adapters would get gradients too)."""
    meshed.refuse_mesh(config, "FSDP1 (FullyShardedDataParallel)", "--emit fsdp2 or torchtitan")
    lora = training is not None and training.finetune.value == "lora"
    strategy, strategy_note = _fsdp1_strategy(config, cluster)
    options = fsdp_options.fsdp1_mixed_precision(config.precision, lora, config.reduce_dtype)
    mixed = "None" if options is None else "MixedPrecision(" + ", ".join(
        f"{k}=torch.{v}" if k.endswith("_dtype") else f"{k}={v}" for k, v in options.items()) + ")"
    prefetch = "BackwardPrefetch.BACKWARD_PRE" if config.backward_prefetch else "None"
    imports = [
        "import torch",
        "from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy",
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP",
        "from torch.distributed.fsdp.wrap import CustomPolicy" if lora else "from torch.distributed.fsdp.wrap import ModuleWrapPolicy",
    ]
    ac = []
    if config.checkpoints:
        imports.append("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
                       "    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)")
        ac = [
            f"# Activation checkpointing ({config.activation_checkpointing}) inside each block's unit, non-reentrant.",
            f"checkpointed = {{block for i, block in enumerate(blocks){_ac_every_clause(config)}}}",
            "apply_activation_checkpointing(",
            "    model,",
            "    checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(",
            f"        {_wrapper_args(config, 'm')}),",
            "    check_fn=lambda m: m in checkpointed,",
            ")",
        ]
    imports += tech.imports(config)
    if config.compile:
        ac += ["# torch.compile each block in place, inside its unit (the checkpoint wrapper when there is one)",
               "for unit in model.modules():",
               "    inner = getattr(unit, \"_fsdp_wrapped_module\", None)",
               "    if unit is not model and getattr(inner, \"_checkpoint_wrapped_module\", inner) in blocks:",
               "        inner.compile()"]
    policy = "    auto_wrap_policy=ModuleWrapPolicy({type(blocks[0])}),  # one unit per block + the root"
    lora_unit = []
    if lora:
        policy = "    auto_wrap_policy=CustomPolicy(lora_unit),  # blocks, each adapter linear, the root"
        lora_unit = [
            "block_class = type(blocks[0])",
            "",
            "def lora_unit(m):  # a block, or a leaf whose weight trains: adapters apart from the frozen base",
            "    weight = getattr(m, \"weight\", None)",
            "    leaf = not list(m.children())",
            "    return isinstance(m, block_class) or (leaf and weight is not None and weight.requires_grad)",
            "",
        ]
    body = _preamble(config, "blocks", "[m for m in model.modules() if type(m).__name__ == BLOCK_CLASS]") + lora_unit + [
        *tech.float8_lines(config, "[n for n, m in model.named_modules() if type(m).__name__ == BLOCK_CLASS]",
                           fp8_all_gather=False),
        "if device is None:",
        "    device = torch.device(\"cuda\", torch.cuda.current_device())  # set from LOCAL_RANK beforehand",
        "model = FSDP(",
        "    model,",
        f"    sharding_strategy=ShardingStrategy.{strategy},{'  # ' + strategy_note if strategy_note else ''}",
        *([f"    mixed_precision={mixed},{'  # buffers keep fp32' if options else ''}"] if len(mixed) <= 72 else [
            "    mixed_precision=MixedPrecision(  # buffers keep fp32", f"        {mixed.removeprefix('MixedPrecision(')},"]),
        f"    cpu_offload={'CPUOffload(offload_params=True)' if config.offload else 'None'},"
        f"{'  # params and grads on CPU; there is no optimizer-only offload' if config.offload else ''}",
        f"    backward_prefetch={prefetch},",
        f"    forward_prefetch={config.forward_prefetch},"
        f"{'  # issues the next all-gather early: static graphs only' if config.forward_prefetch else ''}",
        f"    limit_all_gathers={config.limit_all_gathers},"
        "  # rate limiter (<= 2 all-gathers in flight), not message merging",
        policy,
        "    use_orig_params=True,  # needed for LoRA/frozen params and torch.compile",
        "    sync_module_states=False,  # every rank builds identical weights; True broadcasts rank 0's (more traffic)",
        "    device_id=device,",
        ")",
    ] + ac + ["return model"]
    return _render(config, model_spec, cluster, imports, body, training, tech.fsdp1_unexpressed(config))


def emit_fsdp2(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
               training: TrainingSpec | None = None) -> str:
    """Python snippet applying FSDP2 fully_shard torchtitan-style: each block, then the root; with a mesh, TP
    before it on the N-D DeviceMesh (planner/emit_mesh.py)."""
    meshed.refuse_fsdp2(config, model_spec)
    dtypes = _mixed_dtypes(config)
    imports = [
        "import torch",
        "import torch.distributed as dist",
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard",
    ]
    if config.checkpoints:
        imports.append("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
                       "    CheckpointImpl, checkpoint_wrapper)")
    imports += tech.imports(config)
    imports += (["import math"] if meshed.uses_mesh(config) else []) + meshed.fsdp2_imports(config)
    world = "dist.get_world_size()"
    layout = fsdp_options.mesh_layout(config, cluster.n_gpus, cluster.gpus_per_node)
    if meshed.uses_mesh(config):
        pass  # the N-D mesh: emit_mesh.fsdp2_mesh_lines
    elif len(layout["shape"]) == 1:
        mesh = (f"init_device_mesh(device_type, ({world},), mesh_dim_names=(\"dp_shard\",))",)
        mesh_note = "shard over all ranks"
    else:
        shard = layout["shape"][1]
        mesh = (f"init_device_mesh(device_type, ({world} // {shard}, {shard}),",
                "                        mesh_dim_names=(\"dp_replicate\", \"dp_shard\"))")
        mesh_note = ("NO_SHARD: shard groups of 1, every rank a replica (DDP)" if shard == 1
                     else "HSDP: shard inside a node, replicate across nodes")
    reshard = fsdp_options.fully_shard_options(config)["reshard_after_forward"]
    mp = "MixedPrecisionPolicy()" if dtypes is None else \
        f"MixedPrecisionPolicy(param_dtype={dtypes[0]}, reduce_dtype={dtypes[1]})"
    offload = ['fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type != "cpu")  '
               '# params, grads, optimizer step on CPU'] if config.offload else []
    loop = ["for i, name in enumerate(block_names):",
            "    parent_name, _, attr = name.rpartition(\".\")",
            "    parent = model.get_submodule(parent_name)",
            "    block = getattr(parent, attr)"]
    if config.checkpoints:
        wrap = [f"block = {_wrapper_call(config, 'block')}",
                "setattr(parent, attr, block)  # shard the wrapper: recompute stays inside the unit"]
        note = f"# activation checkpointing ({config.activation_checkpointing}), non-reentrant"
        if config.ac_every <= 1:
            loop += [f"    {note}"] + [f"    {line}" for line in wrap]
        else:
            loop += [f"    if i % {config.ac_every} == 0:  {note}"] + [f"        {line}" for line in wrap]
    if config.compile:
        loop += [f"    block.compile()  # {tech.COMPILE_NOTE}"]
    unit_kwargs = "block_kwargs" if config.reshard_after_forward else "fsdp_kwargs"
    if config.ep > 1:
        loop += meshed.expert_unit_lines(config, cluster, unit_kwargs)
    elif config.expert_units:
        loop += ["    # MoE: each routed-experts module (the stacked expert tensors) its own unit, inside the block's",
                 f"    for experts in [m for m in block.modules()",
                 f"                    if {fsdp_options.IS_EXPERTS_MODULE}]:",
                 f"        fully_shard(experts, **{unit_kwargs})"]
    loop += [f"    fully_shard(block, **{unit_kwargs})",
             "fully_shard(model, **fsdp_kwargs)  # root: embeddings, final norm, head"]
    block_kwargs = [
        f"# blocks: after forward keep params sharded over groups of {config.reshard_after_forward} ranks, so backward",
        "# all-gathers inside a group only (the root keeps its own: FSDP2 holds the root for backward)",
        f"block_kwargs = {{**fsdp_kwargs, \"reshard_after_forward\": {config.reshard_after_forward}}}",
    ] if config.reshard_after_forward else []
    if meshed.uses_mesh(config):
        mesh_lines, dp_mesh = meshed.fsdp2_mesh_lines(config, cluster)
    else:
        mesh_lines, dp_mesh = [f"# {mesh_note}", f"mesh = {mesh[0]}", *mesh[1:]], "mesh"
    body = _preamble(config, "block_names",
                     "[n for n, m in model.named_modules() if type(m).__name__ == BLOCK_CLASS]") + [
        "device_type = \"cuda\" if device is None else torch.device(device).type",
        *mesh_lines,
        *meshed.fsdp2_tp_lines(config, model_spec.tied_embeddings),
        *meshed.fsdp2_ep_lines(config),
        "fsdp_kwargs = dict(",
        f"    mesh={dp_mesh},",
        f"    reshard_after_forward={reshard},  # "
        + RESHARD_NOTE[reshard],
        f"    mp_policy={mp},",
        ")",
        *offload,
        *block_kwargs,
        *_moe_padding_fix(config, model_spec, cluster),
        *tech.float8_lines(config, "block_names", fp8_all_gather=config.fp8_all_gather),
    ] + loop + ["return model"]
    return _render(config, model_spec, cluster, imports, body, training,
                   ([tech.PRECOMPUTE_NOTE] if config.fp8_all_gather else [])
                   + meshed.fsdp2_notes(config, model_spec, cluster),
                   meshed.fsdp2_module_level(config, cluster, model_spec, training))


def _moe_padding_fix(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """MoE: the shard_placement_fn that shards stacked expert matrices on dim 1 (fsdp_options.DIM1_PLACEMENT):
    set when the plan chose it (expert_shard_dim=1); a comment to enable knowingly when the plan priced
    FSDP2's dim-0 padding instead (cost_models/moe.py)."""
    if model_spec.moe is None:
        return []
    d = config.shard_group_size(cluster)
    placement = fsdp_options.DIM1_PLACEMENT.replace("% d", f"% {d}")
    lines = ["from torch.distributed.tensor import Shard",
             f"fsdp_kwargs[\"shard_placement_fn\"] = lambda p: (",
             f"    {placement})"]
    e = model_spec.moe.n_experts
    if config.expert_shard_dim:
        return [f"# MoE: {e} experts on a shard group of {d}: stacked experts sharded on dim 1 (no padding on dim 0)",
                *lines]
    if moe.padding_factor(model_spec, d) <= 1:
        return []
    return [f"# MoE: {e} experts on a shard group of {d}: FSDP2 shards the stacked expert tensors on dim 0 and",
            f"# pads them to {moe.rows_per_rank(e, d) * d} rows ({moe.padding_factor(model_spec, d):.1f}x gathered; "
            "this plan priced it). To shard them on dim 1 instead",
            f"# (even shards needed: dim 1 % {d} == 0), uncomment; the gathered size drops to the real one:",
            *(f"# {line}" for line in lines)]


def _render(config, model_spec, cluster, imports: list[str], body: list[str],
            training: TrainingSpec | None = None, extra_notes: list[str] = (), module_level: list[str] = ()) -> str:
    notes = _notes(config, training) + list(extra_notes)
    lines = [
        _comment(_summary(config, model_spec, cluster)),
        *imports,
        "",
        f"BLOCK_CLASS = {model_spec.block_class!r}  # the repeated block: one FSDP unit each",
        "",
        *tech.module_level(config),
        *module_level,
        "",
        "def apply_fsdp(model, device=None):",
        *(f"    {line}" if line else "" for line in body),
        *([""] + [_comment(notes)] if notes else []),
    ]
    if meshed.uses_mesh(config):  # the mesh snippets: every line at most 100 characters
        lines = meshed.fit_lines(lines)
    return "\n".join(lines) + "\n"


def emit_accelerate(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
                    training: TrainingSpec | None = None, fsdp_version: int = 1) -> str:
    """accelerate (1.x) config YAML, FSDP1 or FSDP2 form, loadable by `accelerate launch --config_file`; a mesh
    (FSDP2 only) as accelerate's parallelism_config (emit_mesh.accelerate_mesh)."""
    if fsdp_version == 1:
        meshed.refuse_mesh(config, "accelerate's FSDP1 config", "--emit accelerate-fsdp2 (ParallelismConfig)")
    mesh = meshed.accelerate_mesh(config, cluster, "accelerate")
    strategy, strategy_note = _fsdp1_strategy(config, cluster)
    strategy = strategy.lstrip("_")  # accelerate names it HYBRID_SHARD_ZERO2
    mixed = "fp8" if config.float8 else _ACCELERATE_MIXED[config.precision]
    ac_note = ""
    if config.ac_every > 1:
        ac_note = (f"accelerate checkpoints every block (the plan: {config.activation_checkpointing}); "
                   "more recompute, less memory than planned")
    if fsdp_version == 2:
        sharding_keys = [reshard_entry(config, "fsdp_reshard_after_forward")]
        fsdp1_only = []
    else:
        sharding_keys = [
            ("fsdp_sharding_strategy", strategy, strategy_note),
            # accelerate 1.x reads the FSDP1 strategy from either key: keep both equal.
            ("fsdp_reshard_after_forward", strategy, "the same setting under its newer accelerate name"),
        ]
        fsdp1_only = [
            ("fsdp_backward_prefetch", "BACKWARD_PRE" if config.backward_prefetch else "NO_PREFETCH", ""),
            ("fsdp_forward_prefetch", config.forward_prefetch, "static graphs only" if config.forward_prefetch else ""),
            ("fsdp_use_orig_params", True, "needed for LoRA/frozen params and torch.compile"),
        ]
    fsdp = [
        ("fsdp_version", fsdp_version, ""),
        *sharding_keys,
        ("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "one unit per block + the root"),
        ("fsdp_transformer_layer_cls_to_wrap", model_spec.block_class, ""),
        *fsdp1_only,
        ("fsdp_offload_params", config.offload, "params+grads on CPU, optimizer step on CPU" if config.offload else ""),
        ("fsdp_cpu_ram_efficient_loading", True, "only rank 0 reads the checkpoint (transformers models)"),
        ("fsdp_sync_module_states", True, "required by the line above: broadcasts rank 0's weights once"),
        ("fsdp_state_dict_type", "SHARDED_STATE_DICT", "each rank saves its shard: no full gather on rank 0"),
        ("fsdp_activation_checkpointing", config.checkpoints, ac_note),
    ]
    top = [
        ("compute_environment", "LOCAL_MACHINE", ""),
        ("debug", False, ""),
        ("distributed_type", "FSDP", ""),
        ("downcast_bf16", "no", ""),
        ("enable_cpu_affinity", False, ""),
        ("fsdp_config", fsdp, ""),
        ("machine_rank", 0, "set 0..N-1 on each machine (or --machine_rank)" if cluster.n_nodes > 1 else ""),
        ("main_training_function", "main", ""),
        ("mixed_precision", mixed, _accelerate_precision_note(config)),
        ("num_machines", cluster.n_nodes, ""),
        ("num_processes", cluster.n_gpus, "all GPUs on all machines"),
        ("rdzv_backend", "static", ""),
        ("use_cpu", False, ""),
    ]
    if cluster.n_nodes > 1:
        top.insert(7, ("main_process_port", RDZV_PORT, ""))
    layout = fsdp_options.mesh_layout(config, cluster.n_gpus, cluster.gpus_per_node)
    if mesh is not None:
        top.insert(-2, ("parallelism_config", [
            ("parallelism_config_dp_replicate_size", mesh.dp_replicate, "replicas (HSDP across nodes)"
             if mesh.dp_replicate > 1 else ""),
            ("parallelism_config_dp_shard_size", mesh.dp_shard, "shard group (FSDP shards over dp_shard x cp)"),
            ("parallelism_config_tp_size", mesh.tp, "transformers' tp_plan" if mesh.tp > 1 else ""),
            ("parallelism_config_cp_size", mesh.cp, "ring attention over cp ranks" if mesh.cp > 1 else ""),
        ], ""))
    elif fsdp_version == 2 and len(layout["shape"]) == 2:
        top.insert(-2, ("parallelism_config", [
            ("parallelism_config_dp_replicate_size", layout["shape"][0], "replicas (HSDP across nodes)"),
            ("parallelism_config_dp_shard_size", layout["shape"][1], "shard group"),
        ], ""))
    top += tech.accelerate_dynamo(config) + tech.accelerate_fp8(config, fsdp_version)
    header = _summary(config, model_spec, cluster) + _notes(config, training) + tech.accelerate_unexpressed(
        config, fsdp_version) + meshed.accelerate_notes(config)
    if cluster.n_nodes > 1:
        header.append("multi-node: pass --main_process_ip <address of machine_rank 0> to accelerate launch")
    if config.limit_all_gathers is False:
        header.append("limit_all_gathers=False is not a config key: set it on FullyShardedDataParallelPlugin")
    if config.checkpoints:
        header.append(f"set model.config.use_cache = False in your training loop (HF Trainer does: "
                      f"TrainingArguments.use_cache defaults to False); {_KV_CACHE_WHY}")
    if config.grad_accum > 1:
        header.append(f"gradient accumulation is not a config key: Accelerator(gradient_accumulation_steps="
                      f"{config.grad_accum})")
    if config.expert_shard_dim:
        header.append("the plan shards stacked MoE experts on dim 1 (fully_shard's shard_placement_fn), which this config "
                      "cannot set: FSDP2 through accelerate pads them on dim 0 (use --emit fsdp2); FSDP1 flattens each "
                      "unit and does not pad per expert")
    return _comment(header) + "\n" + "\n".join(_yaml(top)) + "\n"


def _accelerate_precision_note(config: FsdpConfig) -> str:
    precision, reduce = config.precision, config.gradient_reduce_dtype
    if precision is Precision.BF16:
        if reduce == "bf16":
            return "accelerate reduces grads in bf16, as planned"
        return ("accelerate reduces grads in bf16; for the planned fp32 reduction pass FullyShardedDataParallelPlugin("
                "mixed_precision_policy={param_dtype: bf16, reduce_dtype: fp32, buffer_dtype: fp32})")
    if config.reduce_dtype and reduce != precision.reduce_dtype:
        return (f"the plan reduces grads in {reduce}, which this config cannot set: pass FullyShardedDataParallelPlugin("
                f"mixed_precision_policy={{reduce_dtype: {reduce}}})")
    if precision is Precision.BF16_PURE:
        return "bf16-pure: load the model in bf16 (dtype=torch.bfloat16); no autocast, no fp32 masters"
    if precision is Precision.FP16:
        return "accelerate adds the ShardedGradScaler itself"
    return ""


def _yaml(entries, indent: str = "") -> list[str]:
    """Render (key, value, comment) entries; a list value is a nested mapping. Values are plain scalars
    (names, numbers, booleans), so only YAML's boolean words need quoting."""
    lines = []
    for key, value, note in entries:
        if isinstance(value, list):
            lines.append(f"{indent}{key}:")
            lines.extend(_yaml(value, indent + "  "))
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if text.lower() in _YAML_WORDS and not isinstance(value, bool):
            text = f"'{text}'"  # YAML 1.1 reads a bare no/yes/on/off as a boolean
        lines.append(f"{indent}{key}: {text}" + (f"  # {note}" if note else ""))
    return lines


def torchrun_args(cluster: ClusterSpec, script: str = "train.py", *, nnodes: str | None = None,
                  endpoint: str = f"$MASTER_ADDR:{RDZV_PORT}", rdzv_id: str = "fsdp-plan") -> list[str]:
    """torchrun's arguments, one list for every launcher (torchrun, slurm, pytorchjob, hf-trainer): standalone on
    one node, else one c10d rendezvous at `endpoint` for `nnodes` nodes (default: the cluster's count)."""
    if nnodes is None and cluster.n_nodes == 1:
        return ["--standalone", "--nproc_per_node", str(cluster.gpus_per_node), script]
    return ["--nnodes", nnodes or str(cluster.n_nodes), "--nproc_per_node", str(cluster.gpus_per_node),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id, script]


def torchrun_command(cluster: ClusterSpec, script: str = "train.py") -> str:
    return " ".join(["torchrun", *torchrun_args(cluster, script)])


def multi_node_note(cluster: ClusterSpec) -> list[str]:
    if cluster.n_nodes == 1:
        return []
    return [f"run the same command on each of the {cluster.n_nodes} nodes; "
            "MASTER_ADDR = the address of any one of them"]


def emit_torchrun(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec, script: str = "train.py") -> str:
    """torchrun command line: standalone on one node, c10d rendezvous on $MASTER_ADDR across nodes."""
    header = (_summary(config, model_spec, cluster) + tech.launcher_notes(config) + meshed.launcher_mesh_note(config)
              + multi_node_note(cluster))
    return _comment(header) + "\n" + torchrun_command(cluster, script) + "\n"


# model_types whose modeling file lives under another module name (transformers' SPECIAL_MODEL_TYPE_TO_MODULE_NAME)
_HF_MODULES = {"gemma3_text": "gemma3"}


def _hf_module(model_type: str) -> str:
    return _HF_MODULES.get(model_type, model_type)


def emit_lightning(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec) -> str:
    """Lightning Trainer with FSDPStrategy (Lightning's FSDP1 integration), same choices as emit_fsdp1."""
    meshed.refuse_mesh(config, "Lightning's FSDPStrategy (FSDP1)", "--emit fsdp2 (in Lightning: ModelParallelStrategy "
                       "with that code in configure_model) or torchtitan")
    strategy, strategy_note = _fsdp1_strategy(config, cluster)
    dtypes = _mixed_dtypes(config)
    precision = {Precision.FP32: "32-true", Precision.BF16: "bf16-mixed", Precision.FP16: "16-mixed",
                 Precision.BF16_PURE: "bf16-true"}[config.precision]
    lines = [
        _comment(_summary(config, model_spec, cluster)),
        "import torch",
        "from lightning.pytorch import Trainer",
        "from lightning.pytorch.strategies import FSDPStrategy",
        "from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy",
        f"from transformers.models.{_hf_module(model_spec.family)} import modeling_{_hf_module(model_spec.family)} "
        "as modeling" if model_spec.family not in ("generic",) else "# import your block class here",
        "",
        f"Block = modeling.{model_spec.block_class}  # the repeated block: one FSDP unit each",
        "strategy = FSDPStrategy(",
        f"    sharding_strategy=ShardingStrategy.{strategy},{'  # ' + strategy_note if strategy_note else ''}",
        "    auto_wrap_policy={Block},",
        f"    activation_checkpointing_policy={'{Block}' if config.checkpoints else 'None'},"
        + (f"  # Lightning checkpoints every block (plan: {config.activation_checkpointing})" if config.ac_every > 1 else ""),
        f"    cpu_offload={'CPUOffload(offload_params=True)' if config.offload else 'False'},",
        f"    mixed_precision={'None' if dtypes is None else f'MixedPrecision(param_dtype={dtypes[0]}, reduce_dtype={dtypes[1]})'},",
        f"    backward_prefetch={'BackwardPrefetch.BACKWARD_PRE' if config.backward_prefetch else 'None'},",
        f"    forward_prefetch={config.forward_prefetch},",
        f"    limit_all_gathers={config.limit_all_gathers},  # rate limiter, not message merging",
        "    use_orig_params=True,",
        ")",
        f"trainer = Trainer(strategy=strategy, accelerator=\"gpu\", devices={cluster.gpus_per_node}, "
        f"num_nodes={cluster.n_nodes},",
        f"                  precision=\"{precision}\", accumulate_grad_batches={config.grad_accum})",
        f"# DataLoader batch_size={config.micro_batch} per GPU",
    ]
    if config.checkpoints:
        lines.append(f"# in the LightningModule: model.config.use_cache = False; {_KV_CACHE_WHY}")
    lines += [f"# {note}" for note in tech.lightning_unexpressed(config)]
    return "\n".join(lines) + "\n"


def emit_slurm(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec, script: str = "train.py") -> str:
    """sbatch script: one task per node, each running torchrun for that node's GPUs (c10d rendezvous)."""
    return "\n".join([
        "#!/bin/bash",
        _comment(_summary(config, model_spec, cluster) + tech.launcher_notes(config)
                 + meshed.launcher_mesh_note(config)),
        f"#SBATCH --job-name=fsdp-{model_spec.name}",
        f"#SBATCH --nodes={cluster.n_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={cluster.gpus_per_node}",
        "#SBATCH --exclusive",
        "set -euo pipefail",
        "head_node=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        " ".join(["srun torchrun", *torchrun_args(cluster, script, nnodes='"$SLURM_NNODES"',
                                                  endpoint=f'"$head_node:{RDZV_PORT}"', rdzv_id='"$SLURM_JOB_ID"')]),
    ]) + "\n"


# ---------------------------------------------------------------- for a planned candidate

ARTIFACTS = ("fsdp1", "fsdp2", "accelerate", "accelerate-fsdp2", "lightning", "hf-trainer", "hf-trainer-fsdp1",
             "torchtitan", "torchtitan-0.2", "torchrun", "slurm", "pytorchjob")


def emit_artifact(kind: str, candidate) -> str:
    """One of ARTIFACTS for a planner.api.Candidate, folded to 100 columns (planner/emit_format.py)."""
    from .emit_format import fold

    return fold(_emit_artifact(kind, candidate))


def _emit_artifact(kind: str, candidate) -> str:
    from . import emit_trainers as trainers  # it builds on this module's helpers

    config, spec, cluster = candidate.config, candidate.model, candidate.cluster
    if kind in ("hf-trainer", "hf-trainer-fsdp1"):
        version = 2 if kind == "hf-trainer" else 1
        return trainers.emit_hf_trainer(config, spec, cluster, candidate.training, fsdp_version=version)
    if kind in ("torchtitan", "torchtitan-0.2"):  # 0.3's names (the current release), or 0.2's
        return trainers.emit_torchtitan(config, spec, cluster, candidate.training,
                                        version="0.2" if kind == "torchtitan-0.2" else "0.3")
    if kind == "pytorchjob":
        return trainers.emit_pytorchjob(config, spec, cluster)
    if kind == "fsdp1":
        return emit_fsdp1(config, spec, cluster, candidate.training)
    if kind == "fsdp2":
        return emit_fsdp2(config, spec, cluster, candidate.training)
    if kind == "accelerate":
        return emit_accelerate(config, spec, cluster, candidate.training)
    if kind == "accelerate-fsdp2":
        return emit_accelerate(config, spec, cluster, candidate.training, fsdp_version=2)
    if kind == "lightning":
        return emit_lightning(config, spec, cluster)
    if kind == "torchrun":
        return emit_torchrun(config, spec, cluster)
    if kind == "slurm":
        return emit_slurm(config, spec, cluster)
    raise ValueError(f"emit: unknown artifact {kind!r}; choose one of: {', '.join(ARTIFACTS)}")


def recommendation_text(candidate) -> str:
    """The recommended config as FSDP2 code plus the launch line; the other dialects are one flag away. A plan the
    FSDP2 snippet cannot write (EP beside TP, pinned by the user) is given as torchtitan flags, saying why."""
    import textwrap

    from .emit_format import LINE_WIDTH, fold

    others = " | ".join(a for a in ARTIFACTS if a != "fsdp2")
    try:
        code = emit_fsdp2(candidate.config, candidate.model, candidate.cluster, candidate.training)
        head = f"Recommended config (FSDP2; --emit {others} for the other forms):"
    except PlannerError as exc:
        code = emit_artifact("torchtitan", candidate)
        head = f"Recommended config (torchtitan: the FSDP2 snippet cannot write it, {exc}):"
    launch = emit_torchrun(candidate.config, candidate.model, candidate.cluster)
    return "\n".join(textwrap.wrap(head, LINE_WIDTH, subsequent_indent="  ") + ["", fold(code), fold(launch)])
