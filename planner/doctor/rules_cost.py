"""The doctor's rules that price the setup against the planner's pick: it does not fit, a micro-batch that
leaves memory unused, a strategy clearly slower than the plan, the KV cache kept under checkpointing and
gradients reduced in low precision."""

from __future__ import annotations

from dataclasses import replace

from cost_models.evaluate import evaluate, step_peak_reason
from cost_models.feasibility import refusals
from cost_models.host_ram import host_ram_fix
from cost_models.specs import FsdpConfig, ModelSpec
from cost_models.units import DTYPE_BYTES, GiB

from planner.search.words import describe, technique_words
from planner.doctor.findings import ADVICE, ERROR, WARNING, Context, Finding, _techniques


def does_not_fit(ctx: Context):
    refused = {r.reason for r in refusals(ctx.cluster, ctx.candidate.config)}
    if ctx.unwrapped_extra_bytes:  # the step's peak as one unit: wrap_policy reports it
        refused.add(step_peak_reason(ctx.candidate.memory, ctx.candidate.evaluation.capacity_bytes))
    for reason in ctx.candidate.reasons:
        if reason in refused:
            continue  # reported by cannot_run / wrap_policy
        code = "cpu-ram-does-not-fit" if "CPU RAM" in reason else \
            "host-ram-does-not-fit" if "host RAM" in reason else "gpu-memory-does-not-fit"
        fix = {"cpu-ram-does-not-fit": "more nodes (offloaded state per node shrinks with the shard group), or no "
                                       "offload with more GPUs",
               "host-ram-does-not-fit": host_ram_fix(ctx.candidate.memory.host_ram)}.get(code) or _fit_fix(ctx)
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
