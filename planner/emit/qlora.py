"""QLoRA's loading code as the HF Trainer / accelerate artifacts write it: transformers' BitsAndBytesConfig and
peft's LoraConfig, the values the plan priced (cost_models/qlora.py; the adapters' targets, ModelSpec.lora_targets),
checked by constructing both in tests/doctor/test_qlora_emit.py and read back by `fsdp-plan check`
(planner/doctor/readers/python_qlora.py).

Under FSDP the packed weights are stored in the compute dtype (bnb_4bit_quant_storage): FSDP flattens and gathers
each unit's parameters in one dtype, and with bitsandbytes' uint8 default FSDP2 trains with loss 0 and a NaN
gradient norm (accelerate issue 3983). The model loads in that dtype too (dtype=), so the unquantized layers match.
"""

from __future__ import annotations

from cost_models.specs import FsdpConfig, LoraTargets, ModelSpec, TrainingSpec

TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "uint8": "uint8"}
# the attention projections LoRA adapts (ModelSpec.lora_target_shapes: q, k, v, o) under transformers' names
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def target_modules(model_spec: ModelSpec) -> tuple[str, ...] | str:
    """peft's target_modules for the linears the plan priced: the attention projections, or "all-linear" (peft's
    word for every linear but the output layer: the blocks' attention and MLP linears)."""
    return LoraTargets.ALL_LINEAR.value if model_spec.lora_mlp else TARGET_MODULES


def target_modules_text(model_spec: ModelSpec) -> str:
    """target_modules as Python source."""
    targets = target_modules(model_spec)
    return repr(targets) if isinstance(targets, str) else repr(list(targets))


def priced_lora_kwargs_text(training: TrainingSpec, model_spec: ModelSpec | None) -> str:
    """LoraConfig's arguments the plan priced beside r, as Python source: target_modules (with a model spec) and a
    lora_dropout above peft's 0 (cost_models/lora_dropout.py)."""
    kwargs = [f"target_modules={target_modules_text(model_spec)}"] if model_spec else []
    return ", ".join(kwargs + ([f"lora_dropout={training.lora_dropout}"] if training.lora_dropout else []))


def python_lines(training: TrainingSpec, config: FsdpConfig, model_spec: ModelSpec) -> list[str]:
    """bnb_config and lora_config as Python, with how to load the model through them."""
    compute = TORCH_NAMES[config.precision.compute_dtype]
    storage = TORCH_NAMES[training.quant_storage]
    r = training.lora_rank
    return [
        "# QLoRA (the plan's 4-bit base): load the model with",
        f"#   AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb_config, dtype=torch.{compute})",
        "# then model = peft.get_peft_model(model, lora_config), before wrapping it or training it.",
        "# With reentrant gradient checkpointing call model.enable_input_require_grads() first: the frozen",
        "# embeddings give the checkpointed blocks inputs without grad, and no gradient reaches the adapters.",
        "import torch",
        "from peft import LoraConfig",
        "from transformers import BitsAndBytesConfig",
        "",
        "bnb_config = BitsAndBytesConfig(",
        "    load_in_4bit=True,",
        f"    bnb_4bit_quant_type=\"{training.quant.value}\",",
        f"    bnb_4bit_use_double_quant={training.double_quant},",
        f"    bnb_4bit_compute_dtype=torch.{compute},",
        f"    bnb_4bit_quant_storage=torch.{storage},  # the compute dtype: FSDP gathers it with the rest",
        ")",
        f"lora_config = LoraConfig(r={r}, lora_alpha={2 * r}, lora_dropout={training.lora_dropout},",
        "                         bias=\"none\", task_type=\"CAUSAL_LM\",",
        f"                         target_modules={target_modules_text(model_spec)})",
    ]


def yaml_notes(training: TrainingSpec, config: FsdpConfig, model_spec: ModelSpec) -> list[str]:
    """accelerate's YAML has no key for the quantization: the loading code, as comment lines."""
    return ["QLoRA: the config cannot load the model; in the script:"] + [
        line.removeprefix("# ") for line in python_lines(training, config, model_spec)
        if line and not line.startswith(("#", "import", "from"))]


def applies(training: TrainingSpec | None, model_spec: ModelSpec) -> bool:
    return training is not None and training.quantized and bool(model_spec.lora_target_shapes)
