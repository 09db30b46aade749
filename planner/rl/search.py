"""`fsdp-plan rl`: a search over the knobs verl users tune for a GRPO / PPO job, each configuration priced by
evaluate_rl and ranked by its estimated step time (cost_models/rl_time.py), then its peak, among those that fit.

The knobs fall in three groups by what they change in the cost models:
- shared (S): the actor's strategy (actor.strategy: fsdp, FSDP1, or fsdp2), dtype and param / optimizer offload,
  and PPO's critic offloads (its strategy and dtype the actor's unless --critic-strategy / --critic-dtype set them)
  - they change every phase, the offload copies and (strategy, dtype) the update's seconds; the reference's
  offload is not a knob (verl offloads it whatever it says: NOT_SEARCHED);
- engine (E): rollout TP, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens and, for a LoRA actor,
  model.lora.merge (lora_merges; SGLang's LoRA pool slots follow it: lora_slots) - they change only the phases
  with the engine awake (init, rollout, weight_sync: ENGINE_PHASES), the engine's refusals, host RAM, the
  generation time and the weight sync (merged: vLLM without enable_lora at sleep level 2, the merged model sent and
  the base backed up on the host at each sync; unmerged: vLLM's LoRA buffers out of its KV cache, the weights
  backed up at level 1, the adapters sent);
- actor (A): gradient checkpointing, the Ulysses degree (dividing the heads and the GPUs; the KV heads divided
  by it or dividing it, verl's repeat_kv), static micro-batches or dynamic ones (use_dynamic_bsz: packed to a
  token budget, held at the budget, run on the real tokens: cost_models/rl_batch.py), the update's and the
  log-prob's apart (forward only: it takes more), and entropy chunking - they change only the other phases (the
  engine asleep), the batch refusals and the update / log-prob time.
Given S, a configuration fits when its engine side and its actor side each fit, and its step time is f(S, E) +
g(S's strategy and dtype, A) (rl_time.py: generation + weight sync + offload copies; update + log-probs + critic).
So the best configuration of each S is the best E with the best A, found without their product (plan_rl): every E
priced at one A, every A's time read once per (strategy, dtype), then the A in time order until one fits.
tests/unit/test_rl_search.py checks it against the whole product (exhaustive) on a small case.

The strategy: FSDP2 holds at most what FSDP1 holds in every phase (cost_models/rl_strategy.py: verl wraps the
embedding and head as their own units; FSDP1's weight sync keeps a copy of the shard; tests/unit/
test_rl_strategy.py checks it phase by phase) but the update on one-rank shard groups (fsdp_size 1: FSDP1 runs
NO_SHARD), its engine side's seconds no more than FSDP1's (a LoRA's FSDP1 sync summons the whole model, twice
when merged, and a merge backs up the whole shard), and its update is not always the faster: the copies around the
collectives (cost_models/fsdp_copies.py) favour FSDP1 with a bf16 actor or LoRA, FSDP2 with an fp32 actor. So both
are searched; FSDP1's engine side is priced only where FSDP2's fits, and (sharded) an actor choice whose actor
side did not fit under FSDP2 is not priced under FSDP1 with as much offloaded. With --offload-policy the search
keeps FSDP2 (verl's FSDP1 ignores CPUOffloadPolicy), and with --critic-offload-policy where the critic follows the
actor's strategy. FSDP1 LoRA's weight sync gathers the whole model unless rollout.layered_summon: the request's,
never set by the search (verl raises at the first sync with it under rollout.load_format dummy, its default:
--load-format, the request's too, and a refusal where they clash: cost_models/rl_strategy.py sync_refusals, which
leaves a merged LoRA alone), said in the output where it applies.

Entropy chunking changes memory, not time (its loop's cost is not priced): it is the request's unless the actor
side does not fit without it (with_chunking_if_needed). The actor's dtype is searched for its memory and time only:
bf16 keeps no fp32 master weights, which the output says when the best differs from the request. Not searched,
and why: NOT_SEARCHED, said in the output.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from cost_models import moe_lora
from cost_models.model_spec import ModelSpec
from cost_models.profile import Profile
from cost_models.rl_actor import shard_group_ranks
from cost_models.rl_lora_targets import lora_targets
from cost_models.rl_strategy import sync_refusals
from cost_models.spec_values import LoraTargets
from cost_models.units import MiB

from ..errors import PlannerError
from ..models import resolve_model
from .evaluate import RlEstimate, evaluate_rl, train_time_s
from .request import RlRequest

DTYPES = ("fp32", "bf16")
MICRO_BATCHES = (1, 2, 4, 8, 16)
LOG_PROB_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)    # forward only: it can take more than the update
TOKEN_BUDGETS = (8192, 16384, 32768)             # dynamic batches: ppo_max_token_len_per_gpu
LOG_PROB_TOKEN_BUDGETS = (8192, 16384, 32768, 65536)   # log_prob_max_token_len_per_gpu
ULYSSES = (1, 2, 4, 8)
UTILIZATIONS = (0.3, 0.4, 0.5, 0.6, 0.7)
TPS = (1, 2, 4, 8)
MAX_NUM_SEQS = (256, 512, 1024)
# vLLM's max_num_batched_tokens, >= max_num_seqs (rollout_engine.scheduler_refusals) and the request's: smaller
# chunks leave the KV cache more (the profile run's activations); larger ones only less, prefill being
# compute-bound (rl_time.prefill_s) in chunks above ~340 tokens on every GPU of the catalog (peak x efficiency / HBM)
MAX_NUM_BATCHED_TOKENS = (2048, 4096, 8192)
ENGINE_PHASES = ("init", "rollout", "weight_sync")
STRATEGIES = ("fsdp2", "fsdp")   # actor.strategy: FSDP2, FSDP1 (verl's names)
OFFLOADS = ("param_offload", "optimizer_offload", "critic_param_offload", "critic_optimizer_offload")   # S's flags
NOT_SEARCHED: dict = {
    "ref_param_offload": "verl offloads the reference whatever it says (FSDP's own CPU offload of a forward_only "
                         "model: cost_models/rl_settings.py reference_offloaded)",
    "offload_policy": "the request's (FSDP2's CPUOffloadPolicy, --offload-policy): its CPU Adam step rests on the "
                      "host's CPUs (--host-cores-per-node, --omp-num-threads; a thread's rate measured on one H100 "
                      "host: cost_models/host_optimizer.py), and it moves both sides of the split (the engine's start "
                      "and host RAM, the update); with it the strategy stays fsdp2 (verl's FSDP1 ignores it)"}
LORA_NOT_SEARCHED = {
    "layered_summon": "the request's (rollout.layered_summon: FSDP1's LoRA weight sync then gathers one unit at a "
                      "time, not the whole model; verl raises at the first sync with it under rollout.load_format "
                      "dummy, its default: --load-format safetensors)",
    "load_format": "the request's (rollout.load_format: under dummy, verl's default, a LoRA adapter's first sync "
                   "sends the whole base from every rank's host; another format loads it from disk at the engine's "
                   "start)"}


SGLANG_LORA_SLOTS = ("1 where the request leaves it, not searched: SGLang's LoRA pool holds max_loras_per_batch "
                     "slots of the adapter's size, out of the KV cache, and verl serves one adapter (every request "
                     "names it; the weight sync unloads the old before loading the new: sglang_rollout.py "
                     "update_weights), so SGLang's default 8 adds 7 empty slots at the same speed - never better")


def not_searched(request: RlRequest) -> dict:
    """The knobs kept at the request's value that bear on its pricing, each with why."""
    pinned = {"lora_merge": f"the request's ({request.lora_merge}: --lora-merge / --no-lora-merge pins it)"} \
        if request.finetune == "lora" and request.lora_merge is not None else {}
    if request.engine == "sglang" and request.finetune == "lora" and request.lora_merge is not True:
        pinned["max_loras_per_batch"] = SGLANG_LORA_SLOTS if request.max_loras_per_batch is None else (
            f"the request's ({request.max_loras_per_batch}: --max-loras-per-batch pins it)")
    return {**NOT_SEARCHED, **(LORA_NOT_SEARCHED if request.finetune == "lora" else {}), **pinned}


