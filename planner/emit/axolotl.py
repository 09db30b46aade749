"""The plan as an axolotl 0.21 config YAML (`axolotl train config.yaml`): the fine-tuning (full, LoRA, QLoRA on a
bitsandbytes 4-bit base), the batch, precision, attention, optimizer and axolotl's FSDP2 keys. Validated by
axolotl's own pydantic model (validate_config) in tests/doctor/test_axolotl.py and read back by
planner/doctor/readers/axolotl.py (`fsdp-plan check config.yaml`) as the same plan.

Keys as axolotl 0.21.0 spells them (utils/schemas/): base_model (model.py); adapter lora | qlora, load_in_4bit,
lora_r / lora_alpha / lora_dropout / lora_target_modules or lora_target_linear (loaders/adapter.py: every linear
find_all_linear_names finds, the output layer left out) and bnb_config_kwargs, merged over its own
BitsAndBytesConfig (peft.py; loaders/model.py: nf4, double quantization, bf16 storage by default);
micro_batch_size, gradient_accumulation_steps, optimizer (training.py); sequence_len, bf16 / fp16,
attn_implementation, gradient_checkpointing, dp_replicate_size / dp_shard_size, fsdp_version and fsdp_config
(config.py, fsdp.py: offload_params, reshard_after_forward, auto_wrap_policy, transformer_layer_cls_to_wrap,
activation_checkpointing, cpu_ram_efficient_loading, state_dict_type). What the trainer cannot run is left out of
its search (planner/trainers/table.py); what is left is refused here in one PlannerError line.
"""

from __future__ import annotations

from cost_models.mesh import mesh_of
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Optimizer, Precision, TrainingSpec

from planner.emit import attention, optimizer, qlora
from planner.emit.common import (_comment, _summary, hsdp_note, hub_id, multi_node_note, reshard_entry, torchrun_command,
                                 launch_env, yaml_lines)
from planner.errors import PlannerError

VERSION = "0.21.0"
# torch dtype names as bnb_config_kwargs takes them (transformers' BitsAndBytesConfig reads a string storage dtype)
STORAGE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "uint8": "uint8"}
DATASET = {"path": "tatsu-lab/alpaca", "type": "alpaca"}  # a stand-in: the plan prices sequence_len tokens each


def _refuse(config: FsdpConfig, training: TrainingSpec) -> None:
    refusals = [
        ("optimizer", training.optimizer is Optimizer.ADAMW_8BIT, "axolotl refuses bitsandbytes' 8-bit AdamW under "
         "FSDP2 (validation.py check_fsdp2_w_8bit_optimizer; its adamw_torch_8bit is torchao's, not priced): choose "
         "adamw, adam or sgd"),
        ("reduce_dtype", config.gradient_reduce_dtype != config.precision.reduce_dtype,
         f"axolotl reduces gradients in the precision's own dtype ({config.precision.reduce_dtype}), not "
         f"{config.gradient_reduce_dtype}: leave --reduce-dtype out"),
        ("quant", training.quantized and training.quant.value != "nf4", "axolotl stages a 4-bit base through the "
         "CPU as nf4 only (validation.py: \"CPU-staged NF4 requires bnb_4bit_quant_type: nf4\"): choose --quant nf4"),
        ("sharding", training.quantized and config.sharding.is_hybrid, "axolotl stages a 4-bit base through the "
         "CPU on a one-dimensional mesh only (validation.py: \"CPU-staged NF4 requires a one-dimensional sharding "
         "mesh\"): choose FULL_SHARD or SHARD_GRAD_OP"),
        ("precision", config.precision is Precision.BF16_PURE, "accelerate's FSDP2 upcasts axolotl's trainable "
         "params to fp32 under bf16 (no bf16-pure): choose bf16, fp16 or fp32"),
    ]
    for knob, refused, why in refusals:
        if refused:
            raise PlannerError(knob, why)


