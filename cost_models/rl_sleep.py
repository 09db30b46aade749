"""The rollout engine's sleep as the framework runs it, whatever level was asked: which level, and where the
engine's weights are while it sleeps (rl_phases.py: on the GPU or not; rl_host.py: a host backup; rl_time.py:
copied out and back each step).

- verl 0.9.1, the engine in the actor's worker processes (RolloutMode.HYBRID), vLLM:
  workers/rollout/vllm_rollout/vllm_async_server.py _resolve_sleep_level (_sleep_hybrid and release_kv_cache
  sleep at it): level 1 where the actor's LoRA is served as an adapter (lora_as_adapter: model.lora_rank > 0 and
  not model.lora.merge - only the adapter is synced, so the base weights must survive the sleep; likewise an MTP
  drafter or an Ascend NPU), else level 2 (third_party/vllm VLLM_SLEEP_LEVEL = 2 for vLLM >= 0.18, the versions
  0.9.1 supports). rollout.layered_summon sets the rollout adapter's sleep_level to 1 (vllm_rollout.py
  ServerAdapter), an attribute only SGLang's branch of engine_workers.update_weights reads: no effect on vLLM.
  Level 1 is CuMemAllocator.sleep(offload_tags=("weights",)): the bf16 weights backed up to pinned host memory;
  level 2 discards them (the weight sync refills them).
- verl 0.9.1, SGLang (async_sglang_server.py sleep, sglang_rollout.py sleep_level): a LoRA adapter releases the
  KV cache only - the base weights stay on the GPU through every phase (level 1); otherwise weights and KV are
  released with enable_weights_cpu_backup (set in HYBRID mode for sglang >= 0.5.3): the weights backed up on the
  host (level 2).
- TRL 1.16 (rl_settings._trl): vLLM at level 2 (generation/vllm_generation.py llm.sleep(level=2)).
A reward model's engine (rl_reward.py) runs apart from this: COLOCATED mode, always level 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rollout_engine import Engine


@dataclass(frozen=True)
class EngineSleep:
    level: int
    weights_to_host: bool   # backed up in pinned host memory while asleep (copied out and back each step)
    weights_on_gpu: bool    # kept on the GPU while asleep


def verl_sleep_level(lora_adapter: bool) -> int:
    """The level verl 0.9.1 sleeps its engine at (module docstring): 1 for a LoRA adapter, else 2."""
    return 1 if lora_adapter else 2


def engine_sleep(level: int, engine: Engine) -> EngineSleep:
    """Where the weights are at the level that runs (RlSettings.sleep_level, resolved): SGLang's by verl's rule."""
    if engine is Engine.SGLANG:
        return EngineSleep(level, weights_to_host=level == 2, weights_on_gpu=level == 1)
    return EngineSleep(level, weights_to_host=level == 1, weights_on_gpu=False)