def lora_slots(request: RlRequest, merge: dict) -> dict:
    """SGLang's max_loras_per_batch for an engine choice: 1 where verl serves the adapter (merge off) from SGLang
    and the request leaves it (SGLANG_LORA_SLOTS says why), else the request's."""
    merged = merge.get("lora_merge", bool(request.lora_merge))
    served = request.engine == "sglang" and request.finetune == "lora" and not merged
    return {"max_loras_per_batch": 1} if served and request.max_loras_per_batch is None else {}


def lora_merges(request: RlRequest) -> tuple[bool, ...]:
    """model.lora.merge's values to try: both for a verl LoRA actor whose request leaves it unset (verl's default,
    False, first: it wins ties), else none (the request's, or no adapter). verl 0.9.1 refuses neither value under
    either strategy or load_format (workers/engine/fsdp/transformer_impl.py get_per_tensor_param: merged, FSDP1
    and FSDP2 alike, whatever layered_summon says); an adapter under layered_summon and load_format dummy raises at
    its first sync (utils/fsdp_utils.py collect_lora_params: rl_strategy.sync_refusals), which side_fits reads."""
    return (False, True) if request.finetune == "lora" and request.lora_merge is None else ()


@dataclass(frozen=True)
class RlPlan:
    request: RlRequest
    ranked: tuple[RlEstimate, ...]   # the best of each shared choice (S) that fits, fastest first
    misses: tuple[RlEstimate, ...]   # the nearest that do not (smallest peak first), when nothing fits
    searched: int                    # configurations in the space (the product of every knob's values)
    priced: int = 0                  # configurations evaluate_rl priced to find the best


