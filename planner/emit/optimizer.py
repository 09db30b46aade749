"""The optimizer the plan priced (TrainingSpec.optimizer and .optimizer_impl, cost_models/optimizer_step.py) in each
dialect's words, and read back (planner/doctor/readers/): HF Trainer's `optim`, torchtitan's
optimizer.implementation, the code snippets' constructor, and a comment where a dialect holds no optimizer
(accelerate's config, Lightning's strategy: the training script builds it).

Which implementation each runs, from the trainers' code:
- HF Trainer (transformers 5, trainer_optimizer.py _get_adamw_torch): adamw_torch_fused -> AdamW(fused=True) (the
  default `optim` with torch >= 2.8, training_args.py); adamw_torch -> AdamW() with torch's default, foreach where
  every parameter is on CUDA and for-loop for CPU tensors (a CPU-offloaded step; torch/optim/optimizer.py
  _default_to_fused_or_foreach); adamw_bnb_8bit -> bitsandbytes' AdamW8bit; sgd -> torch.optim.SGD with
  optim_args' momentum (torch's default momentum is 0). There is no spelling for a for-loop step on GPU or a
  foreach step on CPU.
- torchtitan (0.2 and 0.3, components/optimizer/optimizer.py): optimizer.implementation for-loop | foreach | fused
  (default fused) becomes fused= / foreach=; optimizer.name (0.2) Adam or AdamW, nothing else.
"""

from __future__ import annotations

from cost_models.specs import Optimizer, OptimizerImpl, TrainingSpec

from planner.errors import PlannerError

# transformers 5's default `optim` where torch >= 2.8 (training_args.py: default_optim)
HF_DEFAULT_OPTIM = "adamw_torch_fused"
HF_SGD_ARGS = "momentum=0.9"  # the planner's SGD keeps a momentum buffer; HF's sgd has none without optim_args
TORCHTITAN_IMPLEMENTATIONS = ("for-loop", "foreach", "fused")
TORCHTITAN_NAMES = {"adamw": "AdamW", "adam": "Adam"}  # OptimizersContainer's factories (DistMuon aside)


torch_default_impl = OptimizerImpl.torch_default


def hf_optim(training: TrainingSpec | None, offload: bool) -> tuple[str, str | None, str]:
    """(optim, optim_args or None, a comment) of TrainingArguments for the priced optimizer; the comment says what
    the arguments cannot ask for."""
    training = training or TrainingSpec()
    impl = training.optimizer_impl
    if training.optimizer is Optimizer.ADAMW_8BIT:
        return "adamw_bnb_8bit", None, "bitsandbytes' 8-bit AdamW, as planned"
    if training.optimizer is Optimizer.SGD:  # every implementation updates in place: the same memory
        return "sgd", HF_SGD_ARGS, "SGD with momentum, as planned (torch's default step: its memory is any one's)"
    adam = " (Adam: AdamW with weight_decay=0, TrainingArguments' default, is Adam)" \
        if training.optimizer is Optimizer.ADAM else ""
    if impl is OptimizerImpl.FUSED:
        return "adamw_torch_fused", None, f"torch._fused_adamw_: the planned fused step, no temporaries{adam}"
    if impl is torch_default_impl(offload):
        return "adamw_torch", None, f"torch's {impl.value} step on {'CPU' if offload else 'GPU'} parameters, as " \
                                    f"planned{adam}"
    return "adamw_torch", None, (f"the plan prices a {impl.value} step, which TrainingArguments cannot ask for: "
                                 f"adamw_torch runs {torch_default_impl(offload).value} here{adam}")


def from_hf_optim(data: dict, offload: bool) -> tuple[tuple, tuple[str, ...]]:
    """((knob, value) pairs of the optimizer TrainingArguments run, notes) from `optim` (absent: transformers'
    default) and optim_args; an optimizer fsdp-plan does not price leaves the pairs empty and says so."""
    name = str(data.get("optim") or HF_DEFAULT_OPTIM).strip().lower()
    name = name.removeprefix("optimizernames.")
    if name == "adamw_torch_fused":
        return (("optimizer", "adamw"), ("optimizer_impl", "fused")), ()
    if name == "adamw_torch":
        return (("optimizer", "adamw"), ("optimizer_impl", torch_default_impl(offload).value)), ()
    if name in ("adamw_bnb_8bit", "adamw_8bit"):
        return (("optimizer", "adamw-8bit"), ("optimizer_impl", "fused")), ()
    if name == "sgd":
        notes = () if "momentum" in str(data.get("optim_args") or "") else (
            "optim sgd without momentum in optim_args keeps no momentum buffer; priced with one (fsdp-plan's SGD)",)
        return (("optimizer", "sgd"), ("optimizer_impl", torch_default_impl(offload).value)), notes
    return (), (f"optim {name} is not priced by fsdp-plan: priced as --optimizer / --optimizer-impl say",)


