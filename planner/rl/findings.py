"""What a priced RL configuration should hear beyond fits / does not fit (issue 28's findings): the KV cache
holding fewer sequences than max_num_seqs, Adam's states appearing after the engine sized its KV cache, TRL's
reference left on the GPU (verl's ref param_offload=False, which verl ignores), FSDP1 LoRA's whole-model weight sync, an fp32 actor where memory is short; TRL's engine
left awake and its reference gathered whole; SGLang's LoRA pool with slots verl never fills. One line each, with the
knob that changes it (TRL: its GRPOConfig's or accelerate's key)."""

from __future__ import annotations

from cost_models.rl_phases import RlMemory
from cost_models.rl_settings import RlSettings
from cost_models.rollout_engine import EngineSettings
from cost_models.units import GiB

from .trl_notes import trl_sync_notes


def findings(settings: RlSettings, engine: EngineSettings, memory: RlMemory, seqs_per_replica: int,
             capacity_bytes: int) -> tuple[str, ...]:
    out = []
    e, phases = memory.engine, {p.name: p for p in memory.phases}
    trl = settings.framework == "trl"
    wanted = min(engine.max_num_seqs, seqs_per_replica)
    if 0 < e.max_concurrent_seqs < wanted:
        out.append(f"the KV cache holds {e.max_concurrent_seqs} sequences of {engine.max_model_len} tokens at once, "
                   f"fewer than the {wanted} a replica is asked to run: the engine queues or preempts the rest "
                   "(slower); raise --gpu-memory-utilization or lower " + (
                       "per_device_train_batch_size x steps_per_generation (TRL's max_num_seqs)" if trl and
                       not settings.server else "--max-num-seqs"))
    adam = phases["rollout"].gpu_bytes.get("Adam states", 0)
    if adam and memory.peak.name == "rollout":
        out.append(f"Adam's states ({adam / GiB:.1f} GiB) are created at the first step, after the engine sized its "
                   "KV cache: from step 2 the rollout holds them beside it " + (
                       "(TRL builds the engine first); --param-offload --optimizer-offload (fsdp_offload_params) "
                       "keeps them on the host" if trl else "(verl PR 1349); --optimizer-offload keeps them on "
                       "the host"))
    ref = phases["rollout"].gpu_bytes.get("reference", 0)
    if ref:  # TRL's only: verl always offloads it (RlSettings.reference_offloaded)
        out.append(f"the reference's shard ({ref / GiB:.1f} GiB) stays on the GPU through every phase: --beta 0 "
                   "drops it, fsdp_offload_params moves it to the host with the actor")
    if not (trl or settings.ref_param_offload or settings.lora):
        out.append("ref.fsdp_config.param_offload=False is ignored: verl builds the reference forward_only "
                   "(ref/dp_ref.yaml) and wraps it with FSDP's own CPU offload whatever it says; priced offloaded "
                   "(its params copied to the GPU unit by unit in its log-prob pass)")
    out += _trl(settings, memory, phases) + trl_sync_notes(settings, engine, memory) if trl else []
    summoned = phases["weight_sync"].gpu_bytes.get("summoned params", 0)
    if summoned and not settings.layered_summon and memory.peak.name == "weight_sync":
        out.append(f"the LoRA weight sync under FSDP1 gathers the whole model at once ({summoned / GiB:.1f} GiB, "
                   "verl's collect_lora_params): --layered-summon --load-format safetensors (rollout.layered_summon "
                   "needs the base preloaded: verl raises under dummy, its default) gathers one unit at a time, or "
                   "--strategy fsdp2 gathers only the adapters")
    out += _offload_policy(settings, memory)
    out += _engine_room(engine, memory, phases, capacity_bytes)
    out += _lora_slots(settings, engine, memory)
    if settings.actor_dtype == "fp32" and memory.peak.reserved_bytes > capacity_bytes:
        out.append("the actor is stored in fp32 (verl's 2025 default model_dtype): --actor-dtype bf16 halves its "
                   "params, gradients and Adam's states")
    return tuple(out)


def _trl(settings: RlSettings, memory: RlMemory, phases: dict) -> list[str]:
    """TRL's own: its engine awake outside generation (vllm_enable_sleep_mode off, TRL's default) where the peak is
    a training phase; its FSDP2 reference gathered whole (one unit) at the peak (cost_models/rl_schedule.py)."""
    out, peak = [], memory.peak
    idle = peak.gpu_bytes.get("engine KV cache", 0) + peak.gpu_bytes.get("engine weights", 0)
    if not settings.sleep_mode and peak.name not in ("init", "rollout", "weight_sync") and idle:
        out.append(f"vllm_enable_sleep_mode is off (TRL's default): the engine's weights and KV cache ({idle / GiB:.1f}"
                   f" GiB) stay on the GPU through {peak.name}; --vllm-enable-sleep-mode frees them outside "
                   "generation (level 2: the weights are sent again at each sync)")
    whole = peak.gpu_bytes.get("reference gathered", 0)
    if whole:
        out.append(f"TRL shards the reference as one FSDP2 unit (prepare_fsdp): its forward gathers it whole "
                   f"({whole / GiB:.1f} GiB, and the gather's buffer as much again while it copies out); "
                   "--strategy fsdp (fsdp_version 1) wraps it by layer, --beta 0 drops it")
    return out


