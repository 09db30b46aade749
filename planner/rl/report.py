"""`fsdp-plan rl estimate`'s outputs: the phase table and host RAM as text, and the JSON dict that
planner/schemas/rl.py describes."""

from __future__ import annotations

import json
import textwrap

from tabulate import tabulate

from cost_models.units import GiB
from planner.line_width import LINE_WIDTH

from .evaluate import RlEstimate
from .search import RlPlan

# What the figures rest on beyond the engines' and verl's own code (said in every output).
ESTIMATES = ("engine profile-run activations and CUDA-graph pool (rollout_engine.py)",
             "every step time: a decode roofline, the FSDP step model at the micro-batch, bytes over links "
             "(rl_time.py)",
             "log-prob forward working set: one block's saved bytes as its bound (rl_phases.py)",
             "mean lengths under remove-padding: as given, else the maxima")


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def rl_dict(e: RlEstimate) -> dict:
    peak = e.memory.peak
    eng, s = e.memory.engine, e.engine_settings
    return {
        "model": e.model.summary_dict(),
        "gpus": e.cluster.n_gpus, "gpu": e.cluster.gpu.id,
        "fits": e.fits, "reasons": list(e.reasons), "notes": list(e.notes),
        "memory": {
            "peak_reserved_bytes": peak.reserved_bytes, "peak_phase": peak.name,
            "cpu_bytes_per_node": e.host.peak_bytes,
            "cpu_ram_capacity_bytes": e.cluster.cpu_ram_bytes_per_node,
            "capacity_bytes": e.cluster.gpu.memory_bytes,
            "phases": [{"name": p.name, "reserved_bytes": p.reserved_bytes, "allocated_bytes": p.allocated_bytes,
                        "gpu_bytes": dict(p.gpu_bytes), "offloaded": list(p.offloaded), "note": p.note}
                       for p in e.memory.phases],
            "host": {"terms": dict(e.host.terms), "process_bytes": e.host.process_bytes,
                     "load_bytes": e.host.load_bytes, "checkpoint_staging_bytes": e.host.checkpoint_staging_bytes},
        },
        "engine": {"engine": s.engine.value, "version": s.version, "gpu_memory_utilization": s.gpu_memory_utilization,
                   "tp": s.tp, "weights_bytes": eng.weights_bytes, "kv_bytes": eng.kv_bytes,
                   "kv_blocks": eng.kv_blocks, "kv_tokens": eng.kv_tokens,
                   "max_concurrent_seqs": eng.max_concurrent_seqs, "cuda_graph_bytes": eng.cuda_graph_bytes,
                   "activation_peak_bytes": eng.activation_peak_bytes},
        "batch": {"data_parallel": e.batch.data_parallel, "sequences_per_step": e.batch.sequences_per_step,
                  "mini_batch_seqs_per_rank": e.batch.mini_batch_seqs_per_rank,
                  "micro_batches_per_mini": e.batch.micro_batches_per_mini,
                  "update_tokens_per_gpu": e.batch.update_tokens_per_gpu,
                  "log_prob_tokens_per_gpu": e.batch.log_prob_tokens_per_gpu},
        "time": e.time.to_dict(),
        "estimates": list(ESTIMATES),
    }


def rl_json(e: RlEstimate) -> str:
    return json.dumps(rl_dict(e), indent=2)


