"""PPO's critic in verl (workers/fsdp_workers.py CriticWorker; 0.9.1: engine_workers.py on the same FSDP engine as
the actor): the actor's model with a value head (AutoModelForTokenClassification, num_labels 1: a Linear(hidden, 1)
with its bias in place of the vocabulary head), trained in full by its own FSDP worker process on the same GPUs,
with its own strategy and stored dtype (critic.strategy, critic.fsdp.model_dtype: verl 0.9.1 defaults fsdp, fp32,
whatever the actor runs; RlSettings takes the actor's where the request leaves them), param / optimizer offload and
CPUOffloadPolicy (critic.fsdp.*: critic_settings). Its memory and its time are the actor's rules on that model
(rl_actor.actor_states, rl_time.critic_seconds): the ledger's update at the same packed micro-batch
(critic.ppo_micro_batch_size_per_gpu taken equal to the actor's), no vocabulary-sized logits, no entropy.
Ignored: a reward model, a LoRA critic."""

from __future__ import annotations

import dataclasses

from .cluster_spec import ClusterSpec
from .model_spec import ModelSpec
from .profile import Profile
from .rl_batch import BatchPlan
from .rl_actor import ActorStates, actor_run, actor_states
from .rl_settings import RlSettings
from .spec_values import Finetune


def value_model(model: ModelSpec, role: str = "critic", bias: bool = True) -> ModelSpec:
    """The critic (or, bias-free, the reward model as served: rl_reward.py): the same blocks and embedding, a
    (hidden -> 1) head in place of the vocabulary's, untied."""
    return dataclasses.replace(model, name=f"{model.name} ({role})", head_params=model.hidden_size + bias,
                               vocab_size=1, tied_embeddings=False)


def critic_settings(settings: RlSettings) -> RlSettings:
    """The critic's worker as the actor's rules read it: full fine-tuning, no entropy, and its own strategy, dtype
    and offloads in the actor's fields (its CPUOffloadPolicy: host_offload, the manual ones forced off under it as
    verl does)."""
    return dataclasses.replace(settings, finetune=Finetune.FULL, entropy=False, entropy_chunking=False,
                               strategy=settings.critic_strategy, actor_dtype=settings.critic_dtype,
                               param_offload=settings.critic_param_offload,
                               optimizer_offload=settings.critic_optimizer_offload,
                               offload_policy=settings.critic_offload_policy)


def critic_states(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, batch: BatchPlan,
                  profile: Profile) -> ActorStates:
    own = critic_settings(settings)
    return actor_states(actor_run(value_model(model), cluster, own, batch), own, batch, profile)
