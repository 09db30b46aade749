"""`fsdp-plan check`: price a user's existing FSDP setup and find what is wrong with it.

Each rule is a small function returning zero or more Findings: a severity (error: it will fail, train
wrongly or not fit; warning: it works but costs memory or speed, or relies on a misreading; advice: a
better choice exists), the reason in a sentence or two, and the fix as a config change. Many rules
correct advice found in blog posts (shared/seed/digest.md, "Corrections").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.evaluate import evaluate, gpu_memory_reason
from cost_models.feasibility import refusals
from cost_models.mesh_rules import mesh_refusals
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.specs import ClusterSpec, Finetune, FsdpConfig, ModelSpec, Precision, TrainingSpec
from cost_models.units import DTYPE_BYTES, GiB

from planner.api import Candidate, Plan
from planner.search import describe, technique_words
from planner.doctor.readers import FSDP2_REMOVED, UserSetup, model_use_cache

ERROR, WARNING, ADVICE = "error", "warning", "advice"
SEVERITY_ORDER = {ERROR: 0, WARNING: 1, ADVICE: 2}


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    message: str
    fix: str

    def to_dict(self) -> dict:
        return {"code": self.code, "severity": self.severity, "message": self.message, "fix": self.fix}


@dataclass(frozen=True)
class Context:
    setup: UserSetup
    candidate: Candidate            # the estimate of the user's config
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    best: Candidate | None          # the planner's pick for the same model, cluster and batch
    dynamic_control_flow: bool
    unwrapped_extra_bytes: int      # memory the estimate lacks when there is no auto-wrap policy
    profile: Profile
    model_use_cache: bool | None = None  # use_cache in the model's own config (config.json, HF dict, module)
    best_same_techniques: Candidate | None = None  # the planner's best with the user's compile / Float8 choices

    @property
    def config(self) -> FsdpConfig:
        return self.setup.config


def _techniques(config: FsdpConfig) -> tuple:
    """What changes the model code rather than FSDP's settings: compile, Float8 (+ its FP8 all-gather)."""
    return config.compile, config.float8


# --- rules ------------------------------------------------------------------------------------------------

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
    if ctx.training.finetune is Finetune.LORA and ctx.setup.fsdp_version == 1 and not ctx.setup.use_orig_params:
        yield Finding("lora-without-use-orig-params", ERROR,
                      "LoRA mixes frozen and trainable parameters in the same FSDP1 unit; without "
                      "use_orig_params=True FSDP1 flattens them into one FlatParameter, which must be uniformly "
                      "trainable, so wrapping fails (or everything trains).",
                      "set use_orig_params=True (accelerate: fsdp_use_orig_params: true)")


def lora_adapters_share_units(ctx: Context):
    """FSDP1 + LoRA wrapped per block only: each block's unit flattens its frozen weights and its adapters
    into one FlatParameter, which needs one dtype and gets one gradient (calibration.apply's
    trainable_mixed and the emitted FSDP1 snippet wrap the adapters apart)."""
    if not (ctx.training.finetune is Finetune.LORA and ctx.setup.fsdp_version == 1 and ctx.setup.use_orig_params
            and ctx.setup.wrap == "block"):
        return
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


def cannot_run(ctx: Context):
    """The configuration cannot run on this cluster at all (cost_models.feasibility, the table the estimate and
    the API refuse by)."""
    for r in refusals(ctx.cluster, ctx.candidate.config):
        yield Finding(r.code, ERROR, f"{r.reason}.", r.fix)


def mesh_rules_broken(ctx: Context):
    """A tensor / context / expert parallel degree the model, the sequence or the cluster does not allow
    (cost_models/mesh_rules.py, the table the estimate and the search use): the run fails, or splits unevenly."""
    for r in mesh_refusals(ctx.model, ctx.cluster, ctx.training, ctx.config):
        yield Finding(r.code, ERROR, f"{r.reason}.", r.fix)


