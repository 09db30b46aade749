"""The plan in the words of the trainers and schedulers people launch with: Hugging Face Trainer arguments
(transformers 5), torchtitan overrides (planner/emit/torchtitan/job.py), a Kubeflow PyTorchJob manifest.

Each says every planned setting the trainer can hold, and names in a comment what it cannot (never a silent
drop); a plan a trainer cannot run at all (fp16 under torchtitan) is refused with one PlannerError line.
planner/doctor/readers/trainers.py and torchtitan.py read the same dialects back (`fsdp-plan check`); tests round-trip them.
"""

from __future__ import annotations

import json
import re

from cost_models import fsdp_options
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec

from planner.emit.code import mesh as meshed
from planner.emit.code import techniques as tech
from planner.emit.common import (RDZV_PORT, _comment, _expert_notes, _fsdp1_only_notes, _fsdp1_strategy, _summary,
                          multi_node_note, reshard_entry, torchrun_args, torchrun_command)
from planner.errors import PlannerError

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
    launch = torchrun_command(cluster, script)
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
                         f"dp_shard_size={shard}),  # HSDP: shard inside a node, replicate across nodes")
    arguments += ["    fsdp=True,", "    fsdp_config={"]
    arguments += [f"        {json.dumps(key)}: {_py(value)},{'  # ' + note if note else ''}"
                  for key, value, note in _hf_fsdp_config(config, model_spec, cluster, version)]
    arguments += ["    },", ")"]
    notes = ([version_note] if version_note else []) + reduce_notes + _hf_technique_notes(config, version)
    notes += meshed.accelerate_notes(config)
    notes += _expert_notes(config, "fsdp_config")
    if version == 2:
        notes += _fsdp1_only_notes(config, "--emit hf-trainer-fsdp1")
    if training is not None and training.finetune.value == "lora":
        notes.append("LoRA: apply the adapters (get_peft_model) before Trainer(...); the Trainer wraps PEFT adapters "
                     "in FSDP units of their own by itself")
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
        *([_comment(notes)] if notes else []),
        _comment([f"launch (Trainer builds the accelerator from these arguments; `accelerate launch` works too): "
                  f"{launch}"] + multi_node_note(cluster)),
    ]) + "\n"


# ---------------------------------------------------------------- Kubeflow PyTorchJob

def _k8s_name(text: str) -> str:
    """A DNS-1123 label: lower case letters, digits and '-', at most 63 characters."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].rstrip("-") or "fsdp"


def emit_pytorchjob(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
                    script: str = "train.py", image: str = "your-registry/your-training-image:latest") -> str:
    """Kubeflow training operator PyTorchJob (kubeflow.org/v1): a Master pod and nodes - 1 Worker pods, each
    running the torchrun command of --emit torchrun with the node's GPUs requested."""
    import yaml

    name = _k8s_name(f"fsdp-{model_spec.name}")
    # Kubernetes expands $(VAR) in a container's command from its environment, where the operator puts MASTER_ADDR.
    args = [a.replace("$MASTER_ADDR", "$(MASTER_ADDR)") for a in torchrun_args(cluster, script)]

    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": {
            "containers": [{
                "name": "pytorch",  # the operator finds the training container by this name
                "image": image,
                "command": ["torchrun", *args],
                "ports": [{"name": "pytorchjob-port", "containerPort": RDZV_PORT}],
                "resources": {"limits": {"nvidia.com/gpu": cluster.gpus_per_node}},
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        }}}

    specs = {"Master": replica(1)}
    if cluster.n_nodes > 1:
        specs["Worker"] = replica(cluster.n_nodes - 1)
    manifest = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
                "spec": {"nprocPerNode": str(cluster.gpus_per_node), "pytorchReplicaSpecs": specs}}
    header = _summary(config, model_spec, cluster) + tech.launcher_notes(config) + meshed.launcher_mesh_note(config) + [
        f"kubectl apply -f <this file>; one pod per node ({cluster.n_nodes}), {cluster.gpus_per_node} GPU(s) each; "
        "replace the image with yours (it must hold the training script)",
        f"the operator sets MASTER_ADDR and MASTER_PORT (= the port named pytorchjob-port, {RDZV_PORT}), WORLD_SIZE "
        "and RANK; torchrun's c10d rendezvous uses MASTER_ADDR",
        "/dev/shm as a memory volume: NCCL and DataLoader workers need more than a pod's 64 MB default",
    ]
    return _comment(header) + "\n" + yaml.safe_dump(manifest, sort_keys=False, width=120)
