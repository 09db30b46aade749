"""What a priced RL configuration should hear beyond fits / does not fit (issue 28's findings): the KV cache
holding fewer sequences than max_num_seqs, Adam's states appearing after the engine sized its KV cache, a
reference left on the GPU, an fp32 actor where memory is short. One line each, with the knob that changes it."""

from __future__ import annotations

from cost_models.rl_phases import RlMemory, RlSettings
from cost_models.rollout_engine import EngineSettings
from cost_models.units import GiB


def findings(settings: RlSettings, engine: EngineSettings, memory: RlMemory, seqs_per_replica: int,
             capacity_bytes: int) -> tuple[str, ...]:
    out = []
    e, phases = memory.engine, {p.name: p for p in memory.phases}
    wanted = min(engine.max_num_seqs, seqs_per_replica)
    if 0 < e.max_concurrent_seqs < wanted:
        out.append(f"the KV cache holds {e.max_concurrent_seqs} sequences of {engine.max_model_len} tokens at once, "
                   f"fewer than the {wanted} a replica is asked to run: the engine queues or preempts the rest "
                   "(slower); raise --gpu-memory-utilization or lower --max-num-seqs")
    adam = phases["rollout"].gpu_bytes.get("Adam states", 0)
    if adam and memory.peak.name == "rollout":
        out.append(f"Adam's states ({adam / GiB:.1f} GiB) are created at the first step, after the engine sized its "
                   "KV cache: from step 2 the rollout holds them beside it (verl PR 1349); --optimizer-offload keeps "
                   "them on the host")
    ref = phases["rollout"].gpu_bytes.get("reference", 0)
    if ref:
        out.append(f"the reference's bf16 shard ({ref / GiB:.1f} GiB) stays on the GPU through every phase: "
                   "--ref-param-offload moves it to the host")
    if settings.actor_dtype == "fp32" and memory.peak.reserved_bytes > capacity_bytes:
        out.append("the actor is stored in fp32 (verl's 2025 default model_dtype): --actor-dtype bf16 halves its "
                   "params, gradients and Adam's states")
    return tuple(out)
