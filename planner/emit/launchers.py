"""The launchers' dialects of a plan (dispatched by planner/emit/): an accelerate (1.x) config, a Lightning
Trainer with FSDPStrategy, a torchrun command, a slurm sbatch script. Pure strings: no torch import.
"""

from __future__ import annotations

from cost_models import fsdp_options
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec

from planner.emit.code import mesh as meshed
from planner.emit.code import techniques as tech
from planner.emit.common import (_KV_CACHE_WHY, RDZV_PORT, _comment, _fsdp1_strategy, _mixed_dtypes, _notes, _summary,
                          multi_node_note, reshard_entry, torchrun_args, torchrun_command)

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
