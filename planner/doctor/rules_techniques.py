"""The doctor's rules on the techniques that change the model code: Float8 without FP8 tensor cores, the int
reshard group, compile with dynamic shapes, selective op-level checkpointing a dialect cannot say, an attention
implementation a file does not set, and checkpointing outside the FSDP units."""

from __future__ import annotations


from cost_models.specs import Precision
from cost_models.units import DTYPE_BYTES, GiB

from planner.doctor.findings import ADVICE, ERROR, WARNING, Context, Finding
from planner.emit.attention import HF_NAMES, transformers_default


def float8_support(ctx: Context):
    """Float8 where it runs but is not what torchao's recipe assumes; on GPUs without FP8: cannot_run."""
    c = ctx.config
    if c.float8 and c.precision not in (Precision.BF16, Precision.BF16_PURE):
        yield Finding("float8-without-bf16-compute", WARNING,
                      f"Float8 linears with {c.precision.value} compute: torchao's recipe (and torchtitan's figures) "
                      "run the rest of the model in bf16; fp32 around FP8 matmuls casts every input and output in "
                      "and out of fp32, fp16 adds loss scaling to FP8's narrow range.",
                      "bf16 mixed precision (param_dtype=torch.bfloat16) with the Float8 linears")
    if c.fp8_all_gather and ctx.setup.fsdp_version == 1:
        yield Finding("fp8-all-gather-needs-fsdp2", ERROR,
                      "The FP8 all-gather (Float8LinearConfig(enable_fsdp_float8_all_gather=True)) works through "
                      "FSDP2's per-parameter DTensors; FSDP1 flattens each unit into one FlatParameter and gathers it "
                      "in the compute dtype, so the setting does nothing or fails.",
                      "FSDP2 (fully_shard; accelerate: fsdp_version: 2), or enable_fsdp_float8_all_gather=False")


def reshard_group(ctx: Context):
    """An int reshard_after_forward FSDP2 accepts but reads as True; one that does not divide: cannot_run."""
    r = ctx.config.reshard_after_forward
    d = ctx.config.shard_group_size(ctx.cluster)
    if r and r == d:
        yield Finding("reshard-after-forward-is-the-whole-group", ADVICE,
                      f"reshard_after_forward={r} is the whole shard group: the same as True (FSDP2 treats it so, and "
                      "the estimate prices it so).",
                      f"reshard_after_forward=True, or a smaller divisor of {d} (the node's "
                      f"{ctx.cluster.gpus_per_node} GPUs) to keep backward's all-gathers inside a node")


def compile_dynamic_shapes(ctx: Context):
    if ctx.config.compile and ctx.setup.compile_dynamic:
        yield Finding("compile-with-dynamic-shapes", WARNING,
                      "torch.compile with dynamic shapes: inductor traces shape-generic kernels (symbolic sizes, "
                      "fewer specialisations, no CUDA graphs), slower than the static ones the plan assumes; training "
                      "batches of one sequence length need none, and varying lengths recompile a few times then go "
                      "dynamic by themselves.",
                      "dynamic=False (accelerate: dynamo_use_dynamic: false) with sequences padded or packed to a "
                      "fixed length")


def attention_unset(ctx: Context):
    """The attention transformers runs where the file does not set it (priced: its default), or sets it only in a
    comment its tool ignores (accelerate's YAML: the comment's is priced); said where the model then runs another
    one than the planner would price (gpt-oss: eager instead of flex)."""
    setup, choices = ctx.setup, ctx.model.attention_choices
    default, priced = transformers_default(choices), ctx.config.attention.value
    if setup.attention_from == "unstated" and default != choices[0]:
        name = HF_NAMES[choices[0]]
        yield Finding("attention-not-set", WARNING,
                      f"The file does not set the attention implementation, so transformers runs its default for "
                      f"{ctx.model.name}, {default} (SDPA only where a model supports it), and that is priced here; "
                      f"the planner prices {choices[0]}.",
                      f"model.set_attn_implementation(\"{name}\") before wrapping (or from_pretrained(..., "
                      f"attn_implementation=\"{name}\")); --emit fsdp2 / fsdp1 / lightning write it")
    if setup.attention_from == "comment" and priced != default:
        name = HF_NAMES[priced]
        yield Finding("attention-only-in-a-comment", WARNING,
                      f"An accelerate config has no attention key: its comment's {name} is priced, but only the "
                      f"training script applies it; loaded without it, {ctx.model.name} runs {default}.",
                      f"from_pretrained(..., attn_implementation=\"{name}\") in the training script")


