"""plan() and estimate(): the Python API the CLI forwards to.

Arguments map one to one to the CLI flags. torch is imported only by the methods that return torch
objects (Candidate.fsdp_kwargs, Candidate.apply_fully_shard).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

from cost_models import fsdp_options
from cost_models.evaluate import Evaluation, evaluate
from cost_models.kernels import kernel_refusal
from cost_models.mesh_rules import mesh_refusals
from cost_models.pipeline_allocations import replayed_reserved
from cost_models.step_allocations import step_replayed_reserved
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.schedules import Schedule
from cost_models.specs import (Attention, ClusterSpec, Finetune, FsdpConfig, ModelSpec, Precision, Sharding,
                               REDUCE_DTYPES, SpecError, TrainingSpec, parse_enum)

from . import pinned
from .admission import cluster_rejects, grad_accum_for
from .errors import PlannerError
from .request import Request, api_signature, build_request, knob_names
from .search import SearchSpace, search, suggestions
from .request.resolve import (RESOLVE_KNOBS, fused_attention_kernel, model_attention, resolve_inputs,
                              resolve_request)
from .trainers import DEFAULT_TRAINER, kernel_sets, narrow_space, refusal, trainer_named, with_trainer_defaults
from planner.search.pipeline import PP_MICROBATCHES_PER_STAGE
from planner.trainers.table import LIGER_KNOBS


@dataclass
class Candidate:
    """One costed configuration, with its FSDP arguments."""

    evaluation: Evaluation
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    trainer: str = DEFAULT_TRAINER  # planner.trainers: the trainer that runs it (its artifact is the plan's)

    @property
    def config(self) -> FsdpConfig:
        return self.evaluation.config

    @property
    def fits(self) -> bool:
        return self.evaluation.fits

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.evaluation.reasons

    @property
    def memory(self):
        return self.evaluation.memory

    @property
    def time(self):
        return self.evaluation.time

    def fsdp1_options(self) -> dict:
        return fsdp_options.fsdp1_options(self.config, self.model.block_class, self.cluster.gpus_per_node,
                                          lora=self.training.finetune.adapters)

    def fully_shard_options(self) -> dict:
        opts = fsdp_options.fully_shard_options(self.config)
        opts["mesh"] = fsdp_options.mesh_layout(self.config, self.cluster.n_gpus, self.cluster.gpus_per_node)
        if "shard_placement_fn" in opts:  # with this plan's shard group in place of d
            d = self.config.shard_group_size(self.cluster)
            opts["shard_placement_fn"] = "lambda p: " + opts["shard_placement_fn"].replace("% d", f"% {d}")
        if self.config.reshard_after_forward:  # the blocks' int group; the root keeps the strategy's bool
            opts["root_reshard_after_forward"] = opts["reshard_after_forward"]
            opts["reshard_after_forward"] = self.config.reshard_after_forward
        return opts

    def fsdp_kwargs(self, module=None, *, device_id=None) -> dict:
        """Keyword arguments for FullyShardedDataParallel(module, **kwargs): real torch objects.

        The wrap policy uses the block class detected in `module` when given, else the class named by the
        model spec (looked up among the module's submodules). Also sets a Hugging Face module's attention to the
        one priced and turns its KV cache off for training (calibration.apply's set_attention, disable_kv_cache).
        """
        from calibration.apply import disable_kv_cache, fsdp1_kwargs

        classes = _block_classes(self.model, module)
        self._prepare_hf(module)
        disable_kv_cache(module)
        return fsdp1_kwargs(self.config, classes,
                            gpus_per_node=self.cluster.gpus_per_node, device_id=device_id,
                            trainable_mixed=self.training.finetune.adapters)

    def apply_fully_shard(self, module, mesh=None):
        """Apply FSDP2 to `module` unit by unit (blocks, then root) as the emitted code does, on the attention
        priced."""
        from calibration.apply import apply_fsdp2, make_mesh

        self._prepare_hf(module)
        if mesh is None:
            import torch

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            mesh = make_mesh(self.config, self.cluster.n_gpus, self.cluster.gpus_per_node, device_type)
        return apply_fsdp2(module, self.config, _block_classes(self.model, module), mesh)

    def _prepare_hf(self, module) -> None:
        from calibration.apply import set_attention
        from planner.emit.attention import hf_name

        if module is not None:
            set_attention(module, hf_name(self.config))

    def to_dict(self) -> dict:
        from planner.reports.table_pipeline import pipeline_dict, rank_memory_dicts

        m = self.memory
        piped = self.config.pp > 1
        return {
            "trainer": self.trainer,
            "training": self.training.to_dict(),
            "config": self.config.to_dict(),
            **({"pipeline": pipeline_dict(self.model, self.config, self.cluster)} if piped else {}),
            "fits": self.fits,
            "reasons": list(self.reasons),
            "memory": {
                "peak_allocated_bytes": m.peak_allocated_bytes,
                "peak_reserved_bytes": m.peak_reserved_bytes,
                "outside_allocator_bytes": m.outside_allocator_bytes,
                "peak_phase": m.peak_phase,
                "peak_moment": m.peak_moment,
                "breakdown": m.breakdown.to_dict(),
                "cpu_bytes_per_node": m.cpu_bytes_per_node,
                "notes": list(m.notes), **({"host_ram": m.host_ram.to_dict()} if m.host_ram is not None else {}),
                "first_step": m.first_step_dict(),
                **({"pipeline_ranks": rank_memory_dicts(m)} if piped else {}),
            },
            "time": {
                "step_s": self.time.step_s,
                "tokens_per_s_per_gpu": self.time.tokens_per_s_per_gpu,
                "mfu": self.time.mfu,
                "breakdown": {k: v for k, v in self.time.to_dict().items()
                              if k not in ("step_s", "tokens_per_s_per_gpu", "mfu", "hfu")},
                "hfu": self.time.hfu,
            },
            "fsdp_kwargs": self.fsdp1_options(),
            "fully_shard_kwargs": self.fully_shard_options(),
        }


def _block_classes(spec: ModelSpec, module) -> set:
    if module is None:
        raise PlannerError("module", "fsdp_kwargs needs the nn.Module to find its block class in")
    from .models import block_classes_of

    classes = {type(m) for m in module.modules() if type(m).__name__ == spec.block_class}
    return classes or block_classes_of(module)


@dataclass
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    candidates: list[Candidate]                          # fitting, best first
    misses: list[Candidate] = field(default_factory=list)  # nearest misses first
    suggestions: list[str] = field(default_factory=list)   # what would make the nearest miss fit
    n_costed: int = 0
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)          # about the space searched (data parallelism's limit)
    trainer: str = DEFAULT_TRAINER                            # the trainer searched for (planner.trainers)
    profile: Profile = DEFAULT_PROFILE                        # what it was priced with
    replayed: int = 0                                         # the first candidates with estimate()'s reserved

    @property
    def best(self) -> Candidate | None:
        """The pick, with the reserved memory estimate() and check report for its config (replay_top(1): its allocator
        replay, run once, on first use), so that plan == estimate == check for it."""
        if not self.candidates:
            return None
        self.replay_top(1)
        return self.candidates[0]

    def replay_top(self, top: int) -> None:
        """Give the first `top` candidates the reserved memory estimate() reports for their configs (a pipeline's
        allocator replay under its alloc_conf), as the CLI does for the rows it prints; ranking and fits stay the
        search's."""
        for i in range(self.replayed, min(top, len(self.candidates))):
            c = self.candidates[i]
            self.candidates[i] = replace(c, evaluation=replayed(c.evaluation, c.model, c.cluster, c.training,
                                                                self.profile, trainer_named(self.trainer).host_ways()))
        self.replayed = max(self.replayed, min(top, len(self.candidates)))

    def to_dict(self, top: int | None = None) -> dict:
        shown = self.candidates[:top] if top else self.candidates
        return {
            "model": self.model.summary_dict(),
            "cluster": {"gpu": self.cluster.gpu.id, "gpus": self.cluster.n_gpus,
                        "gpus_per_node": self.cluster.gpus_per_node,
                        **({"power_limit_w": gpu.power_limit_w, "tdp_w": gpu.tdp_w}
                           if (gpu := self.cluster.gpu).power_limit_w else {})},
            "candidates": [c.to_dict() for c in shown] or [c.to_dict() for c in self.misses[:top or 5]],
            "suggestions": self.suggestions,
            "n_costed": self.n_costed,
            **({"notes": self.notes} if self.notes else {}),
        }


PLAN_KNOBS = tuple(n for n in knob_names("", "cluster", "training", "config.mesh", "search") if n != "model")
PLAN_KNOBS = (PLAN_KNOBS[:PLAN_KNOBS.index("tp")] + ("attention", "attention_kernel", "liger", *LIGER_KNOBS)
              + PLAN_KNOBS[PLAN_KNOBS.index("tp"):])
ESTIMATE_KNOBS = tuple(n for n in knob_names("", "cluster", "training", "config", "config.mesh") if n != "model")
PLAN_GROUPS, ESTIMATE_GROUPS = ("cluster", "training", "mesh", "search"), ("cluster", "training", "config", "mesh")


def plan(model, gpus: int | None = None, *, profile: Profile | None = None, space: SearchSpace | None = None,
         **knobs) -> Plan:
    """Search every candidate configuration and rank those that fit by throughput. Keywords: the knobs of
    planner.request's ClusterRequest, TrainingRequest, SearchRequest and MeshRequest by name, attention, or
    those groups whole (cluster=, training=, search=, mesh=). attention None: the model's first choice (sdpa,
    or eager for families that refuse it); reduce_dtypes: gradient reduction dtypes to search (None: each
    precision's own); tp / cp / ep / pp pin a mesh degree (None: searched; pp 1 leaves pipelines out),
    pp_schedule / pp_stages_per_rank pin the pipeline's schedule (None: 1F1B and interleaved 1F1B with 2 stages
    per rank; the microbatch count follows from the global batch); async_tp True / False pins TP's overlap
    (None: searched where compile and TP run); sequence_parallel False plans TP as transformers' tp_plan runs
    it; routing_imbalance: MoE under EP, the busiest rank's routed rows over the mean (1: balanced)."""
    return plan_request(build_request(model, gpus, valid=PLAN_KNOBS, valid_groups=PLAN_GROUPS, **knobs), profile,
                        space)


def plan_request(request: Request, profile: Profile | None = None, space: SearchSpace | None = None) -> Plan:
    """plan() for a built Request: the search bounded by the request's trainer (planner/trainers; a space given
    whole is narrowed only when the trainer is named) and priced with its defaults."""
    trainer = trainer_named(request.trainer)
    kernels_pinned = request.config.liger is not None or any(getattr(request.config, k, None) is not None
                                                             for k in LIGER_KNOBS)
    pinned_attention_kernel = request.config.attention_kernel
    request = with_trainer_defaults(request, trainer)
    mesh, search_request = request.mesh, request.search
    attention = space.attention.value if space else request.config.attention
    spec, cluster, training = resolve_request(request, attention)
    request = fused_attention_kernel(request, pinned_attention_kernel, model_attention(spec, attention), cluster.gpu)
    if pinned_attention_kernel is not None:
        pinned.check_attention_kernel(trainer, request.config.attention_kernel, cluster)
    if space is None:
        precisions, reduce_dtypes = search_request.precisions, search_request.reduce_dtypes
        space = SearchSpace(
            precisions=tuple(parse_enum(Precision, p, "precision") for p in precisions) if precisions else None,
            attention=parse_enum(Attention, model_attention(spec, attention), "attention"),
            reduce_dtypes=tuple(_reduce_dtype(r) for r in reduce_dtypes) if reduce_dtypes else (None,),
            tp=mesh.tp, cp=mesh.cp, ep=mesh.ep, async_tp=(False, True) if mesh.async_tp is None else (mesh.async_tp,),
            sequence_parallel=mesh.sequence_parallel, pp=mesh.pp, shard_group_gpus=mesh.shard_group_gpus and (
                mesh.shard_group_gpus,),
            pp_schedule=parse_enum(Schedule, mesh.pp_schedule, "pp_schedule") if mesh.pp_schedule is not None
            else None, pp_stages_per_rank=mesh.pp_stages_per_rank,
            kernel_sets=kernel_sets(request, trainer, kernels_pinned, spec.family))
        space = narrow_space(space, trainer, training, spec)
        pinned.check_mesh(spec, cluster, training, space)
    elif request.trainer is not None:
        space = narrow_space(space, trainer, training, spec)
    return plan_for(spec, cluster, training, request.profile(profile), space, trainer.id, request.alloc_conf or "")


def _reduce_dtype(name: str) -> str:
    if name not in REDUCE_DTYPES:
        raise PlannerError("reduce_dtype", f"{name!r}; choose one of: {', '.join(REDUCE_DTYPES)}")
    return name


def plan_for(spec: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, profile: Profile | None = None,
             space: SearchSpace | None = None, trainer: str = DEFAULT_TRAINER, alloc_conf: str = "") -> Plan:
    """Search and rank for resolved specs (`space` bounded by `trainer`) under PYTORCH_CUDA_ALLOC_CONF alloc_conf.
    Reserved is the search's flat figure (it ranks, decides fits); Plan.replay_top gives shown rows estimate()'s
    (a pipeline's replay: ~0.25 s a gpt-13b pp 2 candidate, ~2.4 s a 405B pp 8 one: not every candidate)."""
    profile = profile or DEFAULT_PROFILE
    result = search(spec, cluster, training, profile, space or SearchSpace())
    conf = (lambda e: replace(e, config=replace(e.config, alloc_conf=alloc_conf))) if alloc_conf else (lambda e: e)
    wrap = lambda e: Candidate(conf(e), spec, cluster, training, trainer)  # noqa: E731
    tips = suggestions(spec, cluster, training, profile, result.misses[0]) if not result.fitting and result.misses else []
    return Plan(model=spec, cluster=cluster, training=training, candidates=[wrap(e) for e in result.fitting],
                misses=[wrap(e) for e in result.misses], suggestions=tips, n_costed=result.n_costed,
                skipped=result.skipped, notes=result.notes, trainer=trainer, profile=profile)


def estimate(model, gpus: int | None = None, *, profile: Profile | None = None, **knobs) -> Candidate:
    """Cost one explicit configuration. Keywords: the knobs of planner.request's ClusterRequest,
    TrainingRequest, ConfigRequest and MeshRequest by name, or those groups whole (cluster=, training=,
    config=, mesh=). attention None: the model's first choice; expert_shard_dim=1: FSDP2 shards stacked MoE
    expert matrices on dim 1, unpadded; expert_units: MoE experts as their own units; reduce_dtype fp32 | bf16:
    the gradient reduction's dtype, None: the precision's; activation_checkpointing "selective-op": torchtitan's
    op-level policy in every block; compile: torch.compile per block; float8: torchao Float8 linears,
    fp8_all_gather: FSDP2 gathers them in FP8; reshard_after_forward N: FSDP2 keeps block params sharded over N
    ranks after forward, 0: the strategy's own, as is N equal to the shard group, which FSDP2 reads as True;
    tp / cp / ep / pp: the device mesh's tensor, context, expert and pipeline degrees beside FSDP over the rest
    (cost_models/mesh.py; None: 1); with pp > 1, pp_schedule (gpipe, 1f1b - the default -, interleaved-1f1b,
    zero-bubble, dualpipev) and pp_stages_per_rank (looped schedules; None: 2), and micro_batch is the pipeline
    microbatch: the local batch (global batch / data-parallel ranks) is split into grad_accum microbatches run in
    one schedule step (cost_models/pipeline.py; without a global batch or grad_accum, two per stage, as the
    search takes them); async_tp: TP's collectives overlapped (needs compile; None: off), sequence_parallel
    False: TP as transformers' tp_plan runs it. What cannot run on the cluster, or a mesh the model does not
    allow, raises PlannerError (cost_models.feasibility, cost_models.mesh_rules)."""
    return estimate_request(build_request(model, gpus, valid=ESTIMATE_KNOBS, valid_groups=ESTIMATE_GROUPS, **knobs),
                            profile)


def estimate_request(request: Request, profile: Profile | None = None) -> Candidate:
    """estimate() for a built Request, priced with its trainer's defaults; a configuration the trainer cannot run
    is one PlannerError line (planner/trainers)."""
    trainer = trainer_named(request.trainer)
    pinned_attention_kernel = request.config.attention_kernel
    request = with_trainer_defaults(request, trainer)
    spec, cluster, training = resolve_request(request, request.config.attention)
    attention = model_attention(spec, request.config.attention)
    request = fused_attention_kernel(request, pinned_attention_kernel, attention, cluster.gpu)
    c, mesh = request.config, request.mesh
    tp, cp, ep, pp = (mesh.degrees(default=1)[n] for n in ("tp", "cp", "ep", "pp"))
    if pp == 1 and (mesh.pp_schedule is not None or mesh.pp_stages_per_rank is not None):
        given = "pp_schedule" if mesh.pp_schedule is not None else "pp_stages_per_rank"
        raise PlannerError(given, "needs pipeline parallelism: give pp >= 2 (--pp N) with it, or leave it out")
    grad_accum = c.grad_accum
    if grad_accum is None and pp > 1 and training.global_batch is None:  # the search's choice without a global batch
        schedule = parse_enum(Schedule, mesh.pp_schedule or Schedule.ONE_F_ONE_B, "pp_schedule")
        grad_accum = PP_MICROBATCHES_PER_STAGE * pp * (mesh.pp_stages_per_rank or schedule.default_stages_per_rank)
    if grad_accum is None:
        grad_accum = grad_accum_for(c.micro_batch, cluster, training, tp * cp * pp)
    config = FsdpConfig(sharding=c.sharding, precision=c.precision, offload=c.offload,
                        ac_every=c.activation_checkpointing, micro_batch=c.micro_batch, grad_accum=grad_accum,
                        attention=attention, attention_kernel=c.attention_kernel, backward_prefetch=c.backward_prefetch,
                        forward_prefetch=c.forward_prefetch, limit_all_gathers=c.limit_all_gathers,
                        expert_shard_dim=c.expert_shard_dim, expert_units=c.expert_units, reduce_dtype=c.reduce_dtype,
                        moe_dispatch=c.moe_dispatch or "all-to-all",
                        compile=c.compile, **c.kernels(), float8=c.float8, fp8_all_gather=c.fp8_all_gather,
                        reshard_after_forward=c.reshard_after_forward, tp=tp, cp=cp, ep=ep, pp=pp,
                        async_tp=bool(mesh.async_tp), sequence_parallel=mesh.sequence_parallel,
                        pp_schedule=mesh.pp_schedule or Schedule.ONE_F_ONE_B,
                        pp_stages_per_rank=mesh.pp_stages_per_rank or 0, alloc_conf=request.alloc_conf or "",
                        shard_group_gpus=0 if mesh.shard_group_gpus in (None, cluster.gpus_per_node)
                        else mesh.shard_group_gpus)
    if c.expert_units and spec.moe is None:
        raise PlannerError("expert_units", f"{spec.name} has no routed experts (a dense model): drop --expert-units")
    if (kernel_refused := kernel_refusal(spec, config)) is not None:  # a kernel for an op the model lacks
        raise PlannerError(*kernel_refused)
    refused = refusal(trainer, config, training, spec.family, spec)
    if refused is not None:
        raise refused
    return replace(estimate_config(spec, cluster, training, config, request.profile(profile), trainer.host_ways()),
                   trainer=trainer.id)


def estimate_config(spec: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig,
                    profile: Profile | None = None, ways=None) -> Candidate:
    """Cost an FsdpConfig (PlannerError where it cannot run on the cluster or the model's mesh); ways: host_ram.Ways."""
    raise_refused(spec, cluster, training, config)
    profile = profile or DEFAULT_PROFILE
    evaluation = evaluate(spec, cluster, training, config, profile, None, ways)
    return Candidate(replayed(evaluation, spec, cluster, training, profile, ways), spec, cluster, training)


def raise_refused(spec: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig) -> None:
    """A PlannerError where the configuration cannot run on the model's mesh or the cluster."""
    refused = mesh_refusals(spec, cluster, training, config)
    if refused:
        raise PlannerError(refused[0].field, f"{refused[0].reason}; {refused[0].fix}")
    error = cluster_rejects(cluster, config)
    if error is not None:
        raise error


def replayed(evaluation: Evaluation, spec: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
             profile: Profile, ways=None) -> Evaluation:
    """A reported estimate's reserved from a replay of its allocations under its alloc_conf (not in the search: slow):
    each pipeline rank's (cost_models/pipeline_allocations.py), a plain step's (cost_models/step_allocations.py;
    the configurations it leaves on the flat rule as they are, LoRA under FSDP1's adapter units (ways) among
    them)."""
    if evaluation.config.pp > 1:
        memory = replayed_reserved(evaluation.memory, spec, cluster, training, evaluation.config, profile)
    else:
        memory = step_replayed_reserved(evaluation.memory, spec, cluster, training, evaluation.config, profile,
                                        adapter_units=bool(ways is not None and ways.fsdp1_adapter_units))
    return replace(evaluation, memory=memory)


def _signatures() -> None:
    """help(plan) / help(estimate) list every knob with its type and default (planner.request)."""
    P = inspect.Parameter
    head = [P("model", P.POSITIONAL_OR_KEYWORD),
            P("gpus", P.POSITIONAL_OR_KEYWORD, default=None, annotation=int | None)]
    profile = P("profile", P.KEYWORD_ONLY, default=None, annotation=Profile | None)
    space = P("space", P.KEYWORD_ONLY, default=None, annotation=SearchSpace | None)
    plan.__signature__ = api_signature(head, PLAN_KNOBS, [profile, space], PLAN_GROUPS).replace(return_annotation=Plan)
    estimate.__signature__ = api_signature(head, ESTIMATE_KNOBS, [profile], ESTIMATE_GROUPS).replace(
        return_annotation=Candidate)


_signatures()

__all__ = ["plan", "estimate", "Plan", "Candidate", "Sharding", "SpecError"]