def _offload_policy(settings: RlSettings, memory: RlMemory) -> list[str]:
    """fsdp_config.offload_policy: what CPUOffloadPolicy moves, or that verl does not read it (its FSDP1 branch);
    then the critic's own (critic.fsdp.offload_policy)."""
    return _actor_policy(settings, memory) + _critic_policy(settings, memory)


def _critic_policy(settings: RlSettings, memory: RlMemory) -> list[str]:
    c = memory.critic
    if c is not None and c.on_host:
        held = c.params_bytes + c.grads_bytes + c.optimizer_bytes
        return [f"critic.fsdp.offload_policy: the critic's params, grads and Adam states ({held / GiB:.1f} GiB per "
                "GPU) stay in pinned host memory, its Adam step on the CPU (its param_offload / optimizer_offload "
                "forced off, as verl does)"]
    if settings.ppo and settings.critic_offload_policy:
        return [f"critic.fsdp.offload_policy is ignored under critic.strategy {settings.critic_strategy} (verl "
                "reads it in its FSDP2 branch only): priced without it; --critic-strategy fsdp2 (critic.strategy="
                "fsdp2) applies it"]
    return []


def _actor_policy(settings: RlSettings, memory: RlMemory) -> list[str]:
    a = memory.actor
    if a.on_host:
        held = a.params_bytes + a.grads_bytes + a.optimizer_bytes
        return [f"offload_policy: FSDP2's CPUOffloadPolicy keeps the actor's params, grads and Adam states "
                f"({held / GiB:.1f} GiB per GPU) in pinned host memory all run; each unit's shard is copied to the "
                "GPU for its all-gather, gradients reduce-scattered then copied to the host, Adam steps on the CPU "
                + ("(accelerate's fsdp_offload_params: the reference too)" if settings.framework == "trl" else
                   "(param_offload / optimizer_offload forced off, as verl does)")]
    if settings.offload_policy and settings.framework == "verl":
        return ["offload_policy is ignored under actor.strategy fsdp (verl 0.9.1 reads it in its FSDP2 branch "
                "only): --strategy fsdp2 applies it"]
    return []


def _engine_room(engine: EngineSettings, memory: RlMemory, phases: dict, capacity_bytes: int) -> list[str]:
    """vLLM: a phase with the engine awake over the GPU - its utilization leaves the trainer's tensors no room; the
    KV cache shrinks byte for byte with the utilization (rollout_engine.py), so lowering it by the excess over the
    total fits. SGLang the other way: its fraction is of the memory free at start (after the actor's resident
    params), so a resident actor shrinks its pool rather than overflowing: said with the pool it gets."""
    name = engine.engine.value
    if name == "sglang":
        actor = phases["init"].gpu_bytes.get("actor params", 0)
        if actor:
            kv = memory.engine.kv_bytes
            return [f"SGLang's mem_fraction_static ({engine.gpu_memory_utilization}) is of the memory free at start, "
                    f"after the actor's resident {actor / GiB:.1f} GiB: its KV pool gets {kv / GiB:.1f} GiB; "
                    "--param-offload (fsdp_config.param_offload) or a higher --gpu-memory-utilization gives it more"]
        return []
    over = [p for p in memory.phases if p.reserved_bytes > capacity_bytes
            and p.gpu_bytes.get("engine KV cache", 0) > p.reserved_bytes - capacity_bytes]
    if not over:
        return []
    worst = max(over, key=lambda p: p.reserved_bytes)
    excess = worst.reserved_bytes - capacity_bytes
    fits = int((engine.gpu_memory_utilization - excess / capacity_bytes) * 100) / 100
    return [f"gpu_memory_utilization {engine.gpu_memory_utilization} leaves the trainer no room in {worst.name}: "
            f"{worst.reserved_bytes / GiB:.1f} GiB > {capacity_bytes / GiB:.1f}; the KV cache shrinks with it byte "
            f"for byte: --gpu-memory-utilization {fits} (rollout.gpu_memory_utilization) or --param-offload"]


def _lora_slots(settings: RlSettings, engine: EngineSettings, memory: RlMemory) -> list[str]:
    """verl serving its adapter from SGLang with more than one LoRA pool slot (SGLang's default 8, which verl 0.9.1
    leaves): verl serves one adapter - every generate request names it (async_sglang_server.py generate) and the
    weight sync unloads the old one before loading the new (sglang_rollout.py ServerAdapter.update_weights; SGLang's
    unload waits for the requests still using it: lora_registry.py wait_for_unload) - so one slot serves it and the
    others only hold bytes out of the KV pool (cost_models/rollout_lora_sglang.py: the pool is linear in the slots;
    EngineMemory.lora_read_bytes is the pool at one slot, its backend graph rows included)."""
    e = memory.engine
    if settings.framework != "verl" or engine.engine.value != "sglang" or not e.lora_bytes \
            or engine.max_loras_per_batch == 1:
        return []
    from planner.emit.verl import MAX_LORAS   # the key's one home (it imports the emit package)

    freed = e.lora_bytes - e.lora_read_bytes
    tokens = freed * e.kv_tokens // e.kv_bytes if e.kv_bytes else 0   # SGLang's page: one token
    return [f"SGLang's LoRA pool holds max_loras_per_batch {engine.max_loras_per_batch} adapter slots "
            f"({e.lora_bytes:,} B a GPU, never released) and verl serves one adapter (its weight sync unloads the "
            f"old before loading the new): +{MAX_LORAS}=1 (--max-loras-per-batch 1) frees {freed:,} B "
            f"({freed / GiB:.2f} GiB) a GPU to the KV cache, about {tokens:,} tokens more"]