def key(e: RlEstimate) -> tuple:
    """The ranking: step time, then the peak in whole MiB (below, KV-block rounding: a tie, which the earlier
    choice - the request's max_num_batched_tokens - wins)."""
    return e.time.step_s, -(-e.memory.peak.reserved_bytes // MiB)


def side_fits(e: RlEstimate, engine_side: bool) -> bool:
    """The engine side (ENGINE_PHASES, the engine's refusals, rollout TP, the weight sync's refusals, host RAM) or
    the actor side (the other phases, the batch's and a reward engine's refusals): a configuration fits when both do
    (evaluate_rl's reasons, split)."""
    cap = e.cluster.gpu.memory_bytes
    if any(p.reserved_bytes > cap for p in e.memory.phases if (p.name in ENGINE_PHASES) == engine_side):
        return False
    tp_refusal = any(r.field == "rollout_tp" for r in e.batch.refusals)
    if not engine_side:   # a reward engine's start sees the actor's resident states (rl_reward.py)
        reward = e.memory.reward.memory.refusals if e.memory.reward else ()
        return not reward and not any(r.field != "rollout_tp" for r in e.batch.refusals)
    ram = e.cluster.cpu_ram_bytes_per_node
    return not (e.memory.engine.refusals or tp_refusal or sync_refusals(e.settings)
                or (ram and e.host.peak_bytes > ram))


def _divides_mini(request: RlRequest, n_gpus: int, sp: int, micro: int) -> bool:
    """verl asserts the normalised mini-batch (prompts x n // (GPUs / Ulysses)) divisible by the micro-batch (1:
    dynamic batches, which only need a mini-batch of at least one sequence)."""
    mini = (request.ppo_mini_batch_size or request.train_batch) * request.rollout_n // max(1, n_gpus // sp)
    return mini > 0 and mini % micro == 0


def spaces(request: RlRequest, model: ModelSpec, n_gpus: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(shared, engine, actor) knob values. Pruned by construction: what verl or vLLM refuse (a TP or Ulysses
    degree not dividing the GPUs and heads, a micro-batch not dividing the mini-batch, a budget shorter than one
    sequence / Ulysses), max_num_seqs above a replica's sequences (the same speed, a larger sampler), FSDP1
    under the request's offload_policy or the critic's (verl's FSDP1 ignores it) and the manual offloads a policy
    forces off."""
    heads, kv = model.n_heads, model.n_kv_heads
    # under CPUOffloadPolicy verl forces the manual offloads off (cost_models/rl_settings.py), and its FSDP1 ignores
    # the policy: the request's policy keeps FSDP2 - the critic's too where the critic follows the actor's strategy
    # (else FSDP1's critic would differ from FSDP2's in host RAM and offload time, which plan_rl's pruning assumes
    # equal); a critic strategy the request sets is the same under both
    ppo = request.algorithm == "ppo"
    critic_policy = ppo and request.critic_offload_policy and request.critic_strategy in (None, "fsdp2")
    pairs = list(itertools.product((False, True), (False, True)))
    offloads = ((False, False),) if request.offload_policy else pairs
    strategies = ("fsdp2",) if request.offload_policy or (critic_policy and request.critic_strategy is None) \
        else STRATEGIES
    if moe_lora.fsdp1_fails(model, request.finetune == "lora" and lora_targets(request.lora_targets, model)
                            is LoraTargets.ALL_LINEAR):
        strategies = ("fsdp2",)
    shared = [dict(strategy=st, actor_dtype=d, param_offload=p, optimizer_offload=o)
              for st, d, (p, o) in itertools.product(strategies, DTYPES, offloads)]
    if ppo:
        critic = ((False, False),) if critic_policy else pairs
        shared = [dict(s, critic_param_offload=a, critic_optimizer_offload=b) for s in shared for a, b in critic]
    seqs = request.train_batch * request.rollout_n
    engine = []
    merges = [dict(m, **lora_slots(request, m)) for m in ([dict(lora_merge=m) for m in lora_merges(request)] or [{}])]
    for tp in (t for t in TPS if n_gpus % t == 0 and heads % t == 0):
        per_replica = -(-seqs // (n_gpus // tp))
        wanted = [m for m in MAX_NUM_SEQS if m < per_replica] + [next((m for m in MAX_NUM_SEQS if m >= per_replica),
                                                                      MAX_NUM_SEQS[-1])]
        engine += [dict(rollout_tp=tp, max_num_seqs=m, max_num_batched_tokens=b, **merge, gpu_memory_utilization=u)
                   for m in dict.fromkeys(wanted) for b in _batched_tokens(request, m) for merge in merges
                   for u in UTILIZATIONS]
    longest = request.prompt_len + request.response_len
    actor = []
    for sp in (s for s in ULYSSES if n_gpus % s == 0 and heads % s == 0 and (kv % s == 0 or s % kv == 0)):
        batches = [dict(use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=m, log_prob_micro_batch_size_per_gpu=lm)
                   for m in MICRO_BATCHES if _divides_mini(request, n_gpus, sp, m) for lm in LOG_PROB_MICRO_BATCHES]
        if _divides_mini(request, n_gpus, sp, 1):
            batches += [dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=b, log_prob_max_token_len_per_gpu=lb)
                        for b in TOKEN_BUDGETS if b * sp >= longest
                        for lb in LOG_PROB_TOKEN_BUDGETS if lb * sp >= longest]
        actor += [dict(gradient_checkpointing=gc, ulysses_sequence_parallel_size=sp, **b)
                  for gc in (True, False) for b in batches]
    return shared, engine, actor


def _batched_tokens(request: RlRequest, max_num_seqs: int) -> list[int]:
    """vLLM's max_num_batched_tokens worth pricing: MAX_NUM_BATCHED_TOKENS and the request's, those vLLM takes with
    max_num_seqs, the request's first (it wins ties). SGLang: the request's (its profile and chunks not priced)."""
    if request.engine != "vllm":
        return [request.max_num_batched_tokens]
    return [b for b in dict.fromkeys((request.max_num_batched_tokens, *MAX_NUM_BATCHED_TOKENS)) if b >= max_num_seqs]


def search_space(request: RlRequest, model: ModelSpec, n_gpus: int) -> list[dict]:
    """Every configuration of the space (the product the exhaustive search prices)."""
    shared, engine, actor = spaces(request, model, n_gpus)
    return [{**s, **e, **a} for s, e, a in itertools.product(shared, engine, actor)]


def with_chunking_if_needed(price, request: RlRequest, knobs: dict) -> RlEstimate:
    """Priced with the request's entropy chunking; where the actor side does not fit and the entropy is computed
    unchunked, priced again with chunking (verl's entropy_from_logits_with_chunking: the same time, less memory)."""
    e = price(knobs)
    if side_fits(e, engine_side=False) or not request.entropy or request.entropy_chunking:
        return e
    return price({**knobs, "entropy_chunking": True})


def _pricer(request: RlRequest, profile: Profile | None, model: ModelSpec, memo: dict):
    """evaluate_rl on the request with some knobs changed, counted, sharing one memo."""
    count = [0]

    def price(knobs: dict) -> RlEstimate:
        count[0] += 1
        return evaluate_rl(dataclasses.replace(request, **knobs), profile, model=model, memo=memo)
    return price, count


def exhaustive(request: RlRequest, profile: Profile | None = None) -> list[RlEstimate]:
    """Every configuration of the space priced (entropy chunking by its rule): the reference the pruned search is
    checked against (tests/unit/test_rl_search.py)."""
    model = resolve_model(request.model)
    price, _ = _pricer(request, profile, model, {})
    return [with_chunking_if_needed(price, request, k)
            for k in search_space(request, model, request.cluster.spec().n_gpus)]


def plan_rl(request: RlRequest, profile: Profile | None = None, top: int = 10) -> RlPlan:
    """The best configuration of each shared choice S that fits, ranked (the module docstring says why it is the
    product's best). Per S: the engine choices priced at the first actor choice, rising utilizations of each TP
    and max_num_seqs until one fits at full speed (its KV cache runs every sequence it may: more only adds
    memory) or the engine side is over the GPU (more only adds memory); the best by (f, engine-side peak). Then
    the actor choices in the order of their seconds (train_time_s, read once per strategy and dtype), each priced
    with S and that engine choice until one fits; one whose actor side did not fit with a choice holding no more
    (_holds_no_more) is not priced."""
    if request.framework != "verl":   # the knobs and the engine side / actor side split are verl's
        raise PlannerError("framework", f"{request.framework}: `fsdp-plan rl` searches verl's knobs; price a TRL "
                                        "job with `fsdp-plan rl estimate --framework trl` or `fsdp-plan check`; "
                                        "valid: verl")
    model = resolve_model(request.model)
    n_gpus = request.cluster.spec().n_gpus
    shared, engines, actors = spaces(request, model, n_gpus)
    actors = actors or [{}]   # none verl takes (a mini-batch of 0 sequences a rank): the request's, to say why
    memo: dict = {}
    price, count = _pricer(request, profile, model, memo)
    apis = {(t["strategy"], t["actor_dtype"]) for t in shared}   # the strategy and dtype change g: its order each
    order = {api: sorted(range(len(actors)), key=lambda i: (train_time_s(dataclasses.replace(  # as price() runs it
        request, **{"strategy": api[0], "actor_dtype": api[1], **actors[i]}), model, profile, memo), i))
        for api in apis}
    priced: list[RlEstimate] = []
    failed: list[tuple[dict, set]] = []   # (S, the actor choices whose actor side did not fit with it)
    best = []
    fsdp2_fitting: dict = {}   # S less its strategy -> FSDP2's engine choices that fit, as (f, index)
    sharded = shard_group_ranks(n_gpus, request.fsdp_size) > 1   # else FSDP1 runs NO_SHARD (_holds_no_more)
    # the choices that hold less first (more offloaded; FSDP2 before FSDP1), so their failures prune the others'
    for s in sorted(shared, key=lambda s: (-sum(s[k] for k in OFFLOADS if k in s), s["strategy"] != "fsdp2")):
        twin = tuple(sorted((k, v) for k, v in s.items() if k != "strategy"))
        by_engine = (_engine_side(price, s, engines, actors[0]) if s["strategy"] == "fsdp2" else
                     _engine_side_as_fsdp2(price, s, engines, actors[0], fsdp2_fitting[twin]))
        priced += [e for _, e in by_engine]
        fitting = [(i, e) for i, e in by_engine if side_fits(e, engine_side=True)]
        if s["strategy"] == "fsdp2":
            fsdp2_fitting[twin] = sorted((_f(e), i) for i, e in fitting)
        if not fitting:
            continue
        chosen = engines[min(fitting, key=lambda ie: (_f(ie[1]), _peak_mib(ie[1], True), ie[0]))[0]]
        known = set().union(*(f for t, f in failed if _holds_no_more(t, s, sharded)))
        failing = set()
        for i in order[s["strategy"], s["actor_dtype"]]:
            if i in known:
                continue
            e = with_chunking_if_needed(price, request, {**s, **chosen, **actors[i]})
            if e.fits:
                best.append(e)
                break
            priced.append(e)
            failing.add(i)
        failed.append((s, failing))
    ranked = sorted(best, key=key)
    misses = () if ranked else tuple(sorted(priced, key=lambda e: e.memory.peak.reserved_bytes)[:top])
    space = len(shared) * len(engines) * len(actors)
    return RlPlan(request=request, ranked=tuple(ranked[:top]), misses=misses, searched=space, priced=count[0])


def _holds_no_more(t: dict, s: dict, sharded: bool) -> bool:
    """Every actor-side phase of t holds at most what s's holds: the same dtype, all that s offloads offloaded, and
    s's strategy or, where the actor is sharded, FSDP2 (it never holds more than FSDP1 there; on one-rank shard
    groups FSDP1 runs NO_SHARD and its update holds less: cost_models/rl_strategy.py, tests/unit/
    test_rl_strategy.py)."""
    return (t["actor_dtype"] == s["actor_dtype"] and t["strategy"] in (s["strategy"], "fsdp2" if sharded else None)
            and all(t[k] >= s[k] for k in OFFLOADS if k in s))


def _engine_side(price, s: dict, engines: list[dict], actor: dict) -> list[tuple[int, RlEstimate]]:
    """(index, estimate) of the engine choices worth pricing for S: each TP and max_num_seqs by rising
    utilization (spaces() lists them so), stopping after one that fits with every sequence it may run at once
    (more: the same speed, more memory) or one whose engine phases are over the GPU or that vLLM refuses to start
    (more: over still)."""
    out, stop = [], None
    for i, e in enumerate(engines):
        group = (e["rollout_tp"], e["max_num_seqs"], e["max_num_batched_tokens"], e.get("lora_merge"))
        if group == stop:
            continue
        est = price({**s, **e, **actor})
        out.append((i, est))
        over = _peak(est, True) > est.cluster.gpu.memory_bytes or any(
            r.code == "engine-start" for r in est.memory.engine.refusals)
        wanted = min(e["max_num_seqs"], est.batch.rollout_seqs_per_replica)
        if over or (side_fits(est, True) and est.memory.engine.max_concurrent_seqs >= wanted):
            stop = group
    return out


def _engine_side_as_fsdp2(price, s: dict, engines: list[dict], actor: dict, fsdp2: list[tuple[float, int]]
                          ) -> list[tuple[int, RlEstimate]]:
    """FSDP1's engine choices worth pricing, from FSDP2's with the same dtype and offloads (`fsdp2`: those that fit,
    as (f, index), fastest first): FSDP1's engine side holds at least FSDP2's (its weight sync adds the shard's copy;
    init, rollout, host RAM and the engine's refusals are the same; a merged LoRA's base backup is the whole shard)
    and its f at least FSDP2's (equal for a full actor; a LoRA's FSDP1 sync summons the whole model, twice merged,
    where FSDP2's gathers the adapters or walks the shards once: tests/unit/test_rl_strategy.py), so only those can
    fit, and none whose FSDP2 f is above the fastest FSDP1 f found can beat it: priced in FSDP2's f order until
    then (tests/unit/test_rl_lora_merge_search.py)."""
    out, found = [], None
    for f, i in fsdp2:
        if found is not None and f > found:
            break
        est = price({**s, **engines[i], **actor})
        out.append((i, est))
        if side_fits(est, engine_side=True):
            found = min(_f(est), found if found is not None else _f(est))
    return out


def _f(e: RlEstimate) -> float:
    """The engine side's seconds: generation, weight sync, offload copies."""
    return e.time.generation_s + e.time.weight_sync_s + e.time.offload_s


def _peak(e: RlEstimate, engine_side: bool) -> int:
    return max(p.reserved_bytes for p in e.memory.phases if (p.name in ENGINE_PHASES) == engine_side)


def _peak_mib(e: RlEstimate, engine_side: bool) -> int:
    return -(-_peak(e, engine_side) // MiB)
