"""Enumerate the candidate space, cost each candidate, rank what fits. No I/O.

The space is strategy x precision x offload x activation checkpointing (none, every-K, full, selective-op)
x micro-batch (with gradient accumulation to reach the global batch) x backward prefetch x rate limiter x
torch.compile per block x Float8 linears (where the GPU has FP8 and compute is bf16; with the FP8
all-gather under FULL_SHARD / HYBRID_SHARD) x, for FULL_SHARD across nodes, blocks resharding to the node
after forward; and for mixture-of-experts
models whose experts FSDP2 would pad at a strategy's shard group, stacked experts on dim 0 (padded) or
dim 1 (shard_placement_fn, unpadded). Memory grows with the
micro-batch, so once a micro-batch does not fit, larger ones with the same knobs are skipped (the first
miss is kept: it is a "nearest miss" worth explaining).

Above all of it, the device mesh (cost_models/mesh.py): tensor, context and expert degrees the model and the
cluster allow (cost_models/mesh_rules.py), each searched with the FSDP knobs FSDP2 has (the FSDP1-only ones -
no backward prefetch, no rate limiter - only on the data-parallel-only mesh, which FSDP1 can run; CPU offload
too, the other way out of memory):
- tp: divisors of the heads, the KV heads and the MLP inside the scale-up domain (a TP group's
  four collectives per block on the inter-node tier lose to FSDP alone), unless pinned;
- cp: sequences of at least MIN_CP_TOKENS tokens per rank (ring attention's exchanges hide behind the attention
  only on long chunks), 2 x cp dividing the sequence;
- ep: for MoE, divisors of the experts that divide dp_shard x cp x tp;
- pp: after each mesh without it, pipelines of growing degree (planner/search/pipeline.py: 1F1B and interleaved
  1F1B, the microbatch count the global batch gives), walked past the degrees where nothing fits and those that
  fit faster than the best before, to the first that fits no faster: PP is kept where it wins, or where nothing
  fits without it;
and the global batch a multiple of the data-parallel ranks (GPUs / tp x cp x pp) x micro-batch. Pinned degrees
(SearchSpace.tp / cp / ep / pp) are searched alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from cost_models import moe
from cost_models.evaluate import Evaluation, evaluate, unsupported_reasons
from cost_models.mesh_rules import checkpointing_priced, mesh_refusals
from cost_models.profile import Profile
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Sharding, TrainingSpec

from planner.search.gc_pause import gc_paused
from planner.search.memo import Costing
from planner.search.pipeline import PP_SHARDINGS, microbatch_plans
from planner.search.walk import Walk, per_token_compute_s, pipeline_ceiling, scout_space, walk_on
from planner.search.space import (FLOAT8_PRECISIONS, FP8_ALL_GATHER_SHARDINGS, MeshChoice, SearchSpace, mesh_choices,
                                  pipeline_meshes, training_space)
from planner.search.ranking import SearchResult, _distinct, overshoot, rank_key
from planner.search.words import describe, describe_mesh


def _with_expert_options(knobs, model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, mesh: MeshChoice):
    """Each knob combination with expert_shard_dim 0, and also 1 where FSDP2 would pad the stacked experts
    at that strategy's shard group and sharding them on dim 1 removes it; without expert units, and with
    them for an MoE model under a strategy that gathers blocks again in backward (the backward prefetch
    then leaves the experts out, and they reshard after their own backward)."""
    options: dict[Sharding, list[tuple[int, bool]]] = {}  # they read the strategy alone: once per strategy
    for knob in knobs:
        if knob[0] not in options:
            sharding = FsdpConfig(sharding=knob[0], tp=mesh.tp, cp=mesh.cp, ep=mesh.ep)
            d = sharding.shard_group_size(cluster)
            regathers = d > 1 and sharding.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
            options[knob[0]] = [(dim, units) for dim in space.expert_shard_dims
                                if dim == 0 or (mesh.ep == 1 and moe.dim1_shardable(model, d))
                                for units in space.expert_units if not units or (model.moe is not None and regathers)]
        for dim, units in options[knob[0]]:
            yield (*knob, dim, units)


def _with_techniques(knobs, cluster: ClusterSpec, space: SearchSpace, mesh: MeshChoice):
    """Each knob combination with compile, Float8 (+ FP8 all-gather), resharding to the node and async TP as
    the space and cluster allow: (*knob, compile, float8, fp8_all_gather, reshard_after_forward, async_tp)."""
    compiles = space.compile_for(cluster)
    has_fp8 = cluster.gpu.supports("fp8")
    node_ranks = cluster.gpus_per_node // (mesh.tp * mesh.cp)  # a shard group's ranks inside one node
    to_node = cluster.n_nodes > 1 and node_ranks >= 2
    for knob in knobs:
        sharding, precision = knob[0], knob[1]
        float8s = space.float8 if has_fp8 and precision in FLOAT8_PRECISIONS else (False,)
        reshards = tuple(dict.fromkeys(node_ranks * mesh.cp if on else 0 for on in space.reshard_to_node)) \
            if to_node and sharding is Sharding.FULL_SHARD else (0,)
        for compile_, float8, reshard in itertools.product(compiles, float8s, reshards):
            gathers = space.fp8_all_gather if float8 and sharding in FP8_ALL_GATHER_SHARDINGS else (False,)
            asyncs = space.async_tp if mesh.tp > 1 and compile_ and space.sequence_parallel else (False,)
            for fp8_all_gather, async_tp in itertools.product(gathers, asyncs):
                yield (*knob, compile_, float8, fp8_all_gather, reshard, async_tp)


def data_parallel_note(cluster: ClusterSpec, training: TrainingSpec, space: SearchSpace,
                       fitting: list[Evaluation]) -> str | None:
    """One line when data parallelism alone cannot use every GPU (the global batch has fewer sequences than
    GPUs, or is no multiple of them for any micro-batch), with the way out."""
    n, gb = cluster.n_gpus, training.global_batch
    if gb is None or any(training.grad_accum_for(mb, n) is not None for mb in space.micro_batches):
        return None
    most = max(k for k in range(1, min(n, gb) + 1) if gb % k == 0)  # one sequence or more on every GPU
    mesh = next((e for e in fitting if e.config.model_parallel > 1), None)
    found = (f"; the search found {describe_mesh(mesh.config, cluster)} "
             f"({mesh.time.tokens_per_s_per_gpu:,.0f} tokens/s/GPU)") if mesh is not None else ""
    return (f"data parallelism alone cannot use {n} GPUs with global batch {gb} ({gb} sequences): use at most "
            f"{most} GPU{'s' if most > 1 else ''}, a global batch that is a multiple of {n}, or tensor / context / "
            f"pipeline parallelism{found}")


@dataclass
class _Found:
    fitting: list[Evaluation] = field(default_factory=list)
    misses: list[Evaluation] = field(default_factory=list)
    n_costed: int = 0

    def best_tokens_per_s(self) -> float | None:
        """The fastest fitting, as the pipeline walk weighs degrees: over the node's shard group (a pipeline's HYBRID
        shards over the node: like with like, SearchSpace.shard_groups_for)."""
        return max((e.time.tokens_per_s_per_gpu for e in self.fitting if not e.config.shard_group_gpus), default=None)


def _cost_mesh(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, costing: Costing,
               space: SearchSpace, shardings: tuple[Sharding, ...], mesh: MeshChoice) -> _Found | None:
    """Every knob combination on one mesh (None: no micro-batch reaches the global batch on it, or the mesh does
    not divide the GPUs: a pinned --pp beside a searched tp or cp)."""
    if cluster.n_gpus % mesh.model_parallel:
        return None
    data_parallel = cluster.n_gpus // mesh.model_parallel
    pipe = mesh.pipeline
    if pipe.pp > 1:  # a stage keeps its blocks gathered from forward to backward: no reshard group to choose
        space = replace(space, reshard_to_node=(False,))
    plans = microbatch_plans(training, data_parallel, space.micro_batches, pipe, space.pp_schedule is not None)
    if not plans:
        return None

    def probe(sharding: Sharding, mb: int, accum: int) -> FsdpConfig:
        """What the mesh rules read: the mesh, the strategy, a pipeline's microbatches."""
        return FsdpConfig(sharding=sharding, micro_batch=mb, grad_accum=accum, attention=space.attention, tp=mesh.tp,
                          cp=mesh.cp, ep=mesh.ep, pp=pipe.pp, pp_schedule=pipe.schedule,
                          pp_stages_per_rank=pipe.stages_per_rank, sequence_parallel=space.sequence_parallel)

    found = _Found()
    plain = mesh == MeshChoice()
    runs: dict[Sharding, bool] = {}

    def mesh_runs(config: FsdpConfig) -> bool:
        """The mesh rules pass (EP dividing this strategy's dp_shard x cp x tp among them), and HYBRID is not
        FULL_SHARD or DDP by another name; they read only the mesh and the strategy (a pipeline's microbatches
        are checked before), so once per strategy."""
        if config.sharding not in runs:
            dp_shard = config.dp_shard_size(cluster)
            runs[config.sharding] = not mesh_refusals(model, cluster, training, config) and not (
                config.sharding.is_hybrid and dp_shard in (1, config.data_parallel_size(cluster)))
        return runs[config.sharding]

    # FSDP1-only knobs (no backward prefetch, no rate limiter) only where FSDP1 can run: no mesh
    prefetches = space.backward_prefetch if plain else (True,)
    limits = space.limit_all_gathers if plain else (True,)
    mesh_shardings = shardings if mesh.cp == 1 else tuple(s for s in shardings if s is not Sharding.NO_SHARD)
    if pipe.pp > 1:
        mesh_shardings = tuple(s for s in mesh_shardings if s in PP_SHARDINGS)
    if not plain:  # a strategy the mesh rules refuse here costs nothing (once per strategy, not per knob)
        mb, accum = plans[0]
        mesh_shardings = tuple(s for s in mesh_shardings if mesh_runs(probe(s, mb, accum)))
    # Liger under TP or PP is left out (planner/trainers.refusal: a stage calls the head itself, SP DTensors unchecked)
    kernel_sets = tuple(k for k in space.kernel_sets if mesh.tp == pipe.pp == 1 or "liger" not in dict(k).values())
    # CPU offload is the way out for data parallelism alone; a mesh is the other way out, not combined with it
    offloads = space.offload if plain else (False,)
    ac_choices = space.ac_every if checkpointing_priced(pipe.pp, pipe.schedule) else \
        tuple(a for a in space.ac_every if not a)
    sizes = space.shard_groups_for(cluster, mesh.model_parallel, pipe.pp)
    walked = {s: _worth_walking(costing, replace(probe(s, *plans[0]), precision=space.precisions_for(cluster)[0]),
                                sizes, found, mesh_shardings) if space.shard_group_gpus is None else sizes
              for s in mesh_shardings if s.is_hybrid}
    knobs = itertools.product(mesh_shardings, space.precisions_for(cluster), offloads, ac_choices,
                              prefetches, limits, space.reduce_dtypes)
    for (sharding, precision, offload, ac, prefetch, limit, reduce, dim, units, compile_, float8, fp8_all_gather,
         reshard, async_tp) in _with_techniques(_with_expert_options(knobs, model, cluster, space, mesh),
                                                cluster, space, mesh):
        if offload and sharding is Sharding.NO_SHARD:
            continue  # FSDP offloads shards; with nothing sharded DDP-style offload is not offered
        for kernels in kernel_sets:
            # these knobs on the first group and micro-batch (the first candidate priced), the others through
            # with_batch: only the group, micro-batch and accumulation vary below
            groups = walked.get(sharding, (0,))
            knobbed = FsdpConfig(sharding=sharding, precision=precision, offload=offload, ac_every=ac,
                                 micro_batch=plans[0][0], grad_accum=plans[0][1], attention=space.attention,
                                 backward_prefetch=prefetch, limit_all_gathers=limit, expert_shard_dim=dim,
                                 expert_units=units, reduce_dtype=None if reduce == precision.reduce_dtype else reduce,
                                 compile=compile_, compile_loss=space.compile_loss, float8=float8,
                                 fp8_all_gather=fp8_all_gather, reshard_after_forward=reshard, tp=mesh.tp, cp=mesh.cp,
                                 ep=mesh.ep, pp=pipe.pp, pp_schedule=pipe.schedule,
                                 pp_stages_per_rank=pipe.stages_per_rank, async_tp=async_tp,
                                 sequence_parallel=space.sequence_parallel, shard_group_gpus=groups[0],
                                 **dict(kernels))

            def priced(group: int, mb: int, accum: int) -> FsdpConfig:
                return knobbed.with_batch(mb, accum, group)

            # HYBRID: the node's shard group, then the larger ones worth walking (_worth_walking: the fastest, then
            # each holding less and running slower), those past the fastest from the first micro-batch the group
            # before missed, and none once the largest misses too (memory falls as the group grows)
            first = 0
            for j, group in enumerate(groups):
                start = first if j >= 2 else 0
                if 1 <= j < len(groups) - 1 and not (peek := costing.evaluate(priced(groups[-1], *plans[start]))).fits:
                    found.n_costed += 1
                    found.misses.append(peek)
                    break
                if unsupported_reasons(cluster, priced(group, *plans[start])):
                    continue  # (feasibility's rules read no micro-batch: once a group, not once a candidate)
                for i, (mb, accum) in enumerate(plans[start:], start):
                    config = priced(group, mb, accum)
                    e = costing.evaluate(config, runs=True)
                    found.n_costed += 1
                    if e.fits:
                        found.fitting.append(e)
                    else:
                        found.misses.append(e)
                        first = i
                        break  # larger micro-batches need more memory
                else:
                    if j >= 1:
                        break  # every micro-batch fits: the larger groups hold less but run no faster
    return found