def rl_text(e: RlEstimate) -> str:
    r, eng, b = e.request, e.memory.engine, e.batch
    peak = e.memory.peak
    rows = [[p.name + (" *" if p is peak else ""), gib(p.reserved_bytes),
             ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in p.gpu_bytes.items()), ", ".join(p.offloaded)]
            for p in e.memory.phases]
    host = [[k, gib(v)] for k, v in e.host.terms.items()]
    host += [["workers' processes (a floor)", gib(e.host.process_bytes)],
             ["loading (rank 0 builds the actor)", gib(e.host.load_bytes)],
             ["checkpoint staging", gib(e.host.checkpoint_staging_bytes)], ["peak", gib(e.host.peak_bytes)]]
    head = [
        f"{e.model.name} ({e.model.n_params / 1e9:.2f}B) {r.algorithm.upper()} on {e.cluster.n_gpus} x "
        f"{e.cluster.gpu.id}: {r.strategy} actor {r.actor_dtype} ({r.finetune}), {r.engine} {r.engine_version} "
        f"TP {r.rollout_tp} at {r.gpu_memory_utilization}",
        f"batch: {b.sequences_per_step} sequences per step, {b.mini_batch_seqs_per_rank} per rank per mini-batch; "
        f"update micro-batch {b.update_tokens_per_gpu:,} tokens per GPU, log-prob {b.log_prob_tokens_per_gpu:,}",
        f"engine: weights {gib(eng.weights_bytes)} GiB, KV cache {gib(eng.kv_bytes)} GiB ({eng.kv_tokens:,} tokens, "
        f"{eng.max_concurrent_seqs} sequences of {r.prompt_len + r.response_len} at once)",
    ]
    lines = [
        *(textwrap.fill(line, LINE_WIDTH, subsequent_indent="  ") for line in head),
        "",
        f"Memory per GPU by phase (GiB reserved; * the peak, of {gib(e.cluster.gpu.memory_bytes)}):",
        tabulate(rows, headers=["phase", "reserved", "resident and transient", "off the GPU"], tablefmt="simple",
                 disable_numparse=True, maxcolwidths=[None, None, 50, 20]),
        "",
        textwrap.fill("Step time (s, estimates): " + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f}"
                                                                for k, v in e.time.to_dict().items()), LINE_WIDTH),
        "",
        "Host RAM per node (GiB):",
        tabulate(host, tablefmt="simple", disable_numparse=True),
        "",
    ]
    verdict = "fits: yes" if e.fits else "fits: NO - " + "; ".join(e.reasons)
    lines += [textwrap.fill(t, LINE_WIDTH, subsequent_indent="  ") for t in (
        verdict, *(f"note: {n}" for n in e.notes), "estimates: " + "; ".join(ESTIMATES))]
    return "\n".join(lines)


def _knobs(e: RlEstimate) -> list:
    r = e.request
    micro = "dynamic" if r.use_dynamic_bsz else str(r.ppo_micro_batch_size_per_gpu)
    offload = "+".join(n for n, on in (("param", r.param_offload), ("opt", r.optimizer_offload)) if on) or "-"
    return [offload, micro, f"{r.gpu_memory_utilization}", str(r.rollout_tp)]


def rl_plan_text(p: RlPlan) -> str:
    shown = p.ranked or p.misses
    rows = [[i + 1, *_knobs(e), e.memory.peak.name, gib(e.memory.peak.reserved_bytes), f"{e.time.step_s:.0f}",
             f"{e.time.generation_s:.0f}", f"{e.time.log_prob_s:.0f}", f"{e.time.update_s:.0f}",
             f"{e.time.weight_sync_s + e.time.offload_s:.0f}"] for i, e in enumerate(shown)]
    title = (f"{len(p.ranked)} fastest of the configurations that fit ({p.searched} searched), by estimated step "
             "time (s):" if p.ranked else f"Nothing fits ({p.searched} searched); the smallest peaks:")
    # seconds: the step and its parts (generation, log-probs, update, weight sync + offload copies)
    table = tabulate(rows, headers=["#", "offload", "micro", "util", "TP", "peak in", "GiB", "step", "gen", "logp",
                                    "upd", "sync"], tablefmt="simple", disable_numparse=True)
    lines = [textwrap.fill(title, LINE_WIDTH), table, "", "Best:" if p.ranked else "Nearest miss:", rl_text(shown[0])]
    return "\n".join(lines)


def rl_plan_json(p: RlPlan) -> str:
    return json.dumps({"searched": p.searched, "fits": bool(p.ranked),
                       "candidates": [rl_dict(e) for e in p.ranked or p.misses]}, indent=2)
