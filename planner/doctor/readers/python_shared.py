"""What the Python readers (python_fsdp.py, python_lightning.py; dispatched by python_code.py) share: the vocabulary
(every name imported from the distributed libraries must be one they read, else one PlannerError line naming it),
the precision from FSDP's dtypes, checkpointing, compile, Float8, Liger's patch functions and the optimizer.
"""

from __future__ import annotations

import ast
import functools

from cost_models import fsdp_options
from cost_models.schedules import Schedule
from cost_models.specs import REDUCE_DTYPES, Precision

from planner.doctor.readers.common import _dtype
from planner.doctor.readers.python_ast import CallSite, Snippet, dotted
from planner.emit import attention as attn
from planner.emit.code import techniques as tech
from planner.emit.kernels import from_hf_liger
from planner.emit.optimizer import torch_default_impl
from planner.errors import PlannerError

WRAPPERS = ("fully_shard", "FullyShardedDataParallel", "FSDPStrategy")  # what makes text a snippet check reads
# Modules whose names a snippet may import only from KNOWN: the constructs the readers understand.
LIBRARIES = ("torch.distributed", "torchao", "lightning", "pytorch_lightning", "liger_kernel",
             "transformers.distributed", "torch.utils.checkpoint")
KNOWN = frozenset({
    "init_device_mesh", "fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "FullyShardedDataParallel",
    "ShardingStrategy", "MixedPrecision", "CPUOffload", "BackwardPrefetch", "ModuleWrapPolicy", "CustomPolicy",
    "CheckpointImpl", "checkpoint_wrapper", "apply_activation_checkpointing", "CheckpointPolicy",
    "create_selective_checkpoint_contexts", "Float8LinearConfig", "convert_to_float8_training",
    "precompute_float8_dynamic_scale_for_fsdp", "Replicate", "Shard", "DTensor", "ColwiseParallel", "RowwiseParallel",
    "SequenceParallel", "PrepareModuleInput", "parallelize_module", "loss_parallel", "context_parallel",
    "apply_expert_parallelism", "enable_symm_mem_for_group", "PipelineStage", "Trainer", "FSDPStrategy",
    "ShardedGradScaler", "StateDictOptions", "set_model_state_dict",  # (loading: read for QLoRA, python_qlora.py)
    # checkpoints: how the code loads and saves (python_checkpoint.py), priced in host RAM
    "checkpoint", "save", "async_save", "load", "get_state_dict", "set_state_dict", "get_model_state_dict",
    "get_optimizer_state_dict", "set_optimizer_state_dict",
    *(s.torch_class for s in Schedule)})
# FSDP2 calls that change what is gathered when: not priced, so not read
UNREAD_METHODS = ("set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch", "set_reshard_after_backward",
                  "set_reshard_after_forward", "set_unshard_in_backward")



def canonical(snippet: Snippet, call: CallSite) -> str:
    """A call's name as its library has it: `FSDP` imported as FullyShardedDataParallel is that."""
    bound = snippet.imports.get(call.name)
    return bound.rpartition(".")[2] if bound else call.short


def calls(snippet: Snippet, name: str) -> list[CallSite]:
    return [c for c in snippet.calls if canonical(snippet, c) == name]


def called(snippet: Snippet, name: str) -> bool:
    return bool(calls(snippet, name))


def check_vocabulary(snippet: Snippet) -> None:
    """Every name imported from the distributed libraries is one the readers read; the FSDP2 methods that change
    the prefetch or resharding are refused, each in one line."""
    for bound, full in snippet.imports.items():
        module, _, name = full.rpartition(".")
        if module.startswith(LIBRARIES) and name not in KNOWN and not name.startswith("apply_liger_kernel_to_"):
            raise PlannerError(name, f"{full} is not a construct fsdp-plan check reads; it reads: "
                                     f"{', '.join(sorted(KNOWN))}, apply_liger_kernel_to_*")
    for call in snippet.calls:
        if call.short in UNREAD_METHODS:
            raise PlannerError(call.short, f"{call.name}() changes FSDP2's prefetch or resharding, which fsdp-plan "
                                           "does not price; remove it to check the default schedule")
        if call.name == "torch.compile":
            raise PlannerError("torch.compile", "torch.compile(...) is not read: fsdp-plan prices each block compiled "
                                                "in place (block.compile()), as --emit fsdp2 writes it")


def only(call: CallSite, known: tuple[str, ...], what: str) -> None:
    """A call's keyword arguments are all ones the reader reads."""
    for key in call.kwargs:
        if key.startswith("**"):
            raise PlannerError(what, f"{key}: keyword arguments that are not a dict the snippet builds (dict(...) or "
                                     "{...}) cannot be read")
        if key not in known:
            raise PlannerError(f"{what}.{key}", f"not an argument fsdp-plan check reads; it reads: {', '.join(known)}")


# ---------------------------------------------------------------- precision

