"""The pipeline-parallel rows of benchmarks/memory_accuracy.py (--pp): estimate vs trace for every pipeline rank.

    python benchmarks/memory_accuracy.py --pp [--jobs 1] [--json out.json] [--only-schedule 1f1b]

For each configuration: cost_models.memory.estimate_memory (pp > 1: cost_models/pipeline_memory.py, one figure per
pipeline rank) against calibration.trace_pipeline.trace_pipeline (torch.distributed.pipelining's schedule on fake
tensors at the real world size, one trace per pipeline rank); error = (estimate - trace) / trace of each rank's
peak allocated bytes. The bar: every rank within 1%. Traces are kept in $FSDP_PLANNER_CACHE/pp_traces.json (keyed
by the row), so a re-run after an estimate change re-prices in seconds; delete the file to trace afresh.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

# Small llama-family configs (transformers from_config, no weights): 8 and 16 blocks so pp reaches 8 and
# interleaved schedules 16 stages; llama3.2-1b is the real preset (tied embeddings, V = 128,256).
PP_ARCHS: dict[str, dict] = {
    "llama-8": {"model_type": "llama", "_name_or_path": "llama-8", "hidden_size": 256, "intermediate_size": 768,
                "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8000,
                "max_position_embeddings": 4096},
    "llama-16": {"model_type": "llama", "_name_or_path": "llama-16", "hidden_size": 384, "intermediate_size": 1024,
                 "num_hidden_layers": 16, "num_attention_heads": 6, "num_key_value_heads": 6, "vocab_size": 6000,
                 "max_position_embeddings": 4096},
}
PRESETS = ("llama3.2-1b",)

# (arch, schedule, pp, stages per rank (0: the schedule's), microbatches, gpus, gpus per node, sharding,
#  precision, ac_every, micro-batch, seq)
SETTINGS = [
    ("llama-8", "1f1b", 2, 0, 4, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256),
    ("llama-8", "1f1b", 2, 0, 8, 2, 8, "FULL_SHARD", "bf16", 0, 2, 256),
    ("llama-8", "1f1b", 4, 0, 4, 8, 8, "FULL_SHARD", "bf16", 1, 2, 256),
    ("llama-8", "1f1b", 4, 0, 8, 16, 8, "FULL_SHARD", "fp32", 0, 1, 256),
    ("llama-8", "1f1b", 8, 0, 8, 8, 8, "FULL_SHARD", "bf16", 0, 2, 128),
    ("llama-8", "1f1b", 2, 0, 6, 8, 8, "FULL_SHARD", "bf16", 0, 4, 128),
    ("llama-8", "gpipe", 2, 0, 2, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256),
    ("llama-8", "gpipe", 4, 0, 6, 8, 8, "FULL_SHARD", "bf16", 2, 2, 256),
    ("llama-8", "gpipe", 8, 0, 4, 16, 8, "FULL_SHARD", "bf16-pure", 0, 2, 256),
    ("llama-8", "gpipe", 2, 0, 4, 8, 2, "HYBRID_SHARD", "bf16", 0, 2, 256),
    ("llama-8", "gpipe", 2, 0, 8, 2, 8, "FULL_SHARD", "fp32", 0, 1, 256),
    ("llama-8", "interleaved-1f1b", 2, 2, 4, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256),
    ("llama-8", "interleaved-1f1b", 4, 2, 8, 8, 8, "FULL_SHARD", "bf16", 0, 2, 256),
    ("llama-8", "interleaved-1f1b", 2, 4, 4, 4, 8, "FULL_SHARD", "bf16", 1, 2, 256),
    ("llama-16", "interleaved-1f1b", 4, 2, 4, 16, 8, "FULL_SHARD", "bf16", 1, 2, 256),
    ("llama-16", "interleaved-1f1b", 8, 2, 8, 8, 8, "FULL_SHARD", "bf16", 0, 1, 256),
    ("llama-16", "1f1b", 4, 0, 4, 8, 8, "FULL_SHARD", "bf16", 0, 2, 256),
    ("llama-16", "gpipe", 4, 0, 4, 8, 8, "FULL_SHARD", "fp32", 1, 1, 256),
    ("llama3.2-1b", "1f1b", 2, 0, 2, 4, 8, "FULL_SHARD", "bf16", 0, 1, 512),
    ("llama3.2-1b", "gpipe", 4, 0, 4, 8, 8, "FULL_SHARD", "bf16", 1, 1, 512),
    ("llama3.2-1b", "interleaved-1f1b", 2, 2, 4, 8, 8, "FULL_SHARD", "bf16", 0, 1, 512),
    ("llama3.2-1b", "1f1b", 4, 0, 8, 4, 8, "FULL_SHARD", "bf16-pure", 0, 1, 256),
    # TP inside each stage (transformers' tp_plan: no sequence parallel; the 14th field: tp)
    ("llama-8", "1f1b", 2, 0, 4, 8, 8, "FULL_SHARD", "bf16", 0, 2, 256, 2),
    ("llama-8", "gpipe", 2, 0, 4, 8, 8, "FULL_SHARD", "bf16", 1, 2, 256, 2),
    ("llama-16", "interleaved-1f1b", 2, 2, 4, 8, 8, "FULL_SHARD", "bf16", 0, 2, 256, 2),
    ("llama-16", "1f1b", 4, 0, 8, 16, 8, "FULL_SHARD", "bf16", 0, 1, 256, 2),
    # the split-backward schedules (I / W)
    ("llama-8", "zero-bubble", 2, 2, 4, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256),
    ("llama-8", "dualpipev", 2, 2, 4, 4, 8, "FULL_SHARD", "bf16", 0, 2, 256),
    ("llama-8", "zero-bubble", 2, 2, 4, 4, 8, "FULL_SHARD", "bf16", 1, 2, 256),
    ("llama-8", "dualpipev", 2, 2, 8, 4, 8, "FULL_SHARD", "fp32", 0, 1, 256),
]


def pp_grid() -> list[dict]:
    keys = ("arch", "pp_schedule", "pp", "pp_stages_per_rank", "microbatches", "gpus", "gpus_per_node", "sharding",
            "precision", "ac_every", "micro_batch", "seq_len", "tp")  # tp only where > 1 (the trace cache's keys)
    return [dict(zip(keys, row)) for row in SETTINGS]


def hf_config(arch: str) -> dict:
    if arch in PRESETS:
        from planner.models import hf_config_of

        return hf_config_of(arch)
    return dict(PP_ARCHS[arch])


def row_config(row: dict):
    from cost_models.specs import FsdpConfig

    return FsdpConfig(sharding=row["sharding"], precision=row["precision"], ac_every=row["ac_every"],
                      micro_batch=row["micro_batch"], grad_accum=row["microbatches"], pp=row["pp"],
                      pp_schedule=row["pp_schedule"], pp_stages_per_rank=row["pp_stages_per_rank"],
                      tp=row.get("tp", 1), sequence_parallel=row.get("tp", 1) == 1)


def estimate_row(row: dict):
    """The estimate's PipelineRankMemory per rank (no torch)."""
    from cost_models.memory import estimate_memory
    from cost_models.profile import DEFAULT_PROFILE
    from planner.api import resolve_inputs

    spec, cluster, training = resolve_inputs(hf_config(row["arch"]) if row["arch"] not in PRESETS else row["arch"],
                                             row["gpus"], gpus_per_node=min(row["gpus"], row["gpus_per_node"]),
                                             seq_len=row["seq_len"])
    return spec, estimate_memory(spec, cluster, training, row_config(row), DEFAULT_PROFILE).pipeline_ranks


