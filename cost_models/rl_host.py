"""Host RAM per node of a verl GRPO job with FSDP workers and a co-located engine (shared/reference/rl.md):
what each offload puts on the host, the engine's level-1 weight backup, the /dev/shm model copy and the
checkpoint's staging, summed over the node's GPUs.

- actor param / optimizer offload (verl fsdp_utils offload_fsdp_model_to_cpu / offload_fsdp_optimizer): the
  rank's shard moves to the host between phases (moved, not copied: it is on one side at a time);
- the reference (FSDP1 CPUOffload(offload_params=True)): its bf16 shard stays on the host;
- vLLM sleep level 1 (vllm/device_allocator/cumem.py CuMemAllocator.sleep(offload_tags="weights")): the engine's
  bf16 weights backed up to pinned host memory on every GPU, i.e. the model x GPUs per node / rollout TP; level 2
  discards them;
- model.use_shm: the checkpoint copied once per node to /dev/shm (its bf16 size);
- checkpoint save (verl FSDPCheckpointManager.save_checkpoint: a sharded state dict with offload_to_cpu, then
  torch.save per rank): each rank's params and optimizer shards staged on the host at once, on top of the rest.
Ignored: each worker process's own RSS (CUDA and torch libraries, Ray), the page cache, the dataloader.
The plain-training counterpart (loading, DCP / full-state-dict saves) is cost_models/outside_step.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster_spec import ClusterSpec
from .model_spec import ModelSpec
from .rl_phases import ActorStates, RlSettings, reference_bytes
from .rollout_engine import EngineMemory


@dataclass(frozen=True)
class HostRam:
    terms: dict                 # name -> bytes per node (resident between phases)
    checkpoint_staging_bytes: int

    @property
    def resident_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def peak_bytes(self) -> int:
        """At a checkpoint save: the resident terms and the staging together."""
        return self.resident_bytes + self.checkpoint_staging_bytes


def host_ram_per_node(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, actor: ActorStates,
                      engine: EngineMemory, critic: ActorStates | None = None) -> HostRam:
    """`critic`: PPO's (rl_critic.py), its offloads and its checkpoint staged like the actor's."""
    gpus = cluster.gpus_per_node
    terms = {
        "actor params (offloaded)": actor.params_bytes * gpus if settings.param_offload else 0,
        "Adam states (offloaded)": actor.optimizer_bytes * gpus if settings.optimizer_offload else 0,
        "reference (offloaded)": reference_bytes(model, cluster, settings) * gpus if settings.ref_param_offload else 0,
        "engine weight backup (sleep level 1)": engine.weights_bytes * gpus if settings.sleep_level == 1 else 0,
        "model copy in /dev/shm": model.n_params * 2 if settings.use_shm else 0,
    }
    staged = [actor]
    if critic is not None:
        terms["critic params (offloaded)"] = critic.params_bytes * gpus * settings.critic_param_offload
        terms["critic Adam states (offloaded)"] = critic.optimizer_bytes * gpus * settings.critic_optimizer_offload
        staged.append(critic)
    staging = sum(s.params_bytes + s.optimizer_bytes for s in staged) * gpus
    return HostRam(terms={k: v for k, v in terms.items() if v}, checkpoint_staging_bytes=staging)
