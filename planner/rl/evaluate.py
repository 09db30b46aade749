"""One verl GRPO configuration priced: the request's specs, the batch plan, the engine, every phase's GPU memory and
the host RAM per node, with whether (and why not) it runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cost_models import moe_lora
from cost_models.cluster_spec import ClusterSpec
from cost_models.evaluate import gpu_memory_reason
from cost_models.model_spec import ModelSpec
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.rl_batch import BatchPlan, RlBatch, batch_plan
from cost_models.rl_critic import critic_states
from cost_models.rl_host import HostRam, host_ram_per_node
from cost_models.rl_lora_targets import lora_model, lora_targets, verl_value
from cost_models.rl_actor import actor_run, actor_states
from cost_models.rl_phases import RlMemory, rl_phases
from cost_models.rl_settings import TRL_OFFLOAD_FOLLOWERS, RlSettings
from cost_models.rl_strategy import sync_refusals
from cost_models.rl_reward import RewardSettings
from cost_models.rl_schedule import TRL_ENGINE, TRL_SERVER_OWN, TRL_SETS, trl_max_num_seqs
from cost_models.rl_trl_server import is_local_host
from cost_models.rl_time import RlTime, critic_seconds, rl_step_time, train_seconds
from cost_models.rollout_engine import Engine, EngineSettings
from cost_models.rollout_lora import served_max_lora_rank
from cost_models.rollout_lora_sglang import SGLANG_MAX_LORAS_PER_BATCH, sglang_target_modules
from cost_models.spec_values import LoraTargets
from cost_models.units import GiB

from ..errors import PlannerError
from ..models import resolve_model
from ..request.knobs import knob_table
from .findings import findings
from .request import RlRequest, rl_request
from .verl_notes import verl_notes


@dataclass(frozen=True)
class RlEstimate:
    request: RlRequest
    model: ModelSpec
    cluster: ClusterSpec
    batch: BatchPlan
    engine_settings: EngineSettings
    memory: RlMemory
    host: HostRam
    time: RlTime
    settings: RlSettings           # the FSDP side as priced (specs_of: the critic's strategy and dtype resolved)
    reasons: tuple[str, ...]
    notes: tuple[str, ...] = ()    # planner/rl/findings.py

    @property
    def fits(self) -> bool:
        return not self.reasons


TRL_KEYS = {"beta": "beta", "num_iterations": "num_iterations", "vllm_importance_sampling_correction":
            "importance_sampling", "vllm_enable_sleep_mode": "sleep_mode", "vllm_mode": "vllm_mode",
            "vllm_server_data_parallel_size": "server_data_parallel",
            "vllm_server_host": "server_local"}   # request -> RlSettings (TRL's keys)


def specs_of(r: RlRequest, model: ModelSpec) -> tuple[RlBatch, EngineSettings, RlSettings]:
    """The cost models' inputs from the request (their constructors check the values: SpecError names the field)."""
    trl = r.framework == "trl"
    if not trl:
        for name in TRL_KEYS:
            if getattr(r, name) is not None:
                raise PlannerError(name, "a TRL GRPOConfig key: valid with --framework trl only")
    if r.vllm_mode != "server":
        for name in ("vllm_server_host", "vllm_server_data_parallel_size"):
            if getattr(r, name) is not None:
                raise PlannerError(name, "a vLLM server's: valid with --vllm-mode server only")
    batch = RlBatch(train_batch_size=r.train_batch, rollout_n=r.rollout_n,
                    ppo_mini_batch_size=r.ppo_mini_batch_size or r.train_batch, max_prompt_length=r.prompt_len,
                    max_response_length=r.response_len, ppo_micro_batch_size_per_gpu=r.ppo_micro_batch_size_per_gpu,
                    log_prob_micro_batch_size_per_gpu=r.log_prob_micro_batch_size_per_gpu
                    or r.ppo_micro_batch_size_per_gpu,
                    use_dynamic_bsz=r.use_dynamic_bsz, ppo_max_token_len_per_gpu=r.ppo_max_token_len_per_gpu,
                    log_prob_max_token_len_per_gpu=r.log_prob_max_token_len_per_gpu or r.ppo_max_token_len_per_gpu,
                    ulysses_sequence_parallel_size=r.ulysses_sequence_parallel_size,
                    use_remove_padding=r.use_remove_padding and not trl, mean_prompt_length=r.mean_prompt_len,
                    mean_response_length=r.mean_response_len)
    if r.max_loras_per_batch is not None and r.engine != "sglang":
        raise PlannerError("max_loras_per_batch", "an SGLang server arg (rollout.engine_kwargs.sglang): valid with "
                                                  "--engine sglang only (verl serves vLLM's adapter with max_loras 1)")
    engine = EngineSettings(engine=r.engine, version=r.engine_version, gpu_memory_utilization=r.gpu_memory_utilization,
                            tp=r.rollout_tp, max_model_len=r.prompt_len + r.response_len, max_num_seqs=r.max_num_seqs,
                            max_num_batched_tokens=r.max_num_batched_tokens, enforce_eager=r.enforce_eager,
                            max_loras_per_batch=SGLANG_MAX_LORAS_PER_BATCH if r.max_loras_per_batch is None
                            else r.max_loras_per_batch)
    settings = RlSettings(strategy=r.strategy, framework=r.framework, actor_dtype=r.actor_dtype, finetune=r.finetune,
                          lora_rank=r.lora_rank, lora_merge=bool(r.lora_merge),   # None: verl's default
                          lora_targets=lora_targets(r.lora_targets, model),
                          param_offload=r.param_offload, optimizer_offload=r.optimizer_offload,
                          ref_param_offload=r.ref_param_offload, gradient_checkpointing=r.gradient_checkpointing,
                          entropy=r.entropy, entropy_chunking=r.entropy_chunking,
                          entropy_compile=r.use_torch_compile, fsdp_size=r.fsdp_size,
                          sleep_level=r.sleep_level, use_shm=r.use_shm, algorithm=r.algorithm,
                          critic_param_offload=r.critic_param_offload,
                          critic_optimizer_offload=r.critic_optimizer_offload,
                          critic_offload_policy=r.critic_offload_policy, critic_strategy=r.critic_strategy,
                          critic_dtype=r.critic_dtype, layered_summon=r.layered_summon,
                          offload_policy=r.offload_policy, load_format=r.load_format,
                          **{key: getattr(r, name) for name, key in TRL_KEYS.items()
                             if getattr(r, name) is not None and name != "vllm_server_host"},
                          server_local=is_local_host(r.vllm_server_host))
    lora_model(model, settings)   # targets the actor cannot train are refused here, naming lora_targets
    if trl:
        return batch, _trl_engine(r, model, batch, engine), settings
    # verl serves a LoRA adapter with enable_lora and max_lora_rank: vLLM's rounded up to one it allows
    # (vllm_async_server.py launch_server), SGLang's the rank itself, its pool for lora_target_modules
    # (async_sglang_server.py launch_server; vLLM takes no targets)
    lora_rank, targets = 0, None
    if settings.lora_adapter:
        lora_rank = settings.lora_rank if engine.engine is Engine.SGLANG else served_max_lora_rank(settings.lora_rank)
        if engine.engine is Engine.SGLANG and settings.lora_targets is not LoraTargets.ALL_LINEAR:
            targets = sglang_target_modules(verl_value(settings.lora_targets, model), model)
    return batch, dataclasses.replace(engine, max_lora_rank=lora_rank, lora_target_modules=targets), settings


