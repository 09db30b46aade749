"""`fsdp-plan rl` (rank a small search) and `fsdp-plan rl estimate` (one configuration): a verl GRPO job priced
phase by phase (planner/rl), the flags verl's own knob names (planner/rl/request.py)."""

from __future__ import annotations

import enum
from typing import Annotated, Optional

import typer

from planner.cli.flags import command, options, param
from planner.cli.options import CLUSTER, FormatOpt, Format
from planner.rl.request import RL_KNOBS, RlRequest

rl_app = typer.Typer(add_completion=False, rich_markup_mode=None, invoke_without_command=True,
                     help="RL post-training (verl GRPO, FSDP actor beside a vLLM / SGLang rollout engine).")
NAMES = CLUSTER + tuple(n for n in RL_KNOBS if n not in CLUSTER and n != "scale_up_domain_gpus")
TopOpt = Annotated[int, typer.Option("--top", help="Configurations to list")]


class RlEmit(str, enum.Enum):
    verl = "verl"
    trl = "trl"


EmitOpt = Annotated[Optional[RlEmit], typer.Option("--emit", help="Print only this artifact of the configuration "
                                                   "(rl: the best): verl (main_ppo launch script) or trl (GRPOConfig "
                                                   "YAML and accelerate FSDP2 config)")]


def _artifact(kind: RlEmit, e) -> str:
    if kind is RlEmit.verl:
        from planner.emit.verl import emit_verl

        return emit_verl(e)
    from planner.emit.trl import emit_trl

    return emit_trl(e)


def _estimate(output_format: Format, emit: RlEmit | None, **knobs) -> None:
    from planner.rl import rl_estimate
    from planner.rl.report import rl_json, rl_text

    e = rl_estimate(knobs.pop("model"), knobs.pop("gpus"), **knobs)
    typer.echo(_artifact(emit, e) if emit else rl_json(e) if output_format is Format.json else rl_text(e))


def _plan(ctx: typer.Context, output_format: Format, emit: RlEmit | None, top: int, **knobs) -> None:
    if ctx.invoked_subcommand is not None:
        return
    from planner.errors import PlannerError
    from planner.rl.report import rl_plan_json, rl_plan_text
    from planner.rl.request import rl_request
    from planner.rl.search import plan_rl

    if knobs.get("model") is None:
        raise PlannerError("model", "missing: pass --model with a preset name (see `fsdp-plan models`)")
    p = plan_rl(rl_request(knobs.pop("model"), knobs.pop("gpus"), **knobs), top=top)
    if emit is not None:
        if not p.ranked:
            raise PlannerError("emit", "nothing fits, so there is no config to emit; run without --emit to see why")
        typer.echo(_artifact(emit, p.ranked[0]))
        return
    typer.echo(rl_plan_json(p) if output_format is Format.json else rl_plan_text(p))


def check_rl(setup, model: str | None, gpus: int | None, output_format: Format, **flags) -> None:
    """`fsdp-plan check` of a verl / TRL GRPO job (planner/doctor/readers/verl.py, trl_grpo.py): the file's knobs,
    the command line's cluster flags and mean lengths over them; exit 1 when it does not fit."""
    import dataclasses

    from cost_models.spec_values import SpecError
    from planner.errors import PlannerError
    from planner.models import resolve_model
    from planner.rl.evaluate import evaluate_rl
    from planner.rl.report import rl_json, rl_text
    from planner.rl.request import rl_request

    given = CLUSTER + ("mean_prompt_len", "mean_response_len", "engine_version")   # check's flags that apply
    knobs = {**setup.knobs, **{k: v for k, v in flags.items() if k in given and v is not None}}
    if gpus is not None:
        knobs["gpus"], knobs["gpus_per_node"] = gpus, None
    model = model or setup.model
    if model is None:
        if setup.model_path is None:
            raise PlannerError(setup.model_key, "missing: the file names no model; pass --model")
        try:
            model = resolve_model(setup.model_path)
        except PlannerError:
            raise PlannerError(setup.model_key, f"{setup.model_path!r} is not on this machine: pass --model with a "
                                                "preset name or its config.json") from None
    try:
        request = rl_request(None, knobs.pop("gpus"), **knobs)
        e = evaluate_rl(dataclasses.replace(request, model=model if isinstance(model, str) else model.name),
                        model=None if isinstance(model, str) else model)
    except SpecError as exc:   # a value the cost models refuse: named by the file's key
        if exc.field not in setup.keys:
            raise
        raise PlannerError(setup.keys[exc.field], str(exc).removeprefix(f"{exc.field}: ")) from None
    e = dataclasses.replace(e, notes=(*setup.notes, *e.notes))
    typer.echo(rl_json(e) if output_format is Format.json else f"{setup.dialect}: {setup.source}\n{rl_text(e)}")
    if not e.fits:
        raise typer.Exit(1)


def register(app) -> None:
    """Add `fsdp-plan rl` and `fsdp-plan rl estimate`."""
    import inspect

    shared = [*options(*NAMES, request=RlRequest), param("output_format", FormatOpt, Format.table),
              param("emit", EmitOpt, None)]
    context = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
    rl_app.callback()(command([context, *shared, param("top", TopOpt, 5)], _plan,
                              "Rank verl GRPO configurations (actor dtype, offloads, checkpointing, entropy "
                              "chunking, Ulysses, update and log-prob micro-batches, rollout TP, "
                              "gpu_memory_utilization, max_num_seqs, max_num_batched_tokens; LoRA: model.lora.merge) "
                              "by estimated step time among those that fit; "
                              "then `rl estimate` one."))
    rl_app.command("estimate")(command(shared, _estimate, "Price one verl GRPO configuration: every phase's GPU "
                                                          "memory, the engine's KV cache, host RAM per node."))
    app.add_typer(rl_app, name="rl")
