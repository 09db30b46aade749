"""The request every command and API call is made of, in typed groups: the cluster, the training, the
configuration with its mesh, and what the plan command searches. Each knob is declared here once (type,
default, flag, help); planner/request/knobs.py reads the declarations for the API and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.caching_allocator import AllocatorSettings
from cost_models.outside_allocator import parse_overrides
from cost_models.specs import ClusterSpec, SpecError, TrainingSpec
from cost_models.units import parse_bytes

from ..errors import PlannerError
from ..hardware import DEFAULT_GPU, make_cluster
from .knobs import knob

COMPILE_SCOPES = ("blocks", "blocks+loss")  # FsdpConfig.compile_loss False / True
PP_MICRO_BATCH = ("with --pp, --micro-batch is the pipeline microbatch: the local batch (global batch / "
                  "data-parallel ranks) is split into local batch / micro-batch microbatches, all run in one "
                  "schedule step")


@dataclass(frozen=True)
class ClusterRequest:
    """The GPUs and their links; None: the GPU catalog's figure (planner/catalog/gpus)."""

    gpus: int | None = knob(None, "--gpus", "-g", help="Number of GPUs")
    gpus_per_node: int | None = knob(None, "--gpus-per-node", help="GPUs per node (default min(gpus, 8))")
    gpu: str = knob(DEFAULT_GPU, "--gpu", help="GPU type (see `fsdp-plan gpus`)")
    internode_gbps: float | None = knob(None, "--internode-gbps", help="Network per node, Gbit/s")
    gpu_memory: str | int | None = knob(None, "--gpu-memory", help="Override GPU memory, e.g. 80GiB", cli_type=str)
    intra_node_gb_per_s: float | None = knob(None, "--intra-node-gb-per-s",
                                             help="Override intra-node bus bandwidth, GB/s")
    pcie_gb_per_s: float | None = knob(None, "--pcie-gb-per-s", help="Override host<->device bandwidth, GB/s")
    cpu_ram_per_node: str | int | None = knob(None, "--cpu-ram-per-node", cli_type=str,
                                              help="CPU RAM per node, e.g. 1TiB (checks offload)")
    power_limit_w: float | None = knob(None, "--power-limit-w", help="Board power cap the GPUs run under, watts "
                                       "(nvidia-smi -pl; > 0 and at most the GPU's TDP): matmul and attention "
                                       "rates x (cap / TDP)^(1/3). Default: the catalog's (h100-96gb 500 W), "
                                       "else the TDP")
    # the node's CPUs, for the optimizer step on the host under CPU offload (cost_models/host_optimizer.py)
    host_cores_per_node: int | None = knob(None, "--host-cores-per-node", help="CPU cores per node the ranks "
                                           "share (physical, not SMT threads; default 112, a DGX H100's 2 x 56)")
    host_memory_gb_per_s: float | None = knob(None, "--host-memory-gb-per-s", help="Host memory bandwidth per node, "
                                              "peak GB/s (channels x MT/s x 8 B; default 614.4, a DGX H100's 2 "
                                              "sockets x 8 DDR5-4800 channels)")
    host_thread_gb_per_s: float | None = knob(None, "--host-thread-gb-per-s", help="GB/s one CPU thread's "
                                              "optimizer step streams (default 13.35, measured on an H100 host: "
                                              "docs/step_time.md)")
    omp_num_threads: int | None = knob(None, "--omp-num-threads", help="Threads each rank's CPU optimizer step "
                                       "runs (OMP_NUM_THREADS; default 1, torchrun's)")

    def spec(self) -> ClusterSpec:
        if self.gpus is None:
            raise PlannerError("gpus", "missing: pass gpus=N (N >= 1)")
        sizes = {}
        for name in ("gpu_memory", "cpu_ram_per_node"):  # "80GiB" or bytes
            value = getattr(self, name)
            try:
                sizes[name] = parse_bytes(value) if value is not None else None
            except ValueError as exc:
                raise PlannerError(name, str(exc)) from None
        return make_cluster(self.gpus, gpu=self.gpu, gpus_per_node=self.gpus_per_node,
                            internode_gbps=self.internode_gbps, intra_node_gb_per_s=self.intra_node_gb_per_s,
                            pcie_gb_per_s=self.pcie_gb_per_s, gpu_memory=sizes["gpu_memory"],
                            cpu_ram_per_node=sizes["cpu_ram_per_node"], power_limit_w=self.power_limit_w,
                            host_cores_per_node=self.host_cores_per_node,
                            host_memory_gb_per_s=self.host_memory_gb_per_s,
                            host_thread_gb_per_s=self.host_thread_gb_per_s, omp_num_threads=self.omp_num_threads)


