"""GPU memory per phase of a verl GRPO / PPO step (FSDP workers with the rollout engine in the same process), in verl's
order (PHASES). Each phase is what is resident (actor params / Adam states / reference, the engine awake or asleep)
plus the transient peak of its work; the job's peak is the largest phase.

Sources (shared/reference/rl.md; verl of 2025, workers/fsdp_workers.py and sharding_manager/fsdp_vllm.py):
- the actor's update is the repo's FSDP ledger (memory.estimate_memory) on the packed micro-batch (micro_batch 1 of
  the micro-batch's tokens per GPU), loaded whole on the GPU (verl loads offloaded params and optimizer before
  update_actor and offloads them after); its loss is verl's log-prob path, not the ledger's cross-entropy:
  verl_logits_bytes. The first step has no Adam states in the backward (torch creates them lazily in the step,
  beside the foreach temporaries: optimizer_step.py); a later step keeps them, and they stay on the GPU into the
  next rollout unless offloaded (verl PR 1349).
- the engine (rollout_engine.py) is built after the actor and the reference (ray_trainer.init_workers: "create
  rollout at the end so that vllm can have a better estimation of kv cache memory"): its KV budget sees what is
  resident then, never Adam's states. Asleep it frees weights and KV, at the level the framework runs
  (rl_sleep.py: SGLang's LoRA adapter keeps its weights); its CUDA-graph pool stays.
- weight sync: the actor's shard loaded, the engine's weights awake (0.8-era verl: wake_up() wakes the KV cache
  too; later: weights first, KV after), and one gathered tensor at a time (full_tensor()): the largest one;
  FSDP1's state dict adds its copy of the shard and its walk over the units; verl 0.9.1 sends through a 2 GiB
  bucket (rl_strategy.py: sync_bucket, merged_sync_bytes for model.lora.merge).
- FSDP2's CPUOffloadPolicy (settings.host_offload): the actor's params, grads and Adam states never on the GPU
  (the ledger's CPU offload for the update; the other phases hold the gathered units only); PPO's critic likewise
  under its own (settings.critic_host_offload, critic.on_host).
- Ulysses (batch.ulysses > 1): its all-to-alls' moment in the log-prob forward where it exceeds the block's
  bound, flash attention's repeated k, v in the update (rl_ulysses.py).
- TRL's vLLM server (rl_schedule: engine_on_trainer False): no engine term on the trainer's GPUs at any phase; the
  sync's rank 0 packs what it gathers; the server's GPU and layout as refusals (rl_trl_server.py).
Ignored: the attention's workspaces, gradients after the update (freed: verl's zero_grad
/ offload). PPO's critic (rl_critic.py) adds critic_values / critic_update, a reward model (rl_reward.py) `reward`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster_spec import ClusterSpec
from .feasibility import Refusal
from .model_spec import ModelSpec
from .outside_allocator import outside_allocator_terms
from .profile import Profile
from .rl_actor import (ActorRun, ActorStates, actor_run, actor_states, forward_only_bytes, reference_bytes,
                       sent_tensors)
from .rl_batch import BatchPlan
from .rl_reward import RewardModel, RewardSettings, reward_engine, reward_row
from .rl_schedule import Schedule, schedule_of
from .rl_settings import RlSettings
from .rl_sleep import EngineSleep, engine_sleep
from .rl_strategy import sync_bucket, sync_moment
from .rl_trl_server import server_gpu_bytes, server_refusals
from .rollout_engine import EngineMemory, EngineSettings, engine_memory

PHASES = ("init", "rollout", "weight_sync", "reward", "log_prob", "ref_log_prob", "critic_values", "critic_update",
          "update", "optimizer_step", "checkpoint")   # reward: with a reward model; the critic's two: PPO only


@dataclass(frozen=True)
class Phase:
    name: str
    gpu_bytes: dict          # term -> bytes on one GPU at the phase's peak
    reserved_bytes: int      # what the GPU must hold: torch's terms with fragmentation and context, the engine's
    offloaded: tuple[str, ...] = ()
    note: str = ""

    @property
    def allocated_bytes(self) -> int:
        return sum(self.gpu_bytes.values())


@dataclass(frozen=True)
class RlMemory:
    phases: tuple[Phase, ...]
    engine: EngineMemory
    actor: ActorStates
    refusals: tuple[Refusal, ...]
    critic: ActorStates | None = None   # PPO
    reward: RewardModel | None = None   # reward_model.enable
    sleep: EngineSleep | None = None    # the engine's sleep as the framework runs it

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.reserved_bytes)


def _offloaded(settings: RlSettings, actor_loaded: bool, adam_loaded: bool, engine_asleep: bool,
               critic_loaded: bool = False) -> tuple:
    """What sits on the host (or is discarded) during a phase."""
    return tuple(name for name, away in (
        ("actor params", settings.param_offload and not actor_loaded),
        ("actor params, grads, Adam states (CPUOffloadPolicy)", settings.host_offload),
        ("Adam states", settings.optimizer_offload and not adam_loaded),
        ("reference", settings.reference_offloaded and not settings.lora),
        ("critic params", settings.ppo and settings.critic_param_offload and not critic_loaded),
        ("critic Adam states", settings.ppo and settings.critic_optimizer_offload and not critic_loaded),
        ("critic params, grads, Adam states (CPUOffloadPolicy)", settings.critic_host_offload),
        (f"engine asleep (level {settings.sleep_level})", engine_asleep)) if away)


def _phase(name: str, torch_terms: dict, engine_terms: dict, profile: Profile, outside_bytes: int, offloaded=(),
           note="") -> Phase:
    """Torch's tensors take the allocator's fragmentation, plus the actor process's memory outside the allocator
    (outside_allocator.py: its CUDA context and communicators); the engine's (vLLM's CuMem pool, CUDA graphs) are
    added as they are."""
    terms = {k: v for k, v in {**torch_terms, **engine_terms}.items() if v}
    reserved = profile.reserved_bytes(sum(torch_terms.values()), outside_bytes) + sum(engine_terms.values())
    return Phase(name, terms, reserved, tuple(offloaded), note)


def critic_terms(critic: ActorStates | None, settings: RlSettings, outside_bytes: int) -> tuple[dict, dict, dict]:
    """PPO's critic (its own worker process, verl's CriticWorker) beside every phase: its params and, from step 2,
    Adam's states unless offloaded or under its CPUOffloadPolicy (torch terms), and its process's CUDA context
    (outside this allocator); at init, the params only. GRPO: nothing."""
    if critic is None:
        return {}, {}, {}
    params = 0 if settings.critic_param_offload or critic.on_host else critic.params_bytes
    adam = 0 if settings.critic_optimizer_offload or critic.on_host else critic.optimizer_bytes
    return ({"critic params": params}, {"critic params": params, "critic Adam states": adam},
            {"critic CUDA context": outside_bytes})


def _outside_bytes(run: ActorRun, profile: Profile, memo: dict | None) -> int:
    """outside_allocator_terms of the actor's process, once per FSDP configuration in a search (memo)."""
    memo, key = {} if memo is None else memo, ("outside", run.config, run.cluster.gpus_per_node)
    if key not in memo:
        memo[key] = sum(t.bytes for t in outside_allocator_terms(run.cluster, run.config, profile))
    return memo[key]