def _worth_walking(costing: Costing, probe: FsdpConfig, groups: tuple[int, ...], found: _Found,
                   shardings: tuple[Sharding, ...]) -> tuple[int, ...]:
    """HYBRID's shard groups worth walking on a mesh: the node's (0), and each larger one that the probe (the mesh's
    first micro-batch, no checkpointing, no offload) does not show dominated - no less memory and no faster than
    another group's or than the same knobs sharded over every rank (FULL_SHARD / SHARD_GRAD_OP, searched anyway) -
    as a larger group's gathers cross nodes and the all-reduce over fewer replicas shrinks, whatever the other knobs."""
    if len(groups) == 1:
        return groups
    plain = Sharding.FULL_SHARD if probe.sharding.reshards_after_forward else Sharding.SHARD_GRAD_OP
    points = {g: costing.evaluate(replace(probe, shard_group_gpus=g)) for g in groups}
    rivals = [*points.values(), *([costing.evaluate(replace(probe, sharding=plain))] if plain in shardings else [])]
    found.n_costed += len(rivals)
    key = lambda e: (e.memory.peak_reserved_bytes, -e.time.tokens_per_s_per_gpu)  # noqa: E731 - lower is better
    dominated = lambda e: any(r is not e and all(a <= b for a, b in zip(key(r), key(e))) and key(r) != key(e)  # noqa: E731
                              for r in rivals)
    return tuple(g for g in groups if g == 0 or not dominated(points[g]))