def plan_of(batch: RlBatch, cluster: ClusterSpec, model: ModelSpec, engine: EngineSettings, r: RlRequest) -> BatchPlan:
    """The batch plan as the framework runs it: TRL's several generations per optimizer step, its vLLM server's own
    GPUs (TP x DP) for the rollout's replicas."""
    trl, server = r.framework == "trl", r.vllm_mode == "server"
    return batch_plan(batch, cluster.n_gpus, model.n_heads, model.n_kv_heads, engine.tp, several_generations=trl,
                      engine_gpus=engine.tp * (r.vllm_server_data_parallel_size or 1) if server else None)


def _trl_engine(r: RlRequest, model: ModelSpec, batch: RlBatch, engine: EngineSettings) -> EngineSettings:
    """What TRL runs of the knobs it sets itself (cost_models/rl_schedule.py TRL_SETS): a request value TRL does not
    run is one line naming the field; the engine as TRL builds it."""
    plan = plan_of(batch, r.cluster.spec(), model, engine, r)
    derived = {"max_num_seqs": trl_max_num_seqs(r.ppo_micro_batch_size_per_gpu, engine.tp, plan),
               "log_prob_micro_batch_size_per_gpu": r.ppo_micro_batch_size_per_gpu,
               **dict.fromkeys(TRL_OFFLOAD_FOLLOWERS, r.param_offload)}
    table = knob_table(RlRequest)
    server = r.vllm_mode == "server"
    for name, (runs, why) in TRL_SETS.items():
        if server and name in TRL_SERVER_OWN:   # vllm serve's own flags, not TRL's
            continue
        value, runs = getattr(r, name), derived.get(name, runs)
        if value != table[name].default and value != runs:
            valid = f"{runs!r}, or leave it out" if runs is not None else "leave it out"
            raise PlannerError(name, f"{value!r}: not what TRL runs ({why}); valid with --framework trl: {valid}")
    if server:
        return dataclasses.replace(engine, version=TRL_ENGINE["version"])
    return dataclasses.replace(engine, max_num_seqs=derived["max_num_seqs"], **TRL_ENGINE)