def rl_phases(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, engine: EngineSettings,
              batch: BatchPlan, profile: Profile, critic: ActorStates | None = None,
              actor: ActorStates | None = None, memo: dict | None = None,
              reward: RewardSettings | None = None) -> RlMemory:
    """Every phase of a GRPO step on one GPU (see the module docstring); `critic`: PPO's (rl_critic.py); `actor`:
    the actor's states where the caller priced them already (a search: planner/rl/search.py); memo: actor_run's;
    `reward`: a reward model (rl_reward.py), started before the actor's engine."""
    run = actor_run(model, cluster, settings, batch, memo)
    actor = actor or actor_states(run, settings, batch, profile)
    # the actor's (and a critic process's) memory outside torch's allocator: its context and its FSDP communicator
    # (the engine's own communicators, vLLM TP, not counted)
    outside = _outside_bytes(run, profile, memo)
    c = 2  # bf16 compute (the actor's mixed precision, the reference, the engine)
    sched = schedule_of(settings, engine.version, batch)
    ref = reference_bytes(model, cluster, settings)
    ref_resident = 0 if settings.reference_offloaded else ref
    # CPUOffloadPolicy: the model states never on the GPU; each unit's shard copied in for its all-gather (priced
    # as the gathered units), the optimizer step on the CPU
    loaded = 0 if actor.on_host else actor.params_bytes
    params_resident = 0 if settings.param_offload else loaded
    adam_resident = 0 if settings.optimizer_offload or actor.on_host else actor.optimizer_bytes
    critic_init, critic_held, critic_outside = critic_terms(critic, settings, outside)
    at_init = 0 if sched.engine_first or not sched.engine_on_trainer else (
        params_resident + ref_resident + sum(critic_init.values()) + sum(critic_outside.values()))
    rm = reward and reward_engine(reward, engine, cluster, at_init, outside)
    beside = rm.beside_actor() if rm else {}   # a colocated reward engine's context (its own pool: none)
    e = engine_memory(model, engine, cluster.gpu.memory_bytes, at_init + sum(beside.values()), outside)
    graphs = {"engine CUDA graphs": e.cuda_graph_bytes, **critic_outside, **beside}
    # vLLM's weights pool: the weights and a served LoRA adapter's buffers (rollout_lora.py), woken and put to
    # sleep together
    weights = {"engine weights": e.weights_bytes, "engine LoRA buffers": e.lora_bytes}
    awake = {**weights, "engine KV cache": e.kv_bytes, "engine activations": e.activation_peak_bytes, **graphs}
    sync_engine = {**weights, **graphs, **({"engine KV cache": e.kv_bytes} if sched.sync_wakes_kv else {})}
    # outside generation: asleep, its CUDA-graph pool only; or (TRL without sleep mode) its weights and KV cache
    sleep = engine_sleep(settings.sleep_level, engine.engine)
    kept = weights if sleep.weights_on_gpu else {}   # SGLang's LoRA adapter
    idle = {**weights, "engine KV cache": e.kv_bytes, **graphs} if sched.engine_idle else {**kept, **graphs}
    walk_engine = graphs if engine.version == "0.8" else {**weights, **graphs}
    server = ()
    if not sched.engine_on_trainer:   # TRL's vLLM server, on GPUs of its own (rl_trl_server.py)
        graphs = awake = sync_engine = idle = walk_engine = {}
        server = tuple(server_refusals(model, cluster, settings.strategy, engine.tp, settings.server_data_parallel,
                                       settings.server_local,
                                       server_gpu_bytes(e, list(sent_tensors(model, settings)), outside)))
    asleep = sched.engine_on_trainer and not sched.engine_idle
    # the sender's bucket beside the send, and beside a merged LoRA's walk (drawn from the sender's generator)
    walk, send = actor.sync_bytes
    bucket = sync_bucket(settings, engine.version)
    sync_bytes = ({**walk, **bucket} if walk and settings.lora_merged else walk), {**send, **bucket}
    held = {"actor params": params_resident, "reference": ref_resident}
    resident = {**held, "Adam states": adam_resident}
    fwd, ref_fwd = forward_only_bytes(model, batch.log_prob_tokens_per_gpu, c, settings, batch.ulysses, batch)
    gathered = {"gathered units": actor.unit_gather_bytes}
    ref_actor = {"actor params": loaded} if settings.lora else {"actor params": params_resident}
    update = {"reference": ref_resident, **actor.update_steady.to_dict()}
    first = {"reference": ref_resident, **actor.update_first.to_dict()}
    update, label = (update, "steady step") if sum(update.values()) >= sum(first.values()) else (first, "first step")
    step = {"reference": ref_resident, **({} if actor.on_host else {
        "actor params": actor.params_bytes, "actor grads": actor.grads_bytes, "Adam states": actor.optimizer_bytes,
        "step temporaries": actor.step_temporary_bytes})}
    def reserved(torch_terms: dict, engine_terms: dict) -> int:
        return profile.reserved_bytes(sum(torch_terms.values()), outside) + sum(engine_terms.values())
    # (name, torch terms, engine terms, actor loaded, Adam loaded, engine asleep, note)
    rows = [
        ("init", {} if sched.engine_first else {**held, **critic_init}, awake, False, False, False,
         "the engine starts before the actor and reference are sharded onto the GPU" if sched.engine_first else
         "no engine here: the vLLM server starts on its own GPUs" if not sched.engine_on_trainer else
         "the engine sizes its KV cache beside what is resident"),
        ("rollout", {**resident, **critic_held}, awake, False, False, False,
         "the vLLM server generates; the trainer waits" if not sched.engine_on_trainer else
         "from step 2: Adam's states resident unless offloaded (the KV budget never saw them)"),
        ("weight_sync", *sync_moment(*sync_bytes, {"actor params": loaded, "reference": ref_resident,
                                                         "Adam states": adam_resident, **critic_held},
                                     walk_engine, sync_engine, reserved),
         True, False, False, "one parameter gathered at a time into the engine" if sched.engine_on_trainer else
         "rank 0 packs the gathered parameters into 1 GiB buffers for its NCCL broadcast to the server"),
        *reward_row(rm, {**resident, **critic_held}, idle),
        ("log_prob", {"actor params": loaded, **gathered, "reference": ref_resident,
                      "Adam states": adam_resident, **fwd, **critic_held}, idle, True, False, asleep, "forward only"),
        ("ref_log_prob", reference_pass(model, sched, {**ref_actor, "reference": ref_resident}, gathered,
                                        adam_resident, ref_fwd, critic_held, c), idle, settings.lora, False, asleep,
         "LoRA: the actor without its adapter" if settings.lora else
         "the reference one FSDP2 unit: gathered whole" if sched.whole_reference else ""),
        *critic_rows(critic, resident, critic_held, fwd, idle),
        ("update", {**update, **critic_held}, idle, True, True, asleep,
         f"{label}; Adam's states in the backward from step 2"),
        ("optimizer_step", {**step, **critic_held}, idle, True, True, asleep,
         "CPUOffloadPolicy: the step runs on the CPU" if actor.on_host else
         "the first step creates Adam's states beside the foreach temporaries"),
        ("checkpoint", {"actor params": loaded, "Adam states": adam_resident, "reference": ref_resident,
                        **critic_held}, idle, True, False, asleep, ""),
    ]
    if sched.phases is not None:   # the framework's own phases, in its order (rl_schedule.py)
        rows = [row for name in sched.phases for row in rows if row[0] == name]
    phases = tuple(_phase(name, torch, eng, profile, outside,
                          _offloaded(settings, loaded, adam, asleep, critic_loaded=name.startswith("critic")), note)
                   for name, torch, eng, loaded, adam, asleep, note in rows)
    return RlMemory(phases=phases, engine=e, actor=actor, refusals=batch.refusals + e.refusals + server + (rm.memory.refusals if rm else ()),
                    critic=critic, reward=rm, sleep=sleep)