@dataclass(frozen=True)
class TrainingRequest:
    seq_len: int = knob(2048, "--seq-len", help="Tokens per sequence")
    global_batch: int | None = knob(None, "--global-batch", help="Sequences per optimizer step")
    optimizer: str = knob("adamw", "--optimizer", help="adamw, adam, sgd, adamw-8bit")
    optimizer_impl: str | None = knob(None, "--optimizer-impl", help="How torch runs the optimizer step: foreach "
                                      "(one more fp32 copy of the local shard at the step), fused (none; HF "
                                      "Trainer's adamw_torch_fused, torchtitan 0.3's default) or for-loop "
                                      "(foreach=False: two copies of one parameter). Default: the trainer's "
                                      "(foreach)")
    finetune: str = knob("full", "--finetune", help="full, lora, or qlora (LoRA on a bitsandbytes 4-bit base)")
    lora_rank: int = knob(16, "--lora-rank", help="LoRA rank")
    lora_dropout: float = knob(0.0, "--lora-dropout", help="peft's lora_dropout, 0 <= p < 1: above 0 each adapter "
                               "saves a one-byte mask and its own dropped input (axolotl's examples and TRL's "
                               "ModelConfig: 0.05)")
    lora_targets: str | None = knob(None, "--lora-targets", help="The linears LoRA / QLoRA adapts: attention (q, k, "
                                    "v, o; peft's own default, q and v, is priced as these) or all-linear (the "
                                    "MLP's too: peft's target_modules=\"all-linear\", axolotl's lora_target_linear, "
                                    "the QLoRA paper). Default: attention (a model spec given whole: its own)")
    quant: str = knob("nf4", "--quant", help="With --finetune qlora: the 4-bit type, nf4 or fp4 "
                      "(bnb_4bit_quant_type)")
    double_quant: bool = knob(True, "--double-quant/--no-double-quant", help="With --finetune qlora: quantize the "
                              "absmax too (bnb_4bit_use_double_quant: 0.127 bits a weight, else 0.5)")
    quant_storage: str = knob("bf16", "--quant-storage", help="With --finetune qlora: the dtype the packed weights "
                              "are stored as (bnb_4bit_quant_storage): bf16, fp16, fp32 or uint8; FSDP needs the "
                              "compute dtype's")
    routing_imbalance: float = knob(1.0, "--routing-imbalance", help="MoE with --ep: the busiest rank's routed "
                                    "tokens over the mean (1 = balanced routing, the default)")
    routing: str = knob("learned", "--routing", help="MoE router: learned (the model's gate), or round-robin (NeMo "
                        "Automodel's FakeBalancedGate of its benchmark runs: balanced, no gate matmul)")

    def spec(self) -> TrainingSpec:
        return TrainingSpec(seq_len=self.seq_len, global_batch=self.global_batch, optimizer=self.optimizer,
                            optimizer_impl=self.optimizer_impl or "foreach", finetune=self.finetune,
                            lora_rank=self.lora_rank, lora_dropout=self.lora_dropout, quant=self.quant,
                            double_quant=self.double_quant, quant_storage=self.quant_storage,
                            routing_imbalance=self.routing_imbalance, routing=self.routing)


