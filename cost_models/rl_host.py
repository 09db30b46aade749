"""Host RAM per node of a verl GRPO / PPO job with FSDP workers and a co-located engine (shared/reference/rl.md):
what each offload puts on the host, the engine's level-1 weight backup, the /dev/shm model copy, loading and the
checkpoint's staging, summed over the node's GPUs.

- the workers' processes: one per GPU (the actor / rollout / reference worker; PPO: a critic worker too), each at
  least host_ram.PROCESS_BYTES_PER_RANK (a floor: vLLM's and CUDA's host pages come on top);
- actor param / optimizer offload (verl fsdp_utils offload_fsdp_model_to_cpu / offload_fsdp_optimizer): the
  rank's shard moves to the host between phases (moved, not copied: it is on one side at a time);
- FSDP2's CPUOffloadPolicy (fsdp_config.offload_policy, pin_memory=True): the actor's params, grads and Adam states
  (and the CPU step's temporaries) on the host for the whole run; params and grads pinned (torch _fsdp_param.py,
  _fsdp_collectives.py: the grads' non-blocking D2H copy), Adam's states made by the CPU step beside the params;
  PPO's critic likewise under its own (critic.fsdp.offload_policy);
- the reference (FSDP1 CPUOffload(offload_params=True)): its bf16 shard stays on the host;
- the engine asleep at the level the framework runs (rl_sleep.py): vLLM's level 1 (vllm/device_allocator/cumem.py
  CuMemAllocator.sleep(offload_tags="weights"), verl's for a LoRA adapter) backs its bf16 weights up to pinned host
  memory on every GPU, i.e. the model x GPUs per node / rollout TP, with a served LoRA adapter's buffers (allocated
  under the same "weights" tag: rollout_lora.py); level 2 (verl's otherwise, TRL's) discards
  them; SGLang under verl backs them up at level 2 (enable_weights_cpu_backup) and keeps them on the GPU at 1;
- model.use_shm: the checkpoint copied once per node to /dev/shm (its bf16 size);
- loading (verl builds the actor on rank 0 and broadcasts it: sync_module_states): rank 0 holds the whole actor
  in its dtype, before anything is offloaded (outside_step.load_bytes, RANK0_BROADCAST);
- checkpoint save (verl FSDPCheckpointManager.save_checkpoint: a sharded state dict with offload_to_cpu, then
  torch.save per rank): each rank's params and optimizer shards staged on the host at once, on top of the
  resident terms (outside_step.save_bytes, DCP_ASYNC: "the shard staged to host").
- a reward model (rl_reward.py) on the actor's GPUs: its engine asleep at level 1 between scorings, its bf16
  weights backed up to pinned host memory on every GPU, and its processes (one per GPU); on its own pool, none of
  it on the trainer's nodes (its pool's nodes: awake, no backup, not priced here).
- the weight sync (verl 0.9.1, a LoRA actor; sync_terms): with model.lora.merge, merged_lora_context's backup of the
  base (utils/fsdp_utils.py backup_base_model_weights: every base parameter's shard cloned to the host) at every
  sync; served as an adapter under rollout.load_format dummy (verl's default; engine_workers.py base_sync_done is
  False until the first sync), the first sync sends the base too: collect_lora_params(base_sync_done=False) moves
  the model to the host (model.to("cpu"), FSDP1 inside summon_full_params, FSDP2 its shards) and keeps every
  parameter whole there (full_tensor() over the gloo group, .cpu()) on every rank while the bucketed sender copies
  them out - the whole base in the stored dtype per GPU, once. Under another load_format (safetensors, auto, pt:
  settings.base_preloaded) the engine loads the base from disk at its start and no base is sent (the page cache:
  ignored). Meanwhile the actor's offloaded params are on the GPU (load_fsdp_model_to_gpu) and the engine's level-1
  backup woken into it (resume(tags=["weights"])).
- a reward model on its own resource pool loads nothing on the host: its engine reads the checkpoint from disk
  (vllm serve's load_format auto) and its HFModelConfig(path=...) (experimental/reward_loop/reward_model.py
  RewardModelManager._initialize_llm_servers) leaves use_shm False: no /dev/shm copy, whatever model.use_shm says.
Ignored: the page cache, the dataloader, Ray's object store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cluster_spec import ClusterSpec
from .host_ram import PROCESS_BYTES_PER_RANK
from .model_spec import ModelSpec
from .outside_step import LoadWay, SaveWay, StateSizes, load_bytes, save_bytes
from .rl_actor import ActorStates, reference_bytes
from .rl_lora_targets import lora_model
from .rl_settings import ACTOR_DTYPES, RlSettings
from .rl_reward import RewardModel
from .rl_sleep import EngineSleep, engine_sleep
from .rollout_engine import Engine, EngineMemory
from .units import DTYPE_BYTES


@dataclass(frozen=True)
class HostRam:
    """Its own composition, not host_ram.HostRam's (whose load and save terms it shares: outside_step.load_bytes /
    save_bytes): named resident terms of several workers and the engine in place of one offloaded term, verl's ways
    fixed (no Ways, no why), and no resume term - verl's load_checkpoint (workers/engine/fsdp/transformer_impl.py,
    verl 0.9.1) moves offloaded params back to the GPU first and torch.loads each rank's shard files, the staging's
    bytes (FSDPCheckpointManager.load_checkpoint), so the save's resident + staging bounds it."""

    terms: dict                 # name -> bytes per node held between phases
    process_bytes: int          # the workers' processes (a floor)
    load_bytes: int             # loading the actor on rank 0's node, before the terms exist
    checkpoint_staging_bytes: int
    sync_terms: dict = field(default_factory=dict)   # name -> bytes per node the weight sync adds (module docstring)
    sync_bytes: int = 0         # the weight sync's moment: the terms it leaves on the host and sync_terms

    @property
    def resident_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def peak_bytes(self) -> int:
        """The processes with the largest of loading, a checkpoint save beside the resident terms, the weight sync."""
        return self.process_bytes + max(self.load_bytes, self.resident_bytes + self.checkpoint_staging_bytes,
                                        self.sync_bytes)