def torchtitan_optimizer(training: TrainingSpec | None, version: str) -> tuple[list, list[str]]:
    """((name, value, comment) flags, notes) of the priced optimizer; PlannerError for one torchtitan cannot run."""
    training = training or TrainingSpec()
    if training.optimizer.value not in TORCHTITAN_NAMES:
        raise PlannerError("optimizer", f"torchtitan builds Adam and AdamW only, not {training.optimizer.value}; "
                                        "choose --optimizer adamw or adam, or another --emit")
    impl = training.optimizer_impl.value
    flags = [("optimizer.implementation", impl, {"fused": "torch._fused_adamw_: no step temporaries",
                                                 "foreach": "one more copy of the local shard at the step",
                                                 "for-loop": "one parameter at a time"}[impl])]
    notes = []
    if version == "0.2":
        flags.insert(0, ("optimizer.name", TORCHTITAN_NAMES[training.optimizer.value], ""))
    elif training.optimizer is Optimizer.ADAM:
        notes.append("Adam: torchtitan 0.3's optimizer is its config function's param_groups (AdamW in the ones it "
                     "ships): set optimizer_name \"Adam\" there")
    return flags, notes


def from_torchtitan(settings: dict) -> tuple:
    """(knob, value) pairs of torchtitan's optimizer.implementation (default fused) and optimizer.name (0.2)."""
    impl = str(settings.get("optimizer.implementation", "fused")).strip().lower()
    if impl not in TORCHTITAN_IMPLEMENTATIONS:
        raise PlannerError("optimizer.implementation", f"{impl!r} is not priced by fsdp-plan (fused_opt_states_bf16 "
                           "keeps bf16 states beside fp32 params); choose one of: "
                           f"{', '.join(TORCHTITAN_IMPLEMENTATIONS)}")
    names = {v.lower(): k for k, v in TORCHTITAN_NAMES.items()}
    name = str(settings.get("optimizer.name", "AdamW")).strip()
    if name.lower() not in names:
        raise PlannerError("optimizer.name", f"unknown value {name!r}; choose one of: "
                                             f"{', '.join(TORCHTITAN_NAMES.values())}")
    return (("optimizer", names[name.lower()]), ("optimizer_impl", impl))


def constructor(training: TrainingSpec | None, params: str = "params") -> str:
    """The Python expression that builds the priced optimizer over `params` (torch.optim, or bitsandbytes')."""
    training = training or TrainingSpec()
    if training.optimizer is Optimizer.ADAMW_8BIT:
        return f"bnb.optim.AdamW8bit({params}, lr=1e-4)"
    impl = training.optimizer_impl
    how = "fused=True" if impl is OptimizerImpl.FUSED else f"foreach={impl is OptimizerImpl.FOREACH}"
    if training.optimizer is Optimizer.SGD:
        return f"torch.optim.SGD({params}, lr=1e-3, momentum=0.9, {how})"
    cls = "Adam" if training.optimizer is Optimizer.ADAM else "AdamW"
    return f"torch.optim.{cls}({params}, lr=1e-4, {how})"


def optimizer_lines(training: TrainingSpec | None) -> list[str]:
    """A module-level make_optimizer(model) for the code snippets: the priced optimizer over the trainable params."""
    training = training or TrainingSpec()
    impl = "bitsandbytes' 8-bit kernel" if training.optimizer is Optimizer.ADAMW_8BIT else \
        f"its {training.optimizer_impl.value} step"
    return ["def make_optimizer(model):",
            f"    \"\"\"The optimizer the plan priced: {training.optimizer.value}, {impl}. After apply_fsdp.\"\"\"",
            *(["    import bitsandbytes as bnb", ""] if training.optimizer is Optimizer.ADAMW_8BIT else []),
            "    params = [p for p in model.parameters() if p.requires_grad]",
            f"    return {constructor(training)}"]


def script_note(training: TrainingSpec | None) -> str:
    """For a dialect that holds no optimizer (accelerate's config, Lightning's strategy): what the script builds."""
    return (f"optimizer (the training script's): {constructor(training, 'model.parameters()')}, the step the plan "
            "priced (cost_models/optimizer_step.py)")
