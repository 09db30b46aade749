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
             "log-prob forward working set: one block's saved bytes as its bound (rl_actor.py)",
             "Ulysses: the attention at the whole length and its all-to-alls (rl_time.py); its buffers not counted",
             "mean lengths under remove-padding: as given, else the maxima")


# the request's fields the search sets (planner/rl/search.py spaces), in the JSON's "knobs"
SEARCHED = ("strategy", "actor_dtype", "param_offload", "optimizer_offload", "ref_param_offload",
            "critic_param_offload", "critic_optimizer_offload", "gradient_checkpointing", "entropy_chunking",
            "ulysses_sequence_parallel_size", "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu",
            "log_prob_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu",
            "rollout_tp", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens")


# the priced settings' (RlSettings) fields in the JSON's "knobs" beside SEARCHED: the offloads as verl runs them
# (forced off under a CPUOffloadPolicy), the critic's strategy and dtype as resolved (the actor's where unset)
PRICED = ("param_offload", "optimizer_offload", "critic_param_offload", "critic_optimizer_offload", "critic_strategy",
          "critic_dtype")


def knobs_dict(e: RlEstimate) -> dict:
    """The searched knobs' values as priced (a log-prob micro-batch or budget left unset is the update's; TRL: the
    engine's knobs as TRL sets them; the offloads, the critic's strategy and dtype, and whether a policy or the
    reference's offload applies, as the priced settings hold them: e.settings)."""
    r, engine, s = e.request, e.engine_settings, e.settings
    out = {k: getattr(r, k) for k in SEARCHED}
    out["log_prob_micro_batch_size_per_gpu"] = r.log_prob_micro_batch_size_per_gpu or r.ppo_micro_batch_size_per_gpu
    out["log_prob_max_token_len_per_gpu"] = r.log_prob_max_token_len_per_gpu or r.ppo_max_token_len_per_gpu
    out.update({k: getattr(s, k) for k in PRICED}, max_num_seqs=engine.max_num_seqs,
               max_num_batched_tokens=engine.max_num_batched_tokens, ref_param_offload=s.reference_offloaded,
               critic_offload_policy=s.critic_host_offload)
    if s.lora and s.framework == "verl":   # model.lora.merge, searched for a LoRA actor (search.lora_merges)
        out["lora_merge"] = s.lora_merge
    if engine.engine.value == "sglang" and engine.max_lora_rank:   # SGLang's LoRA pool slots (search: lora_slots)
        out["max_loras_per_batch"] = engine.max_loras_per_batch
    return out


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
                     "load_bytes": e.host.load_bytes, "checkpoint_staging_bytes": e.host.checkpoint_staging_bytes,
                     "sync_terms": dict(e.host.sync_terms), "sync_bytes": e.host.sync_bytes},
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
        "knobs": knobs_dict(e),
        "estimates": list(ESTIMATES),
        **({"reward_pool": reward_pool_dict(e.memory.reward)} if _own_pool(e) else {}),
    }


def _own_pool(e: RlEstimate) -> bool:
    return e.memory.reward is not None and e.memory.reward.own_pool


