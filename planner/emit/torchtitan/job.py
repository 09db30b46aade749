"""The plan as torchtitan override flags, in the names of torchtitan 0.3 (the current release, September 2026)
or, behind --emit torchtitan-0.2, of torchtitan 0.2.

torchtitan 0.3 (checked against 0.3.0's own ConfigManager.parse_args, tests/unit/test_emit_mesh.py):
- the job is a Python config function, chosen with `--module llama3 --config llama3_8b`; `--section.option`
  flags override its fields (training.*, parallelism.*, compile.* keep 0.2's names);
- activation checkpointing is a component chosen by a subcommand, `activation-checkpoint:selective` (op
  level: matmuls, SDPA, max saved, every second matmul recomputed), `:full`, `:none` (`:memory-budget`
  needs compile); tyro takes it after every flag, so it is the file's last line. There is no every-K-th-block
  option any more: a plan that checkpoints one block in K is emitted as `:full`, with a note;
- async TP moved to compile.enable_async_tensor_parallel; parallelism.enable_sequence_parallel switches
  sequence parallel (the head stays vocab-sharded, loss parallel, either way);
- Float8 is a converter of the model spec, which is no flag (`model_spec` is suppressed on the command line):
  it takes a config function of one's own (written here as a comment), and 0.3's Float8LinearConverter has
  rowwise recipes only, without the FP8 all-gather; 0.2's --model.converters and --quantize.linear.float8.*
  are rejected.

planner/doctor/readers/torchtitan.py reads both spellings back (`fsdp-plan check`); tests round-trip them. Pipelines:
parallelism.pipeline_parallel_* and module_fqns_per_model_part in both (0.2's head is "output", 0.3's "lm_head";
0.2.2's own ConfigManager resolved the 0.2 form of a pp 4 interleaved plan: 8 parts, microbatch 2, by hand), and
0.3's training.disable_cuda_graphs, which 0.3 requires with PP.
"""

from __future__ import annotations

from cost_models import fsdp_options
from cost_models.mesh import mesh_of
from cost_models.pipeline import stages
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec

from planner.emit.common import (RESHARD_NOTE, _comment, _expert_notes, _fsdp1_only_notes, _summary, hsdp_note,
                                 launch_env, multi_node_note, torchrun_command)
from planner.errors import PlannerError
from planner.emit.optimizer import torchtitan_optimizer
from planner.emit.kernels import torchtitan_kernel_flags
from planner.emit.torchtitan.split import split_flags

TORCHTITAN_VERSIONS = {"0.3": "torchtitan 0.3 (0.3.0)", "0.2": "torchtitan 0.2 (0.2.0 - 0.2.2)"}
DEFAULT_VERSION = "0.3"
# fsdp-plan's presets -> torchtitan 0.3's --module / --config and the flavor that function builds
# (torchtitan/models/*/config_registry.py)
TORCHTITAN_CONFIGS = {
    "llama3-8b": ("llama3", "llama3_8b", "8B"), "llama3.1-8b": ("llama3", "llama3_8b", "8B"),
    "llama3-70b": ("llama3", "llama3_70b", "70B"), "llama3.1-70b": ("llama3", "llama3_70b", "70B"),
    "llama3.3-70b": ("llama3", "llama3_70b", "70B"),
    "llama3-405b": ("llama3", "llama3_405b", "405B"), "llama3.1-405b": ("llama3", "llama3_405b", "405B"),
    "qwen3-32b": ("qwen3", "qwen3_32b", "32B"), "qwen3-30b-a3b": ("qwen3", "qwen3_30b_a3b", "30B-A3B"),
    "deepseek-v3": ("deepseek_v3", "deepseek_v3_671b", "671B"),
    "gpt-oss-20b": ("gpt_oss", "gpt_oss_20b", "20b"), "gpt-oss-120b": ("gpt_oss", "gpt_oss_120b", "120b"),
}
# the other way (check without --model): the preset whose weights torchtitan's config function trains
PRESET_OF_CONFIG = {("llama3", "llama3_8b"): "llama3.1-8b", ("llama3", "llama3_70b"): "llama3.1-70b",
                    ("llama3", "llama3_405b"): "llama3.1-405b", ("qwen3", "qwen3_32b"): "qwen3-32b",
                    ("qwen3", "qwen3_30b_a3b"): "qwen3-30b-a3b", ("deepseek_v3", "deepseek_v3_671b"): "deepseek-v3",
                    ("gpt_oss", "gpt_oss_20b"): "gpt-oss-20b", ("gpt_oss", "gpt_oss_120b"): "gpt-oss-120b"}
