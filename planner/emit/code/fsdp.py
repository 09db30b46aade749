"""FSDP1 and FSDP2 code snippets for a plan (dispatched by planner/emit/). Every choice mirrors
calibration/apply.py, the code path we measure: one FSDP unit per repeated block plus the root, mixed precision
per Precision, activation checkpointing on blocks 0, K, 2K, ... The snippets define `apply_fsdp(model,
device=None)` and look the block class up by name, so they paste into any script that has built `model` and
initialised the process group. Pure strings: no torch import.
"""

from __future__ import annotations

from cost_models import fsdp_options, moe
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec

from planner.emit import attention
from planner.emit.code.checkpoint import CHECKPOINT_IMPORTS, FSDP1_CHECKPOINT_IMPORTS, checkpoint_code
from planner.emit.code import mesh as meshed
from planner.emit.code import techniques as tech
from planner.emit.common import _KV_CACHE_WHY, RESHARD_NOTE, _comment, _fsdp1_strategy, _mixed_dtypes, _notes, _summary
from planner.emit.format import fit_lines
from planner.emit.optimizer import optimizer_lines
from planner.emit.kernels import code_liger_lines


def _preamble(config: FsdpConfig, blocks_var: str, blocks_expr: str) -> list[str]:
    """Body lines shared by both snippets: find the blocks (fail loudly on a wrong name), no KV cache, the planned
    attention (planner/emit/attention.py), cast for bf16-pure."""
    lines = [f"{blocks_var} = {blocks_expr}",
             f"if not {blocks_var}:",
             "    raise ValueError(f\"no {BLOCK_CLASS} in the model: check the block class name\")",
             f"# {_KV_CACHE_WHY[0].upper()}{_KV_CACHE_WHY[1:]}",
             "if hasattr(getattr(model, \"config\", None), \"use_cache\"):  # a Hugging Face model",
             "    model.config.use_cache = False",
             *attention.set_lines()]
    if config.precision is Precision.BF16_PURE:
        lines.append("model.to(torch.bfloat16)  # bf16-pure: params, grads, optimizer state and reductions in bf16")
    return lines


def _ac_every_clause(config: FsdpConfig) -> str:
    return "" if config.ac_every <= 1 else f" if i % {config.ac_every} == 0"  # selective-op: every block


def _wrapper_args(config: FsdpConfig, module: str) -> str:
    """checkpoint_wrapper's arguments for one block: non-reentrant, with the selective-op policy when planned."""
    policy = ", context_fn=selective_op_context" if config.selective_op_ac else ""
    return f"{module}, checkpoint_impl=CheckpointImpl.NO_REENTRANT{policy}"


def emit_fsdp1(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
               training: TrainingSpec | None = None) -> str:
    """Python snippet wrapping a model with FSDP1 FullyShardedDataParallel.

    LoRA: the wrap policy also gives every trainable leaf (each adapter linear) its own unit, as
    calibration.apply's trainable_mixed does: FSDP1 flattens a unit into one flat parameter, which
    needs one dtype (a bf16 base and fp32 adapters cannot share it) and gets a gradient as a whole
    (frozen weights sharing it with adapters would get gradients too)."""
    meshed.refuse_mesh(config, "FSDP1 (FullyShardedDataParallel)", "--emit fsdp2 or torchtitan")
    lora = training is not None and training.finetune.adapters  # LoRA and QLoRA: adapters on a frozen base
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
        *FSDP1_CHECKPOINT_IMPORTS,
    ]
    mesh = _fsdp1_mesh(config, cluster)
    if mesh:
        imports[1:1] = ["import torch.distributed as dist", "from torch.distributed.device_mesh import init_device_mesh"]
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
        *mesh,
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
        *(["    device_mesh=mesh,  # HYBRID_SHARD's replicate and shard groups"] if mesh else []),
        ")",
    ] + ac + ["return model"]
    return _render(config, model_spec, cluster, imports, body, training,
                   tech.fsdp1_unexpressed(config)) + checkpoint_code(load_pretrained=False, fsdp1=True)


