"""`fsdp-plan explain`: the planner's pick, or one configuration given by flags, its memory and time budget
term by term; --plot draws the step budget by operator class; --format json gives estimate's JSON with the
same terms under "explanation" (planner.schemas.ExplainOutput)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from planner.cli.options import (AttentionOpt, CpuRam, FinetuneOpt, Format, FormatOpt, GlobalBatch, Gpu, GpuMemory,
                                 Gpus, GpusPerNode, InternodeGbps, IntraNode, LoraRank, Model, Optim, Pcie, SeqLen,
                                 Cp, Ep, Pp, PP_MICRO_BATCH, PpSchedule, PpStagesPerRank, Tp, cluster_and_training,
                                 mesh_degrees, pipeline_args)



def _opt(flag: str, help_text: str):
    """A config flag: None unless given (any one given: explain that config, not the planner's pick)."""
    return typer.Option(flag, help=f"config: {help_text}")


def register(app) -> None:
    @app.command("explain")
    def explain_cmd(
        model: Model = None, gpus: Gpus = None, gpus_per_node: GpusPerNode = None, gpu: Gpu = "a100-80gb",
        internode_gbps: InternodeGbps = None, gpu_memory: GpuMemory = None, intra_node_gb_per_s: IntraNode = None,
        pcie_gb_per_s: Pcie = None, cpu_ram_per_node: CpuRam = None, seq_len: SeqLen = 2048,
        global_batch: GlobalBatch = None, optimizer: Optim = "adamw", finetune: FinetuneOpt = "full",
        lora_rank: LoraRank = 16, attention: AttentionOpt = None,
        sharding: Annotated[Optional[str], _opt("--sharding", "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, ...")] = None,
        precision: Annotated[Optional[str], _opt("--precision", "fp32, bf16, bf16-pure, fp16")] = None,
        activation_checkpointing: Annotated[Optional[str], _opt("--activation-checkpointing",
                                                                "none, full, every-K, selective-op")] = None,
        micro_batch: Annotated[Optional[int], _opt("--micro-batch", "sequences per GPU per micro-step; "
                                                               + PP_MICRO_BATCH)] = None,
        grad_accum: Annotated[Optional[int], _opt("--grad-accum", "micro-steps per optimizer step")] = None,
        offload: Annotated[Optional[bool], _opt("--offload/--no-offload", "CPU offload")] = None,
        compile: Annotated[Optional[bool], _opt("--compile/--no-compile", "torch.compile each block")] = None,
        float8: Annotated[Optional[bool], _opt("--float8/--no-float8", "torchao Float8 linears")] = None,
        fp8_all_gather: Annotated[Optional[bool], _opt("--fp8-all-gather/--no-fp8-all-gather",
                                                       "with --float8, all-gather in FP8")] = None,
        tp: Tp = None, cp: Cp = None, ep: Ep = None, pp: Pp = None, pp_schedule: PpSchedule = None,
        pp_stages_per_rank: PpStagesPerRank = None,
        async_tp: Annotated[Optional[bool], _opt("--async-tp/--no-async-tp", "TP's collectives overlapped")] = None,
        sequence_parallel: Annotated[Optional[bool], _opt("--sequence-parallel/--no-sequence-parallel",
                                                          "with --tp: sequence and loss parallel")] = None,
        plot: Annotated[Optional[str], typer.Option("--plot", help="Draw the step budget by operator class to "
                                                    "FILE.png or FILE.svg (the pick and the next 4, or the given "
                                                    "config; needs matplotlib)")] = None,
        timeline: Annotated[Optional[str], typer.Option("--timeline", help="Write the predicted step (the explained "
                                                        "config) to FILE.json as a Chrome trace: one compute track, "
                                                        "one per collective stream; open in ui.perfetto.dev")] = None,
        output_format: FormatOpt = Format.table,
    ):
        """Walk through the winning config's memory and time budget, formula by formula. With any config flag,
        explain that configuration instead (flags not given: `fsdp-plan estimate`'s defaults)."""
        from planner.api import estimate, plan
        from planner.errors import PlannerError
        from planner.reports.explain import explain_json, explain_text

        args = cluster_and_training(model, gpus, gpus_per_node, gpu, internode_gbps, gpu_memory, intra_node_gb_per_s,
                                    pcie_gb_per_s, cpu_ram_per_node, seq_len, global_batch, optimizer, finetune,
                                    lora_rank)
        config = dict(sharding=sharding, precision=precision, activation_checkpointing=activation_checkpointing,
                      micro_batch=micro_batch, grad_accum=grad_accum, offload=offload, compile=compile,
                      float8=float8, fp8_all_gather=fp8_all_gather, **mesh_degrees(tp, cp, ep, pp),
                      **pipeline_args(pp_schedule, pp_stages_per_rank), async_tp=async_tp,
                      sequence_parallel=sequence_parallel)
        given = {k: v for k, v in config.items() if v is not None}
        if given:
            shown = [estimate(model, attention=attention, **given, **args)]
        else:
            p = plan(model, attention=attention, **args)
            if p.best is None:
                raise PlannerError("model", f"nothing fits {p.model.name} on {gpus} x {gpu}; run `fsdp-plan --model "
                                            f"{model} --gpus {gpus}` for the nearest misses and what would fit")
            shown = p.candidates[:5]
        if output_format is Format.json:  # stdout stays one JSON document: the plot's path goes to stderr
            typer.echo(explain_json(shown[0], "flags" if given else "plan"))
        else:
            typer.echo(explain_text(shown[0]))
            if not shown[0].fits:
                typer.echo("\nthis config does not fit: " + "; ".join(shown[0].reasons))
        if plot is not None:
            from planner.reports.plot import plot_step_budget

            drawn = plot_step_budget(shown, plot)
            if output_format is Format.json:
                typer.echo(f"step budget drawn to {drawn}", err=True)
            else:
                typer.echo(f"\nstep budget drawn to {drawn}")
        if timeline is not None:
            from planner.reports.timeline import write_timeline

            try:
                written = write_timeline(shown[0], timeline)
            except OSError as e:
                raise PlannerError("timeline", f"cannot write {timeline}: {e.strerror}") from None
            said = f"predicted step written to {written} (a Chrome trace: ui.perfetto.dev or chrome://tracing)"
            typer.echo(said if output_format is Format.json else "\n" + said, err=output_format is Format.json)