def pipeline_split(ctx: Context):
    """torchtitan splits the blocks its own way (module_fqns_per_model_part as written, or its
    _generate_llm_fqn_per_model_part, which gives the extra blocks to the first stages); the estimate prices the
    even split with the end stages one block fewer (cost_models/pipeline.py): a stage with more blocks holds more
    parameters and activations, and the slowest stage paces the pipeline."""
    settings, config = ctx.setup.pipeline, ctx.config
    if settings is None or config.pp == 1:
        return
    from cost_models.pipeline import blocks_per_stage

    theirs = settings.blocks_per_stage(ctx.model.n_layers)
    ours = blocks_per_stage(ctx.model.n_layers, config.pp_stages)
    if tuple(theirs) != ours:
        yield Finding("pp-split-not-priced", WARNING,
                      f"torchtitan runs {', '.join(map(str, theirs))} blocks on stages 0-{len(theirs) - 1}; the "
                      f"estimate prices the even split {', '.join(map(str, ours))} (the most blocks on one stage: "
                      f"{max(theirs)} against {max(ours)}).",
                      "write the even split as parallelism.module_fqns_per_model_part (`fsdp-plan --emit "
                      "torchtitan` with the same --pp and --pp-schedule writes it)")


def tp_across_nodes(ctx: Context):
    """TP past the fast tier: every block's sequence-parallel all-gathers and reduce-scatters (2 + 2 forward,
    the same in backward) are exposed on the inter-node network, which is many times slower than NVLink."""
    tp, fast = ctx.config.tp, ctx.cluster.fast_tier_gpus
    if tp <= fast:
        return
    inter, intra = ctx.cluster.internode_bytes_per_s, ctx.cluster.gpu.intra_node_bus_bytes_per_s
    gpn = ctx.cluster.gpus_per_node
    yield Finding("tp-across-nodes", WARNING,
                  f"tp={tp} spans {-(-tp // fast)} nodes of {fast} GPUs: each block's TP all-gathers and "
                  f"reduce-scatters (forward and backward) run on the inter-node tier, {inter / gpn / 1e9:.0f} GB/s "
                  f"per GPU (the node's {inter / 1e9:.0f} GB/s of network shared by its {gpn} GPUs, every one in a "
                  f"TP group that crosses) against {intra / 1e9:.0f} GB/s inside the node, on the critical path of "
                  "every block.",
                  f"tp <= {fast} (TP inside a node), with context or data parallelism across nodes "
                  f"(e.g. tp {max(d for d in range(1, fast + 1) if fast % d == 0 and tp % d == 0)} and cp or "
                  "dp_shard for the rest)")


def does_not_fit(ctx: Context):
    refused = {r.reason for r in refusals(ctx.cluster, ctx.candidate.config)}
    for reason in ctx.candidate.reasons:
        if reason in refused or "no auto-wrap" in reason:
            continue  # reported by cannot_run / wrap_policy
        code = "cpu-ram-does-not-fit" if "CPU RAM" in reason else "gpu-memory-does-not-fit"
        fix = ("more nodes (offloaded state per node shrinks with the shard group), or no offload with more GPUs"
               if code == "cpu-ram-does-not-fit" else _fit_fix(ctx))
        yield Finding(code, ERROR, f"Out of memory: {reason}.", fix)


def _fit_fix(ctx: Context) -> str:
    if ctx.best is not None:
        return f"the planner's pick fits: {describe(ctx.best.config)}"
    return "see `fsdp-plan --model ... --gpus ...` for what would fit (more GPUs, offload, checkpointing, LoRA)"


