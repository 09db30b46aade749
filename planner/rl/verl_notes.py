"""Notes on what verl runs in place of, or beside, what the request says: the engine's sleep level verl decides
itself (cost_models/rl_sleep.py), and a reward model on its own pool scoring beside the rollout
(cost_models/rl_reward.py). One line each, with the knob that changes it."""

from __future__ import annotations

from cost_models.rl_phases import RlMemory
from cost_models.rl_settings import RlSettings
from cost_models.rl_time import RlTime


def verl_notes(r, settings: RlSettings, memory: RlMemory, time: RlTime) -> tuple[str, ...]:
    """`r`: the RlRequest; the rest as priced (evaluate_rl)."""
    out = []
    if r.sleep_level is not None and r.sleep_level != settings.sleep_level:   # TRL refuses another level itself
        why = ("a LoRA adapter: only the adapter is synced, so the base weights must survive the sleep" if
               settings.lora else "a full model: the weight sync refills the weights, so they are discarded; level "
               "1 only for a LoRA adapter")
        out.append(f"--sleep-level {r.sleep_level} is not what verl runs: verl 0.9.1 sleeps the engine at level "
                   f"{settings.sleep_level} for {why} (vllm_async_server._resolve_sleep_level; no key sets it); "
                   f"priced at level {settings.sleep_level}")
    rm = memory.reward
    if rm is not None and rm.own_pool:
        out.append(f"the reward model runs on its own pool ({rm.gpus} GPUs, {rm.replicas} replicas of TP "
                   f"{rm.settings.tp}), nothing of it on the actor's GPUs: verl's agent loop scores each response as "
                   f"it finishes, beside the rollout - {time.reward_overlapped_s:.0f} s of scoring overlapped with "
                   f"generation, {time.reward_s:.0f} s beyond it on the step; its engine priced awake (--emit verl "
                   "writes reward_model.rollout.free_cache_engine=False, without which verl sleeps it at start)")
    return tuple(out)
