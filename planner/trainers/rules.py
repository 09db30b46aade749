"""What a trainer means for a request, a search and a configuration: its defaults filled into the request, the
search space narrowed to what it can run, and one line for an explicit configuration it cannot express (never a
plan whose own artifact says "more than planned")."""

from __future__ import annotations

import dataclasses

from cost_models.specs import Finetune, FsdpConfig, TrainingSpec

from planner.errors import PlannerError
from planner.trainers.table import DEFAULT_TRAINER, LAUNCHERS, TRAINERS, Trainer


def trainer_named(name: str | None) -> Trainer:
    """The trainer called `name` (None: the default, the planner's FSDP2 code); one PlannerError line else."""
    if name is None:
        return TRAINERS[DEFAULT_TRAINER]
    key = str(name).strip().lower()
    if key not in TRAINERS:
        raise PlannerError("trainer", f"unknown trainer {name!r}; choose one of: {', '.join(TRAINERS)}")
    return TRAINERS[key]


def trainer_for_artifact(artifact: str) -> Trainer | None:
    """The trainer whose file --emit `artifact` writes (None for a launch line: it runs any trainer's script)."""
    if artifact in LAUNCHERS:
        return None
    return next(t for t in TRAINERS.values() if artifact in t.artifacts)


def resolve_trainer(trainer: str | None, artifact: str | None = None) -> Trainer:
    """--trainer, else the --emit dialect's trainer, else the default; a dialect that does not write the chosen
    trainer's files is one line (what it would emit is not what was planned)."""
    emitted = trainer_for_artifact(artifact) if artifact is not None else None
    if trainer is None:
        return emitted or trainer_named(None)
    chosen = trainer_named(trainer)
    if artifact is not None and artifact not in chosen.artifacts:
        raise PlannerError("emit", f"--emit {artifact} writes {emitted.title}'s files, not {chosen.title}'s (the "
                                   f"trainer planned for); choose one of: {', '.join(chosen.artifacts)}, or --trainer "
                                   f"{emitted.id}")
    return chosen


def with_trainer_defaults(request, trainer: Trainer):
    """The request with every knob it leaves None that the trainer has a default for filled in (the optimizer's
    implementation, kernels, sequence parallel with TP)."""
    from planner.request import knob_table
    from planner.request.groups import Request

    table = knob_table(Request)
    defaults = {"sequence_parallel": trainer.sequence_parallel[0], **trainer.defaults}
    if request.config.compile and trainer.compile_scopes:  # the scope it compiles when told to compile
        defaults["compile_scope"] = trainer.compile_scopes[0]
    for name, value in defaults.items():
        if name not in table:  # a knob this version of the request does not have
            continue
        path = [p for p in table[name].group.split(".") if p]
        holders = [request]
        for part in path:
            holders.append(getattr(holders[-1], part))
        if getattr(holders[-1], name) is not None:
            continue
        updated = dataclasses.replace(holders[-1], **{name: value})
        for holder, part in zip(reversed(holders[:-1]), reversed(path)):
            updated = dataclasses.replace(holder, **{part: updated})
        request = updated
    return request


def narrow_space(space, trainer: Trainer):
    """The search space without what the trainer cannot run; a pinned mesh degree it has no axis for is one
    line."""
    for name in ("tp", "cp", "ep", "pp"):
        pinned = getattr(space, name)
        if pinned is not None and pinned > 1 and name not in trainer.mesh_dims:
            raise PlannerError(name, f"{trainer.title} has no {name} axis (it runs {_axes(trainer)}); choose another "
                                     f"--trainer ({', '.join(_with_axis(name))}) or leave --{name} out")
    changes = {name: 1 for name in ("tp", "cp", "ep", "pp") if name not in trainer.mesh_dims}
    if "tp" in trainer.mesh_dims and space.sequence_parallel not in trainer.sequence_parallel:
        raise PlannerError("sequence_parallel", f"{trainer.title} runs TP {_sp_words(trainer)}")
    keep = lambda values, allowed: tuple(v for v in values if v in allowed)  # noqa: E731
    changes.update(
        shardings=keep(space.shardings, trainer.shardings),
        ac_every=tuple(a for a in space.ac_every if _checkpointing_word(a) in trainer.checkpointing),
        compile_loss=trainer.compile_scopes[0] == "blocks+loss" if trainer.compile_scopes else True)
    if not trainer.offload:
        changes["offload"] = (False,)
    if not trainer.fsdp1_knobs:
        changes.update(backward_prefetch=(True,), limit_all_gathers=(True,))
    if not trainer.compile_scopes:
        changes["compile"] = (False,)
    if not trainer.float8:
        changes["float8"] = (False,)
    if not trainer.fp8_all_gather:
        changes["fp8_all_gather"] = (False,)
    if not trainer.reshard_int:
        changes["reshard_to_node"] = (False,)
    if not trainer.async_tp:
        changes["async_tp"] = (False,)
    return dataclasses.replace(space, **changes)


