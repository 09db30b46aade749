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
  resident then, never Adam's states. Asleep (level 1 or 2) it frees weights and KV; its CUDA-graph pool stays.
- weight sync: the actor's shard loaded, the engine's weights awake (0.8-era verl: wake_up() wakes the KV cache
  too; later: weights first, KV after), and one gathered tensor at a time (full_tensor()): the largest one;
  FSDP1's state dict adds its copy of the shard and its walk over the units (rl_strategy.py).
Ignored: Ulysses' all-to-all buffers, the attention's workspaces, gradients after the update (freed: verl's zero_grad
/ offload). PPO's critic (rl_critic.py) adds critic_values / critic_update, a reward model (rl_reward.py) `reward`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import activations
from .cluster_spec import ClusterSpec
from .feasibility import Refusal
from .memory import estimate_memory
from .memory_types import MemoryBreakdown, ParamCounts
from .model_spec import ModelSpec
from .outside_allocator import outside_allocator_terms
from .profile import Profile
from .rl_batch import BatchPlan
from .rl_reward import RewardModel, RewardSettings, reward_engine, reward_row
from .rl_strategy import forward_gathered_bytes, fsdp2_backward, loss_root_bytes, sync_moment, weight_sync_bytes
from .rollout_engine import EngineMemory, EngineSettings, engine_memory
from .spec_values import Attention, Finetune, LossKernel, Precision, Sharding, SpecError, parse_enum
from .specs import FsdpConfig, TrainingSpec
from .units import DTYPE_BYTES

PHASES = ("init", "rollout", "weight_sync", "reward", "log_prob", "ref_log_prob", "critic_values", "critic_update",
          "update", "optimizer_step", "checkpoint")   # reward: with a reward model; the critic's two: PPO only
ALGORITHMS = ("grpo", "ppo")
ACTOR_DTYPES = {"fp32": Precision.BF16, "bf16": Precision.BF16_PURE}  # stored dtype -> FSDP mixed precision
STRATEGIES = ("fsdp", "fsdp2")
FRAMEWORKS = ("verl", "trl")
ENTROPY_CHUNK_ROWS = 2048  # verl's entropy_from_logits_with_chunking default chunk


