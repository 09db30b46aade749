"""`fsdp-plan calibrate`: short real FSDP runs, fitted back into the cost model (registered by planner.cli).

    fsdp-plan calibrate --model llama3-8b --gpus 8 --gpu h100-80gb --top 3 --steps 10 --warmup 3 --out calib
    fsdp-plan calibrate --model llama3-8b --gpus 8 --sharding FULL_SHARD --micro-batch 2 --out calib  # one config
    fsdp-plan calibrate ... --nodes 2 --rdzv-endpoint node0:29500 [--launch --node-rank N] [--emit slurm]
    fsdp-plan calibrate --factory my_pkg.models:build --gpus 2 --device cpu --out calib-cpu
    fsdp-plan calibrate --model llama3-8b --gpus 8 --sharding FULL_SHARD --tp 2 --out calib-tp  # one mesh config
    fsdp-plan calibrate ... --gpus 8 --sharding HYBRID_SHARD --shard-group-gpus 4 --out calib-hsdp  # (2, 4) groups

Only forwards flags to planner.calibrating.calibrate and prints its report (planner.reports.table_calibration);
the flags are CalibrationRequest's knobs and the request's (planner/cli/flags.py).
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Annotated, Optional

import typer

from planner.calibrating.request import CalibrationRequest
from planner.cli.options import MESH, TRAINING, As, Format, FormatOpt, command, options, param


class CalibrateEmit(str, Enum):
    slurm = "slurm"


# one configuration's flags (any given: run that config, not the top K)
_EXPLICIT = ("sharding", "activation_checkpointing", "micro_batch", "grad_accum", "offload", "backward_prefetch",
             "limit_all_gathers")
_GIVEN = {**{n: As(default=None, help=None) for n in _EXPLICIT},
          "sharding": As(default=None, help="Run this config (estimate's flags)"),
          "sequence_parallel": As(default=None, help="With --tp: torchtitan's sequence + loss parallel (default), "
                                                     "or transformers' tp_plan")}


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


def _params():
    return [
        *options("out_dir", "model", "factory", "gpus", "gpus_per_node", "nodes", "gpu", "internode_gbps", "device",
                 *TRAINING, "attention", "precisions", "top", request=CalibrationRequest, top=As(default=None),
                 precisions=As(help="Precisions to search (repeatable); one value with the config flags")),
        *options(*_EXPLICIT, *MESH, "sequence_parallel", "shard_group_gpus", **_GIVEN),
        *options("steps", "warmup", "fsdp_version", "layers", "emulate_world_size", "profile", "force_profile", "fit",
                 "resume", "timeout_s", "launch", "rdzv_endpoint", "node_rank", "torch_profile",
                 request=CalibrationRequest, launch=As(default=False)),
        param("emit", Annotated[Optional[CalibrateEmit], typer.Option("--emit", help="Print a SLURM batch script "
                                                                                    "instead")], None),
        param("output_format", FormatOpt, Format.table),
        param("fault", Annotated[Optional[str], typer.Option("--fault", hidden=True, help="Testing: "
                                                             "RUN:RANK:KIND[:STEP]")], None),
    ]


def _one_config(knobs: dict, precisions, top, device, gpus, global_batch, emulate_world_size):
    """The FsdpConfig of the config flags given (None: none given, run the top K)."""
    import dataclasses

    from cost_models.specs import FsdpConfig
    from planner.errors import PlannerError
    from planner.request import MeshRequest

    mesh = {n: knobs.pop(n) for n in (*MESH, "sequence_parallel", "shard_group_gpus")}
    MeshRequest(**mesh)  # degrees >= 1
    explicit = {n: knobs.pop(n) for n in _EXPLICIT}
    given = {k: v for k, v in {**explicit, **mesh}.items() if v is not None}
    if not given:
        return None
    if top is not None:
        raise PlannerError("top", "give either --top K or one configuration's flags (--sharding ...), not both")
    if precisions and len(precisions) > 1:
        raise PlannerError("precision", "one configuration takes one --precision")
    if "activation_checkpointing" in given:
        given["ac_every"] = given.pop("activation_checkpointing")
    config = FsdpConfig(precision=(precisions or ["fp32" if device == "cpu" else "bf16"])[0], **given)
    if config.pp > 1 and explicit["grad_accum"] is None and not global_batch:  # as estimate and the search: 2 a stage
        from planner.search.pipeline import PP_MICROBATCHES_PER_STAGE

        config = dataclasses.replace(config, grad_accum=PP_MICROBATCHES_PER_STAGE * config.pp_stages)
    if config.grad_accum == 1 and global_batch and explicit["grad_accum"] is None:
        world = emulate_world_size or gpus
        if world % config.model_parallel:
            raise PlannerError("mesh", f"tp x cp x pp = {config.model_parallel} does not divide gpus={world}")
        # the global batch splits over the data-parallel ranks only (a TP / CP group shares its sequences)
        per_step = config.micro_batch * (world // config.model_parallel)
        if global_batch % per_step:
            dp = "gpus" if config.model_parallel == 1 else "data-parallel ranks"
            raise PlannerError("global_batch", f"{global_batch} is not a multiple of micro_batch x {dp} = {per_step}")
        config = dataclasses.replace(config, grad_accum=global_batch // per_step)
    return config


def calibrate_cmd(out_dir: str, gpus: int | None, precisions, top: int | None, emit, output_format: Format,
                  fault: str | None, **knobs):
    """Run the best candidates (or one config) for a few real steps, refit the cost model, re-rank."""
    from planner.calibrating import calibrate, slurm_script
    from planner.errors import PlannerError
    from planner.reports.table_calibration import calibration_json, calibration_text

    if gpus is None:
        raise PlannerError("gpus", "missing: pass --gpus N (ranks per run; 1 with --emulate-world-size)")
    config = _one_config(knobs, precisions, top, knobs["device"], gpus, knobs["global_batch"],
                         knobs["emulate_world_size"])
    request = CalibrationRequest(out_dir, gpus, precisions=precisions, top=top or 3, config=config,
                                 fault=_fault(fault), **knobs)
    if emit is CalibrateEmit.slurm:
        argv = sys.argv[1:]
        if argv and argv[0] == "calibrate":
            argv = argv[1:]
        typer.echo(slurm_script(request, argv), nl=False)
        return
    try:
        report = calibrate(request)
    except KeyboardInterrupt:  # the run in flight was killed with its process group (calibration.launch)
        typer.echo(f"\ninterrupted: every run that ended is in {out_dir}/results.jsonl; the same command with "
                   "--resume runs the rest", err=True)
        raise typer.Exit(130) from None
    typer.echo(calibration_json(report) if output_format is Format.json else calibration_text(report))


def register(app) -> None:
    """Add the calibrate command to the typer app."""
    app.command("calibrate")(command(_params(), calibrate_cmd, calibrate_cmd.__doc__))