# Dialects that cannot say "selective-op" (their checkpointing switch is a bool), in their own words: (what the
# dialect has, the fix in it). torchtitan can (activation_checkpoint.mode = "selective", selective_ac_option =
# "op"), and so can a kwargs file (the training script's own choice): their readers never mark it unexpressed.
SELECTIVE_OP_DIALECTS = {
    "accelerate": ("An accelerate config", "accelerate's fsdp_activation_checkpointing is a bool (every block "
                   "recomputed whole) and rejects 'selective-op'",
                   "fsdp_activation_checkpointing: true (whole blocks: less memory, more recompute), or wrap each "
                   "block yourself with the selective_op_context that `fsdp-plan ... --emit fsdp2` writes before "
                   "accelerator.prepare"),
    "hf-trainer": ("Hugging Face TrainingArguments", "fsdp_config's activation_checkpointing (like the Trainer's "
                   "own gradient_checkpointing) is a bool: every block recomputed whole",
                   "fsdp_config: {activation_checkpointing: true} (whole blocks: less memory, more recompute), or "
                   "wrap each block with the selective_op_context that `fsdp-plan ... --emit fsdp2` writes before "
                   "building the Trainer, or a torchtitan job (activation_checkpoint.mode = \"selective\", "
                   "selective_ac_option = \"op\")"),
}


def selective_op_unexpressed(ctx: Context):
    if "selective-op" not in ctx.setup.unexpressed:
        return
    who, what, fix = SELECTIVE_OP_DIALECTS.get(
        ctx.setup.dialect, (f"A {ctx.setup.dialect} setup", "it has no op-level checkpointing policy",
                            "apply the selective_op_context that `fsdp-plan ... --emit fsdp2` writes to each block"))
    yield Finding("selective-op-not-expressible", ERROR,
                  f"{who} cannot express selective op-level checkpointing: {what}. The estimate prices the policy "
                  "you asked for.", fix)


def checkpointing_outside_units(ctx: Context):
    """A reentrant checkpoint around each FSDP1 unit's call (HF Trainer's own activation_checkpointing with
    use_reentrant: true): the recompute in backward runs the unit's pre-forward hook before its pre-backward one,
    so a strategy that reshards after forward all-gathers the block a third time (recompute, then backward), 50%
    more all-gather traffic for those blocks; transformers warns of it (huggingface/transformers#30404).
    Non-reentrant checkpointing (transformers 5's default) and FSDP2 gather nothing more, measured in
    tests/distributed/test_hf_checkpointing_gathers.py; unsharded groups and SHARD_GRAD_OP gather nothing."""
    c = ctx.config
    if not (ctx.setup.checkpoint_regathers and c.checkpoints and c.sharding.reshards_after_forward
            and c.shard_group_size(ctx.cluster) > 1):
        return
    n_blocks = ctx.model.n_layers if c.selective_op_ac else -(-ctx.model.n_layers // max(1, c.ac_every))
    gathered = n_blocks * ctx.model.block_params * DTYPE_BYTES[c.precision.compute_dtype]
    every = "" if c.ac_every in (0, 1) or c.selective_op_ac else (
        f"; fsdp_config's checkpoints every block, not every {c.ac_every}th: less memory, more recompute")
    yield Finding("checkpointing-outside-fsdp-units", WARNING,
                  "The Trainer's own activation checkpointing, reentrant, wraps each block from outside its FSDP1 "
                  "unit, so the recompute in backward runs the unit's forward hooks again: each checkpointed block is "
                  f"all-gathered a third time per micro-step ({n_blocks} blocks, {gathered / GiB:.1f} GiB of "
                  f"{c.precision.compute_dtype} params, 50% more all-gather traffic for them), which the estimate "
                  "does not count.",
                  "use_reentrant: false in activation_checkpointing_kwargs (transformers 5's default), or "
                  "activation_checkpointing: false with fsdp_config: {activation_checkpointing: true} (FSDP's own, "
                  f"inside the units{every}), or FSDP2 (fsdp_config: {{version: 2}})")