# traces kept between runs (keyed by the row): re-pricing the grid after an estimate change takes seconds
TRACE_CACHE = Path(os.environ.get("FSDP_PLANNER_CACHE", Path.home() / ".cache" / "fsdp-planner")) / "pp_traces.json"


def _traced(row: dict, spec) -> list[dict]:
    key = json.dumps(row, sort_keys=True)
    cache = json.loads(TRACE_CACHE.read_text()) if TRACE_CACHE.exists() else {}
    if key not in cache:
        from calibration.trace_pipeline import trace_pipeline

        traced = trace_pipeline(spec, row_config(row), n_gpus=row["gpus"],
                                gpus_per_node=min(row["gpus"], row["gpus_per_node"]),
                                seq_len=row["seq_len"], hf_config=hf_config(row["arch"]))
        cache = json.loads(TRACE_CACHE.read_text()) if TRACE_CACHE.exists() else {}  # other jobs' rows too
        cache[key] = [{"peak": t.peak_allocated_bytes, "phase": t.peak_phase, "breakdown": dict(t.breakdown)}
                      for t in traced]
        TRACE_CACHE.parent.mkdir(parents=True, exist_ok=True)
        TRACE_CACHE.write_text(json.dumps(cache))
    return cache[key]


def run_pp_one(row: dict) -> dict:
    t0 = time.perf_counter()
    try:
        spec, ranks = estimate_row(row)
        traced = _traced(row, spec)
    except Exception as exc:  # noqa: BLE001 - a failed row is reported, the grid goes on
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    return {**row, "seconds": time.perf_counter() - t0, "ranks": [
        {"rank": e.rank, "stages": list(e.stages), "estimate_peak": e.peak_allocated_bytes,
         "trace_peak": t["peak"], "estimate_moment": e.peak_moment, "trace_phase": t["phase"],
         "estimate_breakdown": e.breakdown.to_dict(), "trace_breakdown": t["breakdown"],
         "relative_error": e.peak_allocated_bytes / t["peak"] - 1} for e, t in zip(ranks, traced)]}