def _sizes(states: ActorStates, ranks: int) -> StateSizes:
    """outside_step's sizes from a worker's per-rank shards (their whole = shard x ranks)."""
    return StateSizes(params_bytes=states.params_bytes * ranks, optimizer_bytes=states.optimizer_bytes * ranks,
                      largest_tensor_bytes=states.largest_tensor_bytes, largest_unit_bytes=states.unit_gather_bytes,
                      ranks=ranks)


def policy_terms(states: ActorStates, gpus: int, worker: str = "") -> dict:
    """A worker's CPUOffloadPolicy on the node's host: its params, grads and Adam states and the CPU step's
    temporaries, each GPU's shard (none where its states are on the GPU)."""
    held = states.params_bytes + states.grads_bytes + states.optimizer_bytes
    return {f"{worker}params, grads, Adam states (CPUOffloadPolicy)": held * gpus * states.on_host,
            f"{worker}CPU optimizer step temporaries": states.step_temporary_bytes * gpus * states.on_host}


def host_ram_per_node(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, actor: ActorStates,
                      engine: EngineMemory, critic: ActorStates | None = None,
                      reward: RewardModel | None = None, sleep: EngineSleep | None = None) -> HostRam:
    """`critic`: PPO's (rl_critic.py), its process, offloads and checkpoint like the actor's (its load by its own
    strategy, critic.strategy); `reward`: a reward model's engine (its weight backup and processes, where it shares
    the actor's GPUs); `sleep`: the engine's (RlMemory.sleep; default: vLLM's at the settings' level)."""
    gpus, ranks = cluster.gpus_per_node, cluster.n_gpus
    sleep = sleep or engine_sleep(settings.sleep_level, Engine.VLLM)
    terms = {
        "actor params (offloaded)": actor.params_bytes * gpus if settings.param_offload else 0,
        "Adam states (offloaded)": actor.optimizer_bytes * gpus if settings.optimizer_offload else 0,
        **policy_terms(actor, gpus, "actor "),
        "reference (offloaded)": reference_bytes(model, cluster, settings) * gpus if settings.reference_offloaded else 0,
        f"engine weight backup (sleep level {sleep.level})":
            engine.weights_pool_bytes * gpus * sleep.weights_to_host,
        "model copy in /dev/shm": model.n_params * 2 if settings.use_shm else 0,
    }
    workers = [(actor, settings.strategy)]
    if critic is not None:
        terms["critic params (offloaded)"] = critic.params_bytes * gpus * settings.critic_param_offload
        terms["critic Adam states (offloaded)"] = critic.optimizer_bytes * gpus * settings.critic_optimizer_offload
        terms.update(policy_terms(critic, gpus, "critic "))
        workers.append((critic, settings.critic_strategy))
    colocated = reward is not None and not reward.own_pool
    if colocated:
        terms["reward weight backup (sleep level 1)"] = reward.memory.weights_bytes * gpus
    staging = sum(save_bytes(SaveWay.DCP_ASYNC, _sizes(w, ranks)).node_bytes(gpus) for w, _ in workers)
    load = max(load_bytes(LoadWay.RANK0_BROADCAST, _sizes(w, ranks), fsdp2=strategy == "fsdp2").node_bytes(gpus)
               for w, strategy in workers)
    processes = len(workers) + colocated
    sync = {k: v for k, v in sync_host_terms(model, settings, actor, gpus).items() if v}
    # at the sync the offloaded actor params are on the GPU and the engine's backup woken into it
    moved = {"actor params (offloaded)", f"engine weight backup (sleep level {sleep.level})"}
    at_sync = sum(v for k, v in terms.items() if k not in moved) + sum(sync.values()) if sync else 0
    return HostRam(terms={k: v for k, v in terms.items() if v}, process_bytes=PROCESS_BYTES_PER_RANK * gpus
                   * processes, load_bytes=load, checkpoint_staging_bytes=staging, sync_terms=sync, sync_bytes=at_sync)


def merge_backup_bytes(model: ModelSpec, settings: RlSettings, actor: ActorStates) -> int:
    """One rank's base backup under model.lora.merge (sync_host_terms): FSDP1 its whole shard, FSDP2 the shard's
    base share."""
    if settings.strategy == "fsdp":
        return actor.params_bytes
    adapters = lora_model(model, settings).lora_params(settings.lora_rank)
    return actor.params_bytes * model.n_params // (model.n_params + adapters)


def sync_host_terms(model: ModelSpec, settings: RlSettings, actor: ActorStates, gpus: int) -> dict:
    """What verl 0.9.1's weight sync of a LoRA actor puts on a node's host (module docstring), each GPU's: the
    merge's base backup - the rank's shard: FSDP1's flat parameters, adapters too; FSDP2's base parameters alone
    (under disable_adapter, "lora" names skipped), the shard's base share - or the first sync's whole base in the
    stored dtype. Both measured with verl's functions on 2 gloo ranks (benchmarks/verl_sync_check.py)."""
    if settings.framework != "verl" or not settings.lora:
        return {}
    if settings.lora_merged:
        return {"LoRA merge's base backup (each sync)": merge_backup_bytes(model, settings, actor) * gpus}
    stored = DTYPE_BYTES[ACTOR_DTYPES[settings.actor_dtype].param_dtype]
    return {"LoRA base sent from the host (first sync)": model.n_params * stored * gpus * (not settings.base_preloaded)}