@dataclass(frozen=True)
class RlSettings:
    """The FSDP side's knobs as verl names them (actor_rollout_ref.actor.* / ref.* / model.*)."""

    strategy: str = "fsdp"             # actor.strategy: fsdp (FSDP1) | fsdp2 (how each wraps: rl_strategy.py)
    framework: str = "verl"            # verl | trl (GRPOTrainer with accelerate's FSDP)
    actor_dtype: str = "fp32"          # fsdp_config.model_dtype: fp32 master weights (2025 default) or bf16
    finetune: Finetune = Finetune.FULL
    lora_rank: int = 32                # model.lora_rank, target_modules all-linear
    param_offload: bool = False
    optimizer_offload: bool = False
    ref_param_offload: bool = True     # FSDP1's reference: CPUOffload(offload_params=True)
    gradient_checkpointing: bool = True
    entropy: bool = True               # entropy computed in log-prob / update (entropy_coeff != 0 or logged)
    entropy_chunking: bool = False     # actor.entropy_from_logits_with_chunking
    entropy_compile: bool = True       # actor.use_torch_compile: entropy_from_logits compiled (verl's default)
    fsdp_size: int = -1                # fsdp_config.fsdp_size: -1 all GPUs, 1 each GPU holds the whole actor
    sleep_level: int = 1               # vLLM sleep mode: 1 weights to host, 2 discarded
    use_shm: bool = False              # model.use_shm: the checkpoint copied to /dev/shm
    algorithm: str = "grpo"            # algorithm.adv_estimator: grpo (no critic) | ppo (gae: a critic)
    critic_param_offload: bool = False     # critic.model.fsdp_config.param_offload
    critic_optimizer_offload: bool = False
    layered_summon: bool = False       # rollout.layered_summon: FSDP1 LoRA's sync gathers one unit at a time

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise SpecError("strategy", f"unknown value {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
        if self.framework not in FRAMEWORKS:
            raise SpecError("framework", f"unknown value {self.framework!r}; choose one of: {', '.join(FRAMEWORKS)}")
        if self.actor_dtype not in ACTOR_DTYPES:
            raise SpecError("actor_dtype", f"unknown value {self.actor_dtype!r}; choose one of: fp32, bf16")
        object.__setattr__(self, "finetune", parse_enum(Finetune, self.finetune, "finetune"))
        if self.finetune is Finetune.QLORA:
            raise SpecError("finetune", "qlora is not a verl mode; choose one of: full, lora")
        if self.algorithm not in ALGORITHMS:
            raise SpecError("algorithm", f"unknown value {self.algorithm!r}; choose one of: {', '.join(ALGORITHMS)}")
        if self.sleep_level not in (1, 2):
            raise SpecError("sleep_level", f"must be 1 or 2, got {self.sleep_level}")
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise SpecError("fsdp_size", f"must be -1 (all GPUs) or >= 1, got {self.fsdp_size}")

    @property
    def lora(self) -> bool:
        return self.finetune is Finetune.LORA

    @property
    def ppo(self) -> bool:
        return self.algorithm == "ppo"


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
class ActorStates:
    """The actor's per-GPU model states (the ledger's optimizer step) and its update's peak."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    step_temporary_bytes: int
    update_first: MemoryBreakdown    # the backward's peak at the first step (no Adam states yet)
    update_steady: MemoryBreakdown
    largest_tensor_bytes: int        # one gathered parameter (the embedding or head) in the actor's dtype
    unit_gather_bytes: int           # the units a forward-only phase holds gathered (rl_strategy.py)
    sync_bytes: tuple = ({}, {})     # the weight sync's transients: its state-dict walk's, its send's (rl_strategy.py)


def all_linear_lora(model: ModelSpec) -> ModelSpec:
    """LoRA on every linear of a block (PEFT's target_modules="all-linear", verl's examples): q, k, v, o and the
    MLP's gate / up / down. The repo's presets list the attention's only."""
    h, f = model.hidden_size, model.ffn_hidden_size
    mlp = ((h, f), (h, f), (f, h)) if model.gated_mlp else ((h, f), (f, h))
    attention = ((h, model.q_dim), (h, model.kv_dim), (h, model.kv_dim), (model.q_dim, h))
    return dataclasses.replace(model, lora_target_shapes=attention + mlp)


# [tokens, vocab] tensors of the compute dtype alive at the entropy path's peak, traced with torch 2.13's eager
# autograd on fake tensors (tests/unit/test_rl_logits_trace.py): the logits and verl's entropy_from_logits
# (softmax, logsumexp, pd * logits) under no_grad; with grad, through its backward (a log-softmax beside it adds
# nothing to the peak).
ENTROPY_TENSORS_NO_GRAD = 3
ENTROPY_TENSORS_EAGER_GRAD = 7
# verl compiles entropy_from_logits by default (actor.use_torch_compile): AOTAutograd saves the logits and
# recomputes the rest; the backward holds them, their gradient and one working tensor. An estimate (inductor does
# not run on fake tensors).
ENTROPY_TENSORS_COMPILED_GRAD = 3


def verl_logits_bytes(model: ModelSpec, tokens: int, c: int, settings: RlSettings, grad: bool = True) -> int:
    """verl's dp_actor._forward_micro_batch on remove-padded tokens: the logits [tokens, vocab] in compute dtype
    (transformers' lm_head, no upcast); log-probs by flash-attn's cross_entropy_loss (its gradient in place);
    the entropy (verl torch_functional.entropy_from_logits) as traced or compiled (ENTROPY_TENSORS_*), or with
    chunking (entropy_from_logits_with_chunking) three fp32 chunks of ENTROPY_CHUNK_ROWS rows beside the logits."""
    v = model.vocab_size
    logits = tokens * v * c
    if not settings.entropy:
        return logits
    if settings.entropy_chunking:
        return logits + 3 * min(tokens, ENTROPY_CHUNK_ROWS) * v * 4
    if not grad:
        return ENTROPY_TENSORS_NO_GRAD * logits
    return (ENTROPY_TENSORS_COMPILED_GRAD if settings.entropy_compile else ENTROPY_TENSORS_EAGER_GRAD) * logits


@dataclass(frozen=True)
class ActorRun:
    """What the FSDP models price for verl's actor: the model as trained (all-linear LoRA adapters), the cluster
    its shard group sees (HYBRID over fsdp_size: a node of fsdp_size GPUs), the FsdpConfig and the packed
    micro-batch (micro_batch 1 of the micro-batch's tokens per GPU)."""

    model: ModelSpec
    cluster: ClusterSpec
    config: FsdpConfig
    training: TrainingSpec
    shard_ranks: int


def actor_run(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, batch: BatchPlan,
              memo: dict | None = None) -> ActorRun:
    """FULL_SHARD over the GPUs (fsdp_size -1), NO_SHARD for fsdp_size 1, else HYBRID over fsdp_size; fp32 master
    weights with bf16 compute (or bf16 throughout); the loss priced apart (verl_logits_bytes). memo: a search's
    cache for the actor (one model and cluster), keyed by what the run reads."""
    if memo is not None:
        key = ("actor_run", settings.finetune, settings.lora_rank, settings.actor_dtype,
               settings.gradient_checkpointing, settings.fsdp_size, batch.update_tokens_per_gpu)
        if key not in memo:
            memo[key] = actor_run(model, cluster, settings, batch)
        return memo[key]
    size = cluster.n_gpus if settings.fsdp_size == -1 else min(settings.fsdp_size, cluster.n_gpus)
    sharding = Sharding.FULL_SHARD if size == cluster.n_gpus else Sharding.NO_SHARD if size == 1 \
        else Sharding.HYBRID_SHARD
    config = FsdpConfig(sharding=sharding, precision=ACTOR_DTYPES[settings.actor_dtype],
                        ac_every=int(settings.gradient_checkpointing), micro_batch=1, grad_accum=1,
                        attention=Attention.SDPA, loss_kernel=LossKernel.LIGER)
    return ActorRun(model=all_linear_lora(model) if settings.lora else model,
                    cluster=dataclasses.replace(cluster, gpus_per_node=size) if 1 < size < cluster.n_gpus else cluster,
                    config=config, training=TrainingSpec(seq_len=batch.update_tokens_per_gpu,
                                                         finetune=settings.finetune, lora_rank=settings.lora_rank),
                    shard_ranks=size)


def actor_states(run: ActorRun, settings: RlSettings, batch: BatchPlan, profile: Profile) -> ActorStates:
    """The ledger's update at the packed micro-batch, with verl's log-prob loss in place of the cross-entropy."""
    model, config, training, size = run.model, run.config, run.training, run.shard_ranks
    # verl accumulates gradients over the mini-batch's micro-batches: from the second micro-batch on the whole
    # sharded gradient is resident (the ledger's grad_accum > 1: FSDP adds each new shard in place)
    accumulating = batch.micro_batches_per_mini > 1
    tokens = training.seq_len
    est = estimate_memory(model, run.cluster, training, dataclasses.replace(config, grad_accum=1 + accumulating),
                          profile)
    step = est.phases["optimizer_step"]
    body = est.phases["backward"]
    if settings.lora and config.precision.mixed:
        # verl builds the actor in its model_dtype (fp32 by default) and PEFT keeps the base in it: the frozen
        # shard is stored in fp32, where the ledger keeps a frozen base in the compute dtype
        frozen = ParamCounts.of(model, training).frozen(model.n_layers)
        extra = -(-frozen * (4 - DTYPE_BYTES[config.precision.compute_dtype]) // size)
        body, step = (dataclasses.replace(b, sharded_params=b.sharded_params + extra) for b in (body, step))
    c = DTYPE_BYTES[config.precision.compute_dtype]
    body = fsdp2_backward(body, est.peak_moment, model, settings, c, DTYPE_BYTES[config.gradient_reduce_dtype], size)
    # the loss moment: every block's saved tensors (checkpointed: its input), the root's, the root gathered (as
    # the strategy wraps it: rl_strategy.py), the last block's all-gather prefetched for its backward, and the
    # verl logits path
    per_block = (activations.checkpointed_block_bytes_per_token(model, c) if settings.gradient_checkpointing else
                 activations.block_bytes_per_token(model, c, Attention.SDPA, tokens, 1, training.adapter_rank))
    saved = tokens * (model.n_layers * per_block + activations.root_bytes_per_token(model, c, lora=settings.lora))
    loss = MemoryBreakdown(sharded_params=step.sharded_params, optimizer_state=step.optimizer_state,
                           sharded_grads=step.sharded_grads if accumulating else 0,
                           unsharded_params=loss_root_bytes(model, settings, c), activations=saved,
                           collective_buffers=model.block_params * c if size > 1 else 0,
                           logits_and_loss=verl_logits_bytes(model, tokens, c, settings))
    steady = max(body, loss, key=lambda b: b.total_bytes)
    first = dataclasses.replace(steady, optimizer_state=0)
    p = DTYPE_BYTES[config.precision.param_dtype]
    largest = max(model.embedding_params, model.head_params) * p
    return ActorStates(params_bytes=step.sharded_params, grads_bytes=step.sharded_grads,
                       optimizer_bytes=step.optimizer_state, step_temporary_bytes=step.optimizer_temporaries,
                       update_first=first, update_steady=steady, largest_tensor_bytes=largest,
                       sync_bytes=weight_sync_bytes(model, settings, step.sharded_params, p, size),
                       unit_gather_bytes=forward_gathered_bytes(model, settings, c))


def forward_only_bytes(model: ModelSpec, tokens: int, c: int, settings: RlSettings) -> dict:
    """A log-prob forward under no_grad on `tokens` tokens per GPU: one block's working set (bounded by what it
    would save for backward), the residual stream in and out, and verl's logits path."""
    block = activations.block_bytes_per_token(model, c, Attention.SDPA, tokens, 1)
    return {"forward activations": tokens * (block + 2 * c * model.hidden_size),
            "logits and entropy": verl_logits_bytes(model, tokens, c, settings, grad=False)}


def reference_bytes(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings) -> int:
    """The reference's bf16 shard on one GPU (LoRA: none, the actor without its adapter is the reference)."""
    if settings.lora:
        return 0
    return -(-model.n_params * 2 // cluster.n_gpus)


@dataclass(frozen=True)
class RlMemory:
    phases: tuple[Phase, ...]
    engine: EngineMemory
    actor: ActorStates
    refusals: tuple[Refusal, ...]
    critic: ActorStates | None = None   # PPO
    reward: RewardModel | None = None   # reward_model.enable

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.reserved_bytes)


def _offloaded(settings: RlSettings, actor_loaded: bool, adam_loaded: bool, engine_asleep: bool,
               critic_loaded: bool = False) -> tuple:
    """What sits on the host (or is discarded) during a phase."""
    return tuple(name for name, away in (
        ("actor params", settings.param_offload and not actor_loaded),
        ("Adam states", settings.optimizer_offload and not adam_loaded),
        ("reference", settings.ref_param_offload and not settings.lora),
        ("critic params", settings.ppo and settings.critic_param_offload and not critic_loaded),
        ("critic Adam states", settings.ppo and settings.critic_optimizer_offload and not critic_loaded),
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
    Adam's states unless offloaded (torch terms), and its process's CUDA context (outside this allocator);
    at init, the params only. GRPO: nothing."""
    if critic is None:
        return {}, {}, {}
    params = 0 if settings.critic_param_offload else critic.params_bytes
    adam = 0 if settings.critic_optimizer_offload else critic.optimizer_bytes
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
    ref = reference_bytes(model, cluster, settings)
    ref_resident = 0 if settings.ref_param_offload else ref
    params_resident = 0 if settings.param_offload else actor.params_bytes
    adam_resident = 0 if settings.optimizer_offload else actor.optimizer_bytes
    critic_init, critic_held, critic_outside = critic_terms(critic, settings, outside)
    at_init = params_resident + ref_resident + sum(critic_init.values()) + sum(critic_outside.values())
    rm = reward and reward_engine(reward, engine, cluster.gpu.memory_bytes, at_init, outside)
    e = engine_memory(model, engine, cluster.gpu.memory_bytes, at_init + (rm.context_bytes if rm else 0), outside)
    graphs = {"engine CUDA graphs": e.cuda_graph_bytes, **critic_outside, **(rm.asleep() if rm else {})}
    awake = {"engine weights": e.weights_bytes, "engine KV cache": e.kv_bytes,
             "engine activations": e.activation_peak_bytes, **graphs}
    sync_engine = {"engine weights": e.weights_bytes, **graphs,
                   **({"engine KV cache": e.kv_bytes} if engine.version == "0.8" else {})}
    held = {"actor params": params_resident, "reference": ref_resident}
    resident = {**held, "Adam states": adam_resident}
    fwd = forward_only_bytes(model, batch.log_prob_tokens_per_gpu, c, settings)
    gathered = {"gathered units": actor.unit_gather_bytes}
    ref_actor = {"actor params": actor.params_bytes} if settings.lora else {"actor params": params_resident}
    update = {"reference": ref_resident, **actor.update_steady.to_dict()}
    first = {"reference": ref_resident, **actor.update_first.to_dict()}
    update, label = (update, "steady step") if sum(update.values()) >= sum(first.values()) else (first, "first step")
    step = {"reference": ref_resident, "actor params": actor.params_bytes, "actor grads": actor.grads_bytes,
            "Adam states": actor.optimizer_bytes, "step temporaries": actor.step_temporary_bytes}
    def reserved(torch_terms: dict, engine_terms: dict) -> int:
        return profile.reserved_bytes(sum(torch_terms.values()), outside) + sum(engine_terms.values())
    # (name, torch terms, engine terms, actor loaded, Adam loaded, engine asleep, note)
    rows = [
        ("init", {**held, **critic_init}, awake, False, False, False,
         "the engine sizes its KV cache beside what is resident"),
        ("rollout", {**resident, **critic_held}, awake, False, False, False,
         "from step 2: Adam's states resident unless offloaded (the KV budget never saw them)"),
        ("weight_sync", *sync_moment(*actor.sync_bytes, {"actor params": actor.params_bytes, "reference": ref_resident,
                                                         "Adam states": adam_resident, **critic_held},
                                     graphs if engine.version == "0.8" else {"engine weights": e.weights_bytes,
                                                                             **graphs}, sync_engine, reserved),
         True, False, False, "one parameter gathered at a time into the engine"),
        *reward_row(rm, {**resident, **critic_held}, graphs),
        ("log_prob", {"actor params": actor.params_bytes, **gathered, "reference": ref_resident,
                      "Adam states": adam_resident, **fwd, **critic_held}, graphs, True, False, True, "forward only"),
        ("ref_log_prob", {**ref_actor, "reference": ref_resident, **gathered, "Adam states": adam_resident, **fwd,
                          **critic_held}, graphs, settings.lora, False, True,
         "LoRA: the actor without its adapter" if settings.lora else ""),
        *critic_rows(critic, resident, critic_held, fwd, graphs),
        ("update", {**update, **critic_held}, graphs, True, True, True,
         f"{label}; Adam's states in the backward from step 2"),
        ("optimizer_step", {**step, **critic_held}, graphs, True, True, True,
         "the first step creates Adam's states beside the foreach temporaries"),
        ("checkpoint", {"actor params": actor.params_bytes, "Adam states": adam_resident, "reference": ref_resident,
                        **critic_held}, graphs, True, False, True, ""),
    ]
    phases = tuple(_phase(name, torch, eng, profile, outside,
                          _offloaded(settings, loaded, adam, asleep, critic_loaded=name.startswith("critic")), note)
                   for name, torch, eng, loaded, adam, asleep, note in rows)
    return RlMemory(phases=phases, engine=e, actor=actor, refusals=batch.refusals + e.refusals + (rm.memory.refusals if rm else ()),
                    critic=critic, reward=rm)


def critic_rows(critic: ActorStates | None, resident: dict, critic_held: dict, fwd: dict, graphs: dict) -> list:
    """PPO's compute_values (the critic's forward: a value per token, no vocabulary) and update_critic (its ledger
    update, or its optimizer step where larger), the critic loaded whole, the actor as between phases."""
    if critic is None:
        return []
    values = {**resident, "critic params": critic.params_bytes, "critic gathered units": critic.unit_gather_bytes,
              "critic Adam states": critic_held["critic Adam states"],
              "forward activations": fwd["forward activations"]}
    backward = {f"critic {k.replace('_', ' ')}": v for k, v in critic.update_steady.to_dict().items()}
    step = {"critic params": critic.params_bytes, "critic grads": critic.grads_bytes,
            "critic Adam states": critic.optimizer_bytes, "critic step temporaries": critic.step_temporary_bytes}
    update = max(backward, step, key=lambda t: sum(t.values()))
    return [("critic_values", values, graphs, False, False, True, "PPO: the critic's forward"),
            ("critic_update", {**resident, **update}, graphs, False, False, True,
             "PPO: the critic's backward or optimizer step, whichever is larger")]
