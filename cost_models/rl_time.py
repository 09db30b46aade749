"""Time of one verl GRPO step, split into generation, log-probs, update, weight sync and offload transfers. Every
part is an estimate (a roofline or the FSDP step-time model at the micro-batch), meant to rank configurations of
one job against each other, not to predict a wall clock:

- generation: a decode roofline per engine replica (rollout TP GPUs): each decode step reads the weights on a GPU
  and the KV cache of the sequences running (HBM-bound), sequences run in waves of the KV capacity (or
  max_num_seqs); prefill at the bf16 peak x the GPU's measured matmul efficiency, in vLLM's chunks of
  max_num_batched_tokens each reading the weights at least (and a served LoRA adapter's buffers: vLLM's LoRA
  kernels read them each step). Ignored: preemption, the sampler, the scheduler's gaps, the unequal lengths that
  leave the last wave's tail;
- update: the FSDP step-time model (step_time.py) of one micro-batch, times the micro-batches of a step, plus one
  optimizer step per mini-batch;
- log-probs (old and reference): the forward of a log-prob micro-batch (its own micro-batch or token budget, priced
  as the update's is), a third of its compute without recompute, per token; TRL (rl_schedule.py): the passes it
  runs (the old log-probs, the reference's: 0 to 2), its update num_iterations times over a generation batch, its
  forward and backward at the padded lengths (it pads to the generation batch's longest prompt and completion);
- Ulysses (sp > 1; verl models/transformers/monkey_patch.py _ulysses_flash_attention_forward): the micro-step is
  priced on sequences of L / sp tokens; each GPU in fact attends heads / sp over the whole L, the full length's
  attention FLOPs per local token (sp x those at L / sp), and runs four all-to-alls a layer (q, k, v before the
  attention, KV heads repeated to sp where fewer; the output after) forward, four backward, four more in a
  checkpointed block's recompute, on the critical path over the Ulysses group's tier (ulysses_s). Ignored: the
  attention kernel's higher rate at the full length, position_ids' all-gather;
- weight sync: every actor parameter all-gathered over the shard group in its stored dtype (intra-node bus), twice
  for verl's FSDP1 LoRA with model.lora.merge (its merge summons the model, then its state dict is walked); only
  the adapters for verl's FSDP2 LoRA served as an adapter (synced_bytes); TRL's
  vLLM server: the larger of that and rank 0's broadcast of the model to the server (rl_trl_server.send_s: its
  packed buffers double-buffered beside the gathers), once a step;
- TRL's steps (rl_schedule.trl_cycle): several generations per optimizer step each generate and run their log-prob
  passes; the update's micro-steps and optimizer steps as TRL counts them;
- offload: the host<->device bytes each step moves: actor params in and out for log-prob, update and sync; Adam's
  states in and out for the update; the offloaded reference streamed in once; sleep level 1's weight backup
  out and back; a merged LoRA's base shard out and back (merged_lora_context's backup and restore); PPO's
  critic likewise for its values and update (under its own CPUOffloadPolicy: its shard per
  values micro-batch; its update's copies and CPU step in critic_seconds); FSDP2's CPUOffloadPolicy: the update's
  per-unit H2D copies, gradient D2H copies and CPU Adam step as the step-time model prices CPU offload (the actor run's
  FsdpConfig.offload), the old log-prob's per-micro-batch and the sync's shard copies here (host_policy_bytes);
- a reward model (rl_reward.py): a prefill over each sequence on its engine's replicas (prefill_s), and its
  weights back from the host and out again (woken at level 1 for compute_rm_score, then asleep); on its own pool,
  awake, scoring each response as it finishes: overlapped with generation, only what outlasts it on the step
  (streamed; the last responses' scoring after the rollout ends is not counted).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from . import comm
from .cluster_spec import ClusterSpec
from .model_spec import ModelSpec
from .profile import Profile
from .rl_batch import BatchPlan
from .rl_actor import ActorStates, actor_run, reference_bytes, sent_tensors
from .rl_critic import critic_settings, value_model
from .rl_host import merge_backup_bytes
from .rl_settings import RlSettings
from .rl_reward import RewardModel
from .rl_sleep import engine_sleep
from .rl_schedule import schedule_of
from .rl_trl_server import send_s
from .rollout_engine import Engine, EngineMemory, EngineSettings, KvShape
from .step_time import TimeBreakdown, estimate_step_time

PASSES_PER_STEP = 3   # actor params loaded for compute_log_prob, update_actor and the weight sync
CRITIC_PASSES_PER_STEP = 2   # critic params loaded for compute_values and update_critic
ATTENTION_FORWARD_SHARE = 1 / 3.5   # kernel_time.price_block: flash-attention's backward at 2.5 x its forward


@dataclass(frozen=True)
class RlTime:
    generation_s: float
    log_prob_s: float
    update_s: float
    weight_sync_s: float
    offload_s: float
    critic_s: float = 0.0   # PPO: the critic's values and update (the actor's body, no vocabulary head)
    reward_s: float = 0.0   # a reward model's scoring: its engine's prefill and wake / sleep copies
    reward_overlapped_s: float = 0.0   # its own pool's scoring hidden behind generation (not in step_s)

    @property
    def step_s(self) -> float:
        return self.generation_s + self.log_prob_s + self.update_s + self.weight_sync_s + self.offload_s \
            + self.critic_s + self.reward_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "step_s": self.step_s}


def generation_s(model: ModelSpec, cluster: ClusterSpec, s: EngineSettings, e: EngineMemory, seqs_per_replica: int,
                 prompt_tokens: int, response_tokens: int) -> float:
    gpu = cluster.gpu
    running = max(1, min(e.max_concurrent_seqs, seqs_per_replica))
    waves = math.ceil(seqs_per_replica / running)
    kv_token_bytes = KvShape.of(model).token_bytes_per_layer(s.tp, s.kv_dtype_bytes) * model.n_layers
    context = prompt_tokens + response_tokens / 2   # the mean context a decode step reads
    # each decode step reads the weights once for the sequences running - and a served adapter's slot of the LoRA
    # buffers, which vLLM's punica kernels (SGLang's: of its pool) read for every wrapped linear (rollout_lora.py,
    # rollout_lora_sglang.py; their launches not priced); each
    # sequence reads its own context at each of its steps (a last wave not full reads only its sequences')
    decode = response_tokens * (waves * e.decode_read_bytes + seqs_per_replica * context * kv_token_bytes) \
        / gpu.hbm_bytes_per_s
    return decode + prefill_s(model, cluster, s, e, seqs_per_replica * prompt_tokens)


def prefill_s(model: ModelSpec, cluster: ClusterSpec, s: EngineSettings, e: EngineMemory, tokens: int) -> float:
    """A replica's prompts at the bf16 peak x the GPU's matmul efficiency, and no faster than its forward steps
    each reading the weights: vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py, token_budget =
    max_num_scheduled_tokens) runs at most max_num_batched_tokens tokens a step, so chunked prefill takes
    ceil(tokens / max_num_batched_tokens) steps (SGLang: its own chunk size, not priced)."""
    gpu = cluster.gpu
    flops = 2 * model.active_params / s.tp * tokens
    compute = flops / (gpu.priced_peak_flops("bf16") * gpu.matmul_fraction(0.8))
    if s.engine is not Engine.VLLM:
        return compute
    return max(compute, math.ceil(tokens / s.max_num_batched_tokens) * e.weights_pool_bytes / gpu.hbm_bytes_per_s)


def ulysses_s(model: ModelSpec, cluster: ClusterSpec, profile: Profile, micro: TimeBreakdown, tokens: int, sp: int,
              checkpointed: bool, forward_only: bool = False) -> float:
    """Seconds Ulysses adds to one micro-step of `tokens` tokens per GPU priced at L / sp (module docstring): the
    attention's (sp - 1) x its priced seconds (forward only: its forward share; a checkpointed block recomputes
    the forward) and the all-to-alls of q, k, v and the output, tokens x their widths x 2 B each."""
    if sp <= 1:
        return 0.0
    kv = model.n_kv_heads * max(sp // model.n_kv_heads, 1) * model.head_dim   # verl's repeat_kv up to sp heads
    tier = comm.Tier.for_group(cluster, profile, spans_nodes=sp > cluster.fast_tier_gpus)
    a2a = sum(comm.all_to_all_s(tokens * w * 2, sp, tier) for w in (model.q_dim, kv, kv, model.q_dim))
    f = ATTENTION_FORWARD_SHARE
    passes, attention = (1, f) if forward_only else (2 + checkpointed, 1 + f * checkpointed)
    return (sp - 1) * micro.attention_s * attention + model.n_layers * passes * a2a


def micro_step(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, batch: BatchPlan, tokens: int,
               mean_len: int, profile: Profile, sp: int, memo: dict | None = None) -> tuple[TimeBreakdown, int]:
    """The FSDP step model on one micro-batch of `tokens` tokens per GPU, priced as the sequences it packs
    (flash-attention's varlen kernel attends within each): whole sequences of their mean length (over sp with
    Ulysses); with the tokens as priced (whole sequences). memo: one search's cache (one cluster and profile; the
    actor's model and the critic's value model), keyed by the step's inputs."""
    run = actor_run(model, cluster, settings, batch, memo)
    seq = max(1, min(tokens, mean_len // sp))
    seqs = max(1, round(tokens / seq))
    fsdp2 = settings.strategy == "fsdp2"  # the copies around the collectives differ by API (fsdp_copies.py)
    key = (run.model.name, run.model.lora_targets, run.config, run.training, seq, seqs, fsdp2)
    if memo is not None and key in memo:
        return memo[key]
    step = estimate_step_time(run.model, run.cluster, dataclasses.replace(run.training, seq_len=seq),
                              dataclasses.replace(run.config, micro_batch=seqs), profile, fsdp2=fsdp2), seqs * seq
    if memo is not None:
        memo[key] = step
    return step


def train_seconds(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, batch: BatchPlan, prompt_tokens: int,
                  response_tokens: int, profile: Profile, sp: int, memo: dict | None = None,
                  steps: tuple[float, float] | None = None) -> tuple[float, float]:
    """(update, log-probs) seconds of a step: the update's micro-steps and one optimizer step per mini-batch (steps:
    (micro-steps, optimizer steps) where the schedule counts them: TRL's rl_schedule.trl_cycle); the old and
    reference log-probs, each the forward of the rank's tokens at the log-prob micro-batch. memo: a search's cache
    (micro_step's), which holds the result too."""
    key = ("train_seconds", model.name, settings.strategy, settings.finetune, settings.lora_rank,
           settings.lora_targets, settings.actor_dtype, settings.gradient_checkpointing, settings.fsdp_size,
           settings.host_offload, batch, prompt_tokens, response_tokens, sp, steps)
    if memo is not None and key in memo:
        return memo[key]
    length, gc = prompt_tokens + response_tokens, settings.gradient_checkpointing
    # what a micro-batch runs on average: dynamic batches are priced on their real tokens (BatchPlan), not the budget
    tokens = batch.update_run_tokens_per_gpu or batch.update_tokens_per_gpu
    micro, seqs_x_seq = micro_step(model, cluster, settings, batch, tokens, length, profile, sp, memo)
    per_token = (micro.step_s - micro.optimizer_s + ulysses_s(model, cluster, profile, micro, seqs_x_seq, sp, gc)) \
        / seqs_x_seq
    per_step, optimizer_steps = steps or (max(1, batch.micro_batches_per_mini) * batch.mini_batches_per_step,
                                          batch.mini_batches_per_step)
    update = per_step * tokens * per_token + optimizer_steps * micro.optimizer_s
    lp_tokens = batch.log_prob_run_tokens_per_gpu or batch.log_prob_tokens_per_gpu
    fwd, fwd_tokens = (micro, seqs_x_seq) if lp_tokens == tokens else micro_step(
        model, cluster, settings, batch, lp_tokens, length, profile, sp, memo)
    forward_per_token = ((fwd.compute_s - fwd.recompute_s) / 3
                         + ulysses_s(model, cluster, profile, fwd, fwd_tokens, sp, gc, forward_only=True)) / fwd_tokens
    rank_tokens = batch.step_seqs_per_rank * length / sp
    seconds = update, 2 * forward_per_token * rank_tokens
    if memo is not None:
        memo[key] = seconds
    return seconds


def rl_step_time(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, engine: EngineSettings,
                 e: EngineMemory, batch: BatchPlan, actor: ActorStates, prompt_tokens: int, response_tokens: int,
                 profile: Profile, sp: int, critic: ActorStates | None = None, memo: dict | None = None,
                 reward: RewardModel | None = None, trained: tuple[int, int] | None = None) -> RlTime:
    """prompt / response tokens: the means the engine generates; sp: the Ulysses degree; critic: PPO's, priced as
    the actor's update plus one forward (its values), its head's FLOPs left out, and its offload copies (params in
    and out for compute_values and update_critic, Adam's states for the update); memo: micro_step's; reward: a
    reward model's engine (reward_seconds over the step's sequences split across its replicas); trained: the
    (prompt, response) lengths the trainer's passes run where not those generated (TRL pads to the maxima)."""
    run = actor_run(model, cluster, settings, batch, memo)
    sched = schedule_of(settings, engine.version, batch)
    update, log_prob = train_seconds(model, cluster, settings, batch, *(trained or (prompt_tokens, response_tokens)),
                                     profile, sp, memo, steps=sched.update_steps)
    # TRL: update_steps counts its iterations; each generation runs its log-prob passes
    update *= 1 if sched.update_steps else sched.updates_per_generation
    log_prob *= sched.log_prob_passes / 2 * sched.generations
    d = run.shard_ranks
    bus = cluster.gpu.intra_node_bus_bytes_per_s
    synced = synced_bytes(model, settings, actor)
    sync = synced * (d - 1) / bus if d > 1 else synced / cluster.gpu.hbm_bytes_per_s
    # verl's FSDP1 merged LoRA: the merge's summon_full_params gathers the model once more (rl_strategy.py)
    sync *= 1 + (settings.lora_merged and settings.strategy == "fsdp" and d > 1)
    if not sched.engine_on_trainer:   # TRL's server: rank 0's broadcast, double-buffered beside the gathers
        sync = max(sync, send_s(cluster, profile, sum(sent_tensors(model, settings)), settings.server_local))
    sync *= sched.syncs
    moved = (2 * PASSES_PER_STEP * actor.params_bytes * settings.param_offload
             + 2 * actor.optimizer_bytes * settings.optimizer_offload
             + reference_bytes(model, cluster, settings) * settings.reference_offloaded * (settings.framework == "verl")
             + 2 * e.weights_pool_bytes * engine_sleep(settings.sleep_level, engine.engine).weights_to_host
             + 2 * merge_backup_bytes(model, settings, actor) * settings.lora_merged   # the merge's, out and back
             + host_policy_bytes(settings, batch, actor, sum(trained or (prompt_tokens, response_tokens)), sp,
                                 sched.log_prob_passes * sched.generations))
    if critic is not None:   # its CPUOffloadPolicy: the shard copied in for each values micro-batch's all-gathers
        values = critic.params_bytes * critic.on_host * forward_micro_batches(
            batch, sum(trained or (prompt_tokens, response_tokens)), sp,
            batch.update_run_tokens_per_gpu or batch.update_tokens_per_gpu)
        moved += (2 * CRITIC_PASSES_PER_STEP * critic.params_bytes * settings.critic_param_offload
                  + 2 * critic.optimizer_bytes * settings.critic_optimizer_offload + values)
    time = RlTime(generation_s=sched.generations * generation_s(model, cluster, engine, e,
                                                                 batch.rollout_seqs_per_replica, prompt_tokens,
                                                                 response_tokens),
                  log_prob_s=log_prob, update_s=update, weight_sync_s=sync,
                  offload_s=moved / cluster.gpu.pcie_bytes_per_s,
                  critic_s=critic_seconds(model, cluster, settings, batch, *(trained or (prompt_tokens,
                                                                                    response_tokens)),
                                          profile, sp, memo) if critic is not None else 0.0,
                  reward_s=0.0 if reward is None else reward_seconds(
                      cluster, reward, -(-batch.sequences_per_step // reward.replicas),
                      prompt_tokens + response_tokens))
    return streamed(time) if reward is not None and reward.own_pool else time


def synced_bytes(model: ModelSpec, settings: RlSettings, actor: ActorStates) -> int:
    """A rank's shard bytes each weight sync gathers. verl 0.9.1's FSDP2 LoRA served as an adapter: the adapters'
    share alone (workers/engine/fsdp/transformer_impl.py get_per_tensor_param(base_sync_done=True) ->
    utils/fsdp_utils.py collect_lora_params: get_peft_model_state_dict's tensors, each .full_tensor(); its
    FSDP.summon_full_params is FSDP1's API, a no-op on FSDP2 modules; the first sync's base, once, is not a step's).
    Otherwise the whole shard: FSDP1's summon (whole or layered_summon's units) or a state-dict walk."""
    if settings.framework == "verl" and settings.lora_adapter and settings.strategy == "fsdp2":
        return actor.params_bytes - merge_backup_bytes(model, settings, actor)   # less the base's share
    return actor.params_bytes


def host_policy_bytes(settings: RlSettings, batch: BatchPlan, actor: ActorStates, length: int, sp: int,
                      passes: int = 2) -> int:
    """CPUOffloadPolicy's copies outside the update (whose per-unit H2D copies, gradient D2H copies and CPU step
    the step-time model prices: step_parts._optimizer_times): the shard copied in for every forward-only
    micro-batch's all-gathers (the old log-probs; LoRA's reference is the actor too) and once for the weight sync.
    TRL: each of its `passes` (the reference offloaded with the actor, in its dtype: a shard as large)."""
    if not actor.on_host:
        return 0
    micro_batches = forward_micro_batches(batch, length, sp,
                                          batch.log_prob_run_tokens_per_gpu or batch.log_prob_tokens_per_gpu)
    per_micro_batch = passes if settings.framework == "trl" else 1 + settings.lora
    return actor.params_bytes * (micro_batches * per_micro_batch + 1)


def forward_micro_batches(batch: BatchPlan, length: int, sp: int, tokens_per_micro_batch: int) -> int:
    """A rank's forward micro-batches over the step's sequences of `length` tokens (over sp with Ulysses)."""
    return -(-batch.step_seqs_per_rank * length // sp // max(1, tokens_per_micro_batch))


def critic_seconds(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, batch: BatchPlan, prompt_tokens: int,
                   response_tokens: int, profile: Profile, sp: int, memo: dict | None = None) -> float:
    """PPO's critic: its update and one forward (half the two log-prob passes), priced as the actor's are under the
    critic's own settings (rl_critic.critic_settings: trained in full at its strategy and dtype, its
    CPUOffloadPolicy's per-unit copies and CPU Adam step: host_optimizer.py) on the value model (a hidden x 1 head:
    no vocabulary FLOPs, its own parameters in the CPU step) and the actor's batch plan."""
    update, log_prob = train_seconds(value_model(model), cluster, critic_settings(settings), batch, prompt_tokens,
                                     response_tokens, profile, sp, memo)
    return update + log_prob / 2


def reward_seconds(cluster: ClusterSpec, rm: RewardModel, seqs_per_replica: int, seq_tokens: int) -> float:
    """A reward model's scoring: each replica's sequences prefilled whole (one score each: no decode); colocated
    (compute_rm_score), its level-1 sleep's weights copied in and out over PCIe too."""
    return (prefill_s(rm.model, cluster, rm.settings, rm.memory, seqs_per_replica * seq_tokens)
            + 2 * rm.memory.weights_bytes / cluster.gpu.pcie_bytes_per_s * (not rm.own_pool))


def streamed(time: RlTime) -> RlTime:
    """A reward pool's scoring as verl streams it (rl_reward.py): beside the rollout, on the step only where it
    outlasts generation."""
    return dataclasses.replace(time, reward_s=max(0.0, time.reward_s - time.generation_s),
                               reward_overlapped_s=min(time.reward_s, time.generation_s))
