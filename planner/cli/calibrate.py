"""`fsdp-plan calibrate`: short real FSDP runs, fitted back into the cost model (registered by planner.cli).

    fsdp-plan calibrate --model llama3-8b --gpus 8 --gpu h100-80gb --top 3 --steps 10 --warmup 3 --out calib
    fsdp-plan calibrate --model llama3-8b --gpus 8 --sharding FULL_SHARD --micro-batch 2 --out calib  # one config
    fsdp-plan calibrate ... --nodes 2 --rdzv-endpoint node0:29500 [--launch --node-rank N] [--emit slurm]
    fsdp-plan calibrate --factory my_pkg.models:build --gpus 2 --device cpu --out calib-cpu
    fsdp-plan calibrate --model llama3-8b --gpus 8 --sharding FULL_SHARD --tp 2 --out calib-tp  # one mesh config

Only forwards flags to planner.calibrating.calibrate and prints its report (planner.reports.table_calibration).
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Annotated, Optional

import typer

from planner.cli.options import (AttentionOpt, Cp, Ep, FinetuneOpt, FormatOpt, Format, GlobalBatch, Gpu, Gpus,
                                 GpusPerNode, InternodeGbps, LoraRank, Model, Optim, Pp, PpSchedule, PpStagesPerRank,
                                 SeqLen, Tp, finite_float, mesh_degrees, pipeline_args)


class CalibrateEmit(str, Enum):
    slurm = "slurm"


_EXPLICIT = ("sharding", "activation_checkpointing", "micro_batch", "grad_accum", "offload", "backward_prefetch",
             "limit_all_gathers")


def _fault(text: str | None) -> dict | None:
    """--fault RUN:RANK:KIND[:STEP] (testing): make rank RANK of the RUN-th run (0-based) fail."""
    if not text:
        return None
    from planner.errors import PlannerError

    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[0].isdigit() or not parts[1].isdigit():
        raise PlannerError("fault", f"expected RUN:RANK:KIND[:STEP], got {text!r}")
    return {"run": int(parts[0]), "rank": int(parts[1]), "kind": parts[2],
            "step": int(parts[3]) if len(parts) == 4 else 0}


def register(app) -> None:
    """Add the calibrate command to the typer app."""

    @app.command("calibrate")
    def calibrate_cmd(
        out: Annotated[str, typer.Option("--out", help="Directory for results.jsonl, profile.json, logs")] = "calibration",
        model: Model = None,
        factory: Annotated[Optional[str], typer.Option("--factory", help="pkg.module:function building the nn.Module "
                                                       "(called with n_layers=L under --layers)")] = None,
        gpus: Gpus = None, gpus_per_node: GpusPerNode = None,
        nodes: Annotated[Optional[int], typer.Option("--nodes", help="Nodes (multi-node: with --rdzv-endpoint)")] = None,
        gpu: Gpu = "a100-80gb", internode_gbps: InternodeGbps = None,
        device: Annotated[str, typer.Option("--device", help="cuda (NCCL) or cpu (gloo, one thread per rank)")] = "cuda",
        seq_len: SeqLen = 2048, global_batch: GlobalBatch = None, optimizer: Optim = "adamw",
        finetune: FinetuneOpt = "full", lora_rank: LoraRank = 16, attention: AttentionOpt = None,
        precision: Annotated[Optional[list[str]], typer.Option(
            "--precision", help="Precisions to search (repeatable); one value with the config flags")] = None,
        top: Annotated[Optional[int], typer.Option("--top", help="Run the K best planned candidates (default 3)")] = None,
        sharding: Annotated[Optional[str], typer.Option("--sharding", help="Run this config (estimate's flags)")] = None,
        activation_checkpointing: Annotated[Optional[str], typer.Option("--activation-checkpointing")] = None,
        micro_batch: Annotated[Optional[int], typer.Option("--micro-batch")] = None,
        grad_accum: Annotated[Optional[int], typer.Option("--grad-accum")] = None,
        offload: Annotated[Optional[bool], typer.Option("--offload/--no-offload")] = None,
        backward_prefetch: Annotated[Optional[bool], typer.Option("--backward-prefetch/--no-backward-prefetch")] = None,
        limit_all_gathers: Annotated[Optional[bool], typer.Option("--limit-all-gathers/--no-limit-all-gathers")] = None,
        tp: Tp = None, cp: Cp = None, ep: Ep = None, pp: Pp = None, pp_schedule: PpSchedule = None,
        pp_stages_per_rank: PpStagesPerRank = None,
        sequence_parallel: Annotated[Optional[bool], typer.Option(
            "--sequence-parallel/--no-sequence-parallel", help="With --tp: torchtitan's sequence + loss parallel "
            "(default), or transformers' tp_plan")] = None,
        steps: Annotated[int, typer.Option("--steps", help="Timed steps per run")] = 10,
        warmup: Annotated[int, typer.Option("--warmup", help="Untimed steps first")] = 3,
        fsdp_version: Annotated[int, typer.Option("--fsdp-version", help="1 (FullyShardedDataParallel) or 2 (fully_shard)")] = 2,
        layers: Annotated[Optional[int], typer.Option("--layers", help="Run L blocks, extrapolate per block")] = None,
        emulate_world_size: Annotated[Optional[int], typer.Option(
            "--emulate-world-size", help="One device runs rank 0 of an N-rank job (fake process group)")] = None,
        profile: Annotated[Optional[str], typer.Option("--profile", help="Predict with this profile.json")] = None,
        force_profile: Annotated[bool, typer.Option("--force-profile", help="Use a profile from another cluster")] = False,
        fit: Annotated[bool, typer.Option("--fit/--no-fit", help="Refit the profile from the measured runs")] = True,
        resume: Annotated[bool, typer.Option("--resume", help="Skip runs already in DIR/results.jsonl")] = False,
        timeout: Annotated[Optional[float], typer.Option("--timeout", parser=finite_float, help="Seconds per run before its process "
                                                         "group is killed (default: 600 + 10x the predicted steps)")] = None,
        launch: Annotated[bool, typer.Option("--launch", help="Multi-node: run this node's part (else print)")] = False,
        rdzv_endpoint: Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT of node 0")] = None,
        node_rank: Annotated[int, typer.Option("--node-rank", help="This node's rank (with --launch)")] = 0,
        torch_profile: Annotated[bool, typer.Option("--torch-profile", help="Save a torch.profiler trace (Chrome "
                                                    "JSON) of one more step per run beside its result")] = False,
        emit: Annotated[Optional[CalibrateEmit], typer.Option("--emit", help="Print a SLURM batch script instead")] = None,
        output_format: FormatOpt = Format.table,
        fault: Annotated[Optional[str], typer.Option("--fault", hidden=True, help="Testing: RUN:RANK:KIND[:STEP]")] = None,
    ):
        """Run the best candidates (or one config) for a few real steps, refit the cost model, re-rank."""
        import dataclasses

        from cost_models.specs import FsdpConfig
        from planner.calibrating import CalibrationRequest, calibrate, slurm_script
        from planner.errors import PlannerError
        from planner.reports.table_calibration import calibration_json, calibration_text

        if gpus is None:
            raise PlannerError("gpus", "missing: pass --gpus N (ranks per run; 1 with --emulate-world-size)")
        given = {k: v for k, v in dict(sharding=sharding, activation_checkpointing=activation_checkpointing,
                                       micro_batch=micro_batch, grad_accum=grad_accum, offload=offload,
                                       backward_prefetch=backward_prefetch,
                                       limit_all_gathers=limit_all_gathers, sequence_parallel=sequence_parallel,
                                       **mesh_degrees(tp, cp, ep, pp),
                                       **pipeline_args(pp_schedule, pp_stages_per_rank)).items() if v is not None}
        config = None
        if given:
            if top is not None:
                raise PlannerError("top", "give either --top K or one configuration's flags (--sharding ...), not both")
            if precision and len(precision) > 1:
                raise PlannerError("precision", "one configuration takes one --precision")
            if "activation_checkpointing" in given:
                given["ac_every"] = given.pop("activation_checkpointing")
            config = FsdpConfig(precision=(precision or ["fp32" if device == "cpu" else "bf16"])[0], **given)
            if config.pp > 1 and grad_accum is None and not global_batch:  # as estimate and the search: 2 a stage
                from planner.search.pipeline import PP_MICROBATCHES_PER_STAGE

                config = dataclasses.replace(config, grad_accum=PP_MICROBATCHES_PER_STAGE * config.pp_stages)
            if config.grad_accum == 1 and global_batch and grad_accum is None:
                world = emulate_world_size or gpus
                if world % config.model_parallel:
                    raise PlannerError("mesh", f"tp x cp x pp = {config.model_parallel} does not divide gpus={world}")
                # the global batch splits over the data-parallel ranks only (a TP / CP group shares its sequences)
                per_step = config.micro_batch * (world // config.model_parallel)
                if global_batch % per_step:
                    dp = "gpus" if config.model_parallel == 1 else "data-parallel ranks"
                    raise PlannerError("global_batch", f"{global_batch} is not a multiple of micro_batch x {dp} = {per_step}")
                config = dataclasses.replace(config, grad_accum=global_batch // per_step)
        request = CalibrationRequest(
            out_dir=out, gpus=gpus, model=model, factory=factory, device=device, gpu=gpu, gpus_per_node=gpus_per_node,
            nodes=nodes, internode_gbps=internode_gbps, seq_len=seq_len, global_batch=global_batch,
            optimizer=optimizer, finetune=finetune, lora_rank=lora_rank, precisions=precision, attention=attention,
            top=top or 3, config=config, steps=steps, warmup=warmup, fsdp_version=fsdp_version, layers=layers, emulate_world_size=emulate_world_size,
            profile=profile, force_profile=force_profile, fit=fit, resume=resume, timeout_s=timeout, launch=launch,
            rdzv_endpoint=rdzv_endpoint, node_rank=node_rank, torch_profile=torch_profile, fault=_fault(fault))
        if emit is CalibrateEmit.slurm:
            argv = sys.argv[1:]
            if argv and argv[0] == "calibrate":
                argv = argv[1:]
            typer.echo(slurm_script(request, argv), nl=False)
            return
        try:
            report = calibrate(request)
        except KeyboardInterrupt:  # the run in flight was killed with its process group (calibration.launch)
            typer.echo(f"\ninterrupted: every run that ended is in {out}/results.jsonl; the same command with "
                       "--resume runs the rest", err=True)
            raise typer.Exit(130) from None
        typer.echo(calibration_json(report) if output_format is Format.json else calibration_text(report))