def search(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, profile: Profile,
           space: SearchSpace = SearchSpace()) -> SearchResult:
    """Cost the space. Each mesh without a pipeline, then its pipelines (pipeline_meshes) by growing degree for each
    schedule until a degree fits no faster than the best before it (walk_on) or cannot beat the fastest candidate
    so far (pipeline_ceiling: the mesh's own compute with the textbook bubble), each degree on the scout knobs
    (scout_space: a pipeline candidate prices every rank's schedule, 5-60 ms at pp 8-32 against 0.5 ms without);
    then the whole knob space on the fastest scouted pipeline where it beats the meshes without PP on the same knobs.
    The cyclic garbage collector is paused meanwhile (planner/search/gc_pause.py: the search makes no cycles)."""
    with gc_paused():
        return _search(model, cluster, training, profile, space)


def _search(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, profile: Profile,
            space: SearchSpace) -> SearchResult:
    found: list[_Found] = []
    skipped: list[str] = []
    space = training_space(space, model, cluster, training)  # (QLoRA's precisions, all-linear LoRA on an MoE)
    shardings = space.shardings_for(cluster)
    if len(shardings) < len(space.shardings):
        skipped.append("HYBRID strategies: single node (or GPUs not divisible by GPUs per node), "
                       "where they equal FULL_SHARD / SHARD_GRAD_OP")
    costing = Costing(model, cluster, training, profile, ways=space.host_ways)  # each configuration priced once
    cost = lambda mesh, knobs=space: _cost_mesh(model, cluster, training, costing, knobs, shardings[:1] if  # noqa: E731
                                                 knobs is not space else shardings, mesh)
    scout = scout_space(space, cluster)
    scouted: dict[tuple, tuple[float, MeshChoice]] = {}  # per schedule: the fastest scouted pipeline
    best_known = 0.0  # the fastest fitting candidate so far, tokens/s/GPU
    flat_scouts = 0.0  # the meshes without PP on the scout knobs: what a scouted pipeline must beat
    for mesh in mesh_choices(model, cluster, training, space):
        flat = cost(mesh)
        found.append(flat)
        flat_best = flat.best_tokens_per_s() if flat else None  # (read again by each schedule's walk below)
        best_known = max(best_known, flat_best or 0.0)
        if mesh.pipeline.pp > 1:
            continue  # pinned pp: mesh_choices gave the pipelines themselves
        if space.pp != 1:  # like with like (0.2 ms a candidate; counted once, with the mesh's own)
            flat_scout = cost(mesh, scout)
            flat_scouts = max(flat_scouts, (flat_scout.best_tokens_per_s() or 0.0) if flat_scout else 0.0)
        walks: dict[tuple, Walk] = {}  # per schedule
        stopped: set[tuple] = set()
        per_token_s = per_token_compute_s(flat.fitting + flat.misses if flat is not None else [])
        for pipe in pipeline_meshes(model, cluster, space, mesh):
            key = (pipe.schedule, pipe.stages_per_rank)
            if key in stopped:
                continue
            plans = microbatch_plans(training, cluster.n_gpus // (mesh.model_parallel * pipe.pp), space.micro_batches,
                                     pipe, space.pp_schedule is not None)
            ceiling = pipeline_ceiling(per_token_s, pipe, plans)
            if ceiling is not None and ceiling <= best_known:
                stopped.add(key)  # a larger degree: fewer microbatches or more stages, a larger bubble
                continue
            piped = cost(replace(mesh, pipeline=pipe), scout)
            found.append(piped)
            best = piped.best_tokens_per_s() if piped is not None else None
            if best is not None and best > scouted.get(key, (0.0, None))[0]:
                scouted[key] = (best, replace(mesh, pipeline=pipe))
                best_known = max(best_known, best)
            least = min((overshoot(e)[0] for e in piped.misses), default=None) if piped is not None else None
            go_on, walks[key] = walk_on(best, least, piped is not None,
                                        walks.get(key, Walk(flat_best)))
            if not go_on:
                stopped.add(key)
    if scouted:  # the whole knob space on the fastest scouted pipeline, where it beats no PP on the same knobs
        best, fastest = max(scouted.values(), key=lambda bm: bm[0])
        found += [cost(fastest)] if best > flat_scouts else []
    costed = [f for f in found if f is not None]
    if not costed:
        skipped.append(f"every micro-batch: global batch {training.global_batch} is not a multiple of "
                       f"micro-batch x the data-parallel ranks for any of {space.micro_batches} on any mesh")
    fitting = _distinct(sorted((e for f in costed for e in f.fitting), key=rank_key))
    misses = _distinct(sorted((e for f in costed for e in f.misses), key=overshoot))
    note = data_parallel_note(cluster, training, space, fitting)
    return SearchResult(fitting=fitting, misses=misses, n_costed=sum(f.n_costed for f in costed), skipped=skipped,
                        notes=[note] if note else [])