def reward_pool_dict(rm) -> dict:
    """A reward model on its own pool (cost_models/rl_reward.py): its GPUs and one GPU's memory, its engine awake."""
    held = {k: v for k, v in rm.awake().items() if v}
    return {"gpus": rm.gpus, "tp": rm.settings.tp, "replicas": rm.replicas,
            "gpu_memory_utilization": rm.settings.gpu_memory_utilization, "reserved_bytes": sum(held.values()),
            "gpu_bytes": held}


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
             ["checkpoint staging", gib(e.host.checkpoint_staging_bytes)],
             *([f"weight sync: {k}", gib(v)] for k, v in e.host.sync_terms.items()), ["peak", gib(e.host.peak_bytes)]]
    head = [
        f"{e.model.name} ({e.model.n_params / 1e9:.2f}B) {r.algorithm.upper()} on {e.cluster.n_gpus} x "
        f"{e.cluster.gpu.id}: {r.strategy} actor {r.actor_dtype} ({r.finetune}{_targets(e)}), {r.engine} "
        f"{r.engine_version} "
        f"TP {r.rollout_tp} at {r.gpu_memory_utilization}",
        trl_knob_words(e) if r.framework == "trl" else knob_words(r, e.settings),
        f"batch: {b.sequences_per_step} sequences per step, {b.mini_batch_seqs_per_rank} per rank per mini-batch; "
        f"update micro-batch {b.update_tokens_per_gpu:,} tokens per GPU, log-prob {b.log_prob_tokens_per_gpu:,}",
        f"engine: weights {gib(eng.weights_bytes)} GiB, "
        + (f"LoRA buffers {gib(eng.lora_bytes)} GiB{_slots(e)}, " if eng.lora_bytes else "")
        + f"KV cache {gib(eng.kv_bytes)} GiB ({eng.kv_tokens:,} tokens, "
        f"{eng.max_concurrent_seqs} sequences of {r.prompt_len + r.response_len} at once)",
    ]
    if _own_pool(e):
        pool = reward_pool_dict(e.memory.reward)
        head.append(f"reward pool: {pool['gpus']} GPUs of their own, {pool['replicas']} replicas of TP {pool['tp']} "
                    f"at {pool['gpu_memory_utilization']}: {gib(pool['reserved_bytes'])} GiB per GPU (" + ", ".join(
                        f"{k.removeprefix('reward ')} {gib(v)}" for k, v in pool["gpu_bytes"].items()) + ")")
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


def _slots(e: RlEstimate) -> str:
    """SGLang's LoRA pool: its adapter slots (max_loras_per_batch)."""
    s = e.engine_settings
    n = s.max_loras_per_batch
    return f" ({n} slot{'s' if n > 1 else ''}: max_loras_per_batch)" if s.engine.value == "sglang" else ""


def knob_words(r, settings) -> str:
    """Every knob the search sets, as a sentence (the best plan's description); PPO's critic's strategy and dtype
    where they are not the actor's (settings: the priced ones, the critic's resolved)."""
    def on(flag: bool) -> str:
        return "on" if flag else "off"
    batch = (f"token budget per GPU: update {r.ppo_max_token_len_per_gpu:,}, log-prob "
             f"{(r.log_prob_max_token_len_per_gpu or r.ppo_max_token_len_per_gpu):,}" if r.use_dynamic_bsz else
             f"sequences per GPU a micro-batch: update {r.ppo_micro_batch_size_per_gpu}, log-prob "
             f"{r.log_prob_micro_batch_size_per_gpu or r.ppo_micro_batch_size_per_gpu}")
    own = "".join(f", critic {name} {mine}" for name, mine, actor in (
        ("strategy", settings.critic_strategy, settings.strategy), ("dtype", settings.critic_dtype,
                                                                    settings.actor_dtype)) if mine != actor)
    critic = (f", critic param offload {on(r.critic_param_offload)}, critic optimizer offload "
              f"{on(r.critic_optimizer_offload)}{own}" if r.algorithm == "ppo" else "")
    return (f"knobs: actor {r.actor_dtype}, param offload {on(r.param_offload)}, optimizer offload "
            f"{on(r.optimizer_offload)}, reference offload {on(r.ref_param_offload)}{critic}, gradient checkpointing "
            f"{on(r.gradient_checkpointing)}, entropy chunking {on(r.entropy_chunking)}, Ulysses "
            f"{r.ulysses_sequence_parallel_size}, {batch}; rollout TP {r.rollout_tp}, gpu_memory_utilization "
            f"{r.gpu_memory_utilization}, max_num_seqs {r.max_num_seqs}, max_num_batched_tokens "
            f"{r.max_num_batched_tokens}" + (f", LoRA merge {on(settings.lora_merge)}" if settings.lora else ""))


def _targets(e: RlEstimate) -> str:
    """LoRA's targets where they are not verl's default all-linear (model.target_modules)."""
    s = e.settings
    return f" on {s.lora_targets.value}" if s.lora and not s.lora_all_linear else ""