def precision_of(param: str | None, reduce: str | None, stored: str, key: str) -> tuple[Precision, str | None]:
    """(Precision, reduce_dtype override or None) from FSDP's mixed-precision dtypes (fp32 | bf16 | fp16; None: not
    set; FSDP reduces in param_dtype when reduce_dtype is None) and the dtype the model is stored in: the pair
    whose fsdp_options.mixed_precision_dtypes gives them back, the precision's own reduction first."""
    reduce = reduce or param
    want = None if param is None and reduce is None else {"param_dtype": param, "reduce_dtype": reduce}
    for precision in Precision:
        if precision.param_dtype != stored:
            continue
        for override in (None, *REDUCE_DTYPES):
            names = fsdp_options.mixed_precision_dtypes(precision, override)
            got = None if names is None else {k: None if v is None else _dtype(k, v) for k, v in names.items()}
            if got == want or (want is None and got is None):
                return precision, override
    raise PlannerError(key, f"param_dtype {param}, reduce_dtype {reduce} over {stored} parameters is not a precision "
                            f"fsdp-plan prices; choose one of: {', '.join(p.value for p in Precision)}")


def dtype_kwargs(snippet: Snippet, node, what: str) -> tuple[str | None, str | None]:
    """(param_dtype, reduce_dtype) of a MixedPrecision(...) / MixedPrecisionPolicy(...) node; None for None."""
    if node is None or (not isinstance(node, ast.Call) and snippet.value(node, what) is None):
        return None, None
    if not isinstance(node, ast.Call):
        raise PlannerError(what, f"cannot read {ast.unparse(node)!r}: write {what}=MixedPrecision(...) in place")
    site = CallSite(dotted(node.func) or "", node, {k.arg: k.value for k in node.keywords if k.arg})
    only(site, ("param_dtype", "reduce_dtype", "buffer_dtype", "cast_forward_inputs"), what)
    param, reduce = (site.kwargs.get(k) for k in ("param_dtype", "reduce_dtype"))
    return (None if param is None or snippet.value(param, f"{what}.param_dtype") is None
            else _dtype(f"{what}.param_dtype", snippet.value(param, f"{what}.param_dtype")),
            None if reduce is None or snippet.value(reduce, f"{what}.reduce_dtype") is None
            else _dtype(f"{what}.reduce_dtype", snippet.value(reduce, f"{what}.reduce_dtype")))


def stored_dtype(snippet: Snippet) -> str:
    """bf16 when the snippet casts the model (model.to(torch.bfloat16): bf16-pure), else fp32."""
    for call in snippet.calls:
        if call.name == "model.to" and call.node.args:
            return _dtype("model.to", snippet.value(call.node.args[0], "model.to"))
    return "fp32"


# ---------------------------------------------------------------- FSDP1's switches (the FSDP1 code and Lightning's)

def cpu_offload(snippet: Snippet, node) -> bool:
    """FSDP1's cpu_offload=None / False / True / CPUOffload(offload_params=...)."""
    if node is None:
        return False
    if isinstance(node, ast.Call):
        flag = next((k.value for k in node.keywords if k.arg == "offload_params"), None)
        return bool(snippet.value(flag, "cpu_offload.offload_params")) if flag is not None else False
    return bool(snippet.value(node, "cpu_offload"))


def backward_prefetch(value) -> bool:
    """FSDP1's backward_prefetch (its default BACKWARD_PRE) as FsdpConfig.backward_prefetch."""
    if value not in (None, "BackwardPrefetch.BACKWARD_PRE", "BackwardPrefetch.BACKWARD_POST"):
        raise PlannerError("backward_prefetch", f"{value!r}; choose BackwardPrefetch.BACKWARD_PRE, "
                                                "BackwardPrefetch.BACKWARD_POST or None")
    return value is not None


def grad_scaler(snippet: Snippet) -> str | None:
    """sharded (ShardedGradScaler) | plain (torch's GradScaler) | None: the snippet builds none (the loop's)."""
    if called(snippet, "ShardedGradScaler"):
        return "sharded"
    return "plain" if any(c.short == "GradScaler" for c in snippet.calls) else None


# ---------------------------------------------------------------- techniques

def checkpointing(snippet: Snippet, wrappers: list[CallSite], every: int) -> int | str:
    """ac_every from checkpoint_wrapper calls: non-reentrant, whole blocks (every K-th with `every`) or with the
    selective-op context of --emit fsdp2 (compared statement by statement with the emitter's)."""
    if not wrappers:
        return 0
    selective = False
    for call in wrappers:
        only(call, ("checkpoint_impl", "context_fn"), "checkpoint_wrapper")
        impl = snippet.value(call.kwargs["checkpoint_impl"], "checkpoint_impl") if "checkpoint_impl" in call.kwargs \
            else "CheckpointImpl.NO_REENTRANT"  # checkpoint_wrapper's default
        if impl != "CheckpointImpl.NO_REENTRANT":
            raise PlannerError("checkpoint_impl", f"{impl}: fsdp-plan prices non-reentrant checkpointing; choose "
                                                  "CheckpointImpl.NO_REENTRANT")
        if "context_fn" in call.kwargs:
            name = dotted(call.kwargs["context_fn"])
            if name != "selective_op_context" or not _policy_is_ours(snippet):
                raise PlannerError("context_fn", f"{name}: fsdp-plan prices one selective policy, --emit fsdp2's "
                                                 "selective_op_context as written (torchtitan's op list)")
            selective = True
    if selective and every:
        raise PlannerError("context_fn", f"selective-op checkpointing of every {every}-th block is not priced; "
                                         "checkpoint every block with it, or whole blocks every K-th")
    return "selective-op" if selective else every or 1