def _fsdp1_mesh(config: FsdpConfig, cluster: ClusterSpec) -> list[str]:
    """HYBRID over a shard group other than a node (FSDP1 alone shards inside the node): its 2-D device_mesh."""
    if not (config.sharding.is_hybrid and config.shard_group_gpus):
        return []
    return _hsdp_mesh("\"cuda\"", fsdp_options.mesh_layout(config, cluster.n_gpus, cluster.gpus_per_node)["shape"][1])


def _hsdp_mesh(device: str, shard: int, note: str = "") -> list[str]:
    """The 2-D device mesh of HSDP (FSDP1's and FSDP2's): shard groups of `shard` ranks, replicas of each other."""
    return [f"# {note or f'HSDP: shard groups of {shard} ranks, the groups replicas of each other'}",
            f"mesh = init_device_mesh({device}, (dist.get_world_size() // {shard}, {shard}),",
            "                        mesh_dim_names=(\"dp_replicate\", \"dp_shard\"))"]


def emit_fsdp2(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
               training: TrainingSpec | None = None) -> str:
    """Python snippet applying FSDP2 fully_shard torchtitan-style: each block, then the root; with a mesh, TP
    before it on the N-D DeviceMesh (planner/emit/code/mesh.py)."""
    meshed.refuse_fsdp2(config, model_spec)
    dtypes = _mixed_dtypes(config)
    imports = [
        "import torch",
        "import torch.distributed as dist",
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard",
        *CHECKPOINT_IMPORTS,
    ]
    if config.checkpoints:
        imports.append("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
                       "    CheckpointImpl, checkpoint_wrapper)")
    imports += tech.imports(config)
    imports += (["import math"] if meshed.uses_mesh(config) else []) + meshed.fsdp2_imports(config)
    layout = fsdp_options.mesh_layout(config, cluster.n_gpus, cluster.gpus_per_node)
    if meshed.uses_mesh(config):
        mesh_lines, dp_mesh = meshed.fsdp2_mesh_lines(config, cluster)
    elif len(layout["shape"]) == 1:
        mesh_lines, dp_mesh = ["# shard over all ranks", "mesh = init_device_mesh(device_type, "
                               "(dist.get_world_size(),), mesh_dim_names=(\"dp_shard\",))"], "mesh"
    else:
        shard = layout["shape"][1]
        mesh_lines, dp_mesh = _hsdp_mesh("device_type", shard,
                                         "NO_SHARD: shard groups of 1, every rank a replica (DDP)" if shard == 1
                                         else "" if config.shard_group_gpus
                                         else "HSDP: shard inside a node, replicate across nodes"), "mesh"
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
        indent = 4 if config.ac_every <= 1 else 8
        one_line = f"block = checkpoint_wrapper({_wrapper_args(config, 'block')})"
        wrap = ([one_line] if indent + len(one_line) <= 100 else  # the selective-op policy: two lines
                ["block = checkpoint_wrapper(", f"    {_wrapper_args(config, 'block')})"])
        wrap += ["setattr(parent, attr, block)  # shard the wrapper: recompute stays inside the unit"]
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
                   meshed.fsdp2_module_level(config, cluster, model_spec, training)) + checkpoint_code()


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
    notes = _notes(config, training, model_spec) + list(extra_notes)
    lines = [
        _comment(_summary(config, model_spec, cluster)),
        *imports,
        "",
        f"BLOCK_CLASS = {model_spec.block_class!r}  # the repeated block: one FSDP unit each",
        attention.constant_line(config),
        "",
        *tech.module_level(config),
        *module_level,
        *code_liger_lines(config, model_spec.family),  # the plan's Liger kernels (planner/emit/kernels.py)
        "",
        "def apply_fsdp(model, device=None):",
        *(f"    {line}" if line else "" for line in body),
        *([""] + [_comment(notes)] if notes else []),
        "",
        "",
        *optimizer_lines(training),
    ]
    if meshed.uses_mesh(config):  # the mesh snippets: every line at most 100 characters
        lines = fit_lines(lines)
    return "\n".join(lines) + "\n"
