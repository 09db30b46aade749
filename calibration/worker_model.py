"""The model a calibration rank runs (calibration/runner.py step 1 and 2): built with its parameters on meta at
the job's depth, FSDP applied as the emitted config does, then the parameters materialised and initialised."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from calibration.apply import apply_fsdp1, apply_fsdp2, cast_for_precision, make_mesh
from calibration.build import build_model, load_factory
from calibration.spec_dicts import model_spec_from_dict
from cost_models.specs import FsdpConfig, ModelSpec

INIT_STD = 0.02


@contextlib.contextmanager
def params_on_meta():
    """Modules built inside get their parameters on the meta device, buffers stay real.

    Rotary frequency tables and similar buffers are computed in __init__ and cannot be recomputed
    after a plain `with torch.device("meta")`; parameters are re-initialised anyway. (accelerate's
    init_empty_weights(include_buffers=False) does the same.) A parameter already on meta is kept as is,
    so tied weights stay tied.
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _model_spec(data: dict) -> ModelSpec:
    return model_spec_from_dict(data)  # nested MoeSpec / ActivationProfile too (MoE models crashed here)


def build(job_model: dict, attention: str) -> nn.Module:
    """The job's model, parameters on meta, at the job's depth."""
    source = job_model["source"]
    with params_on_meta():
        if source == "factory":
            kwargs = {"n_layers": job_model["n_layers"]} if job_model.get("n_layers") else {}
            model = load_factory(job_model["factory"])(**kwargs)
        elif source == "hf":
            model = build_model(_model_spec(job_model["spec"]), hf_config=job_model["hf_config"], attention=attention,
                                device="cpu")
        else:
            model = build_model(_model_spec(job_model["spec"]), attention=attention, device="cpu")
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model builder returned {type(model).__name__}, not an nn.Module")
    return model


@torch.no_grad()
def init_module_params(module: nn.Module, buffers: dict[int, dict[str, torch.Tensor]]) -> None:
    """Initialise `module`'s own parameters and restore its own buffers (not its children's)."""
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters(recurse=False):
        local = p.to_local() if isinstance(p, DTensor) else p
        if p.ndim >= 2:
            local.normal_(0.0, INIT_STD)
        elif name.endswith("bias"):
            local.zero_()
        else:
            local.fill_(1.0)  # norm weights
    for name, value in buffers.get(id(module), {}).items():
        current = module._buffers.get(name)
        if current is not None:
            current.copy_(value.to(current.device))


def snapshot_buffers(model: nn.Module) -> dict[int, dict[str, torch.Tensor]]:
    return {id(m): {n: b.detach().clone() for n, b in m._buffers.items() if b is not None and b.device.type != "meta"}
            for m in model.modules()}


def apply_config(model: nn.Module, config: FsdpConfig, fsdp_version: int, classes: set[type], world: int,
                 gpus_per_node: int, device: torch.device, lora: bool = False) -> nn.Module:
    """Apply FSDP as the emitted config does, then materialise the meta parameters on `device`.
    lora: FSDP1 wraps the adapters in their own units (frozen and trainable params apart)."""
    cast_for_precision(model, config)
    buffers = snapshot_buffers(model)
    if fsdp_version == 1:
        def materialise(module: nn.Module) -> None:  # meta -> device, unit by unit, before sharding
            module.to_empty(device=device, recurse=False)
            init_module_params(module, buffers)

        return apply_fsdp1(model, config, classes, param_init_fn=materialise, gpus_per_node=gpus_per_node,
                           device_id=device, trainable_mixed=lora)
    mesh = make_mesh(config, world, gpus_per_node, device.type)
    apply_fsdp2(model, config, classes, mesh)
    model.to_empty(device=device)
    for module in model.modules():
        init_module_params(module, buffers)
    model._calibration_mesh = mesh  # the N-D mesh: context parallelism shards each step's inputs on its "cp" dim
    return model
