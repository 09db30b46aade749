"""Uncalibrated tokens/s against every published FSDP run in shared/reference/published.md.

    python benchmarks/throughput_accuracy.py [--json out.json]

Prints each row's published and predicted tokens/s/GPU (and reserved memory where the source gives it),
the error (predicted - published) / published, and the MAPE over the rows. Each row is priced in its
published setting: torchtitan's selective op-level checkpointing, torch.compile, Float8 linears and the
FP8 all-gather where the run used them. `--fit` also prints the bf16 matmul efficiency and the
memory-bound efficiency that fit all rows best jointly (the defaults in cost_models/profile.py come from it).

torchtitan's Llama runs its fused RMSNorm (norm "fused_rmsnorm", as tests/golden/test_published.py).
The H100 rows ran on Grand Teton hosts: 96 GB HBM2e at 2.4 TB/s, 500 W (catalog id h100-96gb).

The mesh rows (published.md, "torchtitan with context and tensor parallelism"): FSDP 8 x TP 8 on 64 GPUs
(sequence and loss parallel, TP inside each host; "local batch 12" is per data-parallel rank: micro-batch 12
on each TP group, one micro-step), vanilla and async TP, bf16 and Float8 tensorwise linears; FSDP 4 x CP 2 on 8
GPUs at 65,536 tokens. The Float8 rowwise TP rows (3,709 and 3,915 tokens/s/GPU) are not priced: the planner
has no rowwise-scaling recipe (NOT_PRICED).

The pipeline rows (PP_ROWS, issue 18): Llama 3 405B pretraining (Dubey et al. 2024, Table 4) as BF16 model
TFLOP/s per GPU = MFU x 989, every input stated in tests/golden/test_pipeline_rows.py (h100-80gb, TP 8 x PP 16,
interleaved 1F1B with the paper's one-layer chunks: V = 8, no checkpointing, 16M tokens per batch, micro-batch 1).
They are costed through cost_models.evaluate (the mesh rules still refuse pp > 1 and block-less end stages).

The expert-parallel rows (AUTOMODEL_ROWS, issue 26): NVIDIA NeMo Automodel's Qwen3-30B-A3B and GPT-OSS 20B on
8 x H100 80 GB, FSDP 8 x EP 8, through the public API with the automodel trainer and one setting for both
(AUTOMODEL_SETTING: bf16 params and Adam states, fp32 reduce, full checkpointing, DeepEP, round-robin routing, TE
RMSNorm, the MoE parallelizer's SHARD_GRAD_OP; the trainer's TE attention, attention_kernel cudnn on Hopper;
tests/golden/test_automodel_rows.py says why each).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from tabulate import tabulate

from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.specs import FsdpConfig, TrainingSpec
from planner.api import estimate_config
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.trainers.table import TORCHTITAN_ALLOC_CONF


@dataclass(frozen=True)
class Row:
    source: str
    model: str
    gpu: str
    gpus: int
    micro_batch: int
    seq_len: int
    technique: str           # as published
    tokens_per_s: float      # published, per GPU
    memory_gib: float | None  # published peak reserved, where given
    checkpointing: str       # activation checkpointing as published (selective-op: torchtitan's op-level policy)
    options: tuple = ()      # the published run's optimizations: compile, float8, fp8_all_gather
    unmodelled: str = ""     # what the published run does that the plan does not (empty: modelled exactly)
    compile_loss: bool = True  # with compile: the loss compiled too (torchtitan's default since 2025)
    tp: int = 1              # tensor-parallel degree (sequence and loss parallel, torchtitan's default)
    cp: int = 1              # context-parallel degree (FSDP over dp_shard x cp)


A100, H100, H200 = "torchtitan 64 x A100 (mid-2024)", "torchtitan H100 (Dec 2024)", "torchtitan H200 (Jun 2025)"
H100_TP = "torchtitan H100 async TP (Jun 2025)"
SELECTIVE_OP = "selective op-level AC"
ROWS = [
    Row(A100, "llama2-13b", "a100-80gb", 64, 2, 4096, "none", 2162, None, "none"),
    Row(A100, "llama2-13b", "a100-80gb", 64, 2, 4096, "selective layer", 1914, None, "every-2"),
    Row(A100, "llama2-13b", "a100-80gb", 64, 2, 4096, "selective op", 1904, None, "selective-op"),
    Row(A100, "llama2-70b", "a100-80gb", 64, 2, 4096, "full", 353, None, "full"),
    Row(A100, "llama3-8b", "a100-80gb", 64, 1, 8192, "selective layer", 2876, None, "every-2"),
    Row(A100, "llama3-8b", "a100-80gb", 64, 1, 8192, "selective op", 2973, None, "selective-op"),
    Row(A100, "llama3-70b", "a100-80gb", 64, 1, 8192, "full", 323, None, "full"),
    # torchtitan's train.py of late 2024 compiled the blocks only: its `loss_fn = torch.compile(loss_fn)` was
    # commented out ("compiling loss function causes CUDA errors"); the loss became a compile component in 2025.
    *(Row(H100, "llama3.1-8b", "h100-96gb", gpus, 2, 8192, tech, tps, mem, "selective-op", options,
          compile_loss=False)
      for gpus, rows in ((8, ((5762, 82.4), (6667, 77.0), (8532, 76.8))),
                         (128, ((5605, 67.0), (6514, 62.0), (8380, 61.8))))
      for (tps, mem), tech, options in zip(rows, ("FSDP", "FSDP + compile", "FSDP + compile + Float8"),
                                           ((), ("compile",), ("compile", "float8")))),
    Row(H100, "llama3.1-8b", "h100-96gb", 8, 1, 32768, "compile + Float8, full AC", 3890, 83.9, "full",
        ("compile", "float8"), compile_loss=False),
    Row(H200, "llama3.1-8b", "h200-141gb", 32, 2, 8192, "compile + Float8 + FP8 all-gather", 10938, 47.96,
        "selective-op", ("compile", "float8", "fp8_all_gather")),
    Row(H200, "llama3.1-8b", "h200-141gb", 64, 2, 8192, "compile + Float8 + FP8 all-gather", 10753, 46.97,
        "selective-op", ("compile", "float8", "fp8_all_gather")),
    # the mesh: benchmarks/llama3_h100_202412_torchtitan.md (CP, Table 2) and asyncTP_llama3_h100_2025-06 (TP)
    Row(H100, "llama3.1-8b", "h100-96gb", 8, 1, 65536, "FSDP 4 x CP 2, compile + Float8, full AC", 2540, 84.2,
        "full", ("compile", "float8"), compile_loss=False, cp=2),
    *(Row(H100_TP, "llama3.1-8b", "h100-96gb", 64, 12, 8192, f"FSDP 8 x TP 8, {tech}", tps, None, "selective-op",
          options, tp=8)
      for tech, tps, options in (("bf16, vanilla TP", 4378, ("compile",)),
                                 ("bf16, async TP", 4809, ("compile", "async_tp")),
                                 ("Float8 tensorwise, vanilla TP", 5078, ("compile", "float8")),
                                 ("Float8 tensorwise, async TP", 5570, ("compile", "float8", "async_tp")))),
]
# published rows the planner cannot price (printed, not costed)
NOT_PRICED = [
    (H100_TP, "FSDP 8 x TP 8, Float8 rowwise, vanilla TP", 3709, "no rowwise-scaling Float8 recipe"),
    (H100_TP, "FSDP 8 x TP 8, Float8 rowwise, async TP", 3915, "no rowwise-scaling Float8 recipe"),
]


LLAMA3 = "Llama 3 405B pretraining (Dubey et al. 2024, Table 4)"
LLAMA3_TOKENS_PER_BATCH = 2 ** 24  # 16M tokens per global batch


@dataclass(frozen=True)
class PipelineRow:
    gpus: int
    cp: int
    seq_len: int
    tflops_per_gpu: float    # published BF16 model TFLOP/s per GPU
    tp: int = 8
    pp: int = 16


PP_ROWS = [PipelineRow(8192, 1, 8192, 430), PipelineRow(16384, 1, 8192, 400), PipelineRow(16384, 16, 131072, 380)]


def predict_pipeline(row: PipelineRow, profile: Profile = DEFAULT_PROFILE, stages_per_rank: int = 8,
                     checkpointing: str = "none"):
    """(model, cluster, config, Evaluation) of a Llama 3 row: DP = the GPUs over tp x cp x pp, the microbatches
    the 16M-token batch over DP at micro-batch 1 (tests/golden/test_pipeline_rows.py states why each input)."""
    from cost_models.evaluate import evaluate

    model = load_preset("llama3.1-405b")
    dp = row.gpus // (row.tp * row.pp * row.cp)
    config = FsdpConfig(sharding="FULL_SHARD", precision="bf16", ac_every=checkpointing, micro_batch=1,
                        grad_accum=LLAMA3_TOKENS_PER_BATCH // row.seq_len // dp, tp=row.tp, cp=row.cp, pp=row.pp,
                        pp_schedule="interleaved-1f1b", pp_stages_per_rank=stages_per_rank)
    cluster = make_cluster(row.gpus, "h100-80gb")
    return model, cluster, config, evaluate(model, cluster, TrainingSpec(seq_len=row.seq_len), config, profile)


def pipeline_table() -> tuple[list[list[str]], list[float]]:
    """The PP rows' table lines and errors (predicted TFLOP/s = MFU x the GPU's bf16 peak)."""
    table, errors = [], []
    for row in PP_ROWS:
        _, cluster, config, e = predict_pipeline(row)
        t = e.time
        tflops = t.mfu * cluster.gpu.priced_peak_flops("bf16") / 1e12
        errors.append(tflops / row.tflops_per_gpu - 1)
        table.append([LLAMA3, f"{row.gpus:,} x h100-80gb", f"tp {row.tp} cp {row.cp} pp {row.pp} dp "
                      f"{config.data_parallel_size(cluster)}", f"{row.seq_len:,}", config.pp_microbatches,
                      f"{row.tflops_per_gpu:.0f}", f"{tflops:.0f}", f"{100 * errors[-1]:+.1f}%",
                      f"{100 * t.pp_bubble_s / t.step_s:.1f}%", f"{100 * t.pp_imbalance_s / t.step_s:.1f}%",
                      f"{100 * t.pp_comm_s / t.step_s:.1f}%"])
    return table, errors


AUTOMODEL = "NeMo Automodel DGX-H100 (Oct 2025)"
AUTOMODEL_SETTING = dict(trainer="automodel", gpu="h100-80gb", seq_len=4096, ep=8, precision="bf16-pure",
                         reduce_dtype="fp32", activation_checkpointing="full", sharding="SHARD_GRAD_OP",
                         moe_dispatch="deepep", routing="round-robin", norm_kernel="te")
AUTOMODEL_GRAD_ACCUM = 16
# model, local batch, attention (TE attention priced as SDPA's flash kernel; GPT-OSS: FlexAttention), tokens/s/GPU
AUTOMODEL_ROWS = [("qwen3-30b-a3b", 4, "sdpa", 12040), ("gpt-oss-20b", 2, "flex", 13058)]


def predict_automodel(model: str, local_batch: int, attention: str):
    """An Automodel row in its published setting (8 GPUs, global batch = local batch x 16 x 8)."""
    from planner import estimate

    return estimate(model, 8, micro_batch=local_batch, global_batch=local_batch * AUTOMODEL_GRAD_ACCUM * 8,
                    attention=attention, **AUTOMODEL_SETTING)


def automodel_table() -> tuple[list[list[str]], list[float]]:
    """The Automodel rows' table lines and errors."""
    table, errors = [], []
    for model, local_batch, attention, published in AUTOMODEL_ROWS:
        c = predict_automodel(model, local_batch, attention)
        t = c.time
        errors.append(t.tokens_per_s_per_gpu / published - 1)
        table.append([AUTOMODEL, model, f"{local_batch} x 4,096", f"{published:,}", f"{t.tokens_per_s_per_gpu:,.0f}",
                      f"{100 * errors[-1]:+.1f}%", f"{t.step_s:.2f}", f"{t.memory_bound_s:.2f}", f"{t.ep_comm_s:.2f}",
                      f"{c.memory.allocator_reserved_bytes / 2**30:.1f}"])
    return table, errors


