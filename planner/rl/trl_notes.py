"""Notes on TRL's weight sync (planner/rl/findings.py adds them): its vLLM server's GPUs and what rank 0 packs for it
(cost_models/rl_trl_server.py), and PEFT's merge on FSDP1's flat shards, which fails or sends wrong weights."""

from __future__ import annotations

from cost_models.rl_phases import RlMemory
from cost_models.rl_settings import RlSettings
from cost_models.rollout_engine import EngineSettings
from cost_models.units import GiB


def trl_sync_notes(settings: RlSettings, engine: EngineSettings, memory: RlMemory) -> list[str]:
    out, sync = [], {p.name: p for p in memory.phases}["weight_sync"].gpu_bytes
    e = memory.engine
    if settings.server:
        gpus = engine.tp * settings.server_data_parallel
        where = "on the trainer's first node" if settings.server_local else "on a node of its own"
        out.append(f"vllm_mode server: the engine on {gpus} GPU{'s' * (gpus > 1)} of its own (TP {engine.tp} x DP "
                   f"{settings.server_data_parallel}, {where}): KV cache "
                   f"{e.kv_bytes / GiB:.1f} GiB a GPU, {e.max_concurrent_seqs} sequences at once; each sync rank 0 "
                   f"holds {sync.get('packed broadcast buffers (rank 0)', 0) / GiB:.1f} GiB of vLLM's packed "
                   "broadcast (1 GiB chunks, two in flight)")
    if settings.lora and "gathered units" in sync:
        out.append("LoRA under FSDP1: TRL merges the adapters on FSDP1's flat shards (use_orig_params' 1-D views), "
                   "where PEFT's merge_adapter raises or gives a wrong weight as the views fall on the ranks "
                   "(benchmarks/trl_sync_check.py, 2 gloo ranks): --strategy fsdp2 (fsdp_version 2), whose merge "
                   "runs on DTensor shards")
    return out