FLOAT8_MODULE = "fsdp_plan_float8"  # the module name the 0.3 Float8 config function is saved under
# Checkpoints the way the torchtitan trainers are priced (planner/trainers/table.py: save dcp, load meta-dcp;
# cost_models/outside_step.py): each rank writes its shard with DCP, synchronously. The same [checkpoint] names in
# 0.2 (config/job_config.py Checkpoint) and 0.3 (components/checkpointer/dcp.py CheckpointManager.Config).
CHECKPOINT_FLAGS = [
    ("checkpoint.enable", True, "checkpoints: each rank saves its shard with DCP, as priced; to start from pretrained "
     "weights add --checkpoint.initial_load_path=<HF dir> --checkpoint.initial_load_in_hf (read into the meta-built, "
     "sharded model: each rank its slice)"),
    ("checkpoint.folder", "checkpoint", ""),
    ("checkpoint.interval", 500, "steps between saves"),
    ("checkpoint.async_mode", "disabled", "synchronous DCP, as priced (async modes stage a host copy of the shard)"),
]


def _version(version: str) -> str:
    if version not in TORCHTITAN_VERSIONS:
        raise PlannerError("torchtitan_version", f"{version!r}; choose one of: {', '.join(TORCHTITAN_VERSIONS)}")
    return version


def module_and_config(model_spec: ModelSpec | None) -> tuple[str, str] | None:
    """torchtitan 0.3's (--module, --config) for the model, None when torchtitan has no config for it."""
    known = TORCHTITAN_CONFIGS.get(model_spec.name) if model_spec is not None else None
    return known[:2] if known else None


def preset_of(module: str | None, function: str | None) -> str | None:
    """The fsdp-plan preset torchtitan 0.3's --module / --config trains (Float8's own function: its base's)."""
    if function and module == FLOAT8_MODULE:
        function = function.removesuffix("_float8")
        module = next((m for (m, f) in PRESET_OF_CONFIG if f == function), None)
    return PRESET_OF_CONFIG.get((module, (function or "").removesuffix("_float8")))


def _refusal(config: FsdpConfig, version: str) -> None:
    if config.precision is Precision.FP16:
        raise PlannerError("emit", "torchtitan has no fp16 mixed precision (training.mixed_precision_param: bfloat16 | "
                                   "float32); plan with --precision bf16 or fp32, or use --emit fsdp2")
    if version == "0.2" and config.tp > 1 and not config.sequence_parallel:
        raise PlannerError("sequence_parallel", "torchtitan 0.2 always runs sequence parallel with TP (it has no "
                                                "switch); plan with sequence parallel, or use --emit torchtitan (0.3: "
                                                "parallelism.enable_sequence_parallel)")


def _flag(name: str, value) -> str:
    """torchtitan's (tyro) flag form: --section.option=value; a boolean is --section.option / --section.no-option;
    a subcommand (value None) is its own word; a list of lists of names (module_fqns_per_model_part) one word per
    inner list, its names joined by commas (tyro's form: `--x a,b c` is [["a", "b"], ["c"]])."""
    if value is None:
        return name
    if isinstance(value, list):
        return " ".join([f"--{name}", *(",".join(names) for names in value)])
    if isinstance(value, bool):
        section, _, option = name.rpartition(".")
        return f"--{name}" if value else f"--{section}.no-{option}"
    return f"--{name}={value}"


