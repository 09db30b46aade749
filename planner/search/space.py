"""The candidate space the search walks: its knobs (SearchSpace, the micro-batches and checkpointing choices) and
the meshes - (tp, cp, ep) and the pipelines over each - the model and the cluster allow."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models import moe_lora
from cost_models.mesh_rules import cp_degrees, ep_degrees, tp_degrees
from cost_models.schedules import Schedule
from cost_models.specs import SELECTIVE_OP, Attention, ClusterSpec, ModelSpec, Precision, Sharding, TrainingSpec

from planner.search.pipeline import NO_PIPELINE, Pipeline, pipelines, pp_degrees

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
AC_CHOICES = (0, 4, 2, 1, SELECTIVE_OP)  # none, every 4th, every 2nd, every block, torchtitan's op-level policy
FLOAT8_PRECISIONS = (Precision.BF16, Precision.BF16_PURE)  # torchao's Float8 linears as torchtitan runs them
FP8_ALL_GATHER_SHARDINGS = (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)  # gather every step in forward and backward
MIN_CP_TOKENS = 4096  # tokens per CP rank the search goes down to (Llama 3's 131k runs: CP 16, 8k per rank)


@dataclass(frozen=True)
class SearchSpace:
    shardings: tuple[Sharding, ...] = tuple(Sharding)
    precisions: tuple[Precision, ...] | None = None  # None: bf16, or fp16 where the GPU has no bf16
    offload: tuple[bool, ...] = (False, True)
    ac_every: tuple[int | str, ...] = AC_CHOICES
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    backward_prefetch: tuple[bool, ...] = (True, False)
    limit_all_gathers: tuple[bool, ...] = (True, False)
    attention: Attention = Attention.SDPA
    expert_shard_dims: tuple[int, ...] = (0, 1)  # MoE: 1 only where it removes padding (moe.dim1_shardable)
    expert_units: tuple[bool, ...] = (False, True)  # MoE: experts as their own unit where blocks are re-gathered
    # gradient reduction dtypes (None: each precision's own); a numerics choice like the precision: only the
    # user's (`--reduce-dtype`), not searched by default
    reduce_dtypes: tuple[str | None, ...] = (None,)
    # torch.compile per block; None: (False, True) on GPUs, (False,) on calibrate's CPU "device" (id "cpu"),
    # where inductor takes ~15 s per run and its CPU kernels say nothing about a GPU's
    compile: tuple[bool, ...] | None = None
    compile_loss: bool = True  # with compile, the loss compiled too (the trainer's compile scope: planner/trainers)
    # the kernels priced, each a set of FsdpConfig (field, value) pairs (planner/trainers.kernel_sets); (): the
    # model's own ops
    kernel_sets: tuple[tuple[tuple[str, str], ...], ...] = ((),)
    # pairs of mesh axes the trainer cannot combine above 1 (planner/trainers: the FSDP2 snippet writes neither CP nor
    # EP inside pipeline stages, nor EP beside TP)
    mesh_exclusions: tuple[tuple[str, str], ...] = ()
    trainer_precisions: tuple[Precision, ...] = tuple(Precision)  # what the trainer runs (planner/trainers)
    host_ways: object = None  # how the trainer loads and saves (cost_models/host_ram.Ways); None: rank 0, DCP

    def excludes(self, **degrees: int) -> bool:
        return any(degrees.get(a, 1) > 1 and degrees.get(b, 1) > 1 for a, b in self.mesh_exclusions)
    float8: tuple[bool, ...] = (False, True)  # only where the GPU has FP8 tensor cores and compute is bf16
    fp8_all_gather: tuple[bool, ...] = (True,)  # with float8 under FP8_ALL_GATHER_SHARDINGS (elsewhere: False)
    reshard_to_node: tuple[bool, ...] = (False, True)  # FULL_SHARD over several nodes: reshard_after_forward = node
    # HYBRID's shard group in GPUs (FsdpConfig.shard_group_gpus): None searches a node and every multiple of nodes
    # that divides a pipeline stage's GPUs (below all of them: that is FULL_SHARD); (0,): a node only; (N,) pins N
    shard_group_gpus: tuple[int, ...] | None = None
    # the mesh: None searches the degrees the model and cluster allow; an int pins one
    tp: int | None = None
    cp: int | None = None
    ep: int | None = None
    async_tp: tuple[bool, ...] = (False, True)   # with tp, compile and sequence parallel
    sequence_parallel: bool = True               # False: transformers' tp_plan (the user's --no-sequence-parallel)
    # pipelines (planner/search/pipeline.py): pp None walks the degrees, 1 leaves PP out, N pins it; a pinned
    # schedule / stages per rank narrows the schedules tried
    pp: int | None = None
    pp_schedule: Schedule | None = None
    pp_stages_per_rank: int | None = None

    def compile_for(self, cluster: ClusterSpec) -> tuple[bool, ...]:
        if self.compile is not None:
            return self.compile
        return (False,) if cluster.gpu.id == "cpu" else (False, True)

    def precisions_for(self, cluster: ClusterSpec) -> tuple[Precision, ...]:
        """The precisions asked for, else bf16 (fp16 where the GPU has no bf16), within what the trainer runs (fp32
        where it runs neither)."""
        if self.precisions is not None:
            return self.precisions
        chosen = (Precision.BF16,) if cluster.gpu.supports("bf16") else (Precision.FP16,)
        return tuple(p for p in chosen if p in self.trainer_precisions) or (Precision.FP32,)

    def shardings_for(self, cluster: ClusterSpec) -> tuple[Sharding, ...]:
        """HYBRID on one node is FULL_SHARD under another name (unless a smaller shard group is pinned); NO_SHARD-like
        choices need >1 GPU to differ."""
        out, pinned = [], any(self.shard_group_gpus or ())  # a pinned group: HYBRID inside one node too
        for s in self.shardings:
            if s.is_hybrid and not pinned and (cluster.n_nodes == 1 or cluster.n_gpus % cluster.gpus_per_node):
                continue
            out.append(s)
        return tuple(out)

    def shard_groups_for(self, cluster: ClusterSpec, model_parallel: int, pp: int) -> tuple[int, ...]:
        """HYBRID's shard groups (shard_group_gpus) on a mesh of model_parallel = tp x cp x pp: 0 (a node), then 2,
        3, ... nodes where they divide the GPUs, hold whole tp x cp groups and leave two replicas or more (without a
        pipeline; a pinned group is tried on pipelines too)."""
        if self.shard_group_gpus is not None:  # pinned: a node's GPUs are the default's 0
            return tuple(0 if g == cluster.gpus_per_node else g for g in self.shard_group_gpus)
        if pp > 1:  # a pipeline candidate prices every rank's schedule (5-60 ms): the node's group only
            return (0,)
        node, stage, inner = cluster.gpus_per_node, cluster.n_gpus // pp, model_parallel // pp
        return (0,) + tuple(k * node for k in range(2, stage // node // 2 + 1)
                            if stage % (k * node) == 0 and (k * node) % inner == 0)


def training_space(space: SearchSpace, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> SearchSpace:
    """The space without what the training runs on no mesh: QLoRA's 4-bit linears take no Float8, and FSDP needs them
    stored in the compute dtype (cost_models/qlora.refusals): the precisions that compute in it; all-linear LoRA on an
    MoE no selective op-level checkpointing (peft's MoE ParamWrappers under SAC raise), nor the experts as units of
    their own (cost_models/moe_lora.refusals)."""
    if training.quantized:
        storage = training.quant_storage
        matching = tuple(p for p in space.precisions_for(cluster) if p.compute_dtype == storage) or tuple(
            p for p in (Precision.BF16, Precision.FP16, Precision.FP32) if p.compute_dtype == storage)
        space = replace(space, float8=(False,), fp8_all_gather=(False,), precisions=matching or None)
    if moe_lora.selective_op_refused(model, training):
        space = replace(space, ac_every=tuple(a for a in space.ac_every if a != SELECTIVE_OP), expert_units=(False,))
    return space


@dataclass(frozen=True)
class MeshChoice:
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pipeline: Pipeline = NO_PIPELINE

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.pipeline.pp


def mesh_choices(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                 space: SearchSpace) -> list[MeshChoice]:
    """The (tp, cp, ep) the search tries without a pipeline, data parallelism alone first (pp pinned: with it).
    ep is checked against each strategy's dp_shard in the search (mesh_refusals, once per mesh and strategy);
    the pipelines over each are pipeline_meshes'."""
    n = cluster.n_gpus
    tps = [space.tp] if space.tp else [t for t in tp_degrees(model) if n % t == 0 and t <= cluster.fast_tier_gpus]
    cps = [space.cp] if space.cp else [c for c in cp_degrees(training.seq_len, n)
                                      if c == 1 or training.seq_len // c >= MIN_CP_TOKENS]
    eps = [space.ep] if space.ep else [e for e in ep_degrees(model, n) if e == 1 or e & (e - 1) == 0]
    # EP beside TP is priced (estimate --tp --ep) but not applied by the trace tier nor written as FSDP2 code, and
    # its memory is unchecked against a trace: searched only when the user pins both
    both = space.tp is not None and space.ep is not None
    out = [MeshChoice(t, c, e) for t in tps for c in cps for e in eps
           if n % (t * c) == 0 and (both or t == 1 or e == 1) and not space.excludes(tp=t, cp=c, ep=e)]
    out = sorted(out, key=lambda m: (m.tp * m.cp * m.ep, m.tp, m.cp))
    if space.pp is not None and space.pp > 1:  # pinned: every mesh with that pipeline, and no mesh without it
        return [replace(m, pipeline=p) for m in out for p in pipeline_meshes(model, cluster, space, m)]
    return out


def pipeline_meshes(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, mesh: MeshChoice) -> list[Pipeline]:
    """The pipelines over `mesh`'s tp x cp (x ep) the search may walk, by degree then schedule (PP_SCHEDULES'
    order); none when the space leaves PP out."""
    if space.pp == 1 or space.excludes(tp=mesh.tp, cp=mesh.cp, ep=mesh.ep, pp=2):
        return []
    free = cluster.n_gpus // (mesh.tp * mesh.cp)
    return [p for pp in pp_degrees(model, free, space.pp)
            for p in pipelines(model, pp, space.pp_schedule, space.pp_stages_per_rank)]
