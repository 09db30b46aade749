"""Torch models to run: from a Hugging Face config (transformers), the reference Llama, or a user factory."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable

import torch
from torch import nn

from calibration.reference import build_reference
from cost_models.specs import ModelSpec


def build_model(spec: ModelSpec, hf_config: dict | None = None, attention: str = "sdpa",
                device: str | torch.device = "meta", dtype: torch.dtype | None = None) -> nn.Module:
    """Build the model without weights on `device` ("meta" allocates nothing; traces and planning use it).

    With hf_config (a config.json as a dict, including model_type) the model comes from transformers:
    AutoModelForCausalLM, or AutoModelForMaskedLM (BertForMaskedLM) for BERT, built as a GPU training run
    builds it: `attention` where the family supports it, else eager (hf_attention: Gemma 2 refuses SDPA
    for its logit soft-capping, gpt-oss for its attention sinks), and mixture-of-experts layers through
    transformers' grouped_mm experts kernel (HF_EXPERTS). The choices made are on model.config
    (_attn_implementation, _experts_implementation). Without hf_config, the reference Llama built from
    `spec`. dtype defaults to fp32 rather than the config's torch_dtype: FSDP's precision policy (or
    cast_for_precision for bf16-pure) decides the dtypes, not the checkpoint.
    """
    dtype = dtype or torch.float32
    with torch.device(device):
        if hf_config is None:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)  # allocate directly in dtype (no fp32 copy first)
            try:
                return build_reference(spec, attention)
            finally:
                torch.set_default_dtype(previous)
        config = hf_config_object(hf_config)
        auto = _auto_class(config)
        cls = hf_model_class(config)
        experts = {"experts_implementation": HF_EXPERTS} if cls._can_set_experts_implementation() else {}
        model = auto.from_config(config, attn_implementation=hf_attention(cls, attention), dtype=dtype, **experts,
                                 **_remote(config))
    _cast_kept_parameters(model, dtype)
    return model


@torch.no_grad()
def _cast_kept_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters transformers keeps in fp32 whatever the dtype asked (_keep_in_fp32_modules_strict:
    DeepSeek-V3's router weight), cast to `dtype` as cast_for_precision's model.to() casts them for
    bf16-pure: FSDP2 needs one dtype per unit. New tensors in the parameters' slots (works on fake
    tensors, where model.to() does not); buffers keep their dtype."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                module._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)


# transformers 5's default experts kernel, and the one a GPU run takes: the b x s x top-k routed token rows
# sorted by expert, one torch._grouped_mm per projection (static shapes, so it also runs on fake tensors).
# Named explicitly so that a transformers release changing its default cannot change what we price.
HF_EXPERTS = "grouped_mm"


def hf_config_object(hf_config: dict):
    """The transformers config of a config.json dict (with model_type). Remote code (auto_map, which the
    planner lets through only with --trust-remote-code) comes from the directory named by _name_or_path,
    the dict's fields over the file's (a profile's or a small calibration run's layer count)."""
    from transformers import AutoConfig

    fields = copy.deepcopy(hf_config)  # transformers rewrites nested fields (rope_scaling) in place
    model_type = fields.pop("model_type")
    if fields.pop("auto_map", None):
        return AutoConfig.from_pretrained(fields.pop("_name_or_path"), trust_remote_code=True, **fields)
    return AutoConfig.for_model(model_type, **fields)


def quiet_transformers(make):
    """make() without transformers' config warnings (token ids etc. are not ours to show)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return make()
    finally:
        transformers.logging.set_verbosity(verbosity)


def _remote(config) -> dict:
    """from_config's trust_remote_code for a config whose classes come with the model (auto_map)."""
    return {"trust_remote_code": True} if getattr(config, "auto_map", None) else {}


def _auto_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    return AutoModelForMaskedLM if config.model_type == "bert" else AutoModelForCausalLM


def hf_model_class(config) -> type:
    """The transformers class from_config builds: *ForMaskedLM for BERT, *ForCausalLM otherwise."""
    from transformers.models.auto.auto_factory import _get_model_class

    auto_map = getattr(config, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map:  # remote code: the class its directory defines
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], config._name_or_path)
    return _get_model_class(config, _auto_class(config)._model_mapping)


def hf_attention(cls: type, requested: str) -> str:
    """The attention implementation `cls` runs for `requested`: SDPA or FlexAttention where the family supports
    it (transformers' `_supports_sdpa`, `_supports_flex_attn`), else eager, which every family has. Flex is
    calibration/flex_kernel.py's: transformers' own compiled kernel on a GPU, and on CPU and fake tensors a kernel
    that saves what that one saves."""
    if requested == "sdpa" and not getattr(cls, "_supports_sdpa", False):
        return "eager"
    if requested == "flex":
        from .flex_kernel import use_flex

        return use_flex() if getattr(cls, "_supports_flex_attn", False) else "eager"
    return requested


def model_kernels(model: nn.Module, default_attention: str) -> tuple[str, str | None]:
    """(attention implementation, experts implementation or None) a built model runs: transformers keeps
    them on model.config; a model without experts layers (or not from transformers) has None."""
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None) or default_attention
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    experts = getattr(config, "_experts_implementation", None) if can_set is not None and can_set() else None
    return attention, experts


def load_factory(path: str) -> Callable[..., nn.Module]:
    """The callable named by "pkg.module:function" (the user's own model constructor)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"factory must look like 'pkg.module:function', got {path!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{path} is not callable")
    return obj
