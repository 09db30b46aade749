"""Torch models to run: from a Hugging Face config (transformers), the reference Llama, or a user factory."""

from __future__ import annotations

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
    AutoModelForCausalLM, or AutoModelForMaskedLM (BertForMaskedLM) for BERT. Without one, the reference
    Llama built from `spec`. dtype defaults to fp32 rather than the config's torch_dtype: FSDP's
    precision policy (or cast_for_precision for bf16-pure) decides the dtypes, not the checkpoint.
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
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

        fields = dict(hf_config)
        model_type = fields.pop("model_type")
        config = AutoConfig.for_model(model_type, **fields)
        auto = AutoModelForMaskedLM if model_type == "bert" else AutoModelForCausalLM
        return auto.from_config(config, attn_implementation=attention, dtype=dtype)


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
