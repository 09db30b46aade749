"""A configuration in the words of the CLI flags, for tables, notes and findings: the FSDP knobs, the mesh, the
pipeline and the techniques (compile, Float8, async TP, ...)."""

from __future__ import annotations


from cost_models.mesh import mesh_of
from cost_models.specs import ClusterSpec, FsdpConfig



def describe(config: FsdpConfig, compact: bool = False) -> str:
    """A config in the words of the CLI flags; compact for table cells."""
    if compact:
        parts = [config.sharding.value, config.precision.value, f"AC {config.activation_checkpointing}",
                 f"mb {config.micro_batch}x{config.grad_accum}"]
        if config.offload:
            parts.append("offload")
        if not config.backward_prefetch:
            parts.append("no bwd prefetch")
        if config.expert_shard_dim:
            parts.append("experts dim 1")
        if config.expert_units:
            parts.append("expert units")
        if config.reduce_dtype:
            parts.append(f"reduce {config.reduce_dtype}")
        return ", ".join(parts + mesh_parts(config) + technique_words(config, compact=True))
    ac = config.activation_checkpointing if config.checkpoints else "no"
    parts = [config.sharding.value, config.precision.value, f"{ac} activation checkpointing",
             f"micro-batch {config.micro_batch}"]
    if config.offload:
        parts.append("CPU offload")
    if config.expert_shard_dim:
        parts.append("stacked experts sharded on dim 1")
    if config.expert_units:
        parts.append("routed experts as their own FSDP units")
    if config.reduce_dtype:
        parts.append(f"gradients reduced in {config.reduce_dtype}")
    return ", ".join(parts + mesh_parts(config) + technique_words(config))


def mesh_parts(config: FsdpConfig) -> list[str]:
    """The degrees beside FSDP in the words of the flags ("tp 8", "cp 2", "no sequence parallel", "pp 8 1f1b ...")."""
    parts = [f"{name} {getattr(config, name)}" for name in ("tp", "cp", "ep") if getattr(config, name) > 1]
    if config.shard_group_gpus:
        parts.append(f"shard groups of {config.shard_group_gpus} GPUs")
    if config.tp > 1 and not config.sequence_parallel:
        parts.append("no sequence parallel")
    return parts + pipeline_words(config)


def pipeline_words(config: FsdpConfig, compact: bool = False) -> list[str]:
    """"pp 8 interleaved-1f1b (2 stages per rank), 16 microbatches"; compact "pp 8 interleaved-1f1b x2" (none
    without a pipeline)."""
    if config.pp == 1:
        return []
    v = config.pp_stages_per_rank
    if compact:
        return [f"pp {config.pp} {config.pp_schedule.value}" + (f" x{v}" if v > 1 else "")]
    return [f"pp {config.pp} {config.pp_schedule.value}" + (f" ({v} stages per rank)" if v > 1 else "")
            + f", {config.pp_microbatches} microbatches"]


def technique_words(config: FsdpConfig, compact: bool = False) -> list[str]:
    """compile, Float8 (+ FP8 all-gather), the blocks' reshard group, async TP and the kernels in words (none: an
    empty list)."""
    words = ("compile", "float8", " + fp8 all-gather", "reshard to {}", "async TP") if compact else (
        "torch.compile per block", "Float8 linears", " with FP8 all-gather", "blocks resharded to {} ranks after forward",
        "async TP")
    parts = [words[0]] if config.compile else []
    if config.float8:
        parts.append(words[1] + (words[2] if config.fp8_all_gather else ""))
    if config.reshard_after_forward:
        parts.append(words[3].format(config.reshard_after_forward))
    if config.async_tp:
        parts.append(words[4])
    return parts + kernel_words(config, compact)


# the op classes' kernels other than the model's own (FsdpConfig.*_kernel), as the flags name them
_OPS = (("norm_kernel", "RMSNorm"), ("rope_kernel", "RoPE"), ("swiglu_kernel", "SwiGLU"), ("loss_kernel", "loss"))
_OWNERS = {"liger": "Liger", "te": "TE", "chunked": "chunked"}
_ATTENTION = {"cudnn": "cuDNN attention", "fa3": "flash-attention 3"}


def kernel_words(config: FsdpConfig, compact: bool = False) -> list[str]:
    """The kernels a config runs beside the model's own ops: "Liger kernels" when all four are Liger's (HF's
    use_liger_kernel), else each op's ("TE RMSNorm", "chunked loss"); the fused attention's kernel but FlashAttention-2
    (none: an empty list)."""
    chosen = {op: getattr(config, name).value for name, op in _OPS if getattr(config, name).value != "eager"}
    if len(chosen) == len(_OPS) and set(chosen.values()) == {"liger"}:
        parts = ["liger" if compact else "Liger kernels"]
    else:
        parts = [f"{value if compact else _OWNERS[value]} {op}" for op, value in chosen.items()]
    kernel = config.attention_kernel.value
    if kernel in _ATTENTION:
        parts.append(kernel if compact else _ATTENTION[kernel])
    return parts


def describe_mesh(config: FsdpConfig, cluster: ClusterSpec) -> str:
    return mesh_of(config, cluster).describe()
