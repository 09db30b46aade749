"""Options shared by the `fsdp-plan` commands: one flag = one API argument, defined once."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer


class Format(str, Enum):
    table = "table"
    json = "json"


class Emit(str, Enum):
    fsdp1 = "fsdp1"
    fsdp2 = "fsdp2"
    accelerate = "accelerate"
    accelerate_fsdp2 = "accelerate-fsdp2"
    lightning = "lightning"
    torchrun = "torchrun"
    slurm = "slurm"


# --- options shared by every command (one flag = one API argument) ---------------------------------
Model = Annotated[Optional[str], typer.Option("--model", "-m", help="Preset name, HF config.json, or a directory holding one")]
Gpus = Annotated[Optional[int], typer.Option("--gpus", "-g", help="Number of GPUs")]
GpusPerNode = Annotated[Optional[int], typer.Option("--gpus-per-node", help="GPUs per node (default min(gpus, 8))")]
Gpu = Annotated[str, typer.Option("--gpu", help="GPU type (see `fsdp-plan gpus`)")]
InternodeGbps = Annotated[Optional[float], typer.Option("--internode-gbps", help="Network per node, Gbit/s")]
GpuMemory = Annotated[Optional[str], typer.Option("--gpu-memory", help="Override GPU memory, e.g. 80GiB")]
IntraNode = Annotated[Optional[float], typer.Option("--intra-node-gb-per-s", help="Override intra-node bus bandwidth, GB/s")]
Pcie = Annotated[Optional[float], typer.Option("--pcie-gb-per-s", help="Override host<->device bandwidth, GB/s")]
CpuRam = Annotated[Optional[str], typer.Option("--cpu-ram-per-node", help="CPU RAM per node, e.g. 1TiB (checks offload)")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence")]
GlobalBatch = Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per optimizer step")]
Optim = Annotated[str, typer.Option("--optimizer", help="adamw, adam, sgd, adamw-8bit")]
FinetuneOpt = Annotated[str, typer.Option("--finetune", help="full or lora")]
LoraRank = Annotated[int, typer.Option("--lora-rank", help="LoRA rank")]
AttentionOpt = Annotated[str, typer.Option("--attention", help="sdpa (fused) or eager")]
FormatOpt = Annotated[Format, typer.Option("--format", help="table or json")]


def cluster_and_training(model, gpus, gpus_per_node, gpu, internode_gbps, gpu_memory, intra_node_gb_per_s,
                          pcie_gb_per_s, cpu_ram_per_node, seq_len, global_batch, optimizer, finetune,
                          lora_rank) -> dict:
    from planner.errors import PlannerError

    if model is None:
        raise PlannerError("model", "missing: pass --model with a preset name (see `fsdp-plan models`) or a "
                                    "config.json path")
    if gpus is None:
        raise PlannerError("gpus", "missing: pass --gpus N (N >= 1)")
    return dict(gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, internode_gbps=internode_gbps,
                gpu_memory=gpu_memory, intra_node_gb_per_s=intra_node_gb_per_s, pcie_gb_per_s=pcie_gb_per_s,
                cpu_ram_per_node=cpu_ram_per_node, seq_len=seq_len,
                global_batch=global_batch, optimizer=optimizer, finetune=finetune, lora_rank=lora_rank)
