"""The doctor's rules on FSDP's own settings: the fp16 scaler, LoRA's units and use_orig_params, the wrap
policy, HYBRID_SHARD on one node, sync_module_states, forward prefetch, the rate limiter and the FSDP1 settings
FSDP2 removed. Each rule takes the Context and returns zero or more Findings (planner/doctor/findings.py)."""

from __future__ import annotations


from cost_models import moe_lora
from cost_models.specs import Precision
from cost_models.units import DTYPE_BYTES, GiB

from planner.doctor.readers import FSDP2_REMOVED
from planner.doctor.findings import ADVICE, ERROR, WARNING, Context, Finding


def fp16_scaler(ctx: Context):
    if ctx.config.precision is not Precision.FP16 or ctx.setup.grad_scaler == "sharded":
        return
    severity = WARNING if ctx.setup.grad_scaler is None else ERROR
    what = {None: "no gradient scaler is stated", "none": "no gradient scaler is used",
            "plain": "a plain GradScaler checks only this rank's gradient shard for inf/NaN"}[ctx.setup.grad_scaler]
    yield Finding("fp16-without-sharded-scaler", severity,
                  f"fp16 mixed precision needs loss scaling, and {what}: small gradients underflow to zero, and "
                  "with sharded gradients ranks can disagree on skipping a step.",
                  "use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (scaler.scale(loss).backward(); "
                  "scaler.step(optimizer); scaler.update()), or switch to bf16 on GPUs that have it (no scaler needed)")


def lora_without_orig_params(ctx: Context):
    if ctx.training.finetune.adapters and ctx.setup.fsdp_version == 1 and not ctx.setup.use_orig_params:
        yield Finding("lora-without-use-orig-params", ERROR,
                      "LoRA mixes frozen and trainable parameters in the same FSDP1 unit; without "
                      "use_orig_params=True FSDP1 flattens them into one FlatParameter, which must be uniformly "
                      "trainable, so wrapping fails (or everything trains).",
                      "set use_orig_params=True (accelerate: fsdp_use_orig_params: true)")


def moe_all_linear_fsdp1(ctx: Context):
    """All-linear LoRA on an MoE under FSDP1 fails in every wrapping (moe_lora.fsdp1_refusals,
    benchmarks/peft_moe_fsdp1.py)."""
    all_linear = moe_lora.trains_all_linear(ctx.model, ctx.training)
    for r in moe_lora.fsdp1_refusals(ctx.model, all_linear, ctx.setup.fsdp_version == 1,
                                     "fsdp_version", "use FSDP2 (fully_shard; accelerate: fsdp_version: 2), or LoRA on "
                                     "the attention alone"):
        yield Finding(r.code, ERROR, r.reason[0].upper() + r.reason[1:] + ".", r.fix)


def lora_adapters_share_units(ctx: Context):
    """FSDP1 + LoRA wrapped per block only: each block's unit flattens its frozen weights and its adapters
    into one FlatParameter, which needs one dtype and gets one gradient (calibration.apply's
    trainable_mixed and the emitted FSDP1 snippet wrap the adapters apart)."""
    if not (ctx.training.finetune.adapters and ctx.setup.fsdp_version == 1 and ctx.setup.use_orig_params
            and ctx.setup.wrap == "block") or ctx.setup.dialect == "hf-trainer":
        return  # HF Trainer wraps a PEFT model's adapters apart itself (transformers update_fsdp_plugin_peft)
    frozen_block = ctx.model.block_params * ctx.model.n_layers
    d = ctx.config.shard_group_size(ctx.cluster)
    grad_bytes = frozen_block * DTYPE_BYTES[ctx.config.precision.param_dtype] / d
    # An accelerate config is fine under HF Trainer, which swaps in peft's policy for PEFT models itself.
    accelerate = ctx.setup.dialect == "accelerate"
    trainer = " HF Trainer swaps in peft's policy for PEFT models by itself; plain accelerate does not." if accelerate else ""
    yield Finding("lora-adapters-share-units", ADVICE if accelerate else WARNING,
                  "LoRA with one FSDP1 unit per block: each unit flattens the frozen weights and the adapters into "
                  "one FlatParameter, which must have one dtype (peft's fp32 adapters over a bf16 base fail with "
                  "'Must flatten tensors with uniform dtype') and has one gradient: in one dtype, the frozen block "
                  f"weights get gradients too ({grad_bytes / GiB:.1f} GiB per GPU of sharded gradients, plus a "
                  f"block's unsharded gradient at a time, that the plan does not count).{trainer}",
                  "wrap each adapter in its own unit: auto_wrap_policy=peft.utils.other.fsdp_auto_wrap_policy(model), "
                  "or the CustomPolicy that `fsdp-plan --finetune lora --emit fsdp1` writes; FSDP2 needs nothing")


