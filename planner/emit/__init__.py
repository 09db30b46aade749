"""Text artifacts for a chosen plan, one dispatcher over the dialect families: FSDP1 and FSDP2 code (code/), the
trainers' - HF Trainer, accelerate, Lightning - (trainers.py), torchtitan's (torchtitan/), NeMo Automodel's
(automodel.py), axolotl's (axolotl.py) and the launchers' - torchrun, slurm, PyTorchJob - (launchers.py). The
dialects share common.py and format.py and never import this module. Pure strings (no torch import).
"""

from __future__ import annotations

from planner.emit import qlora
from planner.emit.automodel import emit_automodel
from planner.emit.axolotl import emit_axolotl
from planner.emit.code.fsdp import emit_fsdp1, emit_fsdp2
from planner.emit.launchers import emit_pytorchjob, emit_slurm, emit_torchrun
from planner.emit.torchtitan.job import emit_torchtitan
from planner.emit.lightning import emit_lightning
from planner.emit.trainers import emit_accelerate, emit_hf_trainer
from planner.errors import PlannerError

__all__ = ["ARTIFACTS", "emit_artifact", "recommendation_text", "emit_fsdp1", "emit_fsdp2", "emit_accelerate",
           "emit_lightning", "emit_slurm", "emit_torchrun", "emit_torchtitan", "emit_automodel", "emit_axolotl"]

ARTIFACTS = ("fsdp1", "fsdp2", "accelerate", "accelerate-fsdp2", "lightning", "hf-trainer", "hf-trainer-fsdp1",
             "torchtitan", "torchtitan-0.2", "automodel", "axolotl", "torchrun", "slurm", "pytorchjob")


def emit_artifact(kind: str, candidate) -> str:
    """One of ARTIFACTS for a planner.api.Candidate, folded to 100 columns (planner/emit/format.py)."""
    from planner.emit.format import fold

    return fold(_emit_artifact(kind, candidate))


def _emit_artifact(kind: str, candidate) -> str:
    config, spec, cluster = candidate.config, candidate.model, candidate.cluster
    if kind in ("hf-trainer", "hf-trainer-fsdp1"):
        version = 2 if kind == "hf-trainer" else 1
        return emit_hf_trainer(config, spec, cluster, candidate.training, fsdp_version=version)
    if kind in ("torchtitan", "torchtitan-0.2"):  # 0.3's names (the current release), or 0.2's
        return emit_torchtitan(config, spec, cluster, candidate.training,
                               version="0.2" if kind == "torchtitan-0.2" else "0.3")
    if kind == "automodel":  # NeMo Automodel 0.7.0's recipe YAML
        return emit_automodel(config, spec, cluster, candidate.training)
    if kind == "axolotl":  # axolotl 0.21.0's config YAML
        return emit_axolotl(config, spec, cluster, candidate.training)
    if kind == "pytorchjob":
        return emit_pytorchjob(config, spec, cluster)
    if kind in ("fsdp1", "fsdp2"):  # QLoRA: then how to load the 4-bit base (BitsAndBytesConfig, LoraConfig)
        emit = emit_fsdp1 if kind == "fsdp1" else emit_fsdp2
        training = candidate.training
        loading = qlora.python_lines(training, config, spec) if qlora.applies(training, spec) else []
        code = emit(config, spec, cluster, candidate.training)
        return code.rstrip("\n") + "\n\n\n" + "\n".join(loading) + "\n" if loading else code
    if kind == "accelerate":
        return emit_accelerate(config, spec, cluster, candidate.training)
    if kind == "accelerate-fsdp2":
        return emit_accelerate(config, spec, cluster, candidate.training, fsdp_version=2)
    if kind == "lightning":
        return emit_lightning(config, spec, cluster, candidate.training)
    if kind == "torchrun":
        return emit_torchrun(config, spec, cluster)
    if kind == "slurm":
        return emit_slurm(config, spec, cluster)
    raise ValueError(f"emit: unknown artifact {kind!r}; choose one of: {', '.join(ARTIFACTS)}")


def recommendation_text(candidate) -> str:
    """The recommended config in its trainer's own form (planner/trainers: FSDP2 code by default) plus the launch
    line; the trainer's other forms are one flag away. The search proposes only what the trainer's form writes
    (planner/trainers); should it still refuse, an FSDP2 plan is given as torchtitan flags, saying why, and any
    other is said in one line with the plan left as priced."""
    import textwrap

    from planner.emit.format import fold
    from planner.line_width import LINE_WIDTH
    from planner.trainers import trainer_named

    trainer = trainer_named(candidate.trainer)
    own = trainer.own_artifact
    others = " | ".join(a for a in (ARTIFACTS if own == "fsdp2" else trainer.artifacts) if a != own)
    try:
        code = _emit_artifact(own, candidate)
        head = (f"Recommended config (FSDP2; --emit {others} for the other forms):" if own == "fsdp2" else
                f"Recommended config ({trainer.title}, --emit {own}; --emit {others} for the other forms):")
    except PlannerError as exc:
        code, head = "", (f"Recommended config: --emit {own} cannot write it ({exc}); the plan above is priced as it "
                          "stands:")
        if own == "fsdp2":
            try:
                code = emit_artifact("torchtitan", candidate)
                head = f"Recommended config (torchtitan: the FSDP2 snippet cannot write it, {exc}):"
            except PlannerError as titan:  # e.g. fp16 with context parallel inside pipeline stages: say both, no code
                head = (f"Recommended config: neither the FSDP2 snippet ({exc}) nor torchtitan ({titan}) writes it; "
                        "the plan above is priced as it stands:")
    launch = emit_torchrun(candidate.config, candidate.model, candidate.cluster)
    return "\n".join(textwrap.wrap(head, LINE_WIDTH, subsequent_indent="  ") + ["", *([fold(code)] if code else []),
                                                                             fold(launch)])