# What the actor's (and critic's) states do not depend on: where they sit between phases (rl_phases.py)
PLACEMENT = dict(param_offload=False, optimizer_offload=False, ref_param_offload=False, critic_param_offload=False,
                 critic_optimizer_offload=False)


def _memoized(memo: dict | None, worker: str, settings: RlSettings, plan: BatchPlan, states):
    """A search's worker states priced once per dtype, checkpointing, entropy and update micro-batch (not per
    offload or engine choice): memo keyed by the settings less their placement and the micro-batch's shape."""
    if memo is None:
        return states()
    key = (worker, dataclasses.replace(settings, **PLACEMENT), plan.update_tokens_per_gpu,
           plan.micro_batches_per_mini > 1)
    if key not in memo:
        memo[key] = states()
    return memo[key]


def evaluate_rl(request: RlRequest, profile: Profile | None = None, model: ModelSpec | None = None,
                memo: dict | None = None) -> RlEstimate:
    """Price one configuration; `model`: its spec where the caller resolved it already, `memo`: a cache of the
    micro-steps' prices one search shares (cost_models/rl_time.py micro_step)."""
    profile = profile or DEFAULT_PROFILE
    if request.model is None and model is None:
        raise PlannerError("model", "missing: pass --model with a preset name (see `fsdp-plan models`) or a "
                                    "config.json path")
    spec = model or resolve_model(request.model)
    cluster = request.cluster.spec()
    batch, engine, settings = specs_of(request, spec)
    plan = plan_of(batch, cluster, spec, engine, request)
    states = _memoized(memo, "actor", settings, plan,
                       lambda: actor_states(actor_run(spec, cluster, settings, plan, memo), settings, plan, profile))
    critic_plan = _critic_plan(request, batch, plan, cluster, spec, engine)
    critic = _memoized(memo, "critic", settings, critic_plan,
                       lambda: critic_states(spec, cluster, settings, critic_plan, profile)) if settings.ppo else None
    memory = rl_phases(spec, cluster, settings, engine, plan, profile, critic, actor=states, memo=memo,
                       reward=reward_settings(request))
    host = host_ram_per_node(spec, cluster, settings, memory.actor, memory.engine, critic, memory.reward,
                             sleep=memory.sleep)
    prompt, response = (batch.mean_prompt_length or batch.max_prompt_length,
                        batch.mean_response_length or batch.max_response_length)
    # TRL pads each micro-batch to the generation batch's longest prompt and completion: its passes at the maxima
    trained = (batch.seq_prompt_tokens, batch.seq_response_tokens) if settings.framework == "trl" else None
    time = rl_step_time(spec, cluster, settings, engine, memory.engine, plan, memory.actor, prompt, response, profile,
                        batch.ulysses_sequence_parallel_size, critic=critic, memo=memo, reward=memory.reward,
                        trained=trained)
    refusals = memory.refusals + tuple(r for r in critic_plan.refusals if r not in plan.refusals) \
        + sync_refusals(settings) + tuple(moe_lora.fsdp1_refusals(spec, settings.lora_all_linear,
                                                                  settings.strategy == "fsdp", "strategy",
                                                                  "use --strategy fsdp2"))
    reasons = [f"{r.field}: {r.reason}; {_trl_fix(r) if settings.framework == 'trl' else r.fix}" for r in refusals]
    capacity = cluster.gpu.memory_bytes
    for phase in memory.phases:
        if phase.reserved_bytes > capacity:
            largest = max(phase.gpu_bytes.items(), key=lambda kv: kv[1])
            reasons.append(gpu_memory_reason(phase.reserved_bytes, capacity, f"in {phase.name}; largest: "
                                             f"{largest[0]} {largest[1] / GiB:.1f} GiB"))
    ram = cluster.cpu_ram_bytes_per_node
    if ram and host.peak_bytes > ram:
        reasons.append(f"host RAM: needs {host.peak_bytes / GiB:.0f} GiB per node > {ram / GiB:.0f} GiB "
                       f"(--cpu-ram-per-node)")
    return RlEstimate(request=request, model=spec, cluster=cluster, batch=plan, engine_settings=engine,
                      memory=memory, host=host, time=time, settings=settings, reasons=tuple(reasons),
                      notes=findings(settings, engine, memory, plan.rollout_seqs_per_replica, capacity)
                      + verl_notes(request, settings, memory, time))