def trl_knob_words(e: RlEstimate) -> str:
    """A TRL job's knobs by GRPOConfig's and accelerate's names, TRL's defaults where the request leaves them."""
    from cost_models.rl_schedule import trl_steps

    r, s = e.request, e.engine_settings
    accumulation, per_generation = trl_steps(e.batch)
    on = {True: "on", False: "off"}
    beta = 0.0 if r.beta is None else r.beta
    return (f"knobs (TRL): per_device_train_batch_size {r.ppo_micro_batch_size_per_gpu}, gradient_accumulation_steps "
            f"{accumulation}, steps_per_generation {per_generation}, num_iterations {r.num_iterations or 1}, beta "
            f"{beta}, vllm_importance_sampling_correction {on[r.vllm_importance_sampling_correction is not False]}, "
            f"vllm_enable_sleep_mode {on[bool(r.vllm_enable_sleep_mode)]}, fsdp_offload_params {on[r.param_offload]}, "
            f"gradient_checkpointing {on[r.gradient_checkpointing]}; " + (
                f"vllm_mode server: trl vllm-serve --tensor-parallel-size {r.rollout_tp} --data-parallel-size "
                f"{r.vllm_server_data_parallel_size or 1} --gpu-memory-utilization {r.gpu_memory_utilization} "
                f"--max-num-seqs {s.max_num_seqs} --max-num-batched-tokens {s.max_num_batched_tokens}"
                if r.vllm_mode == "server" else
                f"vllm_tensor_parallel_size {r.rollout_tp}, vllm_gpu_memory_utilization {r.gpu_memory_utilization} "
                f"(TRL's max_num_seqs {s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens})"))


