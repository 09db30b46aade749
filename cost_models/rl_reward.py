"""A model-based reward model in verl 0.9.1 (reward.reward_model.enable, or the legacy reward_model.enable that
experimental/reward_loop/reward_loop.py migrate_legacy_reward_impl moves there): not an FSDP worker any more but an
inference engine of its own (experimental/reward_loop/reward_model.py RewardModelManager: vLLM / SGLang replicas of
reward_model.rollout.tensor_model_parallel_size GPUs, is_reward_model=True, served through /classify), colocated
on the actor's GPUs in separate processes (enable_resource_pool false: the actor's resource pool).

- the model: AutoModelForSequenceClassification with num_labels 1 (the blocks and embedding, a bias-free
  Linear(hidden, 1) score head in place of the vocabulary head), bf16, sharded over its TP ranks;
- when: ray_trainer.init_workers builds it after the actor / reference workers and before the actor's engine
  (AgentLoopManager): its KV budget sees the actor's resident params and reference; with free_cache_engine (verl's
  default) it sleeps at once at level 1 (vllm_async_server.sleep, COLOCATED: weights backed up to the host, KV
  freed) and is woken for compute_rm_score after generation (RewardLoopManager.compute_rm_score: wake_up,
  score, sleep): the `reward` phase, one forward (prefill) per sequence, no vocabulary logits;
- its processes keep their CUDA context on the GPU through every phase (an estimate: the actor process's context
  and communicator, outside_allocator_terms).
verl 0.9.1 has no reward micro-batch or param offload (the FSDP RewardModelWorker's micro_batch_size_per_gpu /
fsdp_config.param_offload are gone): its engine's utilization and TP are the knobs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .model_spec import ModelSpec
from .rl_critic import value_model
from .rollout_engine import EngineMemory, EngineSettings, engine_memory
from .spec_values import SpecError

# verl 0.9.1 trainer/config/_generated_ppo_trainer.yaml reward.reward_model.rollout defaults
REWARD_TP = 2
REWARD_GPU_MEMORY_UTILIZATION = 0.5
REWARD_ENFORCE_EAGER = True
REWARD_MAX_NUM_SEQS = 1024
REWARD_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class RewardSettings:
    """What the request says of the reward model (reward_model.model.path and reward_model.rollout.*)."""

    model: ModelSpec
    tp: int = REWARD_TP
    gpu_memory_utilization: float = REWARD_GPU_MEMORY_UTILIZATION


@dataclass(frozen=True)
class RewardModel:
    """The reward engine on one GPU: its settings (reward_model.rollout.*) and memory, and its process's memory
    outside the engine (CUDA context: kept while asleep)."""

    model: ModelSpec
    settings: EngineSettings
    memory: EngineMemory
    context_bytes: int

    def asleep(self) -> dict:
        """Beside every other phase (level 1: weights on the host, KV freed; eager: no graph pool)."""
        return {"reward CUDA context": self.context_bytes}

    def awake(self) -> dict:
        e = self.memory
        return {"reward weights": e.weights_bytes, "reward KV cache": e.kv_bytes,
                "reward activations": e.activation_peak_bytes, "reward CUDA graphs": e.cuda_graph_bytes,
                **self.asleep()}


def reward_engine(r: RewardSettings, actor_engine: EngineSettings, total_bytes: int, resident_bytes: int,
                  context_bytes: int) -> RewardModel:
    """The reward engine started beside `resident_bytes` (the actor's resident params, the reference, a critic; its
    own process: the trainer's bytes are other processes' memory to it, outside its torch, as its context is)."""
    try:
        s = dataclasses.replace(actor_engine, tp=r.tp, gpu_memory_utilization=r.gpu_memory_utilization,
                                enforce_eager=REWARD_ENFORCE_EAGER, max_num_seqs=REWARD_MAX_NUM_SEQS,
                                max_num_batched_tokens=REWARD_MAX_NUM_BATCHED_TOKENS)
    except SpecError as err:   # named as the request names it
        raise SpecError(f"reward_model_{err.field}", str(err).split(": ", 1)[1]) from None
    rm = value_model(r.model, role="reward", bias=False)   # a bias-free score head
    e = engine_memory(rm, s, total_bytes, 0, resident_bytes + context_bytes)
    refusals = tuple(dataclasses.replace(x, field=f"reward_model_{x.field}", fix=x.fix.replace(
        "--gpu-memory-utilization", "--reward-model-gpu-memory-utilization")) for x in e.refusals)
    return RewardModel(model=rm, settings=s, memory=dataclasses.replace(e, refusals=refusals),
                       context_bytes=context_bytes)


def reward_row(rm: RewardModel | None, resident: dict, graphs: dict) -> list:
    """compute_rm_score: the actor as between phases, its engine asleep, the reward engine awake."""
    if rm is None:
        return []
    return [("reward", resident, {**graphs, **rm.awake()}, False, False, True,
             "the reward model's engine woken to score the responses")]