def suggestions(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, profile: Profile,
                miss: Evaluation) -> list[str]:
    """What would make the nearest miss fit: more GPUs, offload, checkpointing, LoRA, shorter sequences."""
    from cost_models.specs import Finetune  # local: only needed when nothing fits

    out = []
    config = miss.config
    fs = replace(config, sharding=Sharding.FULL_SHARD)
    n = cluster.n_gpus
    for _ in range(12):  # up to 4096x more GPUs
        n *= 2
        bigger = replace(cluster, n_gpus=n, gpus_per_node=min(cluster.gpus_per_node, n))
        fitting = [c for c in (replace(fs, offload=False), fs) if evaluate(model, bigger, training, c, profile).fits]
        if fitting:
            out.append(f"{n} GPUs with {describe(fitting[0])}")
            break
    if not config.offload and config.sharding is not Sharding.NO_SHARD:
        if evaluate(model, cluster, training, replace(config, offload=True), profile).fits:
            out.append("CPU offload (--offload): params, grads and optimizer state in CPU RAM; slower steps")
    full = replace(config, ac_every=1, selective_op_ac=False)
    if config.ac_every != 1 and evaluate(model, cluster, training, full, profile).fits:
        out.append("full activation checkpointing (--activation-checkpointing full)")
    if training.finetune is not Finetune.LORA:
        lora = replace(training, finetune=Finetune.LORA)
        if evaluate(model, cluster, lora, config, profile).fits:
            out.append(f"LoRA fine-tuning (--finetune lora --lora-rank {training.lora_rank}): frozen weights "
                       "need no gradients, no optimizer state, and none of the activations kept for weight gradients")
    seq = training.seq_len
    while seq > 128:
        seq //= 2
        if evaluate(model, cluster, replace(training, seq_len=seq), config, profile).fits:
            out.append(f"sequences of {seq} tokens (--seq-len {seq})")
            break
    return out
