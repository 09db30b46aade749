"""What a trainer means for a request, a search and a configuration: its defaults filled into the request, the
search space narrowed to what it can run, and one line for an explicit configuration it cannot express (never a
plan whose own artifact says "more than planned")."""

from __future__ import annotations

import dataclasses

from cost_models.specs import FsdpConfig, TrainingSpec

from planner.errors import PlannerError
from planner.trainers.table import DEFAULT_TRAINER, KERNEL_DEFAULTS, LAUNCHERS, LIGER_KNOBS, TRAINERS, Trainer


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


def model_for(trainer: Trainer, spec):
    """The model as the trainer's own implementation runs and wraps it: torchtitan's models their RMSNorm and 0.3's
    embedding and head units (ModelSpec.edge_units); a model type the trainer implements itself (Trainer.own_models)
    its fused RoPE, and it keeps its traced block memory profile, whose saved bytes the formulas match, but not the
    traced transformers block's operators: its step is priced from the structure."""
    if trainer.norm is not None and spec.norm == "rmsnorm":
        spec = dataclasses.replace(spec, norm=trainer.norm)
    if trainer.edge_units != spec.edge_units:
        spec = dataclasses.replace(spec, edge_units=trainer.edge_units)
    if spec.family in trainer.own_models:
        profile = spec.activation_profile
        spec = dataclasses.replace(spec, rope="fused",
                                   activation_profile=profile.without_operators() if profile is not None else None)
    return spec


def with_trainer_defaults(request, trainer: Trainer):
    """The request with every knob it leaves None that the trainer has a default for filled in (the optimizer's
    implementation, kernels, sequence parallel with TP)."""
    from planner.request import knob_table
    from planner.request.groups import Request

    table = knob_table(Request)
    defaults = {"sequence_parallel": trainer.sequence_parallel[0], "alloc_conf": "", **trainer.defaults}
    if request.config.compile and trainer.compile_scopes:  # the scope it compiles when told to compile
        defaults["compile_scope"] = trainer.compile_scopes[0]
    for name in KERNEL_DEFAULTS:  # its kernels, but --liger's four where the user switched Liger on
        if not (name in LIGER_KNOBS and getattr(request.config, "liger", False)):
            defaults[name] = trainer.kernel_choices(name)[0]
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


def search_space(trainer: Trainer, training: TrainingSpec | None = None, **fields):
    """The search's whole space (planner.search.SearchSpace with `fields`) narrowed to the trainer (and what it runs
    for `training`)."""
    from planner.search import SearchSpace

    return narrow_space(SearchSpace(**{"sequence_parallel": trainer.sequence_parallel[0], **fields}), trainer,
                        training)


