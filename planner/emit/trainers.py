"""The plan in the words of the trainers people train with: Hugging Face Trainer arguments (transformers 5) and an
accelerate (1.x) config (Lightning's: planner/emit/lightning.py; torchtitan's: planner/emit/torchtitan/).

Each says every planned setting the trainer can hold, and names in a comment what it cannot (never a silent
drop); a plan a trainer cannot run at all is refused with one PlannerError line. planner/doctor/readers/ reads
the same dialects back (`fsdp-plan check`); tests round-trip them.
"""

from __future__ import annotations

import json

from cost_models import fsdp_options
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec

from planner.emit import attention, optimizer, qlora
from planner.emit.code import mesh as meshed
from planner.emit.code import techniques as tech
from planner.emit.kernels import hf_kernel_notes, hf_liger_arguments
from planner.emit.common import (_KV_CACHE_WHY, RDZV_PORT, _comment, hsdp_note, _expert_notes, _fsdp1_only_notes,
                                 _fsdp1_strategy, _notes, _summary, multi_node_note, reshard_entry, env_words,
                                 launch_env, torchrun_command)

_TORCH_DTYPE = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}
# transformers prefers FSDP's own checkpointing (fsdp_config) over its activation_checkpointing argument: that one
# (formerly gradient_checkpointing) checkpoints outside the FSDP units, and its recompute adds a redundant
# all-gather in backward (transformers' training_args.py, issue 30404).
HF_AC_NOTE = "TrainingArguments' activation_checkpointing (gradient_checkpointing) would add an all-gather in backward"


def _py(value) -> str:
    """A Python literal: True/False for booleans, JSON (double quotes) for strings, numbers and lists."""
    return repr(value) if isinstance(value, bool) else json.dumps(value)


def _shard_layout(config: FsdpConfig, cluster: ClusterSpec) -> tuple[int, int]:
    """(replicas, shard group): the FSDP2 / torchtitan mesh of the plan (fsdp_options.mesh_layout)."""
    shape = fsdp_options.mesh_layout(config, cluster.n_gpus, cluster.gpus_per_node)["shape"]
    return (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])


# ---------------------------------------------------------------- Hugging Face Trainer (transformers 5)

def _hf_version(config: FsdpConfig, cluster: ClusterSpec, fsdp_version: int) -> tuple[int, str]:
    """The FSDP version the snippet can use, and why it differs from the one asked for: accelerate's FSDP2 has no
    shard group of 1 (ParallelismConfig refuses dp_shard_size=1 with replicas: "use DDP"), so NO_SHARD is FSDP1."""
    if fsdp_version == 2 and _shard_layout(config, cluster)[1] == 1 and cluster.n_gpus > 1:
        return 1, ("FSDP1 (version 1): accelerate's FSDP2 refuses a shard group of 1 (NO_SHARD), and the Trainer "
                   "without fsdp would run DDP instead")
    return fsdp_version, ""


def _hf_fsdp_config(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec, version: int) -> list:
    """(key, value, comment) entries of TrainingArguments.fsdp_config, in transformers 5's names."""
    ac_note = "FSDP's own, inside each block's unit"
    if config.ac_every > 1 or config.selective_op_ac:
        ac_note = (f"whole blocks, every block (the plan: {config.activation_checkpointing}): more recompute, less "
                   "memory than planned")
    if version == 2:
        sharding = [reshard_entry(config, "reshard_after_forward")]
        fsdp1 = []
    else:
        strategy, note = _fsdp1_strategy(config, cluster)
        sharding = [("reshard_after_forward", strategy.lstrip("_").lower(),
                     "FSDP1 takes the sharding strategy under this key" + (f"; {note}" if note else ""))]
        fsdp1 = [
            ("backward_prefetch", "BACKWARD_PRE" if config.backward_prefetch else "NO_PREFETCH",
             "transformers' FSDP1 default is NO_PREFETCH" if config.backward_prefetch else ""),
            ("forward_prefetch", config.forward_prefetch, "static graphs only" if config.forward_prefetch else ""),
            ("limit_all_gathers", config.limit_all_gathers, "rate limiter (<= 2 all-gathers in flight)"),
            ("use_orig_params", True, "needed for LoRA/frozen params and torch.compile"),
            ("sync_module_states", True, "required by cpu_ram_efficient_loading: broadcasts rank 0's weights once"),
        ]
    return [
        ("version", version, "FSDP1 is deprecated in transformers 5" if version == 1 else ""),
        ("transformer_layer_cls_to_wrap", [model_spec.block_class], "one unit per block + the root"),
        *sharding,
        ("cpu_offload", config.offload, "params+grads on CPU, optimizer step on CPU" if config.offload else ""),
        ("activation_checkpointing", config.checkpoints, ac_note if config.checkpoints else ""),
        *fsdp1,
        ("cpu_ram_efficient_loading", True, "only rank 0 reads the checkpoint; the others receive it by broadcast"),
        ("state_dict_type", "SHARDED_STATE_DICT", "each rank saves its shard: no full gather on rank 0"),
    ]