def _checkpointing(config: FsdpConfig, version: str) -> tuple[list, list[str]]:
    """(flags, notes) of the plan's activation checkpointing."""
    if version == "0.2":
        if config.selective_op_ac:
            return [("activation_checkpoint.mode", "selective", ""),
                    ("activation_checkpoint.selective_ac_option", "op", "op-level: the plan's selective-op")], []
        if config.ac_every > 1:
            return [("activation_checkpoint.mode", "selective", ""),
                    ("activation_checkpoint.selective_ac_option", config.ac_every,
                     f"one block in {config.ac_every} (torchtitan counts from 1: blocks {config.ac_every - 1}, "
                     f"{2 * config.ac_every - 1}, ...)")], []
        return [("activation_checkpoint.mode", "full" if config.ac_every else "none", "")], []
    if config.selective_op_ac:
        return [("activation-checkpoint:selective", None, "op-level (matmuls, SDPA, max saved; every second matmul "
                 "recomputed): the plan's selective-op; a subcommand, so it comes after every flag")], []
    if config.ac_every > 1:
        return [("activation-checkpoint:full", None, "every block (a subcommand, after every flag)")], [
            f"the plan checkpoints one block in {config.ac_every}; torchtitan 0.3 has no every-K-th-block option "
            "(selective is per op), so every block is checkpointed whole: more recompute, less memory than "
            "planned (--emit torchtitan-0.2 has selective_ac_option K)"]
    if config.ac_every:
        return [("activation-checkpoint:full", None, "every block recomputed whole (a subcommand, after every flag)")], []
    return [("activation-checkpoint:none", None, "no activation checkpointing (a subcommand, after every flag)")], []


def _float8(config: FsdpConfig, model_spec: ModelSpec | None, version: str) -> tuple[list, list[str]]:
    """(flags, notes) of the plan's Float8 linears."""
    if not config.float8:
        return [], ["no Float8: leave float8 out of the model converters of the base config"]
    if version == "0.2":
        return [
            ("model.converters", "quantize.linear.float8", "torchao Float8 linears, tensorwise scaling"),
            ("quantize.linear.float8.filter_fqns", "output", "the head stays bf16, as planned (blocks only)"),
            ("quantize.linear.float8.enable_fsdp_float8_all_gather", config.fp8_all_gather,
             "FSDP2 all-gathers Float8 weights in FP8" if config.fp8_all_gather else ""),
            ("quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", config.fp8_all_gather,
             "one all-reduce of every scale after the optimizer step" if config.fp8_all_gather else ""),
        ], []
    module, function, flavor = TORCHTITAN_CONFIGS.get(getattr(model_spec, "name", None),
                                                      ("<module>", "<config>", "<flavor>"))
    compiled = "True" if config.compile else "False"
    notes = [
        "Float8 in 0.3 is a model converter of the config function, not a flag: save these lines as "
        f"{FLOAT8_MODULE}.py and launch with --module {FLOAT8_MODULE} --config {function}_float8:",
        "  from torchtitan.components.quantization import Float8LinearConverter",
        f"  from torchtitan.models.{module} import model_registry",
        f"  from torchtitan.models.{module}.config_registry import {function}",
        f"  def {function}_float8():",
        f"      config = {function}()",
        f"      config.model_spec = model_registry(\"{flavor}\", converters=[Float8LinearConverter.Config(",
        f"          filter_fqns=[\"lm_head\"], model_compile_enabled={compiled})])  # the head stays bf16",
        "      return config",
        "0.3's Float8LinearConverter scales rowwise (the plan priced tensorwise scaling: torchao's fastest)",
    ]
    if config.fp8_all_gather:
        notes.append("the plan all-gathers Float8 weights in FP8, which torchtitan 0.3 cannot (its Float8 recipes "
                     "are rowwise, gathered in bf16): more all-gather traffic than planned (--emit torchtitan-0.2 "
                     "or fsdp2 have it)")
    return [], notes


