"""`fsdp-plan check` on Lightning code (planner/doctor/readers/python_code.py dispatches here): FSDPStrategy(...)
(Lightning 2.x lightning/pytorch/strategies/fsdp.py, FSDP1 underneath) and the Trainer(...) it is given to, as
planner/emit/lightning.py emit_lightning writes them.

- precision: the strategy's mixed_precision where given, else what Lightning derives from the Trainer's precision
  (lightning/fabric/plugins/precision/fsdp.py mixed_precision_config: "bf16-mixed" / "bf16-true" -> param, reduce
  and buffer dtypes bf16; "16-*" fp16; "32-true" fp32); "-true" stores the model in that dtype (bf16-pure).
- activation_checkpointing_policy={Block}: every block (Lightning has no every-K-th and no op-level policy).
- Trainer: devices x num_nodes ranks, accumulate_grad_batches; the micro-batch is the DataLoader's (--micro-batch).
- compile, Float8 and the optimizer live in the LightningModule's configure_model / configure_optimizers, the user's
  code: the emitter writes them as notes (planner/emit/code/techniques.py lightning_unexpressed, planner/emit/
  optimizer.py script_note) and they are read from those notes, word for word.
"""

from __future__ import annotations

import ast
import re

from cost_models.specs import FsdpConfig, Precision

from planner.doctor.readers import python_shared as shared
from planner.doctor.readers.common import UserSetup, _strategy
from planner.doctor.readers.python_ast import Snippet, dotted
from planner.emit.code import techniques as tech
from planner.errors import PlannerError

STRATEGY_ARGS = ("sharding_strategy", "auto_wrap_policy", "activation_checkpointing_policy", "cpu_offload",
                 "mixed_precision", "backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params",
                 "sync_module_states", "state_dict_type", "timeout", "process_group_backend")
# Trainer(precision=...) -> (the dtype FSDP's MixedPrecision casts to and reduces in, the model's stored dtype)
PRECISIONS = {"32-true": (None, "fp32"), "32": (None, "fp32"), "bf16-mixed": ("bf16", "fp32"),
              "bf16-true": ("bf16", "bf16"), "16-mixed": ("fp16", "fp32")}
CONFIGURE_OPTIMIZERS = "in configure_optimizers:"


def from_lightning(s: Snippet) -> UserSetup:
    strategies = shared.calls(s, "FSDPStrategy")
    if len(strategies) != 1:
        raise PlannerError("FSDPStrategy", "build one FSDPStrategy(...): fsdp-plan check reads its arguments")
    strategy = strategies[0]
    shared.only(strategy, STRATEGY_ARGS, "FSDPStrategy")
    trainer = _trainer(s)
    kw = {k: s.value(v, k) for k, v in strategy.kwargs.items()
          if k in ("sharding_strategy", "backward_prefetch", "forward_prefetch", "limit_all_gathers",
                   "use_orig_params", "sync_module_states", "state_dict_type")}
    precision, reduce = _precision(s, strategy.kwargs.get("mixed_precision"), trainer.get("precision", "32-true"))
    offload = shared.cpu_offload(s, strategy.kwargs.get("cpu_offload"))
    prefetch = shared.backward_prefetch(kw.get("backward_prefetch", "BackwardPrefetch.BACKWARD_PRE"))  # FSDP's
    compiled = s.says(_note(compile=True))  # configure_model: block.compile() (the loss: the module's own, eager)
    float8 = s.says(_note(float8=True))
    attention, attention_from = shared.attention(s)  # emit_lightning's set_attention(model)
    config = FsdpConfig(
        sharding=_strategy("sharding_strategy", kw.get("sharding_strategy", "FULL_SHARD")), precision=precision,
        reduce_dtype=reduce, offload=offload, ac_every=_checkpointing(strategy.kwargs.get(
            "activation_checkpointing_policy")), backward_prefetch=prefetch,
        forward_prefetch=bool(kw.get("forward_prefetch", False)), limit_all_gathers=bool(kw.get("limit_all_gathers",
                                                                                                 True)),
        compile=compiled, compile_loss=False, float8=float8, grad_accum=trainer.get("accumulate_grad_batches", 1),
        **attention)
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    return UserSetup(
        config=config, fsdp_version=1, source=s.source, dialect="lightning", explicit=frozenset(strategy.kwargs),
        wrap="block" if strategy.kwargs.get("auto_wrap_policy") is not None else "none",
        use_orig_params=bool(kw.get("use_orig_params", True)),  # Lightning's FSDPStrategy sets it by default
        sync_module_states=bool(kw.get("sync_module_states", False)),
        # Lightning's checkpoints: "full" (its default, gathered on rank 0) or "sharded" (DCP)
        state_dict_type="SHARDED_STATE_DICT" if kw.get("state_dict_type") == "sharded" else "FULL_STATE_DICT",
        n_processes=devices * nodes if isinstance(devices, int) and isinstance(nodes, int) else None,
        n_machines=nodes if isinstance(nodes, int) else None,
        grad_scaler="sharded" if precision is Precision.FP16 else None,  # Lightning's FSDPPrecision scales fp16
        use_cache=False if s.says("in the LightningModule: model.config.use_cache = False") else None,
        attention_from=attention_from,
        training=_optimizer(s, offload))