def _hf_precision(config: FsdpConfig) -> list[str]:
    """The bf16 / fp16 arguments (as argument lines) for the plan's precision."""
    if config.precision is Precision.BF16:
        return ["    bf16=True,  # bf16 compute, fp32 master weights",
                "    # use_cpu=True,  # only to build these arguments without a GPU: bf16=True refuses there"]
    if config.precision is Precision.FP16:
        return ["    fp16=True,  # fp16 compute, fp32 master weights; accelerate adds the ShardedGradScaler itself"]
    if config.precision is Precision.BF16_PURE:
        return ["    bf16=False,  # bf16-pure: load the model in bf16 (from_pretrained(..., dtype=torch.bfloat16)); "
                "no autocast, no fp32 masters"]
    return ["    bf16=False,  # fp32 throughout"]


def _hf_reduce_policy(config: FsdpConfig, version: int) -> tuple[list[str], list[str]]:
    """(code lines, notes) for the gradient reduction dtype: accelerate's bf16/fp16 policy reduces in the compute
    dtype, so a planned fp32 reduction is set on the plugin arguments the Trainer builds FSDP from."""
    reduce, compute = config.gradient_reduce_dtype, config.precision.compute_dtype
    if not config.precision.mixed:
        if config.reduce_dtype and reduce != config.precision.reduce_dtype:
            return [], [f"the plan reduces gradients in {reduce}, which these arguments cannot set without mixed "
                        f"precision: reduce_dtype={_TORCH_DTYPE[reduce]} in a MixedPrecisionPolicy of your own"]
        return [], []
    if reduce == compute:
        return [], []
    third = ("output_dtype", _TORCH_DTYPE[compute]) if version == 2 else ("buffer_dtype", "torch.float32")
    return [f"# the plan reduces gradients in {reduce}; accelerate's {compute} policy would reduce them in {compute}:",
            "args.fsdp_plugin_args[\"mixed_precision_policy\"] = {",
            f"    \"param_dtype\": {_TORCH_DTYPE[compute]}, \"reduce_dtype\": {_TORCH_DTYPE[reduce]}, "
            f"\"{third[0]}\": {third[1]},",
            "}"], []


def optim_lines(training: TrainingSpec | None, offload: bool) -> list[str]:
    """TrainingArguments' optim (and optim_args) for the priced optimizer (planner/emit/optimizer.py)."""
    name, args, note = optimizer.hf_optim(training, offload)
    return [f"    optim={_py(name)},  # {note}"] + ([f"    optim_args={_py(args)},"] if args else [])


def _hf_technique_notes(config: FsdpConfig, version: int) -> list[str]:
    notes = []
    if config.float8:
        gather = (" with Float8LinearConfig(enable_fsdp_float8_all_gather=True), and call torchao.float8."
                  "precompute_float8_dynamic_scale_for_fsdp(model) after each optimizer step (a TrainerCallback's "
                  "on_optimizer_step)") if config.fp8_all_gather else ""
        notes.append("Float8 linears: TrainingArguments has no such setting; convert the blocks' linears with torchao "
                     f"before Trainer(...) (--emit fsdp2 writes convert_to_float8_training){gather}")
    return (notes + tech.fp8_all_gather_note(config, version, "--emit hf-trainer")
            + tech.reshard_group_note(config, "fsdp_config cannot set (a bool)"))


