"""`fsdp-plan trace`: the real FSDP2 step on fake tensors (registered onto the app by planner.cli).

Takes exactly the flags of `fsdp-plan estimate` and prints the same JSON shape with "source": "trace",
plus the analytic estimate ("analytic") and the difference; or a table of both by category.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from planner.cli_options import (AttentionOpt, CpuRam, FinetuneOpt, Format, FormatOpt, GlobalBatch, Gpu, GpuMemory,
                                 Gpus, GpusPerNode, InternodeGbps, IntraNode, LoraRank, Model, Optim, Pcie, SeqLen,
                                 cluster_and_training)


def trace_cmd(
    model: Model = None, gpus: Gpus = None, gpus_per_node: GpusPerNode = None, gpu: Gpu = "a100-80gb",
    internode_gbps: InternodeGbps = None, gpu_memory: GpuMemory = None, intra_node_gb_per_s: IntraNode = None,
    pcie_gb_per_s: Pcie = None, cpu_ram_per_node: CpuRam = None,
    seq_len: SeqLen = 2048, global_batch: GlobalBatch = None, optimizer: Optim = "adamw",
    finetune: FinetuneOpt = "full", lora_rank: LoraRank = 16, attention: AttentionOpt = "sdpa",
    sharding: Annotated[str, typer.Option("--sharding", help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2")] = "FULL_SHARD",
    precision: Annotated[str, typer.Option("--precision", help="fp32, bf16, bf16-pure, fp16")] = "bf16",
    activation_checkpointing: Annotated[str, typer.Option("--activation-checkpointing", help="none, full, every-K")] = "none",
    micro_batch: Annotated[int, typer.Option("--micro-batch", help="Sequences per GPU per micro-step")] = 1,
    grad_accum: Annotated[Optional[int], typer.Option("--grad-accum", help="Micro-steps per optimizer step")] = None,
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="CPU offload of params, grads, optimizer")] = False,
    backward_prefetch: Annotated[bool, typer.Option("--backward-prefetch/--no-backward-prefetch")] = True,
    limit_all_gathers: Annotated[bool, typer.Option("--limit-all-gathers/--no-limit-all-gathers")] = True,
    output_format: FormatOpt = Format.table,
):
    """Run the real FSDP2 step on fake tensors (no GPU) and compare its memory with the estimate."""
    import json

    from planner.tracing import report_text, trace

    args = cluster_and_training(model, gpus, gpus_per_node, gpu, internode_gbps, gpu_memory, intra_node_gb_per_s,
                                 pcie_gb_per_s, cpu_ram_per_node, seq_len, global_batch, optimizer, finetune,
                                 lora_rank)
    r = trace(model, sharding=sharding, precision=precision, activation_checkpointing=activation_checkpointing,
              micro_batch=micro_batch, grad_accum=grad_accum, attention=attention, offload=offload,
              backward_prefetch=backward_prefetch, limit_all_gathers=limit_all_gathers, **args)
    typer.echo(json.dumps(r.to_dict(), indent=2) if output_format is Format.json else report_text(r))


def register(app) -> None:
    """Add the trace command to the typer app."""
    app.command("trace")(trace_cmd)
