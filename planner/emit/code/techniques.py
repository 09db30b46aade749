"""The text planner/emit/ writes for selective op-level checkpointing, per-block torch.compile, Float8
linears with the FP8 all-gather and an int reshard_after_forward: the code where a dialect can say it,
and a comment where it cannot. Each mirrors calibration/apply.py (tests run both and compare).
"""

from __future__ import annotations

from cost_models.specs import FsdpConfig

from planner.search.words import technique_words

# torchtitan's selective op-level checkpointing as module-level code of a snippet: the same ops and counting
# as calibration.apply.selective_op_context (a test compares the two op by op).
SELECTIVE_OP_IMPORTS = [
    "from collections import defaultdict",
    "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts",
]
SELECTIVE_OP_POLICY = [
    "# Selective op-level checkpointing (torchtitan): the outputs of matmuls, SDPA, max and reduce-scatter are",
    "# saved, except every second matmul; everything else (norms, activations, elementwise) is recomputed.",
    "_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}  # nn.Linear without / with a bias",
    "_SAVE = _MATMULS | {",
    "    torch.ops.aten._scaled_dot_product_flash_attention.default,",
    "    torch.ops.aten._scaled_dot_product_efficient_attention.default,",
    "    torch.ops.aten._scaled_dot_product_cudnn_attention.default,",
    "    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,",
    "    torch.ops.aten.max.default,",
    "    torch.ops._c10d_functional.reduce_scatter_tensor.default,",
    "}",
    "",
    "",
    "def selective_op_context():",
    "    matmuls = defaultdict(int)  # counted apart in forward and recompute, so both choose the same",
    "",
    "    def policy(ctx, func, *args, **kwargs):",
    "        mode = \"recompute\" if ctx.is_recompute else \"forward\"",
    "        if func in _MATMULS:",
    "            matmuls[mode] += 1",
    "        save = func in _SAVE and not (func in _MATMULS and matmuls[mode] % 2 == 0)",
    "        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE",
    "",
    "    return create_selective_checkpoint_contexts(policy)",
    "",
]
FLOAT8_IMPORT = "from torchao.float8 import Float8LinearConfig, convert_to_float8_training"
COMPILE_NOTE = "torch.compile per block, in place (torchtitan compiles each block before sharding it)"
# The next-token cross-entropy as Hugging Face's ForCausalLMLoss computes it (labels = the input ids; shifted
# and padded rather than the logits sliced), for a loss compiled outside the model.
NEXT_TOKEN_TARGETS = "torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)"
COMPILED_LOSS_NOTE = ("compile the loss too (the plan counts it fused: the bf16 logits and their gradient, no fp32 "
                      "copies): loss_fn = torch.compile(lambda logits, labels: torch.nn.functional.cross_entropy("
                      f"logits.flatten(0, 1).float(), {NEXT_TOKEN_TARGETS}.flatten(), ignore_index=-100)), applied "
                      "to model(input_ids).logits and input_ids (the model called without labels).")
PRECOMPUTE_NOTE = ("FP8 all-gather: after each optimizer.step() call torchao.float8.precompute_float8_dynamic_scale_for_fsdp"
                   "(model): every Float8 weight's scale in one all-reduce, not one per weight inside each all-gather.")


def hf_compiled_loss_lines(config: FsdpConfig) -> list[str]:
    """With compile the plan counts the loss fused (config.loss_compiled: the bf16 logits and their gradient, no
    fp32 copies). A Hugging Face model computes its loss eagerly inside its forward; Trainer's compute_loss_func
    takes it out (Trainer then calls the model without labels), compiled as calibration/runner.py runs it."""
    if not config.loss_compiled:
        return []
    return [
        "",
        "",
        "@torch.compile  # the loss fused, as planned: bf16 logits and their gradient, no fp32 copies of them",
        "def causal_lm_loss_sum(logits, labels):",
        f"    targets = {NEXT_TOKEN_TARGETS}  # next token; the last ignored",
        "    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),",
        "                                             ignore_index=-100, reduction=\"sum\")",
        "",
        "",
        "def compute_loss_func(outputs, labels, num_items_in_batch=None):",
        "    \"\"\"Trainer(..., compute_loss_func=compute_loss_func): the model's loss, outside it.\"\"\"",
        "    count = num_items_in_batch if num_items_in_batch is not None else (labels[:, 1:] != -100).sum()",
        "    return causal_lm_loss_sum(outputs.logits, labels) / count",
    ]


def module_level(config: FsdpConfig) -> list[str]:
    """Code a snippet defines before apply_fsdp (the selective-op policy), else nothing."""
    return SELECTIVE_OP_POLICY if config.selective_op_ac else []


def imports(config: FsdpConfig) -> list[str]:
    return (SELECTIVE_OP_IMPORTS if config.selective_op_ac else []) + ([FLOAT8_IMPORT] if config.float8 else [])


def float8_lines(config: FsdpConfig, names_expr: str, fp8_all_gather: bool) -> list[str]:
    """Body lines converting the blocks' linears to torchao Float8 (calibration.apply.convert_to_float8):
    `names_expr` is an expression of the blocks' module names."""
    if not config.float8:
        return []
    gather = "True),  # FSDP2 all-gathers these weights in FP8" if fp8_all_gather else "False),"
    return [
        "# Float8 linears (torchao, tensorwise dynamic scaling) inside the blocks, dims multiples of 16 (FP8 matmuls);",
        "# embeddings, head and norms stay in bf16. GPUs with FP8 tensor cores only (H100, H200, B200, ...).",
        *([] if names_expr == "block_names" else [f"block_names = {names_expr}"]),
        "in_blocks = tuple(f\"{n}.\" for n in block_names)",
        "convert_to_float8_training(",
        "    model,",
        f"    config=Float8LinearConfig(enable_fsdp_float8_all_gather={gather}",
        "    module_filter_fn=lambda m, fqn: (",
        "        isinstance(m, torch.nn.Linear) and fqn.startswith(in_blocks)",
        "        and m.in_features % 16 == 0 and m.out_features % 16 == 0),",
        ")",
    ]


