"""Uncalibrated tokens/s and reserved memory against the published runs past the defaults' region (issue 27).

    python benchmarks/frontier_accuracy.py

Each row of shared/reference/published.md that the planner was never fitted to (long context under CP 4,
torchtitan's 405B pipelines, Blackwell), priced through the public API in its published setting with the trainer
that ran it, and printed beside the published figures. Nothing here is fitted: the rows say where the cost model
drifts (docs/accuracy.md and the issue note carry the figures), and any change to the model should print them
before and after.

- torchtitan's December-2024 runs (published.md, "How torchtitan's December-2024 benchmark runs were configured"):
  trainer torchtitan-0.2, the blocks compiled and the loss eager (compile_scope "blocks"), Float8 linears (the
  405B rows with the FP8 all-gather and async TP), full checkpointing; H100 96 GB / 500 W hosts (h100-96gb).
  The 405B rows: FSDP 8 x TP 8 x PP 8 on 512 GPUs, local batch 32 as 8 microbatches of 4 (global batch 256);
  the interleaved row at 2 stages per rank (that commit's default).
- torchtitan on 8 x B200 (docs/mxfp8.md): Llama 3 8B, selective op-level checkpointing, compiled blocks and loss,
  fused AdamW, bf16 linears. Those B200s were power-limited to 750 W: the row prices the 1,000 W b200 at
  power_limit_w=750 (matmul and attention rates x (750 / 1000)^(1/3) = 0.909, GpuSpec.clock_scale). The gap left is
  kernel-level: no measured Blackwell GEMM or attention efficiency in the reference (b200 takes the profile's
  defaults, 0.8 and 0.35, Hopper-like), nothing tuned to this row.
"""

from __future__ import annotations

from tabulate import tabulate

from planner import estimate

TITAN_DEC_2024 = dict(trainer="torchtitan-0.2", precision="bf16", compile=True, compile_scope="blocks", float8=True,
                      activation_checkpointing="full")
PIPELINE_405B = dict(TITAN_DEC_2024, gpu="h100-96gb", tp=8, pp=8, seq_len=8192, micro_batch=4, global_batch=256,
                     fp8_all_gather=True, async_tp=True)
# (label, model, GPUs, estimate's keywords, published tokens/s/GPU, published reserved GiB)
ROWS = [
    ("8B FSDP 2 x CP 4, 131,072 tokens (Dec 2024)", "llama3.1-8b", 8,
     dict(TITAN_DEC_2024, gpu="h100-96gb", cp=4, seq_len=131072, micro_batch=1), 1071, 84.0),
    ("405B FSDP 8 x TP 8 x PP 8, 1F1B (Dec 2024)", "llama3.1-405b", 512,
     dict(PIPELINE_405B, pp_schedule="1f1b"), 100, 82.5),
    ("405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B (Dec 2024)", "llama3.1-405b", 512,
     dict(PIPELINE_405B, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2), 128, 72.7),
    ("Llama 3 8B FSDP 8 on B200 (750 W), selective op", "llama3-8b", 8,
     dict(trainer="torchtitan", gpu="b200", power_limit_w=750, precision="bf16", seq_len=8192, micro_batch=1,
          compile=True, activation_checkpointing="selective-op", optimizer_impl="fused"), 8307.5, 33.71),
]


def defaults_gib(model: str, gpus: int, knobs: dict) -> str:
    """A pipeline row's reserved replayed under PyTorch's default allocator settings (alloc_conf ""); the row itself
    runs under its trainer's, expandable_segments:True for torchtitan (its run_train.sh sets it)."""
    if knobs.get("pp", 1) == 1:
        return ""
    return f"{estimate(model, gpus, alloc_conf='', **knobs).memory.allocator_reserved_bytes / 2**30:.1f}"


def main() -> None:
    table = []
    for label, model, gpus, knobs, tokens_per_s, reserved_gib in ROWS:
        c = estimate(model, gpus, **knobs)
        # published "reserved" is torch.cuda.max_memory_reserved: the caching allocator's segments only, so the estimate's
        # allocator part is compared (peak_reserved_bytes adds the memory outside it: cost_models/outside_allocator.py)
        predicted_tps, predicted_gib = c.time.tokens_per_s_per_gpu, c.memory.allocator_reserved_bytes / 2**30
        cap = f" at {knobs['power_limit_w']} W" if "power_limit_w" in knobs else ""
        table.append([label, f"{gpus} x {knobs['gpu']}{cap}", f"{tokens_per_s:,.0f}", f"{predicted_tps:,.0f}",
                      f"{100 * (predicted_tps / tokens_per_s - 1):+.1f}%", f"{reserved_gib:.1f}", f"{predicted_gib:.1f}",
                      f"{100 * (predicted_gib / reserved_gib - 1):+.1f}%", defaults_gib(model, gpus, knobs)])
    print(tabulate(table, headers=["published run", "GPUs", "tok/s/GPU", "predicted", "error", "reserved GiB",
                                   "predicted GiB", "error", "PyTorch defaults GiB"]))


if __name__ == "__main__":
    main()
