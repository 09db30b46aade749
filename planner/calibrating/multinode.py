"""The text a multi-node calibration prints instead of running: each run's torchrun command per node,
and a SLURM batch script that runs the same calibration on every node (--emit slurm)."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

from calibration import launch as launching
from calibration import store
from cost_models.specs import FsdpConfig

from ..search import describe
from .request import CalibrationRequest, nodes_and_per_node


def node_commands(device: str, jobs: list[tuple[FsdpConfig, Path]], launch: launching.Launch,
                  nodes: int) -> list[str]:
    """Multi-node without --launch: each run's torchrun command for every node (its job file already
    written), to run in order."""
    lines = []
    for position, (config, job_path) in enumerate(jobs):
        lines.append(f"# run {position + 1}/{len(jobs)}: {describe(config, compact=True)}")
        for node in range(nodes):
            run_launch = replace(launch, python=None,
                                 rendezvous=replace(launch.rendezvous, port=launch.rendezvous.port + position))
            argv = launching.runner_command(run_launch, job_path, node_rank=node)
            lines.append(f"#   node {node}:")
            lines.append(launching.shell_line(argv, {"OMP_NUM_THREADS": 1} if device == "cpu" else None))
    return lines


def slurm_script(request: CalibrationRequest, argv: list[str]) -> str:
    """sbatch script: one task per node, each running this calibration with --launch and its node rank;
    node 0's address is the rendezvous. DIR must be on a filesystem every node sees."""
    nodes, per_node = nodes_and_per_node(request)
    args = [a for a in argv]
    drop_with_value = {"--emit", "--rdzv-endpoint", "--node-rank"}
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in drop_with_value:
            skip = True
            continue
        if a.split("=", 1)[0] in drop_with_value or a in ("--launch", "--no-launch"):
            continue
        kept.append(a)
    command = " ".join(shlex.quote(a) for a in ["fsdp-plan", "calibrate", *kept])
    gres = f"#SBATCH --gpus-per-node={per_node}" if request.device == "cuda" else f"#SBATCH --cpus-per-task={per_node}"
    return "\n".join([
        "#!/bin/bash",
        f"# fsdp-plan calibrate on {nodes} node(s) x {per_node}: every node runs the same calibration, node 0",
        f"# records {Path(request.out_dir) / store.RESULTS_FILE} and fits {Path(request.out_dir) / store.PROFILE_FILE}.",
        "#SBATCH --job-name=fsdp-calibrate",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        gres,
        "#SBATCH --exclusive",
        "set -euo pipefail",
        "head_node=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        "export HEAD_NODE=\"$head_node\" OMP_NUM_THREADS=1",
        "# one task per node; each expands its own $SLURM_NODEID",
        "srun --kill-on-bad-exit=0 bash -c " + shlex.quote(
            f'{command} --launch --node-rank "$SLURM_NODEID" --rdzv-endpoint "$HEAD_NODE:29500"'),
    ]) + "\n"

