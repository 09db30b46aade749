"""LoRA fine-tuning as the cost model prices it, with peft: one code path for traces and calibration runs.

    add_lora(model, spec, rank=16, block_classes={LlamaDecoderLayer}, precision=Precision.BF16)

The adapted linears are those of ModelSpec.lora_shapes ((in, out) of each block linear: the attention
projections for every architecture the planner knows, and under all-linear the MLP's), found in the first
block by shape, in module order, and named to peft by their path inside the block ("self_attn.q_proj"), which
peft matches in every block. The base model is frozen (peft marks only the adapters trainable).

Dtypes follow peft's defaults for a base model loaded in a low precision (lora_dtypes): under mixed
precision the frozen weights are in the compute dtype (what `from_pretrained(dtype=torch.bfloat16)`
gives; the cost model counts them so) and the adapters in fp32 (peft's autocast_adapter_dtype); FSDP then
gathers both in bf16 and reduces the adapters' gradients in fp32. Otherwise (fp32, bf16-pure) both are in
the parameter dtype.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from cost_models.specs import ModelSpec, Precision, parse_enum

from .apply import TORCH_DTYPES


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a linear layer: nn.Linear, or transformers' Conv1D (GPT-2), whose weight is (in, out)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return tuple(module.weight.shape)
    return None


def lora_target_names(block: nn.Module, shapes: tuple[tuple[int, int], ...]) -> list[str]:
    """Paths inside `block` of the linears with the given (in, out) shapes, first matches in module order."""
    wanted = Counter(tuple(s) for s in shapes)
    names = []
    for name, module in block.named_modules():
        shape = linear_shape(module)
        if shape is not None and wanted[shape] > 0:
            wanted[shape] -= 1
            names.append(name)
    missing = +wanted
    if missing:
        raise ValueError(f"LoRA: no linear of shape(s) {sorted(missing)} (in, out) in {type(block).__name__}; "
                         f"the model spec's lora_target_shapes / mlp_linear_shapes do not match the model")
    return names


def lora_dtypes(precision: Precision) -> tuple[torch.dtype, torch.dtype]:
    """(frozen base, adapters) dtypes under `precision`; see the module docstring."""
    frozen = precision.compute_dtype if precision.mixed else precision.param_dtype
    return TORCH_DTYPES[frozen], TORCH_DTYPES[precision.param_dtype]


def add_lora(model: nn.Module, spec: ModelSpec, rank: int, block_classes: set[type],
             precision: Precision | str = Precision.FP32, dropout: float = 0.0) -> nn.Module:
    """Freeze `model` and inject rank-`rank` LoRA adapters into its blocks' target linears (in place),
    with the dtypes of lora_dtypes(precision); dropout: peft's lora_dropout (an nn.Dropout on each adapter's
    input when > 0, which the cost model prices: activations.lora_dropout_bytes).

    Works on real and meta parameters, not on fake ones (peft moves adapters with Module.to(), which
    cannot swap fake tensors): traces build on meta, add LoRA, then materialise under FakeTensorMode."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise RuntimeError("LoRA runs need peft: pip install 'fsdp-planner[lora]'") from None
    if not spec.lora_shapes:
        raise ValueError(f"{spec.name}: the model spec names no LoRA target linears (lora_target_shapes)")
    block = next((m for m in model.modules() if isinstance(m, tuple(block_classes))), None)
    if block is None:
        raise ValueError(f"no block of class {sorted(c.__name__ for c in block_classes)} in {type(model).__name__}")
    frozen_dtype, adapter_dtype = lora_dtypes(parse_enum(Precision, precision, "precision"))
    for param in model.parameters():  # parameters only: buffers such as rotary tables keep their dtype
        if param.dtype != frozen_dtype:
            param.data = param.data.to(frozen_dtype)
    if spec.moe is not None and spec.lora_mlp:
        # an MoE's all-linear is peft's own: its transformers-5 conversion (inject_adapter ->
        # convert_peft_config_for_transformers) adds the router and the stacked experts as ParamWrappers
        # (cost_models/moe_lora.py), which no list of nn.Linear names reaches
        targets, conv1d = "all-linear", False
    else:
        targets = lora_target_names(block, spec.lora_shapes)
        conv1d = any(type(block.get_submodule(t)).__name__ == "Conv1D" for t in targets)  # GPT-2: (in, out) weights
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, bias="none", target_modules=targets,
                        fan_in_fan_out=conv1d)
    model = inject_adapter_in_model(config, model)
    # peft gave each adapter its base layer's device and dtype; remake the adapters in adapter_dtype,
    # freeze everything else.
    for path, module in model.named_modules():
        adapter = any(part.startswith("lora_") for part in path.split("."))
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if adapter:
                base = _base_weight(model, path)
                new = torch.empty(param.shape, dtype=adapter_dtype, device=base.device)
                if new.device.type != "meta":
                    _init_adapter(new, is_a=".lora_A." in f".{path}.")
                module._parameters[name] = nn.Parameter(new)
            else:
                param.requires_grad_(False)
    return model


def _base_weight(model: nn.Module, adapter_path: str) -> torch.Tensor:
    """The frozen weight of the layer an adapter belongs to ("...q_proj.lora_A.default" -> q_proj)."""
    parts = adapter_path.split(".")
    layer = model.get_submodule(".".join(parts[:next(i for i, p in enumerate(parts) if p.startswith("lora_"))]))
    base = layer.get_base_layer()   # an MoE's ParamWrapper: the experts module, its stacks and no `weight`
    return base.weight if hasattr(base, "weight") else next(base.parameters())


@torch.no_grad()
def _init_adapter(weight: torch.Tensor, is_a: bool) -> None:
    """peft's default: A ~ kaiming-uniform, B = 0 (the adapted model starts as the base model)."""
    if is_a:
        nn.init.kaiming_uniform_(weight, a=5 ** 0.5)
    else:
        weight.zero_()