def wrap_policy(ctx: Context):
    if ctx.setup.wrap == "none":
        total = ctx.candidate.memory.peak_reserved_bytes  # already priced as one unit by check()
        fits = total <= ctx.cluster.gpu.memory_bytes
        yield Finding("no-auto-wrap-policy", WARNING if fits else ERROR,
                      "No auto-wrap policy: the whole model is one FSDP unit, so every all-gather materialises the "
                      f"full unsharded model ({ctx.unwrapped_extra_bytes / GiB:.1f} GiB more than per-block "
                      f"wrapping; peak {total / GiB:.1f} GiB of {ctx.cluster.gpu.memory_bytes / GiB:.0f} GiB) and no "
                      "communication overlaps compute.",
                      f"auto_wrap_policy=ModuleWrapPolicy({{{ctx.model.block_class}}}) (accelerate: "
                      f"fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, fsdp_transformer_layer_cls_to_wrap: "
                      f"{ctx.model.block_class}); FSDP2: fully_shard each block, then the root")
    elif ctx.setup.wrap == "size":
        yield Finding("size-based-wrap", ADVICE,
                      "size_based_auto_wrap_policy cuts units by parameter count, not at block boundaries: units "
                      "straddle blocks, sizes are uneven, and activation checkpointing cannot follow the units.",
                      f"wrap per transformer block: ModuleWrapPolicy({{{ctx.model.block_class}}})")


def hybrid_single_node(ctx: Context):
    if ctx.config.sharding.is_hybrid and ctx.cluster.n_nodes == 1:
        plain = "FULL_SHARD" if ctx.config.sharding.value == "HYBRID_SHARD" else "SHARD_GRAD_OP"
        yield Finding("hybrid-on-one-node", WARNING,
                      f"{ctx.config.sharding.value} shards inside a node and replicates across nodes; on a single "
                      f"node there is nothing to replicate across, so it is {plain} with extra process groups.",
                      f"sharding_strategy={plain} (HYBRID pays off with several nodes and a slow inter-node network)")


def sync_module_states(ctx: Context):
    s = ctx.setup
    if s.sync_module_states and s.init == "all":
        yield Finding("needless-sync-module-states", ADVICE,
                      "sync_module_states=True broadcasts rank 0's parameters and buffers to every rank when "
                      "wrapping: extra communication, not fewer syncs. It is only needed when rank 0 alone loads the "
                      "weights or the model is built on the meta device.",
                      "sync_module_states=False when every rank builds or loads the same weights")
    elif not s.sync_module_states and s.init in ("rank0", "meta"):
        yield Finding("missing-sync-module-states", ERROR if s.init == "rank0" else WARNING,
                      f"{'Only rank 0 loads the weights' if s.init == 'rank0' else 'The model is built on the meta device'}"
                      " but sync_module_states is off: the other ranks start from different (uninitialised or "
                      "random) weights.",
                      "sync_module_states=True (accelerate: fsdp_sync_module_states: true)")


def forward_prefetch_dynamic(ctx: Context):
    if ctx.config.forward_prefetch and ctx.dynamic_control_flow:
        yield Finding("forward-prefetch-dynamic-graph", ERROR,
                      "forward_prefetch issues the next unit's all-gather from the order recorded in the first "
                      "iteration; with data-dependent control flow the order changes and ranks gather the wrong unit "
                      "(hangs or wrong results).",
                      "forward_prefetch=False")


def limit_all_gathers(ctx: Context):
    if "limit_all_gathers" in ctx.setup.explicit and ctx.setup.fsdp_version == 1:
        on = ctx.config.limit_all_gathers
        yield Finding("limit-all-gathers-is-a-rate-limiter", ADVICE if on else WARNING,
                      "limit_all_gathers does not merge small tensors' communication: it is a rate limiter that "
                      "keeps at most two all-gathers in flight, bounding the memory of prefetched units and avoiding "
                      "allocator thrashing (FSDP paper: up to 5x faster on T5-11B, ~5% slower on DeepViT-8B). "
                      + ("" if on else "With it off the CPU can run ahead and hold more gathered units at once."),
                      "keep limit_all_gathers=True (the default) unless a measured run says otherwise")


def fsdp2_removed_settings(ctx: Context):
    for key in ctx.setup.fsdp2_removed:
        yield Finding(f"fsdp2-removed-{key.replace('_', '-')}", WARNING,
                      f"FSDP2 (fully_shard) has no {key}; the setting is ignored or rejected.",
                      f"remove {key}; FSDP2 uses {FSDP2_REMOVED[key]}")