def reference_pass(model: ModelSpec, sched: Schedule, held: dict, gathered: dict, adam: int, fwd: dict,
                   critic_held: dict, c: int) -> dict:
    """ref_log_prob's torch terms: the reference's units gathered as the actor's (verl, TRL's FSDP1, LoRA's actor
    without its adapter); TRL's FSDP2 reference is one unit (rl_schedule.py): the whole model gathered in the
    compute dtype through its forward, and at its all-gather's copy-out beside the gather's buffer as large - the
    larger moment."""
    if not sched.whole_reference:
        return {**held, **gathered, "Adam states": adam, **fwd, **critic_held}
    whole = {**held, "Adam states": adam, "reference gathered": model.n_params * c}
    return max({**whole, **fwd}, {**whole, "reference all-gather buffer": model.n_params * c},
               key=lambda terms: sum(terms.values()))


def critic_rows(critic: ActorStates | None, resident: dict, critic_held: dict, fwd: dict, graphs: dict) -> list:
    """PPO's compute_values (the critic's forward: a value per token, no vocabulary) and update_critic (its ledger
    update, or its optimizer step where larger), the critic loaded whole, the actor as between phases. Under its
    CPUOffloadPolicy (critic.on_host) its params, grads and Adam states stay on the host: the gathered units and
    the backward's working set only, the step on the CPU."""
    if critic is None:
        return []
    loaded = 0 if critic.on_host else critic.params_bytes
    values = {**resident, "critic params": loaded, "critic gathered units": critic.unit_gather_bytes,
              "critic Adam states": critic_held["critic Adam states"],
              "forward activations": fwd["forward activations"]}
    backward = {f"critic {k.replace('_', ' ')}": v for k, v in critic.update_steady.to_dict().items()}
    step = {} if critic.on_host else {
        "critic params": critic.params_bytes, "critic grads": critic.grads_bytes,
        "critic Adam states": critic.optimizer_bytes, "critic step temporaries": critic.step_temporary_bytes}
    update = max(backward, step, key=lambda t: sum(t.values()))
    return [("critic_values", values, graphs, False, False, True, "PPO: the critic's forward"),
            ("critic_update", {**resident, **update}, graphs, False, False, True,
             "PPO: the critic's backward or optimizer step, whichever is larger")]
