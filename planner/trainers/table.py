"""The trainers the planner plans for, as data: what each one runs and what its files can say.

A plan is only as good as the run it describes: the search proposes only what the chosen trainer can run
(planner/trainers/rules.py narrows the search space and refuses an explicit configuration it cannot express),
the cost model prices that trainer's defaults (its optimizer implementation, its loss, its kernels), and the
emitter writes that trainer's file (`artifacts`), which `fsdp-plan check` reads back as the same plan.

Each entry's facts are read from the trainer's own code at the version named, cited beside it. A new trainer is a
new entry plus an emitter / reader pair, not a branch in the search or the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from cost_models.fsdp1_adapters import AdapterUnits
from cost_models.specs import Precision, Sharding

ALL_SHARDINGS = tuple(Sharding)
# torchtitan's training.mixed_precision_param is bfloat16 | float32 (and training.dtype bfloat16: bf16-pure): no fp16
NO_FP16 = tuple(p for p in Precision if p is not Precision.FP16)
FSDP2_SHARDINGS = ALL_SHARDINGS  # fully_shard: reshard True / False, a 2-D mesh for HYBRID, a shard group of 1
# accelerate's FSDP2 refuses a shard group of 1 (ParallelismConfig: "use DDP"): no NO_SHARD
HF_FSDP2_SHARDINGS = tuple(s for s in ALL_SHARDINGS if s is not Sharding.NO_SHARD)
MESH_DIMS = ("tp", "cp", "ep", "pp")
CHECKPOINTING = ("none", "full", "every-k", "selective-op")
LAUNCHERS = ("torchrun", "slurm", "pytorchjob")  # launch lines: they run any trainer's script
# what a trainer runs unless its entry says more: the model's own ops (cost_models.spec_values Kernel, LossKernel,
# MoeDispatch, Routing)
KERNEL_DEFAULTS = {"norm_kernel": ("eager",), "rope_kernel": ("eager",), "swiglu_kernel": ("eager",),
                   "loss_kernel": ("eager",), "moe_dispatch": ("all-to-all",), "routing": ("learned",),
                   # SDPA's kernel: PyTorch picks FlashAttention-2 first on A100 / H100 (torch 2.13
                   # sdp_utils priority: flash, efficient, math, cuDNN); torchtitan 0.3 puts cuDNN first on sm100 only
                   "attention_kernel": ("flash2",)}
LIGER_KNOBS = ("norm_kernel", "rope_kernel", "swiglu_kernel", "loss_kernel")
# PYTORCH_CUDA_ALLOC_CONF: torchtitan's launcher (run_train.sh at the repository's root, 0.2 and 0.3) starts torchrun
# with PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"; every other trainer leaves PyTorch's default ("")
TORCHTITAN_ALLOC_CONF = "expandable_segments:True"


@dataclass(frozen=True)
class Trainer:
    """One trainer at one version range: what it can run (the search's bounds) and its defaults (what is priced
    when the user does not say).

    mesh_dims: the degrees beyond data parallelism it can set above 1. sequence_parallel: with tp, the forms it
    runs (True: torchtitan's norms on sequence shards and loss parallel; False: transformers' tp_plan, logits
    gathered). checkpointing: of CHECKPOINTING ("every-k": one block in K, K >= 2). fsdp1_knobs: FSDP1's
    backward-prefetch and rate-limiter switches can be turned off. reshard_int: FSDP2's int
    reshard_after_forward. shard_groups: HYBRID's shard group of other than one node (its mesh's dp_shard).
    compile_scopes: "blocks" (each block compiled, the loss eager) and / or
    "blocks+loss"; the first is what it does when told to compile. float8: torchao's tensorwise Float8 linears
    (the recipe the cost model prices); fp8_all_gather: FSDP2 gathering them in FP8. defaults: request knob ->
    the trainer's own value, used where the user gives none (the optimizer's implementation, kernels)."""

    id: str
    title: str
    source: str
    artifacts: tuple[str, ...]
    model_impl: str = "transformers"
    fsdp_version: int = 2
    mesh_dims: tuple[str, ...] = ()
    sequence_parallel: tuple[bool, ...] = (True, False)
    shardings: tuple[Sharding, ...] = FSDP2_SHARDINGS
    checkpointing: tuple[str, ...] = CHECKPOINTING
    offload: bool = True
    fsdp1_knobs: bool = False
    reshard_int: bool = False
    shard_groups: bool = False  # HYBRID's shard group sized apart from the node (FsdpConfig.shard_group_gpus)
    compile_scopes: tuple[str, ...] = ("blocks", "blocks+loss")
    float8: bool = False
    fp8_all_gather: bool = False
    async_tp: bool = False
    lora: bool = True
    qlora_replicas: bool = True  # loads a 4-bit (QLoRA) base under HSDP replicas too
    # FSDP1 with each adapter linear a unit of its own (cost_models/fsdp1_adapters.py): CAST, the units cast their
    # inputs (the planner's FSDP1 code); AUTOCAST, peft's wrap policy with the forward under autocast (HF Trainer,
    # accelerate); None: the adapters inside their block's unit
    fsdp1_adapter_units: AdapterUnits | None = None
    mesh_exclusions: tuple[tuple[str, str], ...] = ()  # axes it cannot combine above 1
    precisions: tuple[Precision, ...] = tuple(Precision)
    norm: str | None = None  # the blocks' RMSNorm as its own model runs it (ModelSpec.norm); None: the model's
    edge_units: bool = False  # the embedding and [final norm, head] FSDP units of their own (ModelSpec.edge_units)
    # HF model types it runs with its own modelling code, not transformers': priced with a fused RoPE (ModelSpec.rope)
    # and from the structure (cost_models/operators.py), not from a traced transformers block's operator inventory
    own_models: tuple[str, ...] = ()
    defaults: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # how its artifact loads the weights and saves checkpoints (cost_models/outside_step.py ways): rank 0 reads and
    # broadcasts (cpu_ram_efficient_loading / broadcast_from_rank0), each rank saves its shard with DCP
    load_way: str = "rank0-broadcast"
    save_way: str = "dcp"
    # kernel knob -> the values it runs, its default first (absent: KERNEL_DEFAULTS' one value)
    kernels: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    def host_ways(self):
        """cost_models.host_ram.Ways: what the host RAM is priced with."""
        from cost_models.host_ram import Ways
        from cost_models.outside_step import LoadWay, SaveWay

        return Ways(LoadWay(self.load_way), SaveWay(self.save_way), fsdp2=self.fsdp_version == 2,
                    fsdp1_adapter_units=self.fsdp1_adapter_units)

    def kernel_choices(self, name: str) -> tuple[str, ...]:
        return self.kernels.get(name, KERNEL_DEFAULTS[name])

    def liger(self) -> bool:
        """Runs Liger Kernel's four kernels at once (HF's use_liger_kernel): the search tries them on and off."""
        return all("liger" in self.kernel_choices(k) for k in LIGER_KNOBS)

    @property
    def own_artifact(self) -> str:
        return self.artifacts[0]

    def can_compile_loss(self) -> bool:
        return "blocks+loss" in self.compile_scopes


def _defaults(**values) -> MappingProxyType:
    return MappingProxyType(values)


# transformers' models patched by Liger Kernel 0.8.5 (liger_kernel.transformers.apply_liger_kernel_to_<family>:
# RMSNorm, RoPE, SwiGLU, fused linear cross-entropy), as HF Trainer's use_liger_kernel applies them
LIGER = MappingProxyType({k: ("eager", "liger") for k in LIGER_KNOBS})
# transformers' own models run flash-attention 3 when asked (attn_implementation "flash_attention_3", which every
# dialect on them writes: planner/emit/attention.py); pinned only, never searched (the first, flash2, is priced)
HF_ATTENTION = MappingProxyType({"attention_kernel": ("flash2", "fa3")})
HF_KERNELS = MappingProxyType({**LIGER, **HF_ATTENTION})


TRAINERS: dict[str, Trainer] = {t.id: t for t in (
    Trainer(
        id="fsdp2", title="the planner's FSDP2 code",
        source="planner/emit/code/fsdp.py, mesh.py, pipeline.py (the code calibration/apply.py runs)",
        artifacts=("fsdp2", *LAUNCHERS), mesh_dims=MESH_DIMS, reshard_int=True, float8=True, fp8_all_gather=True,
        async_tp=True, kernels=HF_KERNELS, shard_groups=True,  # init_device_mesh's (dp_replicate, dp_shard)
        # planner/emit/code/mesh.py refuse_fsdp2, pipeline.py refuse_pipeline: CP or EP inside pipeline stages and EP
        # beside TP are priced but not written as FSDP2 code
        mesh_exclusions=(("cp", "pp"), ("ep", "pp"), ("ep", "tp")),
        # torch.optim.AdamW() with neither foreach nor fused: foreach on CUDA tensors (torch/optim/optimizer.py
        # _default_to_fused_or_foreach)
        defaults=_defaults(optimizer_impl="foreach")),
    Trainer(
        id="fsdp1", title="the planner's FSDP1 code",
        source="planner/emit/code/fsdp.py emit_fsdp1",
        artifacts=("fsdp1", *LAUNCHERS), fsdp_version=1, sequence_parallel=(True,), fsdp1_knobs=True, float8=True,
        shard_groups=True,  # FullyShardedDataParallel's 2-D device_mesh for HYBRID_SHARD
        load_way="every-rank",  # the snippet wraps the model every rank built
        kernels=HF_KERNELS, fsdp1_adapter_units=AdapterUnits.CAST,  # emit_fsdp1's CustomPolicy, cast_forward_inputs
        defaults=_defaults(optimizer_impl="foreach")),
    Trainer(
        # transformers 5 Trainer on accelerate's FSDP2 plugin: fsdp_config keys (training_args.py), accelerate's
        # ParallelismConfig (dp_replicate, dp_shard, tp, cp: no ep, no pp), TP as transformers' tp_plan (no
        # sequence parallel), activation_checkpointing a bool (every block), reshard_after_forward a bool,
        # regional compilation of the blocks (the model's loss stays eager); no Float8 argument (TrainingArguments
        # has none: torchao's conversion would be code of one's own, which check cannot read back); optim
        # defaults to adamw_torch_fused (OptimizerNames, torch >= 2.8)
        id="hf", title="HF Trainer FSDP2",
        source="transformers 5 training_args.py (fsdp_config, optim, use_liger_kernel), accelerate 1.x",
        artifacts=("hf-trainer", *LAUNCHERS), mesh_dims=("tp", "cp"), sequence_parallel=(False,),
        shardings=HF_FSDP2_SHARDINGS, checkpointing=("none", "full"), compile_scopes=("blocks",), kernels=HF_KERNELS,
        shard_groups=True,  # ParallelismConfig's dp_replicate_size / dp_shard_size
        defaults=_defaults(optimizer_impl="fused")),
    Trainer(
        id="hf-fsdp1", title="HF Trainer FSDP1",
        source="transformers 5 training_args.py (fsdp_config version 1, optim, use_liger_kernel)",
        artifacts=("hf-trainer-fsdp1", *LAUNCHERS), fsdp_version=1, sequence_parallel=(True,),
        checkpointing=("none", "full"), fsdp1_knobs=True, compile_scopes=("blocks",), kernels=HF_KERNELS,
        # a PEFT model's adapters in units of their own (transformers 5 distributed/fsdp.py update_fsdp_plugin_peft:
        # peft's fsdp_auto_wrap_policy), the forward under accelerate's autocast
        fsdp1_adapter_units=AdapterUnits.AUTOCAST, defaults=_defaults(optimizer_impl="fused")),
    Trainer(
        # accelerate 1.x launched on one's own training loop: the config file holds the FSDP plugin, the mesh
        # (ParallelismConfig), regional compilation and the torchao Float8 recipe (fp8_config, backend AO: tensorwise,
        # FP8 all-gather under FSDP2), but no kernel and no optimizer: the loop's own (torch.optim.AdamW: foreach)
        id="accelerate-fsdp2", title="accelerate FSDP2 (your training loop)",
        source="accelerate 1.x utils/dataclasses.py (FullyShardedDataParallelPlugin, ParallelismConfig, fp8)",
        artifacts=("accelerate-fsdp2", *LAUNCHERS), mesh_dims=("tp", "cp"), sequence_parallel=(False,),
        shardings=HF_FSDP2_SHARDINGS, checkpointing=("none", "full"), compile_scopes=("blocks",), float8=True,
        fp8_all_gather=True, kernels=HF_ATTENTION, defaults=_defaults(optimizer_impl="foreach"),
        shard_groups=True),  # parallelism_config_dp_replicate_size / dp_shard_size
    Trainer(
        id="accelerate", title="accelerate FSDP1 (your training loop)",
        source="accelerate 1.x FSDP1 plugin (fsdp_sharding_strategy, fsdp_backward_prefetch, ...)",
        artifacts=("accelerate", *LAUNCHERS), fsdp_version=1, sequence_parallel=(True,),
        checkpointing=("none", "full"), fsdp1_knobs=True, compile_scopes=("blocks",), float8=True,
        # LoRA: auto_wrap_policy=peft's fsdp_auto_wrap_policy (the emitted note: one dtype a flat parameter, a bf16
        # base beside fp32 adapters needs it), the forward under the Accelerator's autocast
        fsdp1_adapter_units=AdapterUnits.AUTOCAST, kernels=HF_ATTENTION, defaults=_defaults(optimizer_impl="foreach")),
    Trainer(
        # Lightning 2.x FSDPStrategy wraps FSDP1: activation_checkpointing_policy={Block} checkpoints every block,
        # compile in configure_model (a note the emitter writes; Float8 would be torchao code of one's own there,
        # not priced); configure_optimizers is the user's, torch's default implementation (foreach on CUDA)
        id="lightning", title="Lightning FSDPStrategy (FSDP1)",
        source="lightning/pytorch/strategies/fsdp.py FSDPStrategy",
        artifacts=("lightning", *LAUNCHERS), fsdp_version=1, sequence_parallel=(True,), checkpointing=("none", "full"),
        load_way="every-rank",  # FSDPStrategy as emitted (no sync_module_states): every rank builds the model
        fsdp1_knobs=True, compile_scopes=("blocks",), kernels=HF_ATTENTION,
        defaults=_defaults(optimizer_impl="foreach")),
    Trainer(
        # axolotl 0.21.0: transformers' Trainer on accelerate's FSDP2 plugin, configured by one YAML (utils/schemas/:
        # config.py, fsdp.py, peft.py, training.py). FSDP1 is removed (validation.py check_fsdp_version);
        # dp_replicate_size / dp_shard_size give HSDP (no shard group of 1, as accelerate's FSDP2); its TP is
        # DeepSpeed's AutoTP only and its context parallel ring-flash-attn's (not priced): no mesh axis;
        # fsdp_config.activation_checkpointing a bool (every block); torch_compile compiles the whole model (not the
        # regional compile priced) and Liger comes as a plugin: neither is proposed; bf16 loads the model in bf16 and
        # accelerate upcasts the trainable params to fp32 (fsdp_utils.py fsdp2_prepare_model), so no bf16-pure;
        # optimizer defaults to adamw_torch_fused (training.py); flash-attention 3 by attn_implementation
        id="axolotl", title="axolotl 0.21 (FSDP2)",
        source="axolotl 0.21.0 utils/schemas/ (config.py, fsdp.py, peft.py, training.py), loaders/model.py",
        artifacts=("axolotl", *LAUNCHERS), sequence_parallel=(False,), shardings=HF_FSDP2_SHARDINGS,
        checkpointing=("none", "full"), compile_scopes=(), kernels=HF_ATTENTION,
        precisions=(Precision.FP32, Precision.BF16, Precision.FP16), defaults=_defaults(optimizer_impl="fused"),
        shard_groups=True,  # dp_replicate_size / dp_shard_size
        # QLoRA: rank 0 stages the NF4 base through the CPU on a one-dimensional mesh only (validation.py: "CPU-staged
        # NF4 requires a one-dimensional sharding mesh; dp_replicate_size must be 1"), else every rank loads it
        qlora_replicas=False),
    Trainer(
        # torchtitan 0.3.0 (installed): parallelism.fsdp_reshard_after_forward default | always | never (no int);
        # activation-checkpoint:none | full | selective (per op; no every-K-th block); compile.components
        # ["model", "loss"] by default; Float8LinearConverter recipes "rowwise" | "rowwise_with_gw_hp" only, no FP8
        # all-gather (components/quantization/float8.py), which the cost model does not price: left out;
        # [optimizer] implementation defaults to "fused" (components/optimizer/optimizer.py); full models only.
        # Its own models norm with torch.nn.RMSNorm (models/common/nn_modules.py RMSNorm), one fused kernel on
        # CUDA in torch 2.13 (aten._fused_rms_norm): priced as ModelSpec norm "fused_rmsnorm". Every model config of
        # 0.3 (models/*/config_registry.py: llama3, qwen3, deepseek_v3, gpt_oss, ...) takes ChunkedLossWrapper (8
        # chunks, components/loss.py); plain CrossEntropyLoss only in a debug config, no flag: the loss is chunked.
        # distributed/fsdp.py apply_fsdp_to_decoder: fully_shard(tok_embeddings, reshard_after_forward=not pp),
        # fully_shard([norm, lm_head], reshard_after_forward=False) (tied: the three as one unit), then each block
        # and the model (no parameters left)
        id="torchtitan", title="torchtitan 0.3",
        source="torchtitan 0.3.0: config/configs.py, components/optimizer/optimizer.py, components/quantization/"
               "float8.py, distributed/activation_checkpoint.py",
        artifacts=("torchtitan", *LAUNCHERS), model_impl="torchtitan", mesh_dims=MESH_DIMS,
        checkpointing=("none", "full", "selective-op"), compile_scopes=("blocks+loss", "blocks"), async_tp=True,
        precisions=NO_FP16, shard_groups=True,  # data_parallel_replicate_degree / data_parallel_shard_degree
        lora=False, norm="fused_rmsnorm", edge_units=True, kernels=_defaults(loss_kernel=("chunked",)),
        defaults=_defaults(optimizer_impl="fused", alloc_conf=TORCHTITAN_ALLOC_CONF),
        load_way="meta-dcp"),  # meta init, then its checkpoint (DCP)
    Trainer(
        # torchtitan 0.2: JobConfig TOML / --section.option flags; selective_ac_option "op" or K; Float8 tensorwise
        # with enable_fsdp_float8_all_gather; sequence parallel always on with TP; optimizer.implementation "fused"
        id="torchtitan-0.2", title="torchtitan 0.2",
        source="torchtitan 0.2 config/job_config.py (as planner/emit/torchtitan/job.py writes it)",
        artifacts=("torchtitan-0.2", *LAUNCHERS), model_impl="torchtitan", mesh_dims=MESH_DIMS,
        sequence_parallel=(True,), compile_scopes=("blocks+loss", "blocks"), float8=True, fp8_all_gather=True,
        precisions=NO_FP16, shard_groups=True,
        async_tp=True, lora=False, defaults=_defaults(optimizer_impl="fused", alloc_conf=TORCHTITAN_ALLOC_CONF),
        load_way="meta-dcp"),
    Trainer(
        # NVIDIA NeMo Automodel 0.7.0 (planner/emit/automodel.py reads its recipe keys from the source): FSDP2 over
        # dp_replicate x dp_shard with tp / cp / ep (no pp in the recipes priced), activation_checkpointing a bool,
        # enable_compile per decoder layer (the loss eager), no torchao Float8 recipe, no NO_SHARD; model.backend
        # rms_norm torch_fp32 (default) | te, RoPE as its model runs it (own_models), dispatcher deepep for MoE
        # under EP (its "torch" dispatcher all-gathers tokens: not priced; all-to-all stays the value of ep 1),
        # fake_balanced_gate = round-robin routing; torch.optim.AdamW's default step (foreach)
        id="automodel", title="NeMo Automodel 0.7",
        source="nemo_automodel 0.7.0: recipes/_dist_utils.py, components/distributed/config.py, "
               "components/models/common/utils.py BackendConfig",
        artifacts=("automodel", *LAUNCHERS), mesh_dims=("tp", "cp", "ep"),
        shardings=tuple(s for s in ALL_SHARDINGS if s is not Sharding.NO_SHARD), checkpointing=("none", "full"),
        compile_scopes=("blocks",), lora=False, precisions=NO_FP16,  # fp16: not priced for it (no loss scaler)
        shard_groups=True,  # distributed.dp_size / dp_replicate_size
        # model.backend.attn te (the published MoE runs): Transformer Engine's DotProductAttention, cuDNN fused
        # attention on Hopper (attention_kernel cudnn; elsewhere priced as flash2), sdpa: PyTorch SDPA's flash2
        kernels=_defaults(norm_kernel=("eager", "te"), moe_dispatch=("deepep", "all-to-all"),
                          routing=("learned", "round-robin"), attention_kernel=("cudnn", "flash2")),
        # the base checkpoint read in parallel into the meta-initialised, sharded model (components/checkpoint/
        # checkpointing.py load_base_model -> DCP with its HuggingFaceStorageReader); saved with DCP
        defaults=_defaults(optimizer_impl="foreach"), load_way="meta-dcp",
        # its own modelling of these (_transformers/registry.py maps the architecture to components/models/<type>/
        # model.py: TE linears, its attention backends, GroupedExperts(DeepEP) with torch._grouped_mm). Their RoPE
        # is one kernel each way: TE's FusedRoPEFunc where rope_fusion is on (BackendConfig's HAVE_TE default, the
        # Oct 2025 runs); 0.7.0 forces it off (issue #3027), and apply_rotary_emb_qk then rotates q and k in
        # _compiled_apply_rotary_emb_qk, torch.compile'd on CUDA (gpt_oss/rope_utils.py; deepseek_v3 rotates in
        # common/rope_triton.py's Triton _FusedRope)
        own_models=("deepseek_v3", "gpt_oss", "qwen3_moe")),
)}

DEFAULT_TRAINER = "fsdp2"