@dataclass(frozen=True)
class MeshRequest:
    """The device mesh beside FSDP (torchtitan's degrees). None: not pinned - the plan searches it, one
    configuration takes 1 (async_tp: searched / off)."""

    tp: int | None = knob(None, "--tp", help="Tensor-parallel degree (heads and MLP split over N GPUs of a node; "
                          "default 1, searched by the plan command)")
    cp: int | None = knob(None, "--cp", help="Context-parallel degree (each sequence split over N GPUs, ring "
                          "attention; default 1, searched by the plan command)")
    ep: int | None = knob(None, "--ep", help="Expert-parallel degree (MoE: experts split over N GPUs; default 1, "
                          "searched by the plan command)")
    pp: int | None = knob(None, "--pp", help="Pipeline-parallel degree: the blocks split evenly into stages over N "
                          "ranks (the outermost mesh dimension; embedding on the first stage, norm + head + loss on "
                          f"the last; default 1, searched by the plan command with its schedule); {PP_MICRO_BATCH}")
    pp_schedule: str | None = knob(None, "--pp-schedule", help="With --pp: gpipe, 1f1b (default), "
                                   "interleaved-1f1b, zero-bubble or dualpipev (torch.distributed.pipelining's "
                                   "ScheduleGPipe ... ScheduleDualPipeV)")
    pp_stages_per_rank: int | None = knob(None, "--pp-stages-per-rank", help="With --pp and a looped schedule "
                                          "(interleaved-1f1b, zero-bubble, dualpipev): stages V on each pipeline "
                                          "rank (default 2)")
    async_tp: bool | None = knob(None, "--async-tp/--no-async-tp", help="Overlap TP's all-gathers and "
                                 "reduce-scatters with the matmuls (torchtitan; needs --compile)")
    sequence_parallel: bool | None = knob(None, "--sequence-parallel/--no-sequence-parallel", help="With --tp: "
                                          "norms and residuals split over the sequence, loss parallel (torchtitan); "
                                          "--no-sequence-parallel: transformers' tp_plan (accelerate, HF Trainer), "
                                          "the logits gathered (default: the trainer's; sequence parallel where it "
                                          "runs both)")
    shard_group_gpus: int | None = knob(None, "--shard-group-gpus", help="HYBRID_SHARD*: GPUs of one shard group "
                                        "(dp_shard x cp x tp), a divisor of a node or a multiple of nodes; default "
                                        "one node, the plan command also searching multiples of nodes")

    def __post_init__(self):
        for name in ("tp", "cp", "ep", "pp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PlannerError(name, f"must be an integer >= 1, got {value}")
        if self.shard_group_gpus is not None and self.shard_group_gpus < 1:
            raise PlannerError("shard_group_gpus", f"must be an integer >= 1 (GPUs of one HSDP shard group), got "
                                                   f"{self.shard_group_gpus}")

    def degrees(self, default=None) -> dict:
        """The pinned degrees as keyword arguments, the rest `default` (None: left out, searched)."""
        return {n: v if v is not None else default for n in ("tp", "cp", "ep", "pp")
                if (v := getattr(self, n)) is not None or default is not None}


@dataclass(frozen=True)
class ConfigRequest:
    """One explicit configuration (the estimate command's); attention None: the model's first choice."""

    attention: str | None = knob(None, "--attention", help="sdpa (fused), eager or flex (FlexAttention, compiled); "
                                 "default: the model's first: sdpa, flex for gpt-oss (sinks), eager for Gemma 2")
    attention_kernel: str | None = knob(None, "--attention-kernel", help="The fused (sdpa) attention's kernel: "
                                        "flash2 (PyTorch SDPA's FlashAttention-2), cudnn (Transformer Engine's "
                                        "cuDNN fused attention) or fa3 (flash-attention 3); cudnn and fa3 on Hopper "
                                        "GPUs only. Default: the trainer's (automodel: cudnn where the GPU has it), "
                                        "else flash2")
    sharding: str = knob("FULL_SHARD", "--sharding", help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
                         "HYBRID_SHARD_ZERO2")
    precision: str = knob("bf16", "--precision", help="fp32, bf16, bf16-pure, fp16")
    activation_checkpointing: str = knob("none", "--activation-checkpointing", help="none, full, every-K, "
                                         "selective-op (torchtitan's op-level policy in every block)")
    micro_batch: int = knob(1, "--micro-batch", help=f"Sequences per GPU per micro-step; {PP_MICRO_BATCH}")
    grad_accum: int | None = knob(None, "--grad-accum", help="Micro-steps per optimizer step (with --pp: the "
                                  "microbatches of one schedule step)")
    offload: bool = knob(False, "--offload/--no-offload", help="CPU offload of params, grads, optimizer")
    backward_prefetch: bool = knob(True, "--backward-prefetch/--no-backward-prefetch")
    forward_prefetch: bool = knob(False)  # API only: FSDP1's forward_prefetch
    limit_all_gathers: bool = knob(True, "--limit-all-gathers/--no-limit-all-gathers")
    expert_shard_dim: int = knob(0, "--expert-shard-dim", help="MoE, FSDP2: 0 shards stacked experts on dim 0 "
                                 "(padded to the shard group), 1 on dim 1")
    expert_units: bool = knob(False, "--expert-units/--no-expert-units", help="MoE: wrap each block's routed "
                              "experts as their own FSDP unit")
    reduce_dtype: str | None = knob(None, "--reduce-dtype", help="gradient reduction dtype: fp32 or bf16 "
                                    "(default: the precision's)")
    moe_dispatch: str | None = knob(None, "--moe-dispatch", help="MoE with --ep: all-to-all (NCCL, every routed "
                                    "row) or deepep (DeepEP's dispatch / combine, one row per destination rank, as "
                                    "NeMo Automodel runs it); default: the trainer's, else all-to-all")
    compile: bool = knob(False, "--compile/--no-compile", help="torch.compile each block (torchtitan style, "
                         "before fully_shard)")
    compile_scope: str | None = knob(None, "--compile-scope", help="With --compile: blocks (the loss left eager: "
                                     "HF regional compilation, torchtitan before 2025) or blocks+loss (default: "
                                     "torchtitan 0.3's compile.components = [model, loss])")
    liger: bool | None = knob(None, "--liger/--no-liger", help="Liger Kernel 0.8.5 as HF Trainer's "
                              "use_liger_kernel applies it: RMSNorm, RoPE, SwiGLU and fused linear cross-entropy (a "
                              "--*-kernel flag overrides one of them); default: off for estimate, searched on and off "
                              "by the plan where the trainer runs it")
    norm_kernel: str | None = knob(None, "--norm-kernel", help="RMSNorm kernel: eager (the model's own ops), "
                                   "liger (Liger Kernel 0.8.5 LigerRMSNorm) or te (Transformer Engine 2.x "
                                   "te.RMSNorm); default eager, liger with --liger")
    rope_kernel: str | None = knob(None, "--rope-kernel", help="RoPE kernel: eager, liger (Liger Kernel 0.8.5 "
                                   "liger_rotary_pos_emb) or te (Transformer Engine 2.x fused RoPE); default "
                                   "eager, liger with --liger")
    swiglu_kernel: str | None = knob(None, "--swiglu-kernel", help="SwiGLU kernel: eager, liger (Liger Kernel "
                                     "0.8.5 LigerSwiGLUMLP) or te (Transformer Engine 2.x te.ops.SwiGLU); "
                                     "default eager, liger with --liger")
    loss_kernel: str | None = knob(None, "--loss-kernel", help="Loss: eager (the model's cross-entropy, fp32 "
                                   "upcast; compiled with --compile), chunked (torchtitan 0.3 "
                                   "ChunkedLossWrapper, 8 chunks) or liger (Liger Kernel 0.8.5 fused linear "
                                   "cross-entropy); default eager, liger with --liger")
    float8: bool = knob(False, "--float8/--no-float8", help="torchao Float8 linears in the blocks (GPUs with FP8 "
                        "tensor cores, bf16 compute)")
    fp8_all_gather: bool = knob(False, "--fp8-all-gather/--no-fp8-all-gather", help="with --float8, FSDP2 "
                                "all-gathers the Float8 weights in FP8")
    reshard_after_forward: int = knob(0, "--reshard-after-forward", help="FSDP2: after forward keep block params "
                                      "sharded over N ranks (a divisor of the shard group, e.g. a node); 0: the "
                                      "strategy's own")
    mesh: MeshRequest = field(default_factory=MeshRequest)

    def kernels(self) -> dict:
        """FsdpConfig's kernel fields and compile_loss from --liger, the --*-kernel flags and --compile-scope
        (--liger: the four kernels HF's use_liger_kernel applies to a Llama-like model, each flag overriding
        its own)."""
        default = "liger" if self.liger else "eager"
        out = {name: getattr(self, name) or default
               for name in ("norm_kernel", "rope_kernel", "swiglu_kernel", "loss_kernel")}
        if self.compile_scope is not None and self.compile_scope not in COMPILE_SCOPES:
            raise PlannerError("compile_scope", f"{self.compile_scope!r}; choose one of: {', '.join(COMPILE_SCOPES)}")
        if self.compile_scope is not None and not self.compile:
            raise PlannerError("compile_scope", "scopes torch.compile: give --compile with it, or leave it out")
        return {**out, "compile_loss": self.compile_scope != "blocks"}


@dataclass(frozen=True)
class SearchRequest:
    """What the plan command searches beyond the mesh; None: every choice (reduce_dtypes: each precision's)."""

    precisions: list[str] | None = knob(None, "--precision", help="Precisions to search (repeatable)")
    reduce_dtypes: list[str] | None = knob(None, "--reduce-dtype", help="Gradient reduction dtypes to search, "
                                           "fp32 | bf16 (repeatable; default: each precision's own)")


@dataclass(frozen=True)
class Request:
    """Everything a command is asked: the model, then the groups."""

    model: object = knob(None, "--model", "-m", help="Preset name, HF config.json, or a directory holding one",
                         cli_type=str)
    cluster: ClusterRequest = field(default_factory=ClusterRequest)
    training: TrainingRequest = field(default_factory=TrainingRequest)
    config: ConfigRequest = field(default_factory=ConfigRequest)
    search: SearchRequest = field(default_factory=SearchRequest)
    trainer: str | None = knob(None, "--trainer", help="The trainer that runs the plan: fsdp2 (the planner's "
                               "fully_shard code), fsdp1, hf (HF Trainer FSDP2), hf-fsdp1, accelerate-fsdp2 and "
                               "accelerate (FSDP1: your loop), lightning, axolotl, torchtitan (0.3), torchtitan-0.2, "
                               "automodel (NeMo Automodel 0.7); the search proposes only what it can run, priced "
                               "with its defaults (optimizer implementation, kernels). Default: the --emit dialect's "
                               "trainer, else fsdp2")
    alloc_conf: str | None = knob(None, "--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF the run sets, e.g. "
                                  "expandable_segments:True or max_split_size_mb:512 (keys as torch's "
                                  "CUDACachingAllocator reads them): a pipeline's reserved memory is replayed under "
                                  "it and the launchers export it. Default: the trainer's (torchtitan's run_train.sh "
                                  "sets expandable_segments:True), else PyTorch's (\"\")")
    trust_remote_code: bool = knob(False, "--trust-remote-code", help="Build a config.json whose auto_map names "
                                   "custom modelling code (runs that code)")
    outside_allocator: list[str] | None = knob(None, "--outside-allocator", help="Override a term of the memory "
                                               "outside PyTorch's allocator (repeatable): TERM=GiB with TERM one of "
                                               "cuda_context, nccl, nvls, pp_p2p, symmetric_memory, deepep, float8, "
                                               "compile (e.g. cuda_context=0.6, nccl=512MiB), or an NCCL variable as "
                                               "the run sets it (NCCL_BUFFSIZE=8388608, NCCL_NVLS_ENABLE=0); "
                                               "`fsdp-plan explain` lists the terms")

    def __post_init__(self):
        if self.alloc_conf:  # a bad PYTORCH_CUDA_ALLOC_CONF before any search or file is read
            try:
                AllocatorSettings.parse(self.alloc_conf)
            except ValueError as exc:
                raise PlannerError("alloc_conf", str(exc)) from None
        if self.outside_allocator:  # one line naming the field and the valid terms (outside_allocator.py)
            try:
                parse_overrides(self.outside_allocator)
            except SpecError as exc:
                raise PlannerError("outside_allocator", str(exc).partition(": ")[2]) from None

    def profile(self, profile):
        """`profile` (None: the defaults) with this request's --outside-allocator overrides."""
        from cost_models.profile import DEFAULT_PROFILE

        profile = profile or DEFAULT_PROFILE
        if not self.outside_allocator:
            return profile
        overrides = profile.outside_allocator + parse_overrides(self.outside_allocator)   # later keys win
        return profile.with_updates(outside_allocator=overrides)

    @property
    def mesh(self) -> MeshRequest:
        return self.config.mesh