def module_fqns_per_model_part(model_spec: ModelSpec, config: FsdpConfig, version: str) -> list[list[str]]:
    """The plan's stages as torchtitan's module names (models/common/decoder.py: tok_embeddings, layers.<i>, norm,
    lm_head; 0.2's llama3: output), stage by stage in the model's order."""
    head = "lm_head" if version == "0.3" else "output"
    return [(["tok_embeddings"] if s.embedding else []) + [f"layers.{b}" for b in s.blocks]
            + (["norm", head] if s.head else []) for s in stages(model_spec, config)]


def _pipeline_flags(config: FsdpConfig, model_spec: ModelSpec | None, version: str) -> tuple[list, list[str]]:
    """(flags, notes) of pipeline parallelism: the degree always (a base config's own cannot stand); with pp > 1 the
    schedule, the microbatch size and the stage split, which torchtitan would otherwise make its own way (its
    first / last_stage_less_layers give the extra blocks to the first stages)."""
    flags = [("parallelism.pipeline_parallel_degree", config.pp,
              f"pipeline ranks (the outermost mesh dimension), {config.pp_stages} stages" if config.pp > 1 else "")]
    if config.pp == 1:
        return flags, []
    v = config.pp_stages_per_rank
    flags += [
        ("parallelism.pipeline_parallel_schedule", config.pp_schedule.torchtitan_name,
         f"torch's {config.pp_schedule.torch_class}" + (f", {v} stages per rank" if v > 1 else "")),
        ("parallelism.pipeline_parallel_microbatch_size", config.micro_batch,
         f"the local batch ({config.micro_batch * config.pp_microbatches} sequences) runs as {config.pp_microbatches} "
         "microbatches in one schedule step"),
    ]
    if model_spec is not None:
        split = stages(model_spec, config)
        said = "the plan's stages (" + "; ".join(s.describe() for s in split[:2]) + ("; ..." if len(split) > 2 else "") + ")"
        generated = split_flags(model_spec.n_layers, tuple(s.n_blocks for s in split), config.pp,
                                config.pp_schedule.looped)
        if generated is not None:  # torchtitan's own generator makes the split from two or three numbers
            flags += [(f"parallelism.{name}", value, said if i == 0 else "")
                      for i, (name, value) in enumerate(generated.items())]
        else:
            flags.append(("parallelism.module_fqns_per_model_part",
                          module_fqns_per_model_part(model_spec, config, version), said))
    if version == "0.3":
        flags.append(("training.disable_cuda_graphs", True, "torchtitan 0.3 refuses CUDA graphs with pipeline "
                                                            "parallelism (trainer.py _validate_cuda_graphs)"))
    notes = ["under PP torchtitan keeps each stage's blocks gathered from forward to backward "
             "(parallelize.py: reshard_after_forward = not pp_enabled), as the plan prices"]
    return flags, notes


def _mesh_flags(config: FsdpConfig, version: str) -> tuple[list, list[str]]:
    """(flags, notes) of tensor, context and expert parallelism (their degrees always, so a base config's own
    cannot stand)."""
    flags = [
        ("parallelism.tensor_parallel_degree", config.tp, "heads and MLP split over tp GPUs" if config.tp > 1 else ""),
        ("parallelism.context_parallel_degree", config.cp,
         "ring attention: each rank holds seq_len / cp tokens" if config.cp > 1 else ""),
        ("parallelism.expert_parallel_degree", config.ep,
         "experts split over ep ranks borrowed from dp_shard x cp x tp" if config.ep > 1 else ""),
    ]
    notes = []
    if config.tp > 1:
        async_name = ("compile.enable_async_tensor_parallel" if version == "0.3"
                      else "parallelism.enable_async_tensor_parallel")
        flags.append((async_name, config.async_tp, "TP collectives overlapped with the matmuls (compiled blocks)"
                      if config.async_tp else ""))
        if version == "0.3":
            flags.append(("parallelism.enable_sequence_parallel", config.sequence_parallel,
                          "norms and residuals on seq_len / tp tokens" if config.sequence_parallel else
                          "activations replicated between blocks, as planned (transformers' tp_plan)"))
            if not config.sequence_parallel:
                notes.append("without sequence parallel torchtitan keeps the head vocab-sharded (loss parallel); the "
                             "plan priced transformers' gathered logits (colwise_gather_output): less logits memory "
                             "than planned")
    return flags, notes