def summarize_pp(results: list[dict]) -> str:
    from tabulate import tabulate

    rows, by_schedule = [], {}
    for i, r in enumerate(results, 1):
        label = [i, r["arch"], r["pp_schedule"], f"{r['pp']}x{r['pp_stages_per_rank'] or '-'}", r["microbatches"],
                 r["gpus"], r.get("tp", 1), r["sharding"], r["precision"], r["ac_every"], f"{r['micro_batch']}x{r['seq_len']}"]
        if "error" in r:
            rows.append(label + ["FAILED", r["error"][:60], "", ""])
            continue
        worst = max(r["ranks"], key=lambda x: abs(x["relative_error"]))
        by_schedule.setdefault(r["pp_schedule"], []).append([abs(x["relative_error"]) for x in r["ranks"]])
        rows.append(label + [" ".join(f"{100 * x['relative_error']:+.2f}%" for x in r["ranks"]),
                             f"{worst['trace_peak'] / 2**20:.1f}", f"{worst['estimate_peak'] / 2**20:.1f}",
                             worst["estimate_moment"]])
    lines = ["Per configuration: error = (estimate - trace) / trace of each pipeline rank's peak allocated (rank 0 "
             "first); the worst rank's MiB and the estimate's peak moment (tp > 1: without sequence parallel)",
             tabulate(rows, headers=["#", "arch", "schedule", "pp x V", "m", "gpus", "tp", "sharding", "precision", "ac",
                                     "mb x seq", "error per rank", "trace MiB", "estimate MiB", "estimated peak"],
                      tablefmt="simple", disable_numparse=True), ""]
    every = [ranks for configs in by_schedule.values() for ranks in configs]
    for schedule, configs in [*by_schedule.items(), ("all", every)] if every else ():
        errors = [e for ranks in configs for e in ranks]
        lines.append(f"{schedule}: {len(configs)} configurations, {len(errors)} pipeline ranks, |error| median "
                     f"{100 * statistics.median(errors):.2f}%, max {100 * max(errors):.2f}%; "
                     f"{sum(max(ranks) <= 0.01 for ranks in configs)} of {len(configs)} with every rank within 1%")
    return "\n".join(lines)
