"""A request's specs: the model (its traced block memory profile where it needs one, as its trainer's own
implementation runs it), the cluster and the training; and the attention implementation (and the fused
attention's kernel) a model is priced with."""

from __future__ import annotations

from dataclasses import replace

from cost_models.specs import (Attention, AttentionKernel, ClusterSpec, Finetune, LoraTargets, ModelSpec, TrainingSpec,
                               parse_enum)

from ..errors import PlannerError
from ..models import resolve_model
from ..trainers import model_for, trainer_named
from .build import build_request, knob_names
from .groups import Request, TrainingRequest

RESOLVE_KNOBS = tuple(n for n in knob_names("", "cluster", "training") if n != "model") + ("attention",)


def resolve_inputs(model, gpus: int | None = None, **knobs) -> tuple[ModelSpec, ClusterSpec, TrainingSpec]:
    """The specs behind every command from API/CLI keywords (the cluster's and the training's knobs, attention,
    trust_remote_code; or cluster= / training= groups): resolve_request of their Request."""
    request = build_request(model, gpus, valid=RESOLVE_KNOBS, valid_groups=("cluster", "training"), **knobs)
    return resolve_request(request, request.config.attention)


def resolve_request(request: Request, attention: str | None = None) -> tuple[ModelSpec, ClusterSpec, TrainingSpec]:
    """Model, cluster and training specs of a request. A model without an activation formula gets its traced
    block memory profile here (for `attention`, default: every implementation it runs)."""
    model = request.model
    spec = model if isinstance(model, ModelSpec) else resolve_model(model, trust_remote_code=request.trust_remote_code)
    cluster = request.cluster.spec()
    training = request.training.spec()
    # LoRA on a generic family (attention targets, no dropout): its block traced under the adapters, whose saved
    # bytes price the ledger's blocks (memory_shape.py); the formulas would read a spec the generic path guessed
    lora = (training.finetune is Finetune.LORA and spec.family == "generic" and not training.adapter_dropout
            and request.training.lora_targets in (None, LoraTargets.ATTENTION.value))
    if (training.finetune is Finetune.FULL or lora) and not isinstance(model, ModelSpec):
        from ..models import hf_config_of
        from ..models.block_profiles import needs_block_profile, with_block_profile

        from ..models.module import hf_config_dict

        hf_config = hf_config_dict(model) or hf_config_of(model)  # a transformers module's config, or the file's
        if needs_block_profile(spec, hf_config):
            spec = with_block_profile(spec, hf_config, training.seq_len, attentions=(model_attention(spec, attention),),
                                      lora_rank=training.lora_rank if lora else 0)
    spec = with_lora_targets(spec, request.training)
    return model_for(trainer_named(request.trainer), spec), cluster, training  # the trainer's own implementation


def with_lora_targets(spec: ModelSpec, training: TrainingRequest) -> ModelSpec:
    """The spec with the linears LoRA adapts that the request names (ModelSpec.lora_targets; a SpecError naming
    lora_targets where they cannot be priced: MoE); the knob is validated even where nothing trains adapters."""
    if training.lora_targets is None:
        return spec
    targets = parse_enum(LoraTargets, training.lora_targets, "lora_targets")
    return replace(spec, lora_targets=targets) if parse_enum(Finetune, training.finetune, "finetune").adapters else spec


def fused_attention_kernel(request: Request, pinned: str | None, attention: str, gpu) -> Request:
    """The request with the fused attention's kernel it is priced with: the one the user pinned (refused in one
    line with flex or eager attention, which run their own; a GPU without it is refused by
    cost_models/feasibility.py), else the trainer's default where the GPU has it (Transformer Engine's cuDNN
    attention: Hopper), else flash2."""
    value = parse_enum(AttentionKernel, request.config.attention_kernel or "flash2", "attention_kernel").value
    if pinned is not None and value != "flash2" and attention != "sdpa":
        raise PlannerError("attention_kernel", f"{value} is a fused SDPA kernel and {attention} attention runs its "
                                               "own: give --attention sdpa, or leave --attention-kernel out")
    if pinned is None:
        value = default_kernel_on(value, gpu)
    return replace(request, config=replace(request.config, attention_kernel=value))


def default_kernel_on(kernel: str, gpu) -> str:
    """A trainer's default fused attention kernel where the GPU has it, else flash2 (Transformer Engine's cuDNN
    attention off Hopper): what an unpinned kernel is priced as, by the planner and by check."""
    return kernel if kernel in gpu.attention_kernels() else "flash2"


def model_attention(spec: ModelSpec, attention: str | None) -> str:
    """The attention implementation to price: the one asked for, if the model runs it, else (None) the
    model's first choice."""
    if attention is None:
        return spec.attention_choices[0]
    value = parse_enum(Attention, attention, "attention").value
    if value not in spec.attention_choices:
        raise PlannerError("attention", f"{spec.name} does not run {value} attention in transformers; choose one "
                                        f"of: {', '.join(spec.attention_choices)}")
    return value