def _trl_fix(refusal) -> str:
    """A refusal's fix in TRL's terms where TRL sets the knob it names (vLLM's max_num_batched_tokens >= max_num_seqs:
    TRL passes 4096 and its own max_num_seqs)."""
    if refusal.field not in ("max_num_seqs", "max_num_batched_tokens"):
        return refusal.fix
    return (f"TRL sets both: max_num_batched_tokens {TRL_ENGINE['max_num_batched_tokens']}, max_num_seqs "
            f"{TRL_SETS['max_num_seqs'][1]}: lower that product to <= {TRL_ENGINE['max_num_batched_tokens']}")


def reward_settings(r: RlRequest) -> RewardSettings | None:
    """The reward model (reward_model.enable with reward_model.model.path), resolved as --model is, on the actor's
    GPUs or its own pool (reward_model.enable_resource_pool)."""
    if r.reward_model is None:
        if r.reward_model_enable_resource_pool:
            raise PlannerError("reward_model_enable_resource_pool", "a reward model's pool: valid with --reward-model "
                                                                    "only")
        return None
    return RewardSettings(model=resolve_model(r.reward_model), tp=r.reward_model_tp,
                          gpu_memory_utilization=r.reward_model_gpu_memory_utilization,
                          own_pool=r.reward_model_enable_resource_pool,
                          pool_gpus_per_node=r.reward_model_n_gpus_per_node, pool_nodes=r.reward_model_nnodes)


def _critic_plan(r: RlRequest, batch: RlBatch, plan: BatchPlan, cluster: ClusterSpec, spec: ModelSpec,
                 engine: EngineSettings) -> BatchPlan:
    """PPO's critic batch plan: the actor's, at the critic's own Ulysses degree where it has one (verl's
    critic.ulysses_sequence_parallel_size: its micro-batches split over that group, verl's checks on its heads).
    Its Ulysses refusals name critic_ulysses_sequence_parallel_size; the critic's step time stays the actor's
    (rl_time.critic_seconds)."""
    sp = r.critic_ulysses_sequence_parallel_size
    if r.algorithm != "ppo" or sp in (None, batch.ulysses_sequence_parallel_size):
        return plan
    if not isinstance(sp, int) or sp < 1:
        raise PlannerError("critic_ulysses_sequence_parallel_size", f"{sp!r}: must be a positive integer")
    own = batch_plan(dataclasses.replace(batch, ulysses_sequence_parallel_size=sp), cluster.n_gpus, spec.n_heads,
                     spec.n_kv_heads, engine.tp)
    return dataclasses.replace(own, refusals=tuple(dataclasses.replace(x, field="critic_" + x.field)
                                                   if x.field == "ulysses_sequence_parallel_size" else x
                                                   for x in own.refusals))


def train_time_s(request: RlRequest, model: ModelSpec, profile: Profile | None = None, memo: dict | None = None
                 ) -> float:
    """What the actor's knobs change in the step time (the search's g, planner/rl/search.py): the update, the
    log-probs and PPO's critic, in seconds, as evaluate_rl prices them."""
    batch, _, settings = specs_of(request, model)
    cluster = request.cluster.spec()
    plan = batch_plan(batch, cluster.n_gpus, model.n_heads, model.n_kv_heads, 1)
    lengths = (batch.mean_prompt_length or batch.max_prompt_length,
               batch.mean_response_length or batch.max_response_length)
    profile, sp = profile or DEFAULT_PROFILE, batch.ulysses_sequence_parallel_size
    update, log_prob = train_seconds(model, cluster, settings, plan, *lengths, profile, sp, memo)
    return update + log_prob + (critic_seconds(model, cluster, settings, plan, *lengths, profile, sp, memo)
                                if settings.ppo else 0.0)


def rl_estimate(model, gpus: int | None = None, *, profile: Profile | None = None, **knobs) -> RlEstimate:
    """The Python API of `fsdp-plan rl estimate`: knobs by their verl names (planner/rl/request.py)."""
    return evaluate_rl(rl_request(model, gpus, **knobs), profile)
