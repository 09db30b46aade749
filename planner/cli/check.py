"""`fsdp-plan check`: price an existing FSDP setup and list what is wrong with it.

Exit code 0 with no errors, 1 with errors (usable in CI), 2 for unreadable input.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from planner.cli.options import (CpuRam, FinetuneOpt, Format, FormatOpt, GlobalBatch, Gpu, GpuMemory, Gpus,
                                 GpusPerNode, InternodeGbps, IntraNode, LoraRank, Model, Optim, Pcie)

CONFIG_HELP = ("The setup to check, told apart by content: an accelerate config (YAML); FSDP1 "
               "FullyShardedDataParallel kwargs or FSDP2 fully_shard arguments (JSON/YAML); Hugging Face "
               "TrainingArguments (JSON/YAML with fsdp, fsdp_config); a torchtitan 0.2 job file (.toml) or a "
               "flag list (a text file: 0.3's --module/--config, --section.option flags, activation-checkpoint:X). "
               "Mesh degrees (tp, cp, ep) are read too. Without it: the --sharding/--precision/... flags")
# None: the file's own sequence length where it says one (torchtitan's training.seq_len), else 2048
SeqLenOrFile = Annotated[Optional[int], typer.Option(
    "--seq-len", help="Tokens per sequence [default: the file's (torchtitan training.seq_len), else 2048]")]


def register(app) -> None:
    @app.command("check")
    def check_cmd(
        config: Annotated[Optional[str], typer.Argument(help=CONFIG_HELP)] = None,
        model: Model = None, gpus: Gpus = None, gpus_per_node: GpusPerNode = None, gpu: Gpu = "a100-80gb",
        internode_gbps: InternodeGbps = None, gpu_memory: GpuMemory = None, intra_node_gb_per_s: IntraNode = None,
        pcie_gb_per_s: Pcie = None, cpu_ram_per_node: CpuRam = None, seq_len: SeqLenOrFile = None,
        global_batch: GlobalBatch = None, optimizer: Optim = "adamw", finetune: FinetuneOpt = "full",
        lora_rank: LoraRank = 16,
        micro_batch: Annotated[Optional[int], typer.Option("--micro-batch", help="Sequences per GPU per micro-step")] = None,
        grad_accum: Annotated[Optional[int], typer.Option("--grad-accum", help="Micro-steps per optimizer step")] = None,
        sharding: Annotated[Optional[str], typer.Option("--sharding", help="Without a file: the strategy")] = None,
        precision: Annotated[Optional[str], typer.Option("--precision", help="Without a file: fp32, bf16, bf16-pure, fp16")] = None,
        activation_checkpointing: Annotated[Optional[str], typer.Option("--activation-checkpointing")] = None,
        offload: Annotated[bool, typer.Option("--offload/--no-offload")] = False,
        dynamic_control_flow: Annotated[bool, typer.Option(
            "--dynamic-control-flow", help="The model's forward has data-dependent control flow (MoE routing, ...)")] = False,
        output_format: FormatOpt = Format.table,
    ):
        """Check an existing FSDP config (file or flags): estimate, then findings with fixes."""
        from planner.reports import table as report
        from planner.doctor import check
        from planner.errors import PlannerError
        from planner.doctor.readers import UserSetup, read_setup
        from cost_models.specs import FsdpConfig

        setup = read_setup(config) if config is not None else None
        model = model or (setup.model if setup is not None else None)  # torchtitan 0.3's --module / --config
        if model is None:
            raise PlannerError("model", "missing: pass --model with a preset name or a config.json path")
        if setup is not None:
            if activation_checkpointing is not None:
                from dataclasses import replace
                setup = replace(setup, config=replace(setup.config, ac_every=activation_checkpointing,
                                                  selective_op_ac=False))  # the flag's value decides
        else:
            setup = UserSetup(config=FsdpConfig(sharding=sharding or "FULL_SHARD", precision=precision or "bf16",
                                                ac_every=activation_checkpointing or "none", offload=offload),
                              source="flags")
        r = check(setup, model, gpus, gpus_per_node=gpus_per_node, micro_batch=micro_batch, grad_accum=grad_accum,
                  dynamic_control_flow=dynamic_control_flow, gpu=gpu, internode_gbps=internode_gbps,
                  gpu_memory=gpu_memory, intra_node_gb_per_s=intra_node_gb_per_s, pcie_gb_per_s=pcie_gb_per_s,
                  cpu_ram_per_node=cpu_ram_per_node, seq_len=seq_len, global_batch=global_batch,
                  optimizer=optimizer, finetune=finetune, lora_rank=lora_rank)
        typer.echo(report.check_json(r) if output_format is Format.json else report.check_text(r))
        if r.has_errors:
            raise typer.Exit(1)