def summary_line(config: FsdpConfig) -> list[str]:
    """One more summary comment line naming the techniques the config uses (none: no line, so configs
    without them emit exactly what they did before)."""
    parts = technique_words(config)
    return [", ".join(parts)] if parts else []


def fsdp1_unexpressed(config: FsdpConfig) -> list[str]:
    """What FSDP1 code cannot say, as note lines."""
    notes = []
    if config.fp8_all_gather:
        notes.append("the plan all-gathers Float8 weights in FP8, which FSDP1 cannot: it gathers them in the "
                     "compute dtype (more communication than planned; --emit fsdp2 has it).")
    if config.reshard_after_forward:
        notes.append(f"the plan keeps block params sharded over {config.reshard_after_forward} ranks after forward "
                     "(FSDP2's int reshard_after_forward), which FSDP1 cannot: FULL_SHARD re-gathers over all "
                     "ranks in backward (--emit fsdp2 has it).")
    return notes


def reshard_group_note(config: FsdpConfig, cannot: str) -> list[str]:
    """The plan's int reshard_after_forward, for a dialect that `cannot` set it ([] when the plan has none)."""
    if not config.reshard_after_forward:
        return []
    return [f"the plan keeps block params sharded over {config.reshard_after_forward} ranks after forward "
            f"(fully_shard's int reshard_after_forward), which {cannot}: blocks re-gather over the whole shard "
            "group (--emit fsdp2 has it)"]


def fp8_all_gather_note(config: FsdpConfig, fsdp_version: int, fsdp2_form: str) -> list[str]:
    """The FP8 all-gather under an FSDP1 form: FSDP2 only."""
    if config.fp8_all_gather and fsdp_version == 1:
        return [f"the plan all-gathers Float8 weights in FP8: FSDP2 only (use {fsdp2_form})"]
    return []


def accelerate_dynamo(config: FsdpConfig) -> list:
    """accelerate's dynamo_config for per-block compile: regional compilation compiles each repeated block."""
    if not config.compile:
        return []
    return [("dynamo_config", [
        ("dynamo_backend", "INDUCTOR", ""),
        ("dynamo_use_regional_compilation", True, "torch.compile each repeated block (the plan's per-block compile)"),
    ], "")]


def accelerate_fp8(config: FsdpConfig, fsdp_version: int) -> list:
    """accelerate's fp8_config for Float8 linears: the torchao (AO) backend; its FP8 all-gather (FSDP2 only)
    is on unless said otherwise, and accelerate precomputes the scales after each step itself."""
    if not config.float8:
        return []
    keys = [("backend", "AO", "torchao Float8 linears")]
    if fsdp_version == 2:
        keys.append(("enable_fsdp_float8_all_gather", config.fp8_all_gather,
                     "FSDP2 all-gathers the Float8 weights in FP8" if config.fp8_all_gather else ""))
    return [("fp8_config", keys, "")]


def accelerate_unexpressed(config: FsdpConfig, fsdp_version: int) -> list[str]:
    notes = []
    if config.selective_op_ac:
        notes.append("accelerate checkpoints whole blocks (the plan: selective-op): more recompute, less memory than "
                     "planned; for the op-level policy wrap each block yourself with --emit fsdp2's "
                     "selective_op_context before accelerator.prepare and set fsdp_activation_checkpointing: false")
    if config.float8:
        notes.append("Float8: accelerate's torchao recipe chooses the linears itself (it leaves the first and last "
                     "out); the plan converts every block linear whose dims are multiples of 16")
    return (notes + fp8_all_gather_note(config, fsdp_version, "--emit accelerate-fsdp2")
            + reshard_group_note(config, "accelerate cannot set"))


def lightning_unexpressed(config: FsdpConfig) -> list[str]:
    notes = []
    if config.selective_op_ac:
        notes.append("Lightning checkpoints whole blocks (the plan: selective-op); for the op-level policy pass "
                     "activation_checkpointing_policy=None and wrap the blocks in configure_model with --emit "
                     "fsdp2's selective_op_context")
    if config.compile:
        notes.append("torch.compile per block: in configure_model, block.compile() for each block (after "
                     "checkpoint wrapping, before the strategy shards them)")
    if config.float8:
        notes.append("Float8 linears: in configure_model, before sharding, torchao's convert_to_float8_training as "
                     "--emit fsdp2 writes it")
    if config.fp8_all_gather or config.reshard_after_forward:
        notes.append("FP8 all-gather and an int reshard_after_forward are FSDP2 options: Lightning's FSDPStrategy "
                     "is FSDP1 (use --emit fsdp2, or Lightning's ModelParallelStrategy with fully_shard)")
    return notes


def launcher_notes(config: FsdpConfig) -> list[str]:
    """torchrun / slurm: a launch line sets none of these; the training script does."""
    if not (config.selective_op_ac or config.compile or config.float8 or config.reshard_after_forward):
        return []
    return ["the training script applies selective-op checkpointing, compile, Float8 and reshard_after_forward "
            "(--emit fsdp2 writes that code); the launch line sets none of them"]
