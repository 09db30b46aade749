"""The launchers' dialects of a plan (dispatched by planner/emit/): a torchrun command, a slurm sbatch script, a
Kubeflow PyTorchJob manifest; each starts torchrun on every node. Pure strings: no torch import.
"""

from __future__ import annotations

import re

from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec

from planner.emit.code import mesh as meshed
from planner.emit.code import techniques as tech
from planner.emit.common import (RDZV_PORT, _comment, _summary, env_words, launch_env, multi_node_note,
                                  torchrun_args, torchrun_command)


def emit_torchrun(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec, script: str = "train.py") -> str:
    """torchrun command line: standalone on one node, c10d rendezvous on $MASTER_ADDR across nodes."""
    header = (_summary(config, model_spec, cluster) + tech.launcher_notes(config) + meshed.launcher_mesh_note(config)
              + multi_node_note(cluster))
    return _comment(header) + "\n" + torchrun_command(cluster, script, launch_env(config, cluster)) + "\n"


def emit_slurm(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec, script: str = "train.py") -> str:
    """sbatch script: one task per node, each running torchrun for that node's GPUs (c10d rendezvous)."""
    return "\n".join([
        "#!/bin/bash",
        _comment(_summary(config, model_spec, cluster) + tech.launcher_notes(config)
                 + meshed.launcher_mesh_note(config)),
        f"#SBATCH --job-name=fsdp-{model_spec.name}",
        f"#SBATCH --nodes={cluster.n_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={cluster.gpus_per_node}",
        "#SBATCH --exclusive",
        "set -euo pipefail",
        "head_node=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        *[f"export {a}" for a in env_words(launch_env(config, cluster))],  # srun passes it on (--export=ALL)
        " ".join(["srun torchrun", *torchrun_args(cluster, script, nnodes='"$SLURM_NNODES"',
                                                  endpoint=f'"$head_node:{RDZV_PORT}"', rdzv_id='"$SLURM_JOB_ID"')]),
    ]) + "\n"


# ---------------------------------------------------------------- Kubeflow PyTorchJob

def _k8s_name(text: str) -> str:
    """A DNS-1123 label: lower case letters, digits and '-', at most 63 characters."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].rstrip("-") or "fsdp"


def emit_pytorchjob(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
                    script: str = "train.py", image: str = "your-registry/your-training-image:latest") -> str:
    """Kubeflow training operator PyTorchJob (kubeflow.org/v1): a Master pod and nodes - 1 Worker pods, each
    running the torchrun command of --emit torchrun with the node's GPUs requested."""
    import yaml

    name = _k8s_name(f"fsdp-{model_spec.name}")
    # Kubernetes expands $(VAR) in a container's command from its environment, where the operator puts MASTER_ADDR.
    args = [a.replace("$MASTER_ADDR", "$(MASTER_ADDR)") for a in torchrun_args(cluster, script)]
    env = [{"name": name, "value": value} for name, value in launch_env(config, cluster).items()]

    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": {
            "containers": [{
                "name": "pytorch",  # the operator finds the training container by this name
                "image": image,
                "command": ["torchrun", *args],
                **({"env": env} if env else {}),
                "ports": [{"name": "pytorchjob-port", "containerPort": RDZV_PORT}],
                "resources": {"limits": {"nvidia.com/gpu": cluster.gpus_per_node}},
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        }}}

    specs = {"Master": replica(1)}
    if cluster.n_nodes > 1:
        specs["Worker"] = replica(cluster.n_nodes - 1)
    manifest = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
                "spec": {"nprocPerNode": str(cluster.gpus_per_node), "pytorchReplicaSpecs": specs}}
    header = _summary(config, model_spec, cluster) + tech.launcher_notes(config) + meshed.launcher_mesh_note(config) + [
        f"kubectl apply -f <this file>; one pod per node ({cluster.n_nodes}), {cluster.gpus_per_node} GPU(s) each; "
        "replace the image with yours (it must hold the training script)",
        f"the operator sets MASTER_ADDR and MASTER_PORT (= the port named pytorchjob-port, {RDZV_PORT}), WORLD_SIZE "
        "and RANK; torchrun's c10d rendezvous uses MASTER_ADDR",
        "/dev/shm as a memory volume: NCCL and DataLoader workers need more than a pod's 64 MB default",
    ]
    return _comment(header) + "\n" + yaml.safe_dump(manifest, sort_keys=False, width=120)