def emit_hf_trainer(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
                    training: TrainingSpec | None = None, fsdp_version: int = 2, script: str = "train.py") -> str:
    """transformers.TrainingArguments(...) in transformers 5's form: fsdp=True and every FSDP setting in
    fsdp_config (the strategy string "full_shard auto_wrap" is deprecated), and the launch line."""
    if fsdp_version == 1:
        meshed.refuse_mesh(config, "HF Trainer's FSDP1 (fsdp_config version 1)", "--emit hf-trainer "
                           "(FSDP2 with ParallelismConfig)")
    mesh = meshed.accelerate_mesh(config, cluster, "HF Trainer")
    version, version_note = _hf_version(config, cluster, fsdp_version)
    replicas, shard = _shard_layout(config, cluster)
    hsdp = version == 2 and replicas > 1
    reduce_lines, reduce_notes = _hf_reduce_policy(config, version)
    launch = torchrun_command(cluster, script, launch_env(config, cluster))
    if config.compile:
        launch = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=true " + launch
    loss_lines = tech.hf_compiled_loss_lines(config)
    imports = (["import torch"] if reduce_lines or loss_lines else []) + ["from transformers import TrainingArguments"]
    if hsdp or mesh is not None:
        imports.append("from accelerate import ParallelismConfig")
    arguments = [
        f"    per_device_train_batch_size={config.micro_batch},  # the plan's micro-batch per GPU",
        f"    gradient_accumulation_steps={config.grad_accum},",
        *_hf_precision(config),
        f"    activation_checkpointing=False,  # off: {HF_AC_NOTE}; fsdp_config's is FSDP's own",
        *optim_lines(training, config.offload),
    ]
    if config.compile:
        arguments.append("    torch_compile=True,  # each block compiled: ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION="
                         "true on the launch line (else the whole model)")
    if mesh is not None:
        arguments += [f"    # the plan's mesh: {mesh.describe()}",
                      f"    parallelism_config=ParallelismConfig(dp_replicate_size={mesh.dp_replicate}, "
                      f"dp_shard_size={mesh.dp_shard},",
                      f"                                         tp_size={mesh.tp}, cp_size={mesh.cp}),"]
    elif hsdp:
        arguments.append(f"    parallelism_config=ParallelismConfig(dp_replicate_size={replicas}, "
                         f"dp_shard_size={shard}),  # {hsdp_note(config)}")
    arguments += hf_liger_arguments(config)  # the plan's Liger kernels (planner/emit/kernels.py)
    arguments += ["    fsdp=True,", "    fsdp_config={"]
    arguments += [f"        {json.dumps(key)}: {_py(value)},{'  # ' + note if note else ''}"
                  for key, value, note in _hf_fsdp_config(config, model_spec, cluster, version)]
    arguments += ["    },", ")"]
    notes = ([version_note] if version_note else []) + reduce_notes + _hf_technique_notes(config, version)
    notes += meshed.accelerate_notes(config)
    notes += hf_kernel_notes(config)
    notes += _expert_notes(config, "fsdp_config")
    if version == 2:
        notes += _fsdp1_only_notes(config, "--emit hf-trainer-fsdp1")
    if training is not None and training.finetune.adapters:
        kwargs = qlora.priced_lora_kwargs_text(training, model_spec)
        notes.append(f"LoRA: apply the adapters (get_peft_model, LoraConfig({kwargs}): as priced) "
                     "before Trainer(...); the Trainer wraps PEFT adapters in FSDP units of their own by itself")
    if config.offload:
        notes.append("offload: the optimizer step runs on the CPU (often the bottleneck), and CPU RAM per node must "
                     "hold the params, grads and optimizer state")
    header = _summary(config, model_spec, cluster) + [
        "Hugging Face Trainer (transformers 5): fsdp=True with every FSDP setting in fsdp_config (the strategy string "
        "\"full_shard auto_wrap\" is deprecated)"]
    return "\n".join([
        _comment(header),
        *imports,
        "",
        "args = TrainingArguments(",
        *arguments,
        *reduce_lines,
        *loss_lines,
        *attention.hf_trainer_lines(config),
        *(qlora.python_lines(training, config, model_spec) if qlora.applies(training, model_spec) else []),
        *([_comment(notes)] if notes else []),
        _comment([f"launch (Trainer builds the accelerator from these arguments; `accelerate launch` works too): "
                  f"{launch}"] + multi_node_note(cluster)),
    ]) + "\n"


# ---------------------------------------------------------------- accelerate

_ACCELERATE_MIXED = {Precision.FP32: "no", Precision.BF16: "bf16", Precision.FP16: "fp16", Precision.BF16_PURE: "no"}
_YAML_WORDS = {"no", "yes", "on", "off", "true", "false", "null", "y", "n"}


def emit_accelerate(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
                    training: TrainingSpec | None = None, fsdp_version: int = 1) -> str:
    """accelerate (1.x) config YAML, FSDP1 or FSDP2 form, loadable by `accelerate launch --config_file`; a mesh
    (FSDP2 only) as accelerate's parallelism_config (mesh.accelerate_mesh)."""
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
            ("parallelism_config_dp_replicate_size", layout["shape"][0], hsdp_note(config)),
            ("parallelism_config_dp_shard_size", layout["shape"][1], "shard group"),
        ], ""))
    top += tech.accelerate_dynamo(config) + tech.accelerate_fp8(config, fsdp_version)
    header = _summary(config, model_spec, cluster) + [attention.yaml_comment(config)] + \
        _notes(config, training, model_spec) + \
        tech.accelerate_unexpressed(
        config, fsdp_version) + meshed.accelerate_notes(config) + [optimizer.script_note(training)]
    if qlora.applies(training, model_spec):
        header += qlora.yaml_notes(training, config, model_spec)
    env = launch_env(config, cluster, "accelerate")
    if env:   # no config key holds them (accelerate's ClusterConfig): the launch line does
        header.append(f"launch: {' '.join(env_words(env))} accelerate launch --config_file <this file> train.py")
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