@functools.cache
def _policy_statements() -> frozenset:
    return frozenset(ast.dump(n) for n in ast.parse("\n".join(tech.SELECTIVE_OP_POLICY)).body)


def _policy_is_ours(snippet: Snippet) -> bool:
    return _policy_statements() <= {ast.dump(n) for n in snippet.tree.body}


def compiles(snippet: Snippet) -> tuple[bool, bool]:
    """(compile, compile_loss): each block compiled in place (block.compile(), inner.compile()); the loss too where
    the snippet carries --emit's note saying so (the loss is the training loop's: a note is all it can be)."""
    compiled = any(c.short == "compile" and not c.node.args and c.name != "torch.compile" for c in snippet.calls)
    return compiled, compiled and snippet.says(tech.COMPILED_LOSS_NOTE)


def float8(snippet: Snippet, fsdp2: bool) -> tuple[bool, bool]:
    """(float8, fp8_all_gather): torchao's convert_to_float8_training, its config's FP8 all-gather (FSDP2 only:
    FSDP1 gathers the compute dtype whatever the config says)."""
    if not called(snippet, "convert_to_float8_training"):
        return False, False
    gather = False
    for call in calls(snippet, "Float8LinearConfig"):
        only(call, ("enable_fsdp_float8_all_gather",), "Float8LinearConfig")
        if "enable_fsdp_float8_all_gather" in call.kwargs:
            gather = snippet.value(call.kwargs["enable_fsdp_float8_all_gather"], "enable_fsdp_float8_all_gather")
    return True, bool(gather) and fsdp2


def liger(snippet: Snippet) -> dict:
    """FsdpConfig kernel fields from Liger's apply_liger_kernel_to_<model>(rope=..., rms_norm=..., ...): the same
    switches and defaults as TrainingArguments' liger_kernel_config (planner/emit/kernels.py)."""
    out = {}
    for call in snippet.calls:
        if call.short.startswith("apply_liger_kernel_to_"):
            switches = {key: snippet.value(node, f"{call.short}.{key}") for key, node in call.kwargs.items()
                        if key != "model"}  # model=: the instance patched (--emit's apply_kernels)
            out.update(from_hf_liger({"use_liger_kernel": True, "liger_kernel_config": switches}))
    return out


OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "AdamW8bit": "adamw-8bit"}


def attention(s: Snippet) -> tuple[dict, str]:
    """({"attention": the planner's name} or {}, UserSetup.attention_from) of the last set_attn_implementation(...)
    or attn_implementation=... (from_pretrained / from_config, **model_init_kwargs) the snippet writes; none:
    ({}, "unstated"), for check to price transformers' default (planner/emit/attention.py)."""
    node = None
    for call in s.calls:
        if call.short == "set_attn_implementation" and call.node.args:
            node = call.node.args[0]
        elif "attn_implementation" in call.kwargs:
            node = call.kwargs["attn_implementation"]
    if node is None:
        return {}, "unstated"
    return attn.from_hf_name(s.value(node, "attn_implementation"), "attn_implementation"), "code"


def optimizer(snippet: Snippet, offload: bool) -> tuple:
    """(knob, value) pairs of the optimizer the snippet builds (planner/emit/optimizer.py constructor): torch.optim's
    fused= / foreach= (neither: torch's default for where the parameters live), bitsandbytes' AdamW8bit; none
    built: () and the trainer's default."""
    built = [c for c in snippet.calls if c.name.startswith(("torch.optim.", "bnb.optim.", "bitsandbytes.optim."))]
    if not built:
        return ()
    call = built[-1]
    if call.short not in OPTIMIZERS:
        raise PlannerError("optimizer", f"{call.name} is not priced by fsdp-plan; choose one of: "
                                        f"{', '.join(OPTIMIZERS)}")
    if call.short == "AdamW8bit":
        return ("optimizer", "adamw-8bit"), ("optimizer_impl", "fused")  # bitsandbytes' own kernel, spelled fused
    fused, foreach = (snippet.value(call.kwargs[k], f"{call.short}.{k}") if k in call.kwargs else None
                      for k in ("fused", "foreach"))
    impl = "fused" if fused else "foreach" if foreach else "for-loop" if foreach is False else \
        torch_default_impl(offload).value
    return ("optimizer", OPTIMIZERS[call.short]), ("optimizer_impl", impl)