def predict(row: Row, profile: Profile = DEFAULT_PROFILE):
    """The published setting: FSDP2 FULL_SHARD, bf16 with fp32 reduction, its checkpointing and options, under
    torchtitan's allocator settings (its run_train.sh exports expandable_segments:True: the reserved replay's)."""
    model = replace(load_preset(row.model), norm="fused_rmsnorm", name=f"{row.model} (torchtitan)")
    config = FsdpConfig(sharding="FULL_SHARD", precision="bf16", ac_every=row.checkpointing,
                        micro_batch=row.micro_batch, compile_loss=row.compile_loss, tp=row.tp, cp=row.cp,
                        alloc_conf=TORCHTITAN_ALLOC_CONF,
                        **{name: True for name in row.options})
    return estimate_config(model, make_cluster(row.gpus, row.gpu), TrainingSpec(seq_len=row.seq_len), config,
                           profile)


def fit_efficiencies() -> tuple[tuple[float, float], tuple[float, float], float]:
    """The bf16 matmul efficiency and the memory-bound efficiency (cost_models/profile.py) minimising the
    squared log-errors of all rows jointly: (values, standard errors, rms log error)."""
    import math

    import numpy as np
    from scipy.optimize import least_squares

    def log_errors(x) -> list[float]:
        profile = DEFAULT_PROFILE.with_updates(
            compute_efficiency={**DEFAULT_PROFILE.compute_efficiency, "bf16": x[0], "fp16": x[0]},
            memory_bound_efficiency=x[1])
        return [math.log(predict(r, profile).time.tokens_per_s_per_gpu / r.tokens_per_s) for r in ROWS]

    sol = least_squares(log_errors, [DEFAULT_PROFILE.efficiency("bf16"), DEFAULT_PROFILE.memory_bound_efficiency],
                        bounds=([0.2, 0.1], [1.2, 1.0]))
    variance = float(np.sum(sol.fun ** 2)) / (len(ROWS) - 2)
    errors = np.sqrt(np.diag(np.linalg.inv(sol.jac.T @ sol.jac)) * variance)
    return (float(sol.x[0]), float(sol.x[1])), (float(errors[0]), float(errors[1])), math.sqrt(variance)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows and predictions here")
    parser.add_argument("--fit", action="store_true",
                        help="also print the bf16 matmul and memory-bound efficiencies that least-squares fit every "
                             "row jointly (log errors)")
    args = parser.parse_args(argv)
    if args.fit:
        (matmul, memory), (matmul_se, memory_se), rms = fit_efficiencies()
        print(f"least squares over the {len(ROWS)} rows (log errors, rms {rms:.3f}): bf16 compute efficiency "
              f"{matmul:.3f} +- {matmul_se:.3f} (default {DEFAULT_PROFILE.efficiency('bf16')}), memory-bound "
              f"efficiency {memory:.3f} +- {memory_se:.3f} (default {DEFAULT_PROFILE.memory_bound_efficiency})\n")
    table, out, exact_errors = [], [], []
    for row in ROWS:
        c = predict(row)
        tps = c.time.tokens_per_s_per_gpu
        err = tps / row.tokens_per_s - 1
        mem = c.memory.allocator_reserved_bytes / 2**30  # published: max_memory_reserved, the allocator's alone
        if not row.unmodelled:
            exact_errors.append(abs(err))
        table.append([row.source, row.model, f"{row.gpus} x {row.gpu}", f"{row.micro_batch} x {row.seq_len}",
                      row.technique, f"{row.tokens_per_s:,.0f}", f"{tps:,.0f}", f"{100 * err:+.1f}%",
                      "" if row.memory_gib is None else f"{row.memory_gib:.1f}", f"{mem:.1f}",
                      " + ".join((row.checkpointing,) + row.options)
                      + (f" (lacks {row.unmodelled})" if row.unmodelled else "")])
        out.append({**row.__dict__, "predicted_tokens_per_s": tps, "error": err, "predicted_memory_gib": mem})
    print(tabulate(table, headers=["source", "model", "GPUs", "mb x seq", "published technique", "tok/s/GPU",
                                   "predicted", "error", "GiB", "predicted GiB", "priced as"]))
    print(f"\nMAPE over the {len(exact_errors)} rows modelled exactly: {100 * statistics.mean(exact_errors):.1f}% "
          f"(max {100 * max(exact_errors):.1f}%)" + (f"; the other {len(ROWS) - len(exact_errors)} rows are priced "
                                                    "at the nearest modelled setting" if len(exact_errors) < len(ROWS) else ""))
    pp_table, pp_errors = pipeline_table()
    print("\npipeline rows (interleaved 1F1B, V 8, no checkpointing, micro-batch 1; BF16 model TFLOP/s per GPU):")
    print(tabulate(pp_table, headers=["source", "GPUs", "mesh", "seq", "microbatches", "TFLOP/s", "predicted",
                                      "error", "bubble", "imbalance", "sends exposed"]))
    print(f"MAPE over the {len(pp_errors)} pipeline rows: {100 * statistics.mean(map(abs, pp_errors)):.1f}% "
          f"(max {100 * max(map(abs, pp_errors)):.1f}%)")
    am_table, am_errors = automodel_table()
    print("\nexpert-parallel rows (FSDP 8 x EP 8, DeepEP, round-robin routing, bf16 params and Adam states, full AC):")
    print(tabulate(am_table, headers=["source", "model", "mb x seq", "tok/s/GPU", "predicted", "error", "step s",
                                      "memory-bound s", "EP comm s", "predicted GiB"]))
    print(f"MAPE over the {len(am_errors)} expert-parallel rows: {100 * statistics.mean(map(abs, am_errors)):.1f}%")
    for source, technique, tps, why in NOT_PRICED:
        print(f"not priced: {source}, {technique}: {tps:,} tokens/s/GPU ({why})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