def _finetune(training: TrainingSpec, model: ModelSpec) -> list:
    """adapter, 4-bit loading and LoRA's keys (its targets: those priced, ModelSpec.lora_targets); nothing for full
    fine-tuning."""
    if not training.finetune.adapters:
        return []
    r = training.lora_rank
    entries = [("adapter", training.finetune.value, "LoRA on a 4-bit base" if training.quantized else "")]
    if training.quantized:
        entries.append(("load_in_4bit", True, "bitsandbytes"))
    dropout_note = "as priced: each adapter's dropout mask and output" if training.lora_dropout else ""
    entries += [("lora_r", r), ("lora_alpha", 2 * r), ("lora_dropout", training.lora_dropout, dropout_note),
                ("lora_target_linear", True, "every linear of the blocks, as priced") if model.lora_mlp else
                ("lora_target_modules", qlora.TARGET_MODULES, "the attention projections, as priced")]
    if training.quantized:  # over axolotl's own BitsAndBytesConfig (loaders/model.py): the plan's values
        entries.append(("bnb_config_kwargs", [
            ("bnb_4bit_quant_type", training.quant.value),
            ("bnb_4bit_use_double_quant", training.double_quant),
            ("bnb_4bit_quant_storage", STORAGE[training.quant_storage], "the compute dtype: FSDP gathers it with the "
                                                                        "rest"),
        ]))
    return entries


def _precision(config: FsdpConfig) -> list:
    if config.precision is Precision.BF16:
        return [("bf16", True, "loaded in bf16; accelerate upcasts the trainable params to fp32 masters")]
    if config.precision is Precision.FP16:  # bf16 off: its default, auto, is bf16 on a GPU that has it
        return [("bf16", False), ("fp16", True, "fp32 masters, gradient scaler")]
    return [("bf16", False, "fp32 throughout")]


def emit_axolotl(config: FsdpConfig, model: ModelSpec, cluster: ClusterSpec,
                 training: TrainingSpec | None = None) -> str:
    """The config YAML of the plan (module docstring)."""
    training = training or TrainingSpec()
    _refuse(config, training)
    mesh = mesh_of(config, cluster)
    optim, optim_args, optim_note = optimizer.hf_optim(training, config.offload)
    fsdp = [
        ("offload_params", config.offload, "params, grads, optimizer step on CPU" if config.offload else ""),
        reshard_entry(config, "reshard_after_forward"),
        ("auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "one unit per block + the root"),
        ("transformer_layer_cls_to_wrap", model.block_class),
        ("activation_checkpointing", config.checkpoints, "FSDP's own, every block" if config.checkpoints else ""),
        ("cpu_ram_efficient_loading", True, "rank 0 reads the weights, the others receive them"),
        ("state_dict_type", "SHARDED_STATE_DICT", "each rank saves its shard: no full gather on rank 0"),
    ]
    body = [
        ("base_model", hub_id(model)),
        *_finetune(training, model),
        ("datasets", (DATASET,), "a stand-in: your dataset"),
        ("sequence_len", training.seq_len),
        ("micro_batch_size", config.micro_batch, "the plan's micro-batch per GPU"),
        ("gradient_accumulation_steps", config.grad_accum),
        ("num_epochs", 1),
        ("learning_rate", 0.0002),
        ("optimizer", optim, optim_note),
        *([("optim_args", optim_args)] if optim_args else []),
        *_precision(config),
        ("attn_implementation", attention.hf_name(config), "the attention the plan priced"),
        ("gradient_checkpointing", False, "off: fsdp_config's activation_checkpointing is FSDP's own"),
        *([("dp_replicate_size", mesh.dp_replicate, hsdp_note(config)),
           ("dp_shard_size", mesh.dp_shard, "the shard group")] if mesh.dp_replicate > 1 else []),
        ("fsdp_version", 2),
        ("fsdp_config", fsdp),
        ("output_dir", "./outputs"),
    ]
    launch = torchrun_command(cluster, "-m axolotl.cli.train config.yaml", launch_env(config, cluster))
    head = [f"axolotl {VERSION} config, run with: {launch}", *multi_node_note(cluster),
            *_summary(config, model, cluster)]
    return _comment(head) + "\n" + "\n".join(yaml_lines(body)) + "\n"


__all__ = ["emit_axolotl", "VERSION"]
