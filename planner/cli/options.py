"""Options shared by the `fsdp-plan` commands: one flag = one API argument, defined once."""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated, Callable, Optional

import typer

from planner.emit import ARTIFACTS
from planner.progress import quiet_for


class Format(str, Enum):
    table = "table"
    json = "json"


# --emit's choices are planner.emit's artifacts (one list): "accelerate-fsdp2" is the member accelerate_fsdp2.
Emit = Enum("Emit", {name.replace("-", "_"): name for name in ARTIFACTS}, type=str, module=__name__)


def finite_float(text: str) -> float:
    """The parser of every float flag: a finite number. float() reads "nan", "inf" and "-inf", which no
    bandwidth or timeout means and which slip past `<= 0` checks (NaN compares false to everything)."""
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise typer.BadParameter(f"{text!r} is not a finite number")
    return value


# --- options shared by every command (one flag = one API argument) ---------------------------------
Model = Annotated[Optional[str], typer.Option("--model", "-m", help="Preset name, HF config.json, or a directory holding one")]
Gpus = Annotated[Optional[int], typer.Option("--gpus", "-g", help="Number of GPUs")]
GpusPerNode = Annotated[Optional[int], typer.Option("--gpus-per-node", help="GPUs per node (default min(gpus, 8))")]
Gpu = Annotated[str, typer.Option("--gpu", help="GPU type (see `fsdp-plan gpus`)")]
InternodeGbps = Annotated[Optional[float], typer.Option("--internode-gbps", parser=finite_float, help="Network per node, Gbit/s")]
GpuMemory = Annotated[Optional[str], typer.Option("--gpu-memory", help="Override GPU memory, e.g. 80GiB")]
IntraNode = Annotated[Optional[float], typer.Option("--intra-node-gb-per-s", parser=finite_float, help="Override intra-node bus bandwidth, GB/s")]
Pcie = Annotated[Optional[float], typer.Option("--pcie-gb-per-s", parser=finite_float, help="Override host<->device bandwidth, GB/s")]
CpuRam = Annotated[Optional[str], typer.Option("--cpu-ram-per-node", help="CPU RAM per node, e.g. 1TiB (checks offload)")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence")]
GlobalBatch = Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per optimizer step")]
Optim = Annotated[str, typer.Option("--optimizer", help="adamw, adam, sgd, adamw-8bit")]
FinetuneOpt = Annotated[str, typer.Option("--finetune", help="full or lora")]
LoraRank = Annotated[int, typer.Option("--lora-rank", help="LoRA rank")]
AttentionOpt = Annotated[Optional[str], typer.Option("--attention", help="sdpa (fused) or eager; default: sdpa, "
                                                     "or eager for models that do not run sdpa (Gemma 2, gpt-oss)")]
TrustRemoteCode = Annotated[bool, typer.Option("--trust-remote-code", help="Build a config.json whose auto_map names "
                                               "custom modelling code (runs that code)")]
FormatOpt = Annotated[Format, typer.Option("--format", help="table or json", callback=quiet_for)]  # json: no progress
ProfileOpt = Annotated[Optional[str], typer.Option("--profile", help="Predict with a profile.json fitted by "
                                                   "`fsdp-plan calibrate`")]
ForceProfile = Annotated[bool, typer.Option("--force-profile", help="Use a profile fitted on another GPU type")]
RoutingImbalance = Annotated[float, typer.Option("--routing-imbalance", parser=finite_float, help="MoE with --ep: "
                             "the busiest rank's routed tokens over the mean (1 = balanced routing, the default)")]
# the device mesh beside FSDP (torchtitan's degrees); on the plan command an unset degree is searched
Tp = Annotated[Optional[int], typer.Option("--tp", help="Tensor-parallel degree (heads and MLP split over N GPUs "
                                           "of a node; default 1, searched by the plan command)")]
Cp = Annotated[Optional[int], typer.Option("--cp", help="Context-parallel degree (each sequence split over N GPUs, "
                                           "ring attention; default 1, searched by the plan command)")]
Ep = Annotated[Optional[int], typer.Option("--ep", help="Expert-parallel degree (MoE: experts split over N GPUs; "
                                           "default 1, searched by the plan command)")]
PP_MICRO_BATCH = ("with --pp, --micro-batch is the pipeline microbatch: the local batch (global batch / "
                  "data-parallel ranks) is split into local batch / micro-batch microbatches, all run in one "
                  "schedule step")
Pp = Annotated[Optional[int], typer.Option("--pp", help="Pipeline-parallel degree: the blocks split evenly into "
                                           "stages over N ranks (the outermost mesh dimension; embedding on the "
                                           "first stage, norm + head + loss on the last; default 1, searched by the "
                                           f"plan command with its schedule); {PP_MICRO_BATCH}")]
PpSchedule = Annotated[Optional[str], typer.Option("--pp-schedule", help="With --pp: gpipe, 1f1b (default), "
                                                   "interleaved-1f1b, zero-bubble or dualpipev (torch.distributed."
                                                   "pipelining's ScheduleGPipe ... ScheduleDualPipeV)")]
PpStagesPerRank = Annotated[Optional[int], typer.Option("--pp-stages-per-rank", help="With --pp and a looped "
                                                        "schedule (interleaved-1f1b, zero-bubble, dualpipev): "
                                                        "stages V on each pipeline rank (default 2)")]
AsyncTp = Annotated[bool, typer.Option("--async-tp/--no-async-tp", help="Overlap TP's all-gathers and "
                                       "reduce-scatters with the matmuls (torchtitan; needs --compile)")]
SequenceParallel = Annotated[bool, typer.Option("--sequence-parallel/--no-sequence-parallel", help="With --tp: "
                                                "norms and residuals split over the sequence, loss parallel "
                                                "(torchtitan); --no-sequence-parallel: transformers' tp_plan "
                                                "(accelerate, HF Trainer), the logits gathered")]


def load_profile_flag(path: str | None, gpu: str, force: bool):
    """The cost-model Profile in --profile FILE (None without one), refused when fitted on another GPU type."""
    if path is None:
        return None
    from calibration.store import load_profile  # pydantic, no torch

    return load_profile(path, gpu_id=gpu, force=force)


def cluster_and_training(model, gpus, gpus_per_node, gpu, internode_gbps, gpu_memory, intra_node_gb_per_s,
                          pcie_gb_per_s, cpu_ram_per_node, seq_len, global_batch, optimizer, finetune,
                          lora_rank, trust_remote_code: bool = False, routing_imbalance: float = 1.0) -> dict:
    from planner.errors import PlannerError

    if model is None:
        raise PlannerError("model", "missing: pass --model with a preset name (see `fsdp-plan models`) or a "
                                    "config.json path")
    if gpus is None:
        raise PlannerError("gpus", "missing: pass --gpus N (N >= 1)")
    return dict(gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, internode_gbps=internode_gbps,
                gpu_memory=gpu_memory, intra_node_gb_per_s=intra_node_gb_per_s, pcie_gb_per_s=pcie_gb_per_s,
                cpu_ram_per_node=cpu_ram_per_node, seq_len=seq_len,
                global_batch=global_batch, optimizer=optimizer, finetune=finetune, lora_rank=lora_rank,
                trust_remote_code=trust_remote_code,
                **({"routing_imbalance": routing_imbalance} if routing_imbalance != 1.0 else {}))


def pipeline_args(pp_schedule, pp_stages_per_rank) -> dict:
    """--pp-schedule / --pp-stages-per-rank as API arguments: the given ones only (the rest: the defaults)."""
    return {k: v for k, v in (("pp_schedule", pp_schedule), ("pp_stages_per_rank", pp_stages_per_rank))
            if v is not None}


def mesh_degrees(tp, cp, ep, pp, default=None) -> dict:
    """--tp / --cp / --ep / --pp as API arguments: the given degrees, the rest `default` (None: searched)."""
    from planner.errors import PlannerError

    out = {}
    for name, value in (("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp)):
        if value is not None and value < 1:
            raise PlannerError(name, f"must be an integer >= 1, got {value}")
        if value is not None or default is not None:
            out[name] = value if value is not None else default
    return out


ConfigRunner = Callable[[str, dict, dict, Format], None]


def config_command(app, name: str, help_text: str, run: ConfigRunner, takes_profile: bool = False) -> None:
    """Register a command that takes exactly `fsdp-plan estimate`'s flags (model, cluster, training and one
    explicit configuration). `run(model, cluster_and_training_kwargs, config_kwargs, output_format)`; with
    takes_profile, config_kwargs also holds `profile` (the --profile file's Profile, or None)."""

    def command(
        model: Model = None, gpus: Gpus = None, gpus_per_node: GpusPerNode = None, gpu: Gpu = "a100-80gb",
        internode_gbps: InternodeGbps = None, gpu_memory: GpuMemory = None, intra_node_gb_per_s: IntraNode = None,
        pcie_gb_per_s: Pcie = None, cpu_ram_per_node: CpuRam = None,
        seq_len: SeqLen = 2048, global_batch: GlobalBatch = None, optimizer: Optim = "adamw",
        finetune: FinetuneOpt = "full", lora_rank: LoraRank = 16, attention: AttentionOpt = None,
        sharding: Annotated[str, typer.Option("--sharding", help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
                                                                 "HYBRID_SHARD_ZERO2")] = "FULL_SHARD",
        precision: Annotated[str, typer.Option("--precision", help="fp32, bf16, bf16-pure, fp16")] = "bf16",
        activation_checkpointing: Annotated[str, typer.Option("--activation-checkpointing", help="none, full, every-K, "
                                                              "selective-op (torchtitan's op-level policy in every "
                                                              "block)")] = "none",
        micro_batch: Annotated[int, typer.Option("--micro-batch", help="Sequences per GPU per micro-step; "
                                                 f"{PP_MICRO_BATCH}")] = 1,
        grad_accum: Annotated[Optional[int], typer.Option("--grad-accum", help="Micro-steps per optimizer step "
                                                          "(with --pp: the microbatches of one schedule step)")] = None,
        offload: Annotated[bool, typer.Option("--offload/--no-offload",
                                              help="CPU offload of params, grads, optimizer")] = False,
        backward_prefetch: Annotated[bool, typer.Option("--backward-prefetch/--no-backward-prefetch")] = True,
        limit_all_gathers: Annotated[bool, typer.Option("--limit-all-gathers/--no-limit-all-gathers")] = True,
        expert_shard_dim: Annotated[int, typer.Option("--expert-shard-dim", help="MoE, FSDP2: 0 shards stacked "
                                                      "experts on dim 0 (padded to the shard group), 1 on dim 1")] = 0,
        expert_units: Annotated[bool, typer.Option("--expert-units/--no-expert-units", help="MoE: wrap each block's "
                                                   "routed experts as their own FSDP unit")] = False,
        reduce_dtype: Annotated[Optional[str], typer.Option("--reduce-dtype", help="gradient reduction dtype: fp32 "
                                                            "or bf16 (default: the precision's)")] = None,
        compile: Annotated[bool, typer.Option("--compile/--no-compile", help="torch.compile each block "
                                              "(torchtitan style, before fully_shard)")] = False,
        float8: Annotated[bool, typer.Option("--float8/--no-float8", help="torchao Float8 linears in the blocks "
                                             "(GPUs with FP8 tensor cores, bf16 compute)")] = False,
        fp8_all_gather: Annotated[bool, typer.Option("--fp8-all-gather/--no-fp8-all-gather", help="with --float8, "
                                                     "FSDP2 all-gathers the Float8 weights in FP8")] = False,
        reshard_after_forward: Annotated[int, typer.Option("--reshard-after-forward", help="FSDP2: after forward keep "
                                                           "block params sharded over N ranks (a divisor of the shard "
                                                           "group, e.g. a node); 0: the strategy's own")] = 0,
        tp: Tp = None, cp: Cp = None, ep: Ep = None, pp: Pp = None, pp_schedule: PpSchedule = None,
        pp_stages_per_rank: PpStagesPerRank = None, async_tp: AsyncTp = False,
        sequence_parallel: SequenceParallel = True, routing_imbalance: RoutingImbalance = 1.0,
        output_format: FormatOpt = Format.table,
        profile: ProfileOpt = None, force_profile: ForceProfile = False, trust_remote_code: TrustRemoteCode = False,
    ):
        if profile is not None and not takes_profile:
            from planner.errors import PlannerError

            raise PlannerError("profile", f"`fsdp-plan {name}` does not use a profile")
        args = cluster_and_training(model, gpus, gpus_per_node, gpu, internode_gbps, gpu_memory, intra_node_gb_per_s,
                                    pcie_gb_per_s, cpu_ram_per_node, seq_len, global_batch, optimizer, finetune,
                                    lora_rank, trust_remote_code, routing_imbalance)
        config = dict(sharding=sharding, precision=precision, activation_checkpointing=activation_checkpointing,
                      micro_batch=micro_batch, grad_accum=grad_accum, attention=attention, offload=offload,
                      backward_prefetch=backward_prefetch, limit_all_gathers=limit_all_gathers,
                      expert_shard_dim=expert_shard_dim, expert_units=expert_units, reduce_dtype=reduce_dtype,
                      compile=compile, float8=float8, fp8_all_gather=fp8_all_gather,
                      reshard_after_forward=reshard_after_forward, **mesh_degrees(tp, cp, ep, pp, default=1),
                      **pipeline_args(pp_schedule, pp_stages_per_rank), async_tp=async_tp,
                      sequence_parallel=sequence_parallel)
        if takes_profile:
            config["profile"] = load_profile_flag(profile, gpu, force_profile)
        run(model, args, config, output_format)

    command.__doc__ = help_text
    app.command(name)(command)