def torchtitan_overrides(config: FsdpConfig, cluster: ClusterSpec, seq_len: int, version: str = DEFAULT_VERSION,
                         model_spec: ModelSpec | None = None,
                         training: TrainingSpec | None = None) -> tuple[list, list[str]]:
    """((name, value, comment) flags, notes on what torchtitan cannot say) for the plan, in `version`'s names;
    in 0.3 the last entry is the activation-checkpoint subcommand (value None). The optimizer: `training`'s
    (planner/emit/optimizer.py)."""
    version = _version(version)
    _refusal(config, version)
    mesh = mesh_of(config, cluster)
    replicas, shard = mesh.dp_replicate, mesh.dp_shard
    reshard = fsdp_options.fully_shard_options(config)["reshard_after_forward"]
    flags = [
        ("parallelism.data_parallel_replicate_degree", replicas, hsdp_note(config) if replicas > 1 and
         shard > 1 else ("DDP: every rank a replica" if config.tp == 1 else "DDP: every TP group a replica")
         if shard == 1 and replicas > 1 and config.cp == 1 else ""),
        ("parallelism.data_parallel_shard_degree", shard, "the shard group" + (
            " (FSDP shards over dp_shard x cp)" if config.cp > 1 else "")),
        ("parallelism.fsdp_reshard_after_forward", "default" if reshard else "never", RESHARD_NOTE[reshard]),
    ]
    mesh_flags, notes = _mesh_flags(config, version)
    flags += mesh_flags
    pipeline_flags, pipeline_notes = _pipeline_flags(config, model_spec, version)
    flags += pipeline_flags
    notes += pipeline_notes
    # with PP the local batch is the microbatches of one schedule step, and there is no accumulation on top
    local = config.micro_batch * config.pp_microbatches
    flags += [
        ("training.local_batch_size", local, "the plan's micro-batch per data-parallel rank" if config.pp == 1 else
         f"sequences per data-parallel rank per step: {config.pp_microbatches} microbatches of {config.micro_batch}"),
        ("training.global_batch_size", local * mesh.data_parallel * (config.grad_accum if config.pp == 1 else 1),
         f"{config.grad_accum} gradient accumulation step(s)" if config.grad_accum > 1 and config.pp == 1 else ""),
        ("training.seq_len", seq_len, ""),
    ]
    if config.precision is Precision.BF16_PURE:
        flags.append(("training.dtype", "bfloat16", "bf16-pure: params, grads and optimizer state in bf16"))
    flags += [
        ("training.mixed_precision_param", "float32" if config.precision is Precision.FP32 else "bfloat16", ""),
        ("training.mixed_precision_reduce", "float32", "torchtitan's only choice"),
    ]
    if config.gradient_reduce_dtype != "fp32":
        notes.append(f"the plan reduces gradients in {config.gradient_reduce_dtype}; torchtitan reduces in float32 "
                     "(mixed_precision_reduce has no other value): twice the gradient traffic of the plan")
    flags.append(("training.enable_cpu_offload", config.offload,
                  "params, grads and optimizer step on CPU" if config.offload else ""))
    optimizer_flags, optimizer_notes = torchtitan_optimizer(training, version)
    flags += optimizer_flags + CHECKPOINT_FLAGS
    notes += optimizer_notes
    checkpointing, ac_notes = _checkpointing(config, version)
    notes += ac_notes
    flags.append(("compile.enable", config.compile, "torchtitan compiles each block" if config.compile else ""))
    if config.compile:
        flags.append(("compile.components", "model,loss" if config.compile_loss else "model",
                      "the blocks and the loss (fused cross-entropy: no fp32 copy of the logits)" if config.compile_loss
                      else "the blocks only: the loss stays eager, as planned"))
    kernel_flags, kernel_notes = torchtitan_kernel_flags(config, version)  # loss.num_chunks (planner/emit/kernels.py)
    flags, notes = flags + kernel_flags, notes + kernel_notes
    float8_flags, float8_notes = _float8(config, model_spec, version)
    flags += float8_flags
    notes += float8_notes
    return flags + checkpointing, notes  # 0.3: tyro takes the subcommand after every flag of the parent


