"""`fsdp-plan rl`: a small search over the knobs verl users tune for a GRPO / PPO job - actor (and critic) param /
optimizer offload, the update's micro-batch, the engine's gpu_memory_utilization and rollout TP - each configuration
priced by evaluate_rl, ranked by the estimated step time (cost_models/rl_time.py) among those that fit."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from cost_models.profile import Profile

from ..models import resolve_model
from .evaluate import RlEstimate, evaluate_rl
from .request import RlRequest

MICRO_BATCHES = (1, 2, 4, 8, 16)
TOKEN_BUDGETS = (8192, 16384, 32768)   # dynamic batches: ppo_ (and log_prob_) max_token_len_per_gpu
UTILIZATIONS = (0.3, 0.4, 0.5, 0.6, 0.7)
TPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class RlPlan:
    request: RlRequest
    ranked: tuple[RlEstimate, ...]   # those that fit, fastest first
    misses: tuple[RlEstimate, ...]   # the nearest that do not (smallest peak first), when nothing fits
    searched: int


def search_space(request: RlRequest, n_gpus: int, heads: int) -> list[dict]:
    """The knob values to try: every combination of offloads (PPO: the critic's too), the micro-batch (static
    batches) or the token budget (dynamic ones, those holding one whole sequence), utilization and a rollout TP
    that divides the GPUs and the heads. The Ulysses degree stays the request's."""
    tps = [t for t in TPS if n_gpus % t == 0 and heads % t == 0 and t <= n_gpus]
    longest = (request.prompt_len + request.response_len) / request.ulysses_sequence_parallel_size
    batches = ([{"ppo_max_token_len_per_gpu": b, "log_prob_max_token_len_per_gpu": b} for b in TOKEN_BUDGETS
                if b >= longest] if request.use_dynamic_bsz else
               [{"ppo_micro_batch_size_per_gpu": m, "log_prob_micro_batch_size_per_gpu": m} for m in MICRO_BATCHES])
    critic = ([{"critic_param_offload": a, "critic_optimizer_offload": b}
               for a, b in itertools.product((False, True), (False, True))] if request.algorithm == "ppo" else [{}])
    return [dict(param_offload=p, optimizer_offload=o, gpu_memory_utilization=u, rollout_tp=t, **c, **m)
            for p, o, c, m, u, t in itertools.product((False, True), (False, True), critic, batches or [{}],
                                                      UTILIZATIONS, tps)]


def plan_rl(request: RlRequest, profile: Profile | None = None, top: int = 10) -> RlPlan:
    """Price the search space (the request fixes everything else); rank what fits by step time."""
    model = resolve_model(request.model)
    cluster = request.cluster.spec()
    space = search_space(request, cluster.n_gpus, model.n_heads)
    priced = [evaluate_rl(dataclasses.replace(request, **knobs), profile, model=model) for knobs in space]
    fits = sorted((e for e in priced if e.fits), key=lambda e: (round(e.time.step_s, 1), e.memory.peak.reserved_bytes))
    misses = () if fits else tuple(sorted(priced, key=lambda e: e.memory.peak.reserved_bytes)[:top])
    return RlPlan(request=request, ranked=tuple(fits[:top]), misses=misses, searched=len(space))
