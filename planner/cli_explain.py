"""`fsdp-plan explain`: the planner's pick, its memory and time budget term by term."""

from __future__ import annotations

from planner.cli_options import (CpuRam, FinetuneOpt, GlobalBatch, Gpu, GpuMemory, Gpus, GpusPerNode, InternodeGbps,
                                 IntraNode, LoraRank, Model, Optim, Pcie, SeqLen, cluster_and_training)


def register(app) -> None:
    @app.command("explain")
    def explain_cmd(
        model: Model = None, gpus: Gpus = None, gpus_per_node: GpusPerNode = None, gpu: Gpu = "a100-80gb",
        internode_gbps: InternodeGbps = None, gpu_memory: GpuMemory = None, intra_node_gb_per_s: IntraNode = None,
        pcie_gb_per_s: Pcie = None, cpu_ram_per_node: CpuRam = None, seq_len: SeqLen = 2048,
        global_batch: GlobalBatch = None, optimizer: Optim = "adamw", finetune: FinetuneOpt = "full",
        lora_rank: LoraRank = 16,
    ):
        """Walk through the winning config's memory and time budget, formula by formula."""
        import typer

        from planner.api import plan
        from planner.errors import PlannerError
        from planner.explain import explain_text

        args = cluster_and_training(model, gpus, gpus_per_node, gpu, internode_gbps, gpu_memory, intra_node_gb_per_s,
                                    pcie_gb_per_s, cpu_ram_per_node, seq_len, global_batch, optimizer, finetune,
                                    lora_rank)
        p = plan(model, **args)
        if p.best is None:
            raise PlannerError("model", f"nothing fits {p.model.name} on {gpus} x {gpu}; run `fsdp-plan --model "
                                        f"{model} --gpus {gpus}` for the nearest misses and what would fit")
        typer.echo(explain_text(p.best))