def _config_function(config: FsdpConfig, model_spec: ModelSpec | None) -> list:
    """0.3's --module / --config flags: torchtitan's config function for the model (Float8: the one the notes
    write, saved as FLOAT8_MODULE)."""
    known = module_and_config(model_spec)
    module, function = known or ("YOUR_MODULE", "YOUR_CONFIG_FUNCTION")
    where = f"torchtitan/models/{module}/config_registry.py" if known else "your config function"
    if config.float8:
        module, function, where = FLOAT8_MODULE, f"{function}_float8", f"{FLOAT8_MODULE}.py, written above"
    return [("module", module, f"the config function: {where}"), ("config", function, "")]


def emit_torchtitan(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
                    training: TrainingSpec | None = None, script: str = "-m torchtitan.train",
                    version: str = DEFAULT_VERSION) -> str:
    """Override flags for a torchtitan run of the plan, one a line after the model's own config:
    0.3: `torchrun ... -m torchtitan.train --module M --config C $(grep -v '^#' FILE)`;
    0.2: `torchrun ... -m torchtitan.train --job.config_file MODEL.toml $(grep -v '^#' FILE)`."""
    from planner.emit.code import techniques as tech

    version = _version(version)
    if training is not None and training.finetune.value == "lora":
        raise PlannerError("emit", "torchtitan trains full models (no LoRA); use --emit hf-trainer or fsdp2")
    flags, notes = torchtitan_overrides(config, cluster, training.seq_len if training else 2048, version, model_spec,
                                        training)
    notes += tech.reshard_group_note(config, "fsdp_reshard_after_forward (default | always | never) cannot say")
    notes += _fsdp1_only_notes(config, "an FSDP1 dialect (--emit fsdp1)") + _expert_notes(config, "torchtitan")
    launch = torchrun_command(cluster, script, launch_env(config, cluster))  # run_train.sh's PYTORCH_CUDA_ALLOC_CONF
    if version == "0.3":
        header = [
            f"torchtitan overrides in {TORCHTITAN_VERSIONS[version]} names: the config function (--module, "
            "--config), then --section.option flags on its fields (booleans --option / --no-option), activation "
            "checkpointing a subcommand (last)",
            f"launch: {launch} $(grep -v '^#' <this file>)",
        ]
        if module_and_config(model_spec) is None:
            header.append(f"torchtitan 0.3 has no config function for {model_spec.name}: write one returning "
                          "Trainer.Config (torchtitan/models/*/config_registry.py shows how) and name it below")
        header.append("torchtitan 0.2 spells checkpointing --activation_checkpoint.mode and Float8 "
                      "--model.converters: --emit torchtitan-0.2")
        flags = _config_function(config, model_spec) + flags
    else:
        header = [
            f"torchtitan overrides in {TORCHTITAN_VERSIONS[version]} JobConfig names (TOML sections / "
            "--section.option flags); booleans are --option / --no-option flags",
            "0.1.0 spells compile training.compile and Float8 [float8] (converter \"float8\"); 0.3 (--emit "
            "torchtitan) chooses activation checkpointing by a subcommand and Float8 in the config function",
            f"launch: {launch} --job.config_file <the model's .toml> $(grep -v '^#' <this file>)",
        ]
    header = _summary(config, model_spec, cluster) + header + multi_node_note(cluster)
    # a flag's comment goes on the line above it: grep -v '^#' must leave flags only
    body = [line for name, value, note in flags for line in ([f"# {note}"] if note else []) + [_flag(name, value)]]
    return "\n".join([_comment(header + notes), *body]) + "\n"
