"""The planner's vocabulary: frozen dataclasses validated on construction.

ModelSpec (what is trained), GpuSpec and ClusterSpec (where), TrainingSpec (how much data, which
optimizer, full or LoRA fine-tuning) and FsdpConfig (the FSDP knobs a candidate sets). Bad values raise
SpecError naming the field and the valid choices; the CLI turns that into one line and exit code 2.

FsdpConfig lives here; the rest live in spec_values.py (SpecError, the enums, the field checks), training_spec.py
(TrainingSpec), model_spec.py (ModelSpec and its parts) and cluster_spec.py (GpuSpec, HostCpu, ClusterSpec), and are
re-exported below so that `from cost_models.specs import X` keeps working for the ~120 modules and tests that import
them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .caching_allocator import AllocatorSettings
from .cluster_spec import ClusterSpec, GpuSpec, HostCpu
from .model_spec import ActivationProfile, ActivationTerms, BackwardMoment, ModelSpec, MoeSpec, TracedOperators
from .quick_init import quick_init
from .schedules import Schedule
from .spec_values import QUANT_STORAGE_DTYPES, LoraTargets, MoeDispatch, QuantType, Routing
from .spec_values import OptimizerImpl
from .spec_values import (SELECTIVE_OP, Attention, AttentionKernel, Finetune, Kernel, LossKernel, Optimizer,
                          Precision, Sharding,
                          SpecError, check_degree, check_positive, enum_choices, format_activation_checkpointing,
                          parse_activation_checkpointing, parse_enum)
from .training_spec import TrainingSpec

__all__ = [  # this module's own names and the re-exported ones (see the docstring)
    "TrainingSpec", "FsdpConfig", "REDUCE_DTYPES",
    "ClusterSpec", "GpuSpec", "HostCpu", "OptimizerImpl",
    "MoeDispatch", "Routing", "QuantType", "QUANT_STORAGE_DTYPES", "LoraTargets",
    "ActivationProfile", "ActivationTerms", "BackwardMoment", "ModelSpec", "MoeSpec", "TracedOperators",
    "SELECTIVE_OP", "Attention", "AttentionKernel", "Finetune", "Kernel", "LossKernel", "Optimizer", "Precision",
    "Sharding", "SpecError",
    "check_degree", "check_positive", "enum_choices", "format_activation_checkpointing", "parse_activation_checkpointing",
    "parse_enum",
]


REDUCE_DTYPES = ("fp32", "bf16")
# FsdpConfig fields of FSDP's own: what a candidate's blocks compute and save (step_time._compute_parts, memory_shape)
# never reads them; they price the collectives, the model states and the optimizer step around the blocks
FSDP_ONLY_FIELDS = frozenset({"sharding", "offload", "backward_prefetch", "forward_prefetch", "limit_all_gathers",
                              "reshard_after_forward", "shard_group_gpus", "grad_accum", "reduce_dtype"})


# What FsdpConfig.__post_init__ parses, in its order, and the members it compares with (looked up once)
_PARSED_FIRST = (("sharding", Sharding), ("precision", Precision), ("attention", Attention),
                 ("attention_kernel", AttentionKernel))
_PARSED_KERNELS = (("norm_kernel", Kernel), ("rope_kernel", Kernel), ("swiglu_kernel", Kernel),
                   ("loss_kernel", LossKernel), ("moe_dispatch", MoeDispatch))
_SDPA, _FLASH2, _NO_SHARD = Attention.SDPA, AttentionKernel.FLASH2, Sharding.NO_SHARD
_ALL_TO_ALL, _ONE_F_ONE_B = MoeDispatch.ALL_TO_ALL, Schedule.ONE_F_ONE_B
_RESHARDING_INT = frozenset({Sharding.FULL_SHARD, Sharding.HYBRID_SHARD})  # an int reshard_after_forward's
_HYBRIDS = frozenset(s for s in Sharding if s.is_hybrid)


@quick_init
@dataclass(frozen=True)
class FsdpConfig:
    """One candidate: the knobs FSDP exposes, plus micro-batch and accumulation.

    Wrapping is one unit per repeated block plus the root (torchtitan's layout), which is what every
    emitted config does; with expert_units an MoE model's routed experts (the module holding a sparse
    block's stacked expert tensors) are a unit of their own inside their block's.
    """

    sharding: Sharding = Sharding.FULL_SHARD
    precision: Precision = Precision.BF16
    offload: bool = False
    ac_every: int = 0                 # 0 none, 1 every block, K every K-th block
    micro_batch: int = 1
    grad_accum: int = 1
    attention: Attention = Attention.SDPA
    # the fused attention's kernel (sdpa only; flex and eager run their own): FlashAttention-2, TE's cuDNN, FA3
    attention_kernel: AttentionKernel = AttentionKernel.FLASH2
    backward_prefetch: bool = True    # BackwardPrefetch.BACKWARD_PRE (FSDP2 always prefetches)
    forward_prefetch: bool = False
    limit_all_gathers: bool = True    # FSDP1 rate limiter: at most two all-gathers in flight
    expert_shard_dim: int = 0         # FSDP2: 0 shards every parameter on dim 0 (stacked experts padded to a multiple
    #                                   of the shard group); 1 shards the stacked expert matrices on dim 1 when the
    #                                   group does not divide the experts (shard_placement_fn), unpadded
    expert_units: bool = False        # MoE: each sparse block's routed experts wrapped as their own FSDP unit
    reduce_dtype: str | None = None   # gradient reduction dtype (fp32 | bf16); None: the precision's own
    # torchtitan's selective op-level checkpointing in every block (published.md): matmul, SDPA and max outputs
    # saved except every second matmul, everything else recomputed; ac_every is 0 with it. Construct with
    # ac_every="selective-op" (the CLI's --activation-checkpointing value) or selective_op_ac=True.
    selective_op_ac: bool = False
    compile: bool = False             # torch.compile of each block (torchtitan compiles per block)
    compile_loss: bool = True         # with compile, the loss too (torchtitan's compile.components default
    #                                   ["model", "loss"]): one fused cross-entropy kernel, no fp32 logits
    # The kernel of each op class (cost_models/kernels.py): the model's own ops (fused under compile), Liger
    # Kernel's or Transformer Engine's; the loss: the model's own, torchtitan's chunked or Liger's fused linear one.
    norm_kernel: Kernel = Kernel.EAGER
    rope_kernel: Kernel = Kernel.EAGER
    swiglu_kernel: Kernel = Kernel.EAGER
    loss_kernel: LossKernel = LossKernel.EAGER
    # MoE under EP: NCCL all-to-all of every routed row, or DeepEP's dispatch / combine (cost_models/expert_parallel.py)
    moe_dispatch: MoeDispatch = MoeDispatch.ALL_TO_ALL
    float8: bool = False              # torchao Float8 linears (dynamic tensorwise scaling) on FP8 tensor cores
    fp8_all_gather: bool = False      # with float8, FSDP2 all-gathers the Float8 linears' weights in FP8 (1 byte)
    reshard_after_forward: int = 0    # FSDP2 int: after forward keep params sharded over this many ranks (a
    #                                   divisor of the shard group, e.g. the node) and all-gather only among
    #                                   them in backward; 0: the strategy's own (FULL_SHARD: the whole group)
    # The device mesh beside FSDP (cost_models/mesh.py, torchtitan's layout): tensor, context, expert and pipeline
    # degrees; the data-parallel degrees follow from the strategy and the GPUs left (mesh.mesh_of).
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    # HYBRID strategies: GPUs of one shard group, the tp x cp ranks inside it (dp_shard x cp x tp of the mesh): a
    # divisor of a node or a multiple of nodes; 0: one node (torchtitan's data_parallel_shard_degree x cp x tp)
    shard_group_gpus: int = 0
    async_tp: bool = False            # torchtitan's async TP: TP collectives overlapped with the matmuls (compile)
    sequence_parallel: bool = True    # with tp: norms and residuals on s/tp tokens, loss parallel (torchtitan);
    #                                   False: transformers' tp_plan (accelerate, HF Trainer): activations
    #                                   replicated between blocks, the head colwise with its logits gathered
    # Pipeline stages (cost_models/pipeline.py): with pp > 1 the local batch (global batch / data-parallel ranks)
    # is split into grad_accum microbatches of micro_batch sequences, all run by one schedule step.
    pp_schedule: Schedule = Schedule.ONE_F_ONE_B
    pp_stages_per_rank: int = 0       # V stages on each pipeline rank; 0: the schedule's own (1, looped ones 2)
    # PYTORCH_CUDA_ALLOC_CONF the run sets ("": PyTorch's defaults); the pipeline replay follows it
    # (caching_allocator.AllocatorSettings), the launchers export it
    alloc_conf: str = ""

    def __post_init__(self):
        # A search builds ~5,000 of these (planner/search/): the fields set through the instance dict (what
        # object.__setattr__ does on a frozen dataclass, at a fraction of its cost), and a field already of its type
        # neither parsed nor set again; the checks and their order are the same.
        fields_ = self.__dict__
        if isinstance(self.ac_every, str) and self.ac_every.strip().lower() == SELECTIVE_OP:
            fields_["ac_every"] = 0
            fields_["selective_op_ac"] = True
        for name, enum_cls in _PARSED_FIRST:
            if fields_[name].__class__ is not enum_cls:
                fields_[name] = parse_enum(enum_cls, fields_[name], name)
        if fields_["attention"] is not _SDPA:  # flex / eager run their own kernel: one spelling, configs equal
            fields_["attention_kernel"] = _FLASH2
        if fields_["ac_every"].__class__ is not int or fields_["ac_every"] < 0:
            fields_["ac_every"] = parse_activation_checkpointing(self.ac_every)
        check_positive("micro_batch", self.micro_batch)
        check_positive("grad_accum", self.grad_accum)
        for name, enum_cls in _PARSED_KERNELS:
            if fields_[name].__class__ is not enum_cls:
                fields_[name] = parse_enum(enum_cls, fields_[name], name)
        if not self.compile:  # compile_loss means nothing without compile: one spelling, so configs compare equal
            fields_["compile_loss"] = True
        if self.expert_shard_dim not in (0, 1):
            raise SpecError("expert_shard_dim", f"{self.expert_shard_dim!r}; choose 0 (dim 0, padded) or 1")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise SpecError("reduce_dtype", f"{self.reduce_dtype!r}; choose one of: {', '.join(REDUCE_DTYPES)}")
        if self.selective_op_ac and self.ac_every:
            raise SpecError("activation_checkpointing", f"{SELECTIVE_OP} checkpoints every block by op; "
                            f"it cannot be combined with {format_activation_checkpointing(self.ac_every)}")
        if self.fp8_all_gather and not self.float8:
            raise SpecError("fp8_all_gather", "needs float8 (the FP8 all-gather moves Float8 linears' weights)")
        if self.fp8_all_gather and self.sharding is _NO_SHARD:
            raise SpecError("fp8_all_gather", "NO_SHARD all-gathers nothing; choose FULL_SHARD, SHARD_GRAD_OP or a "
                                              "HYBRID_SHARD strategy")
        if self.reshard_after_forward < 0 or self.reshard_after_forward == 1:
            raise SpecError("reshard_after_forward", f"{self.reshard_after_forward}; give a group of >= 2 ranks "
                            "(a divisor of the shard group), or 0 for the strategy's own")
        for name in ("tp", "cp", "ep", "pp"):
            degree = fields_[name]
            if degree.__class__ is not int or degree < 1:
                check_degree(name, degree)
        self._check_shard_group()
        if self.ep > 1:  # expert parallelism puts each rank's experts in a unit of their own (on the efsdp mesh)
            fields_["expert_units"] = True
        if self.ep == 1:  # nothing is dispatched without EP: one spelling, so configs compare equal
            fields_["moe_dispatch"] = _ALL_TO_ALL
        if self.tp == 1:  # sequence parallel means nothing without TP: one spelling, so configs compare equal
            fields_["sequence_parallel"] = True
        if self.async_tp and self.tp == 1:
            raise SpecError("async_tp", "needs tensor parallelism (tp >= 2)")
        if self.async_tp and not self.compile:
            raise SpecError("async_tp", "needs torch.compile (torchtitan's async TP runs on compiled blocks): add compile")
        if self.async_tp and not self.sequence_parallel:
            raise SpecError("async_tp", "overlaps the sequence-parallel all-gathers and reduce-scatters; it needs "
                                        "sequence_parallel")
        if fields_["pp_schedule"].__class__ is not Schedule:
            fields_["pp_schedule"] = parse_enum(Schedule, self.pp_schedule, "pp_schedule")
        self._check_pipeline()
        if self.alloc_conf:
            self.allocator_settings  # noqa: B018 - refuses a bad PYTORCH_CUDA_ALLOC_CONF on construction
        if self.cp > 1 and self.sharding is _NO_SHARD:
            raise SpecError("cp", "FSDP2 shards over dp_shard x cp even without data parallelism: with cp > 1 "
                                  "choose FULL_SHARD, SHARD_GRAD_OP or a HYBRID_SHARD strategy, not NO_SHARD")
        if self.reshard_after_forward and self.sharding not in _RESHARDING_INT:
            raise SpecError("reshard_after_forward", f"an int group needs FULL_SHARD or HYBRID_SHARD, not "
                            f"{self.sharding.value} (which keeps params gathered after forward)")

    def with_batch(self, micro_batch: int, grad_accum: int, shard_group_gpus: int) -> FsdpConfig:
        """This configuration with another micro-batch, accumulation and HSDP shard group, checked as __post_init__
        checks them (nothing it derives reads them): what a search varies innermost (planner/search/, ~5,000 times a
        search), without checking and normalising every other field again."""
        check_positive("micro_batch", micro_batch)
        check_positive("grad_accum", grad_accum)
        new = object.__new__(FsdpConfig)
        new.__dict__.update(self.__dict__, micro_batch=micro_batch, grad_accum=grad_accum,
                            shard_group_gpus=shard_group_gpus)
        new._check_shard_group()
        return new

    def _check_shard_group(self) -> None:
        g = self.shard_group_gpus
        if not isinstance(g, int) or isinstance(g, bool) or g < 0:
            raise SpecError("shard_group_gpus", f"must be an integer >= 1 (0: one node), got {g!r}")
        if g and not self.sharding.is_hybrid:
            raise SpecError("shard_group_gpus", f"sizes HSDP's shard group: choose HYBRID_SHARD or HYBRID_SHARD_ZERO2, "
                                                f"not {self.sharding.value} (which shards over every data-parallel rank "
                                                "or none), or leave it out")
        if g % (self.tp * self.cp):
            raise SpecError("shard_group_gpus", f"{g} is not a multiple of tp x cp = {self.tp * self.cp} (a shard group "
                                                "holds whole TP and CP groups)")

    def _check_pipeline(self) -> None:
        """The schedule's own shape (torch.distributed.pipelining.schedules raises on each of these); the rules
        on blocks and microbatches are in cost_models/pipeline.py."""
        schedule, v = self.pp_schedule, self.pp_stages_per_rank
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise SpecError("pp_stages_per_rank", f"must be an integer >= 1 (0: the schedule's own), got {v!r}")
        if self.pp == 1:  # no pipeline: one spelling, so configs compare equal
            self.__dict__.update(pp_schedule=_ONE_F_ONE_B, pp_stages_per_rank=1)
            return
        if v == 0:
            self.__dict__["pp_stages_per_rank"] = v = schedule.default_stages_per_rank
        if v > 1 and not schedule.looped:
            looped = ", ".join(s.value for s in Schedule if s.looped)
            raise SpecError("pp_stages_per_rank", f"{v} needs a looped schedule ({looped}); {schedule.value} runs "
                                                  "one stage per rank")
        if schedule.v_shaped and v != 2:
            raise SpecError("pp_stages_per_rank", f"{schedule.value} runs exactly 2 stages per rank (a V), got {v}")

    @property
    def allocator_settings(self) -> AllocatorSettings:
        """The caching allocator's settings alloc_conf sets (SpecError naming alloc_conf where it cannot)."""
        try:
            return AllocatorSettings.parse(self.alloc_conf)
        except ValueError as exc:
            raise SpecError("alloc_conf", str(exc)) from None

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: pp x stages per rank."""
        return self.pp * self.pp_stages_per_rank

    @property
    def pp_microbatches(self) -> int:
        """Microbatches one schedule step runs (1 without a pipeline)."""
        return self.grad_accum if self.pp > 1 else 1

    @property
    def gradient_reduce_dtype(self) -> str:
        """dtype of the reduce-scatter / all-reduce of gradients: the override, else the precision's."""
        return self.reduce_dtype or self.precision.reduce_dtype

    @property
    def activation_checkpointing(self) -> str:
        return format_activation_checkpointing(self.ac_every, self.selective_op_ac)

    @property
    def loss_compiled(self) -> bool:
        """The model's own cross-entropy runs compiled (fused; activations.loss_events); a loss kernel
        (loss_kernel chunked / liger) is priced by cost_models/kernels.py instead."""
        return self.compile and self.compile_loss and self.loss_kernel is LossKernel.EAGER

    @property
    def checkpoints(self) -> bool:
        """Any activation checkpointing (block-level or selective op-level)."""
        return bool(self.ac_every or self.selective_op_ac)

    @property
    def model_parallel(self) -> int:
        """Ranks of one data-parallel rank's model copy: tp x cp x pp (they see the same sequences)."""
        return self.tp * self.cp * self.pp

    def data_parallel_size(self, cluster: ClusterSpec) -> int:
        """Ranks that see different sequences (dp_replicate x dp_shard): the GPUs over tp x cp x pp."""
        return max(1, cluster.n_gpus // self.model_parallel)

    def dp_degrees(self, n_gpus: int, gpus_per_node: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard): FULL_SHARD-like strategies shard over all data-parallel ranks, HYBRID ones
        over those of a shard group (shard_group_gpus, else a node: its GPUs over tp x cp), NO_SHARD over none; the
        rest replicates."""
        tp_cp = self.tp * self.cp  # (the search asks ~15,000 times: the members and properties read once)
        dp = max(1, n_gpus // (tp_cp * self.pp))
        sharding = self.sharding
        if sharding is _NO_SHARD:
            return dp, 1
        shard = max(1, min(dp, (self.shard_group_gpus or gpus_per_node) // tp_cp)) if sharding in _HYBRIDS else dp
        return dp // shard, shard

    def dp_shard_size(self, cluster: ClusterSpec) -> int:
        return self.dp_degrees(cluster.n_gpus, cluster.gpus_per_node)[1]

    def shard_group_size(self, cluster: ClusterSpec) -> int:
        """d: ranks that share one copy of the model state (FSDP's dp_shard x cp)."""
        return self.dp_shard_size(cluster) * self.cp

    def replicate_group_size(self, cluster: ClusterSpec) -> int:
        """r: copies of the model state (data-parallel replicas of the shard group, dp_replicate)."""
        return self.dp_degrees(cluster.n_gpus, cluster.gpus_per_node)[0]

    def to_dict(self) -> dict:
        return {
            "sharding": self.sharding.value,
            "precision": self.precision.value,
            "offload": self.offload,
            "activation_checkpointing": self.activation_checkpointing,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "attention": self.attention.value,
            **({"attention_kernel": self.attention_kernel.value}
               if self.attention_kernel is not AttentionKernel.FLASH2 else {}),
            "backward_prefetch": self.backward_prefetch,
            "forward_prefetch": self.forward_prefetch,
            "limit_all_gathers": self.limit_all_gathers,
            **({"expert_shard_dim": self.expert_shard_dim} if self.expert_shard_dim else {}),
            **({"expert_units": True} if self.expert_units else {}),
            **({"reduce_dtype": self.reduce_dtype} if self.reduce_dtype else {}),
            **({"compile": True} if self.compile else {}),
            **({"compile_loss": False} if self.compile and not self.compile_loss else {}),
            **{name: kernel.value for name in ("norm_kernel", "rope_kernel", "swiglu_kernel", "loss_kernel")
               if (kernel := getattr(self, name)).value != "eager"},
            **({"moe_dispatch": self.moe_dispatch.value} if self.moe_dispatch is not MoeDispatch.ALL_TO_ALL else {}),
            **({"float8": True} if self.float8 else {}),
            **({"fp8_all_gather": True} if self.fp8_all_gather else {}),
            **({"reshard_after_forward": self.reshard_after_forward} if self.reshard_after_forward else {}),
            "tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp,
            **({"shard_group_gpus": self.shard_group_gpus} if self.shard_group_gpus else {}),
            **({"async_tp": True} if self.async_tp else {}),
            **({"sequence_parallel": False} if self.tp > 1 and not self.sequence_parallel else {}),
            **({"pp_schedule": self.pp_schedule.value, "pp_stages_per_rank": self.pp_stages_per_rank}
               if self.pp > 1 else {}),
            **({"alloc_conf": self.alloc_conf} if self.alloc_conf else {}),
        }