def _note(**technique) -> str:
    """The note emit_lightning writes for one technique (the text it is read back from)."""
    return tech.lightning_unexpressed(FsdpConfig(**technique))[0]


def _trainer(s: Snippet) -> dict:
    trainers = shared.calls(s, "Trainer")
    if len(trainers) > 1:
        raise PlannerError("Trainer", "build one Trainer(...)")
    if not trainers:
        return {}
    read = ("precision", "devices", "num_nodes", "accumulate_grad_batches")
    values = {k: s.value(v, f"Trainer.{k}") for k, v in trainers[0].kwargs.items() if k in read}
    for key in ("num_nodes", "accumulate_grad_batches"):
        value = values.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlannerError(f"Trainer.{key}", f"{value!r}: give an integer >= 1")
    return values


def _precision(s: Snippet, node, trainer_precision) -> tuple[Precision, str | None]:
    name = str(trainer_precision)
    if name not in PRECISIONS:
        raise PlannerError("Trainer.precision", f"{name!r} is not priced by fsdp-plan; choose one of: "
                                                f"{', '.join(PRECISIONS)}")
    cast, stored = PRECISIONS[name]
    if node is not None and not (isinstance(node, ast.Constant) and node.value is None):
        param, reduce = shared.dtype_kwargs(s, node, "mixed_precision")
    elif stored == "bf16":  # bf16-true: the model built in bf16, reduced in bf16: bf16-pure
        param, reduce = None, None
    else:
        param, reduce = cast, cast
    return shared.precision_of(param, reduce, stored, "mixed_precision")


def _checkpointing(node) -> int:
    """activation_checkpointing_policy: a set of block classes (every block), or None."""
    if node is None or (isinstance(node, ast.Constant) and node.value is None):
        return 0
    if isinstance(node, ast.Set) or (isinstance(node, ast.Call) and dotted(node.func) == "ModuleWrapPolicy"):
        return 1
    raise PlannerError("activation_checkpointing_policy", f"{ast.unparse(node)}: give the block classes ({{Block}}) "
                                                          "or None")


def _optimizer(s: Snippet, offload: bool) -> tuple:
    """The optimizer the note names for configure_optimizers (planner/emit/optimizer.py script_note), else ()."""
    text = s.comments()
    at = text.find(CONFIGURE_OPTIMIZERS)
    if at < 0:
        return ()
    match = re.search(r"(torch\.optim\.|bnb\.optim\.)\w+\(", text[at:])
    if not match:
        return ()
    start = at + match.start()
    for end in (m.end() for m in re.finditer(r"\)", text[start:])):
        try:
            return shared.optimizer(Snippet(text[start:start + end], s.source), offload)
        except PlannerError:
            continue
    return ()