def refusal(trainer: Trainer, config: FsdpConfig, training: TrainingSpec) -> PlannerError | None:
    """Why the trainer cannot run `config` as priced (its field, the reason, what to do), or None."""
    name = trainer.title
    for dim in ("tp", "cp", "ep", "pp"):
        if getattr(config, dim) > 1 and dim not in trainer.mesh_dims:
            return PlannerError(dim, f"{name} has no {dim} axis (it runs {_axes(trainer)}); choose --{dim} 1 or "
                                     f"another --trainer ({', '.join(_with_axis(dim))})")
    if config.tp > 1 and config.sequence_parallel not in trainer.sequence_parallel:
        return PlannerError("sequence_parallel", f"{name} runs TP {_sp_words(trainer)}")
    if config.sharding not in trainer.shardings:
        return PlannerError("sharding", f"{name} cannot run {config.sharding.value}; choose one of: "
                                        f"{', '.join(s.value for s in trainer.shardings)}")
    word = "selective-op" if config.selective_op_ac else _checkpointing_word(config.ac_every)
    if word not in trainer.checkpointing:
        return PlannerError("activation_checkpointing", f"{name} cannot checkpoint {config.activation_checkpointing}"
                                                        f"; choose one of: {', '.join(trainer.checkpointing)}")
    switches = (
        ("offload", config.offload and not trainer.offload, "has no CPU offload"),
        ("backward_prefetch", not config.backward_prefetch and not trainer.fsdp1_knobs,
         "always prefetches in backward (FSDP2)"),
        ("limit_all_gathers", not config.limit_all_gathers and not trainer.fsdp1_knobs,
         "bounds its all-gathers itself (FSDP2): no rate-limiter switch"),
        ("compile", config.compile and not trainer.compile_scopes, "does not compile"),
        ("compile_scope", config.compile and config.compile_loss and not trainer.can_compile_loss(),
         "compiles the blocks only (its loss stays eager): use --compile-scope blocks"),
        ("float8", config.float8 and not trainer.float8,
         "has no tensorwise Float8 recipe (the one the cost model prices)"),
        ("fp8_all_gather", config.fp8_all_gather and not trainer.fp8_all_gather, "cannot all-gather Float8 in FP8"),
        ("reshard_after_forward", bool(config.reshard_after_forward) and not trainer.reshard_int,
         "takes reshard_after_forward as a bool (no rank group)"),
        ("async_tp", config.async_tp and not trainer.async_tp, "has no async TP"),
        ("finetune", training.finetune is Finetune.LORA and not trainer.lora, "trains full models only (no LoRA)"),
    )
    for field_name, refused, why in switches:
        if refused:
            return PlannerError(field_name, f"{name} {why}; choose another --trainer or drop the setting")
    return None


def _checkpointing_word(ac) -> str:
    if ac == "selective-op":
        return "selective-op"
    return {0: "none", 1: "full"}.get(ac, "every-k")


def _axes(trainer: Trainer) -> str:
    return "data parallelism" + "".join(f", {d}" for d in trainer.mesh_dims)


def _with_axis(dim: str) -> list[str]:
    return [t.id for t in TRAINERS.values() if dim in t.mesh_dims]


def _sp_words(trainer: Trainer) -> str:
    forms = {True: "with sequence parallel (--sequence-parallel)", False: "as transformers' tp_plan "
             "(--no-sequence-parallel)"}
    return " or ".join(forms[s] for s in trainer.sequence_parallel) + " only"