def kernel_sets(request, trainer: Trainer, pinned: bool, family: str) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The kernel choices the search prices (FsdpConfig fields): the request's (its trainer's defaults filled in),
    and, where the trainer runs Liger Kernel on the model's family and the user pinned no kernel, Liger's four
    kernels too."""
    from planner.emit.kernels import LIGER_FAMILIES

    from dataclasses import fields

    from cost_models.specs import FsdpConfig

    names = {f.name for f in fields(FsdpConfig)}
    base = {k: v for k, v in request.config.kernels().items() if k in LIGER_KNOBS}
    base.update({k: getattr(request.config, k) for k in KERNEL_DEFAULTS
                 if k in names and k not in base and getattr(request.config, k, None) is not None})
    sets = [tuple(sorted(base.items()))]
    if trainer.liger() and family in LIGER_FAMILIES and not pinned:
        sets.append(tuple(sorted({**base, **dict.fromkeys(LIGER_KNOBS, "liger")}.items())))
    return tuple(dict.fromkeys(sets))


def trainer_kernel_refusal(trainer: Trainer, knob: str, value: str | None) -> PlannerError | None:
    """One line where the trainer cannot run `value` for kernel knob `knob` (KERNEL_DEFAULTS' names); None else."""
    if value is None or value in trainer.kernel_choices(knob):
        return None
    able = [t.id for t in TRAINERS.values() if value in t.kernel_choices(knob)]
    return PlannerError(knob, f"{trainer.title} runs {' or '.join(trainer.kernel_choices(knob))}, not {value}"
                              + (f"; choose a --trainer that has it: {', '.join(able)}" if able else ""))


def narrow_space(space, trainer: Trainer, training: TrainingSpec | None = None, spec=None):
    """The search space without what the trainer cannot run (for `training`: a QLoRA base); a pinned mesh degree it
    has no axis for is one line, and so is a model it cannot train (spec: model_refusal)."""
    if spec is not None and training is not None and (refused := model_refusal(trainer, spec, training)) is not None:
        raise refused
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
        host_ways=trainer.host_ways(),
        shardings=tuple(s for s in keep(space.shardings, trainer.shardings)
                        if not (s.is_hybrid and _qlora_replicas_refused(trainer, training))),
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
    if not trainer.shard_groups:
        if any(space.shard_group_gpus or ()):
            raise _no_shard_groups(trainer)
        changes["shard_group_gpus"] = (0,)
    pinned = {d: getattr(space, d) or 1 for d in ("tp", "cp", "ep", "pp")}
    for a, b in trainer.mesh_exclusions:
        if pinned[a] > 1 and pinned[b] > 1:
            raise _combination(trainer, a, b)
    if space.precisions is not None:
        changes["precisions"] = tuple(p for p in space.precisions if p in trainer.precisions)
        if not changes["precisions"]:
            raise PlannerError("precision", f"{trainer.title} runs {', '.join(p.value for p in trainer.precisions)}; "
                                            "choose one of them")
    return dataclasses.replace(space, mesh_exclusions=trainer.mesh_exclusions, trainer_precisions=trainer.precisions,
                               **changes)


def _no_shard_groups(trainer: Trainer) -> PlannerError:
    able = [t.id for t in TRAINERS.values() if t.shard_groups]
    return PlannerError("shard_group_gpus", f"{trainer.title} shards HYBRID over one node only (no shard-group size);"
                                            f" leave it out, or choose a --trainer that has it: {', '.join(able)}")


def _combination(trainer: Trainer, a: str, b: str) -> PlannerError:
    able = [t.id for t in TRAINERS.values() if {a, b} <= set(t.mesh_dims) and (a, b) not in t.mesh_exclusions]
    return PlannerError(b, f"{trainer.title} cannot write {a} beside {b} (priced, not written as its code); choose "
                           f"a --trainer that has it: {', '.join(able)}")


def model_refusal(trainer: Trainer, spec, training: TrainingSpec) -> PlannerError | None:
    """What the trainer cannot run on this model whatever the configuration: all-linear LoRA on an MoE under FSDP1
    (cost_models/moe_lora.fsdp1_fails: the step fails)."""
    from cost_models.moe_lora import FSDP1_FAILURE, fsdp1_fails, trains_all_linear

    if not (trainer.fsdp_version == 1 and fsdp1_fails(spec, trains_all_linear(spec, training))):
        return None
    fsdp2 = [t.id for t in TRAINERS.values() if t.fsdp_version == 2 and t.lora]
    return PlannerError("trainer", f"{trainer.title}: {FSDP1_FAILURE}; choose an FSDP2 --trainer ({', '.join(fsdp2)}), "
                                   "or --lora-targets attention")


def refusal(trainer: Trainer, config: FsdpConfig, training: TrainingSpec, family: str | None = None, spec=None
            ) -> PlannerError | None:
    """Why the trainer cannot run `config` as priced (its field, the reason, what to do), or None; `family`: the
    model's (Liger Kernel patches only the families it knows); spec: the model's (model_refusal)."""
    if spec is not None and (refused := model_refusal(trainer, spec, training)) is not None:
        return refused
    from planner.emit.kernels import LIGER_FAMILIES

    name = trainer.title
    liger = [k for k in LIGER_KNOBS if getattr(getattr(config, k), "value", None) == "liger"]
    if liger and family is not None and family not in LIGER_FAMILIES:
        return PlannerError(liger[0], f"liger-kernel 0.8.5 has no apply_liger_kernel_to_{family}; its families: "
                                      f"{', '.join(LIGER_FAMILIES)}")
    for dim in ("tp", "cp", "ep", "pp"):
        if getattr(config, dim) > 1 and dim not in trainer.mesh_dims:
            return PlannerError(dim, f"{name} has no {dim} axis (it runs {_axes(trainer)}); choose --{dim} 1 or "
                                     f"another --trainer ({', '.join(_with_axis(dim))})")
    for a, b in trainer.mesh_exclusions:
        if getattr(config, a) > 1 and getattr(config, b) > 1:
            return _combination(trainer, a, b)
    if liger and (config.pp > 1 or config.tp > 1):
        return PlannerError(liger[0], f"Liger kernels with {'pp' if config.pp > 1 else 'tp'} > 1: a pipeline stage "
                                      "calls the head itself (no fused linear cross-entropy) and Liger's RMSNorm on "
                                      "sequence-parallel DTensors is unchecked; without them, or tp = pp = 1")
    if config.tp > 1 and config.sequence_parallel not in trainer.sequence_parallel:
        return PlannerError("sequence_parallel", f"{name} runs TP {_sp_words(trainer)}")
    if config.precision not in trainer.precisions:
        return PlannerError("precision", f"{name} runs {', '.join(p.value for p in trainer.precisions)}, not "
                                         f"{config.precision.value}")
    if config.sharding not in trainer.shardings:
        return PlannerError("sharding", f"{name} cannot run {config.sharding.value}; choose one of: "
                                        f"{', '.join(s.value for s in trainer.shardings)}")
    word = "selective-op" if config.selective_op_ac else _checkpointing_word(config.ac_every)
    if word not in trainer.checkpointing:
        return PlannerError("activation_checkpointing", f"{name} cannot checkpoint {config.activation_checkpointing}"
                                                        f"; choose one of: {', '.join(trainer.checkpointing)}")
    for knob in KERNEL_DEFAULTS:
        holder = training if knob == "routing" else config
        error = trainer_kernel_refusal(trainer, knob, getattr(getattr(holder, knob, None), "value", None))
        if error is not None:
            return error
    if config.shard_group_gpus and not trainer.shard_groups:
        return _no_shard_groups(trainer)
    for field_name, refuses, why in _SWITCHES:
        if refuses(trainer, config, training):
            able = [t.id for t in TRAINERS.values() if not refuses(t, config, training)]
            return PlannerError(field_name, f"{name} {why}; drop the setting, or choose a --trainer that has it: "
                                            f"{', '.join(able)}")
    return None


# (field, refuses(trainer, config, training), why): the switches a trainer may lack
_SWITCHES = (
    ("offload", lambda t, c, _: c.offload and not t.offload, "has no CPU offload"),
    ("backward_prefetch", lambda t, c, _: not c.backward_prefetch and not t.fsdp1_knobs,
     "always prefetches in backward (FSDP2)"),
    ("limit_all_gathers", lambda t, c, _: not c.limit_all_gathers and not t.fsdp1_knobs,
     "bounds its all-gathers itself (FSDP2): no rate-limiter switch"),
    ("compile", lambda t, c, _: c.compile and not t.compile_scopes, "does not compile"),
    ("compile_scope", lambda t, c, _: c.compile and c.compile_loss and not t.can_compile_loss(),
     "compiles the blocks only (its loss stays eager): use --compile-scope blocks"),
    ("float8", lambda t, c, _: c.float8 and not t.float8, "has no tensorwise Float8 recipe (the one priced)"),
    ("fp8_all_gather", lambda t, c, _: c.fp8_all_gather and not t.fp8_all_gather, "cannot all-gather Float8 in FP8"),
    ("reshard_after_forward", lambda t, c, _: bool(c.reshard_after_forward) and not t.reshard_int,
     "takes reshard_after_forward as a bool (no rank group)"),
    ("async_tp", lambda t, c, _: c.async_tp and not t.async_tp, "has no async TP"),
    ("finetune", lambda t, _, tr: tr.finetune.adapters and not t.lora, "trains full models only (no LoRA)"),
    ("sharding", lambda t, c, tr: c.sharding.is_hybrid and _qlora_replicas_refused(t, tr),
     "loads a 4-bit (QLoRA) base on a one-dimensional mesh only (no HSDP replicas)"),
)


def _qlora_replicas_refused(trainer: Trainer, training: TrainingSpec | None) -> bool:
    return training is not None and training.quantized and not trainer.qlora_replicas


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
