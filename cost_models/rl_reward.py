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

On its own resource pool (reward.reward_model.enable_resource_pool, with n_gpus_per_node x nnodes GPUs: the trainer's
init_resource_pool_mgr adds a "reward_pool" beside the global one, RewardModelManager splits it into replicas of
its TP, split_resource_pool, and starts them COLOCATED there): nothing of it on the actor's GPUs (the reward loop
workers that call it are CPU actors) - no `reward` phase, no context beside the phases, no host backup or process on
the trainer's nodes (its pool is taken as nodes of its own). Its engine starts on an empty GPU (its own process's
context only). Scoring streams: with a reward pool, ray_trainer / trainer_base hand the reward loop workers to the
agent loop (enable_agent_reward_loop = not use_rm or enable_resource_pool), which scores each trajectory as it
finishes (agent_loop.py _compute_score), beside the rollout; compute_rm_score, the colocated path's wake / score /
sleep, does not run. So the engine must stay awake: RewardModelManager sleeps it at start under free_cache_engine
(its default, true) and nothing on that path wakes it - --emit verl writes free_cache_engine false, check says so.
Its time: its replicas' prefill, overlapped with generation (rl_time.streamed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .cluster_spec import ClusterSpec
from .feasibility import Refusal
from .model_spec import ModelSpec
from .rl_critic import value_model
from .rollout_engine import EngineMemory, EngineSettings, engine_memory
from .spec_values import SpecError, check_positive

# verl 0.9.1 trainer/config/_generated_ppo_trainer.yaml reward.reward_model.rollout defaults
REWARD_TP = 2
REWARD_GPU_MEMORY_UTILIZATION = 0.5
REWARD_ENFORCE_EAGER = True
REWARD_MAX_NUM_SEQS = 1024
REWARD_MAX_NUM_BATCHED_TOKENS = 8192
# on its own pool no actor shares the GPU: the engine's refusals' fixes by code (rollout_engine.py), its own knobs
POOL_FIXES = {"engine-start": "lower --gpu-memory-utilization",
              "engine-no-kv": "raise --gpu-memory-utilization or --reward-model-tp, or lower the response length",
              "engine-max-len": "raise --gpu-memory-utilization or --reward-model-tp, or lower the response length"}


@dataclass(frozen=True)
class RewardSettings:
    """What the request says of the reward model (reward_model.model.path, reward_model.rollout.* and its pool)."""

    model: ModelSpec
    tp: int = REWARD_TP
    gpu_memory_utilization: float = REWARD_GPU_MEMORY_UTILIZATION
    own_pool: bool = False       # reward_model.enable_resource_pool
    pool_gpus_per_node: int = 8  # reward_model.n_gpus_per_node (verl's default)
    pool_nodes: int = 1          # reward_model.nnodes (verl's default 0 refuses to start with a pool)

    def __post_init__(self):
        if self.own_pool:   # verl's init_resource_pool_mgr raises ValueError on either
            check_positive("reward_model_n_gpus_per_node", self.pool_gpus_per_node)
            check_positive("reward_model_nnodes", self.pool_nodes)

    @property
    def pool_gpus(self) -> int:
        return self.pool_gpus_per_node * self.pool_nodes if self.own_pool else 0