def micro_batch_headroom(ctx: Context):
    c = ctx.candidate
    if not c.fits or c.memory.peak_reserved_bytes > 0.5 * ctx.cluster.gpu.memory_bytes:
        return
    bigger = replace(ctx.config, micro_batch=ctx.config.micro_batch * 2,
                     grad_accum=max(1, ctx.config.grad_accum // 2))
    e = evaluate(ctx.model, ctx.cluster, ctx.training, bigger, ctx.profile)
    gain = e.time.tokens_per_s_per_gpu / c.time.tokens_per_s_per_gpu - 1
    if e.fits and gain > 0.02:
        yield Finding("micro-batch-leaves-memory-unused", ADVICE,
                      f"The peak uses {c.memory.peak_reserved_bytes / GiB:.1f} of "
                      f"{ctx.cluster.gpu.memory_bytes / GiB:.0f} GiB; micro-batch {bigger.micro_batch} "
                      f"(accumulation {bigger.grad_accum}) also fits and is {100 * gain:.0f}% faster per GPU.",
                      f"micro_batch={bigger.micro_batch}, grad_accum={bigger.grad_accum}")


def slower_than_plan(ctx: Context):
    """Clearly (> 10%) faster picks of the planner: with the user's own compile / Float8 choices, FSDP
    settings alone (sharding, checkpointing, micro-batch: a warning); with torch.compile or Float8 linears
    added (code changes, not FSDP settings: advice)."""
    mine = ctx.candidate
    if not mine.fits or ctx.setup.wrap == "none":
        return
    techniques = ctx.best if ctx.best is not None and _techniques(ctx.best.config) != _techniques(mine.config) else None
    for code, severity, best in (("planner-pick-is-faster", WARNING, ctx.best_same_techniques),
                                 ("techniques-would-help", ADVICE, techniques)):
        gain = best.time.tokens_per_s_per_gpu / mine.time.tokens_per_s_per_gpu - 1 if best is not None else 0.0
        if gain <= 0.10:
            continue
        what = ("The planner ranks this configuration clearly slower" if severity == WARNING else
                f"The planner's pick adds {', '.join(technique_words(best.config))}")
        yield Finding(code, severity,
                      f"{what}: {mine.time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU against "
                      f"{best.time.tokens_per_s_per_gpu:,.0f} (+{100 * gain:.0f}%) for {describe(best.config)}.",
                      f"use the planner's pick (fsdp-plan --model ... --emit fsdp1|fsdp2|accelerate; fsdp2 writes "
                      f"the compile and Float8 code): {describe(best.config)}")


def kv_cache_extra_bytes(model: ModelSpec, config: FsdpConfig, seq_len: int) -> int:
    """What a live KV cache adds under activation checkpointing, at least: the keys and values of every
    checkpointed block, 2 x b x s x kv_dim x compute bytes each (shared/reference/pitfalls.md; Llama 2 7B,
    every-2, 4k tokens: 16 x 64 MiB = 1 GiB, traced +1.06 GiB). With every block checkpointed the peak
    lands later in backward, where each recompute has grown its layer of the cache: tiny real Llamas of 2
    to 8 blocks measured 3-4.5x this (tests/unit/test_apply.py: 3.5x)."""
    if not config.checkpoints:
        return 0
    # blocks 0, K, 2K, ...; selective-op: every block (its recompute reruns the cache's appends too)
    n_checkpointed = model.n_layers if config.selective_op_ac else -(-model.n_layers // config.ac_every)
    kv_bytes = 2 * config.micro_batch * seq_len * model.kv_dim * DTYPE_BYTES[config.precision.compute_dtype]
    return n_checkpointed * kv_bytes


def kv_cache_with_checkpointing(ctx: Context):
    """Checkpointing with the Hugging Face KV cache on: the setup says use_cache: true, or the model's
    config.json does and a kwargs setup does not say it is turned off. An accelerate config gets advice:
    under HF Trainer it is right (TrainingArguments.use_cache defaults to False), in a plain loop not."""
    stated = ctx.setup.use_cache
    if not ctx.config.checkpoints or stated is False or (stated is None and not ctx.model_use_cache):
        return
    extra = kv_cache_extra_bytes(ctx.model, ctx.config, ctx.training.seq_len)
    accelerate = ctx.setup.dialect == "accelerate"
    where = "the setup says use_cache: true" if stated else "the model's config has use_cache: true"
    trainer = (" HF Trainer turns it off (TrainingArguments.use_cache defaults to False); a plain accelerate loop "
               "does not." if accelerate else "")
    yield Finding("checkpointing-with-kv-cache", ADVICE if accelerate else WARNING,
                  f"Activation checkpointing with the KV cache on ({where}): checkpoint_wrapper leaves it on (HF's "
                  "gradient_checkpointing_enable turns it off), so the forward fills a live cache and each "
                  "checkpointed block's recompute appends its keys and values again, held to the end of backward: "
                  f"at least {extra / GiB:.2f} GiB per GPU the estimate does not count (SDPA's gradients are "
                  f"unchanged; eager attention fails in the recompute).{trainer}",
                  "model.config.use_cache = False before training (the snippets `fsdp-plan --emit fsdp1|fsdp2` "
                  "write do it); in a kwargs file, say so with use_cache: false")


def reduce_in_low_precision(ctx: Context):
    if ctx.config.precision.mixed and ctx.setup.reduce_dtype in ("bf16", "fp16"):
        yield Finding("low-precision-reduction", ADVICE,
                      f"Gradients are reduced in {ctx.setup.reduce_dtype}: summing many ranks' gradients in 16 bits "
                      "loses precision (the estimate prices an fp32 reduction).",
                      "reduce_dtype=torch.float32")


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


RULES = (cannot_run, mesh_rules_broken, pipeline_split, tp_across_nodes, float8_support, reshard_group, compile_dynamic_shapes, selective_op_unexpressed,
         checkpointing_outside_units, does_not_fit, fp16_scaler, lora_without_orig_params, lora_adapters_share_units, wrap_policy,
         hybrid_single_node, sync_module_states, forward_prefetch_dynamic, limit_all_gathers, fsdp2_removed_settings,
         reduce_in_low_precision, kv_cache_with_checkpointing, micro_batch_headroom, slower_than_plan)


def unwrapped_extra_bytes(setup: UserSetup, candidate: Candidate) -> int:
    """Without a wrap policy the root is the only unit: the whole model is gathered in compute dtype."""
    if setup.wrap != "none" or candidate.config.shard_group_size(candidate.cluster) == 1:
        return 0
    c = DTYPE_BYTES[candidate.config.precision.compute_dtype]
    gathered_now = candidate.memory.phases["backward"].unsharded_params
    return max(0, candidate.model.n_params * c - gathered_now)


def diagnose(setup: UserSetup, candidate: Candidate, plan: Plan | None, *, unwrapped_extra: int = 0,
             dynamic_control_flow: bool = False, profile: Profile | None = None,
             model_use_cache: bool | None = None) -> list[Finding]:
    """Run every rule. `candidate` is already priced as the user runs it (one unit when unwrapped, adding
    `unwrapped_extra` bytes)."""
    ctx = Context(setup=setup, candidate=candidate, model=candidate.model, cluster=candidate.cluster,
                  training=candidate.training, best=plan.best if plan else None,
                  best_same_techniques=next((c for c in plan.candidates if _techniques(c.config)
                                             == _techniques(candidate.config)), None) if plan else None,
                  dynamic_control_flow=dynamic_control_flow, unwrapped_extra_bytes=unwrapped_extra,
                  profile=profile or DEFAULT_PROFILE, model_use_cache=model_use_cache)
    findings = [f for rule in RULES for f in rule(ctx)]
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


@dataclass
class CheckReport:
    setup: UserSetup
    candidate: Candidate
    findings: list[Finding]
    plan: Plan | None

    @property
    def has_errors(self) -> bool:
        return any(f.severity == ERROR for f in self.findings)

    def to_dict(self) -> dict:
        return {
            "model": self.candidate.model.summary_dict(),
            "source": self.setup.source,
            "fsdp_version": self.setup.fsdp_version,
            **self.candidate.to_dict(),
            "findings": [f.to_dict() for f in self.findings],
        }


def check(setup: UserSetup, model, gpus: int | None = None, *, gpus_per_node: int | None = None,
          micro_batch: int | None = None, grad_accum: int | None = None, dynamic_control_flow: bool = False,
          profile: Profile | None = None, seq_len: int | None = None, **cluster_and_training) -> CheckReport:
    """Estimate the user's setup on the cluster and run every rule. Cluster size defaults to the one the
    accelerate config names (num_processes, num_machines); seq_len to the setup's own (torchtitan's
    training.seq_len), else 2048."""
    from planner.api import RESOLVE_KNOBS, estimate_config, grad_accum_for, plan_for, resolve_request
    from planner.request import build_request
    from planner.errors import PlannerError

    if gpus is None:
        if setup.n_processes is None:
            raise PlannerError("gpus", "missing: pass --gpus N (the config does not name num_processes)")
        gpus = setup.n_processes
    if gpus_per_node is None and setup.n_machines:
        gpus_per_node = max(1, gpus // setup.n_machines)
    seq_len = seq_len or setup.seq_len or 2048
    request = build_request(model, gpus, valid=RESOLVE_KNOBS, gpus_per_node=gpus_per_node, seq_len=seq_len,
                            **cluster_and_training)  # the request estimate() and plan() build
    spec, cluster, training = resolve_request(request)
    mb = micro_batch or setup.config.micro_batch
    pipeline = setup.pipeline  # torchtitan's stages per rank from layers_per_stage need the model's blocks
    staged = {"pp_stages_per_rank": pipeline.stages_per_rank(spec.n_layers)} if pipeline is not None else {}
    config = replace(setup.config, micro_batch=mb, **staged,
                     grad_accum=grad_accum or (grad_accum_for(mb, cluster, training, setup.config.model_parallel)
                                               if training.global_batch else setup.config.grad_accum))
    setup = replace(setup, config=config)
    profile = profile or DEFAULT_PROFILE
    if all(r.priced for r in refusals(cluster, config)):
        # priced even when it cannot run (rejected, with the reasons) so the report shows what it would need;
        # cannot_run explains
        candidate = Candidate(evaluate(spec, cluster, training, config, profile), spec, cluster, training)
    else:
        candidate = estimate_config(spec, cluster, training, config, profile)  # raises cluster_rejects' error
    best = plan_for(spec, cluster, training, profile)
    extra = unwrapped_extra_bytes(setup, candidate)
    candidate = _as_one_unit(candidate, extra, profile)
    findings = diagnose(setup, candidate, best, unwrapped_extra=extra, dynamic_control_flow=dynamic_control_flow,
                        profile=profile, model_use_cache=model_use_cache(model))
    return CheckReport(setup=setup, candidate=candidate, findings=findings, plan=best)


def _as_one_unit(candidate: Candidate, extra_bytes: int, profile: Profile) -> Candidate:
    """Without a wrap policy, the whole model is gathered at once: add it to the backward peak."""
    if not extra_bytes:
        return candidate
    e, m = candidate.evaluation, candidate.memory
    backward = replace(m.phases["backward"], unsharded_params=m.phases["backward"].unsharded_params + extra_bytes)
    phases = {**m.phases, "backward": backward}
    phase, breakdown = max(phases.items(), key=lambda kv: kv[1].total_bytes)
    allocated = breakdown.total_bytes
    memory = replace(m, breakdown=breakdown, peak_phase=phase, phases=phases, peak_allocated_bytes=allocated,
                     peak_reserved_bytes=profile.reserved_bytes(allocated),
                     notes=m.notes + ("no auto-wrap policy: the whole model is one unit, gathered at once",))
    reasons = [r for r in e.reasons if "GiB per GPU" not in r]
    if memory.peak_reserved_bytes > e.capacity_bytes:
        reasons.insert(0, gpu_memory_reason(memory.peak_reserved_bytes, e.capacity_bytes,
                                            "no auto-wrap policy: the whole model is gathered at once"))
    evaluation = replace(e, memory=memory, fits=not reasons, reasons=tuple(reasons))
    return Candidate(evaluation, candidate.model, candidate.cluster, candidate.training)