def _budget(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _knobs(e: RlEstimate) -> dict:
    """A ranked row's knobs by column (LEGEND says what each holds)."""
    r, k = e.request, knobs_dict(e)
    offload = "".join(c for c, on in (("p", k["param_offload"]), ("o", k["optimizer_offload"]),
                                       ("r", k["ref_param_offload"] and r.finetune == "full"),
                                       ("P", k["critic_param_offload"] and r.algorithm == "ppo"),
                                       ("O", k["critic_optimizer_offload"] and r.algorithm == "ppo")) if on) or "-"
    micro = (f"{_budget(k['ppo_max_token_len_per_gpu'])}/{_budget(k['log_prob_max_token_len_per_gpu'])}"
             if r.use_dynamic_bsz else
             f"{k['ppo_micro_batch_size_per_gpu']}/{k['log_prob_micro_batch_size_per_gpu']}")
    ckpt = "+".join(n for n, on in (("gc", r.gradient_checkpointing), ("ec", r.entropy_chunking)) if on) or "-"
    merge = {"merge": "on" if k["lora_merge"] else "off"} if "lora_merge" in k else {}
    return {"strategy": r.strategy, "dtype": r.actor_dtype, "offload": offload, "ckpt": ckpt,
            "sp": str(r.ulysses_sequence_parallel_size), "micro": micro, "TP": str(r.rollout_tp),
            "util": f"{r.gpu_memory_utilization}", "seqs": str(r.max_num_seqs),
            "chunk": _budget(r.max_num_batched_tokens), **merge}


LEGEND = ("strategy: actor.strategy, fsdp (FSDP1) or fsdp2; offload: p actor params, o Adam states, r reference, "
          "P / O the critic's; ckpt: gc gradient checkpointing, ec entropy chunking; sp: Ulysses degree; micro: "
          "update / log-prob sequences per GPU (dynamic batches: token budgets); TP: rollout TP; util: "
          "gpu_memory_utilization; seqs: max_num_seqs; chunk: max_num_batched_tokens; peak: GiB reserved; seconds "
          "(estimates): gen generation, logp log-probs, upd the update (PPO: and the critic), sync weight sync and "
          "offload copies")
LORA_LEGEND = "merge: model.lora.merge (the adapters merged into the base and the whole model sent at each sync)"


def _times(e: RlEstimate) -> dict:
    t = e.time
    return {"peak": gib(e.memory.peak.reserved_bytes), "step": f"{t.step_s:.0f}", "gen": f"{t.generation_s:.0f}",
            "logp": f"{t.log_prob_s:.0f}", "upd": f"{t.update_s + t.critic_s:.0f}",
            "sync": f"{t.weight_sync_s + t.offload_s:.0f}"}


def ranked_table(shown: list[RlEstimate]) -> tuple[str, str]:
    """The rows' knobs and seconds; a knob with one value in every row moves to an "every row:" line."""
    rows = [{"#": str(i + 1), **_knobs(e), **_times(e)} for i, e in enumerate(shown)]
    knobs = list(_knobs(shown[0]))
    same = [k for k in knobs if len({row[k] for row in rows}) == 1] if len(rows) > 1 else []
    headers = [h for h in rows[0] if h not in same]
    table = tabulate([[row[h] for h in headers] for row in rows], headers=headers, tablefmt="simple",
                     disable_numparse=True)
    return table, ("every row: " + ", ".join(f"{k} {rows[0][k]}" for k in same)) if same else ""


def rl_plan_text(p: RlPlan) -> str:
    from .search import not_searched

    shown = list(p.ranked or p.misses)
    kept = not_searched(p.request)
    title = (f"The fastest configuration of each strategy, dtype and offload choice that fits ({p.searched:,} "
             f"configurations in the space, {p.priced:,} priced), by estimated step time (s):" if p.ranked else
             f"Nothing fits ({p.searched:,} configurations in the space, {p.priced:,} priced); the smallest peaks:")
    table, every = ranked_table(shown)
    legend = LEGEND + ("; " + LORA_LEGEND if "lora_merge" in knobs_dict(shown[0]) else "")
    notes = [every, legend, "not searched: " + "; ".join(f"{k}: {why}" for k, why in kept.items())]
    lines = [textwrap.fill(title, LINE_WIDTH), table,
             *(textwrap.fill(n, LINE_WIDTH, subsequent_indent="  ") for n in notes if n),
             "", "Best:" if p.ranked else "Nearest miss:", rl_text(shown[0])]
    best = shown[0]
    if best.request.strategy != p.request.strategy:
        lines.insert(-1, textwrap.fill(
            f"note: the actor wrapped with {best.request.strategy}, not the request's {p.request.strategy} "
            "(actor.strategy): both are searched; FSDP2 holds at most FSDP1's memory in every phase (verl wraps the "
            "embedding and head as their own units; FSDP1's weight sync keeps a copy of the shard), and the copies "
            "around the collectives make its update faster with an fp32 actor, slower with a bf16 one or LoRA",
            LINE_WIDTH, subsequent_indent="  "))
    summoned = next(ph.gpu_bytes.get("summoned params", 0) for ph in best.memory.phases if ph.name == "weight_sync")
    # (where the weight sync is the peak, the estimate's own note says it: planner/rl/findings.py)
    if summoned and not best.request.layered_summon and best.memory.peak.name != "weight_sync":
        lines.insert(-1, textwrap.fill(
            f"note: FSDP1's LoRA weight sync gathers the whole model at once ({gib(summoned)} GiB, priced so); "
            "verl's fix, --layered-summon --load-format safetensors (rollout.layered_summon needs the base preloaded), "
            "gathers one unit at a time: the request's, not searched",
            LINE_WIDTH, subsequent_indent="  "))
    if best.request.actor_dtype != p.request.actor_dtype:
        lines.insert(-1, textwrap.fill(
            f"note: the actor stored in {best.request.actor_dtype}, not the request's {p.request.actor_dtype} "
            "(fsdp_config.model_dtype): bf16 keeps no fp32 master weights; the search prices its memory and time, "
            "not what it does to training", LINE_WIDTH, subsequent_indent="  "))
    return "\n".join(lines)


def rl_plan_json(p: RlPlan) -> str:
    from .search import not_searched

    return json.dumps({"searched": p.searched, "priced": p.priced, "fits": bool(p.ranked),
                       "not_searched": not_searched(p.request),
                       "candidates": [rl_dict(e) for e in p.ranked or p.misses]}, indent=2)