@dataclass(frozen=True)
class RewardModel:
    """The reward engine on one GPU: its settings (reward_model.rollout.*) and memory, and its process's memory
    outside the engine (CUDA context: kept while asleep); the GPUs its replicas run on (its pool's, or the actor's)."""

    model: ModelSpec
    settings: EngineSettings
    memory: EngineMemory
    context_bytes: int
    gpus: int
    own_pool: bool = False

    @property
    def replicas(self) -> int:
        return max(1, self.gpus // self.settings.tp)

    def beside_actor(self) -> dict:
        """On the actor's GPUs beside every other phase: colocated, its process's context (level 1: weights on the
        host, KV freed; eager: no graph pool); on its own pool, nothing."""
        return {} if self.own_pool else {"reward CUDA context": self.context_bytes}

    def awake(self) -> dict:
        e = self.memory
        return {"reward weights": e.weights_bytes, "reward KV cache": e.kv_bytes,
                "reward activations": e.activation_peak_bytes, "reward CUDA graphs": e.cuda_graph_bytes,
                "reward CUDA context": self.context_bytes}


def reward_engine(r: RewardSettings, actor_engine: EngineSettings, cluster: ClusterSpec, resident_bytes: int,
                  context_bytes: int) -> RewardModel:
    """The reward engine started beside `resident_bytes` (the actor's resident params, the reference, a critic; its
    own process: the trainer's bytes are other processes' memory to it, outside its torch, as its context is), or
    on its own pool's empty GPUs (its context only)."""
    try:
        s = dataclasses.replace(actor_engine, tp=r.tp, gpu_memory_utilization=r.gpu_memory_utilization,
                                enforce_eager=REWARD_ENFORCE_EAGER, max_num_seqs=REWARD_MAX_NUM_SEQS,
                                max_num_batched_tokens=REWARD_MAX_NUM_BATCHED_TOKENS, max_lora_rank=0)
    except SpecError as err:   # named as the request names it
        raise SpecError(f"reward_model_{err.field}", str(err).split(": ", 1)[1]) from None
    rm = value_model(r.model, role="reward", bias=False)   # a bias-free score head
    e = engine_memory(rm, s, cluster.gpu.memory_bytes, 0, (0 if r.own_pool else resident_bytes) + context_bytes)
    refusals = tuple(dataclasses.replace(x, field=f"reward_model_{x.field}", fix=(
        POOL_FIXES.get(x.code, x.fix) if r.own_pool else x.fix).replace(
        "--gpu-memory-utilization", "--reward-model-gpu-memory-utilization")) for x in e.refusals)
    return RewardModel(model=rm, settings=s, memory=dataclasses.replace(e, refusals=pool_refusals(r) + refusals),
                       context_bytes=context_bytes, gpus=r.pool_gpus or cluster.n_gpus, own_pool=r.own_pool)


def pool_refusals(r: RewardSettings) -> tuple[Refusal, ...]:
    """verl's checks of the reward pool's layout, as it raises them: RewardModelManager._initialize_llm_servers
    (num_replicas = world_size // TP > 0), split_resource_pool (TP divides the pool), RolloutReplica (a replica
    wider than a node spans whole nodes)."""
    pool, tp, per_node = r.pool_gpus, r.tp, r.pool_gpus_per_node
    fix = "set --reward-model-tp to a divisor of --reward-model-n-gpus-per-node x --reward-model-nnodes"
    if not r.own_pool:
        return ()
    if tp > pool:
        return (Refusal("reward_model_tp", "reward-pool", f"verl: Not enough GPUs to run the reward model. "
                        f"world_size ({pool}) < rollout_world_size ({tp})", fix),)
    if pool % tp:
        return (Refusal("reward_model_tp", "reward-pool", f"verl: the reward pool's {pool} GPUs do not split into "
                        f"replicas of TP {tp} (split_resource_pool: split_size must be a divisor of world_size)", fix),)
    if tp % min(per_node, tp):
        return (Refusal("reward_model_tp", "reward-pool", f"verl: world_size {tp} must be divisible by gpus_per_node "
                        f"{per_node} (a replica spans whole nodes of the reward pool)", fix),)
    return ()


def reward_row(rm: RewardModel | None, resident: dict, graphs: dict) -> list:
    """compute_rm_score: the actor as between phases, its engine asleep, the reward engine awake (colocated only:
    on its own pool it scores beside the rollout, on its own GPUs)."""
    if rm is None or rm.own_pool:
        return []
    return [("reward", resident, {**graphs, **rm.awake()}, False, False, True,
             "the reward model's engine woken to score the responses")]
