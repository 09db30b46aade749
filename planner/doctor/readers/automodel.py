"""Read a NeMo Automodel recipe YAML back for `fsdp-plan check` (the mirror of planner/emit/automodel.py, whose
docstring names the keys and the nemo_automodel 0.7.0 source they come from). Defaults are Automodel's own, so a
file is priced as it would run: FSDP2Config's mp_policy (bf16 params, fp32 reduce), model.torch_dtype "auto"
(bfloat16), reshard_after_forward None (FSDP2's: free after forward), the MoE parallelizer's false when
ep_size > 1, BackendConfig's rms_norm torch_fp32 and dispatcher deepep (where DeepEP is installed, as on the GPU
machines Automodel's MoE recipes run on). A value the cost model cannot price raises one PlannerError naming the key.
"""

from __future__ import annotations

from dataclasses import replace

from cost_models.specs import FsdpConfig, Precision

from planner.doctor.readers.common import DTYPES, UserSetup, _bool, fsdp2_sharding, _int, _int_or_none, hsdp_fields
from planner.errors import PlannerError

_DTYPES = {**DTYPES, "auto": "bf16"}  # auto: the checkpoint's dtype, priced as bf16 (host_ram.PRETRAINED_DTYPE)
_ATTENTION = {"sdpa": "sdpa", "te": "sdpa", "cudnn": "sdpa", "fa4": "sdpa", "flex": "flex", "eager": "eager",
              "torch": "eager"}  # TE / cuDNN / FA4: a fused flash-style kernel, priced as SDPA's
# the SDPA-style backends' kernels (FsdpConfig.attention_kernel): Transformer Engine's DotProductAttention runs
# cuDNN fused attention on Hopper (priced as flash2 elsewhere: planner.doctor.check); FA4 (a Blackwell kernel):
# no figure, priced as PyTorch SDPA's flash2
_ATTENTION_KERNEL = {"te": "cudnn", "cudnn": "cudnn"}
_OPTIMIZERS = {"torch.optim.AdamW": "adamw", "torch.optim.Adam": "adam", "torch.optim.SGD": "sgd", "adamw": "adamw",
               "adam": "adam", "sgd": "sgd"}


def is_automodel(data: dict) -> bool:
    """An Automodel recipe: a `recipe` target, or the model / distributed / step_scheduler sections together."""
    return "recipe" in data or all(k in data for k in ("model", "distributed", "step_scheduler"))


def _section(data: dict, key: str) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise PlannerError(key, "must be a mapping of settings")
    return value


def _dtype(key: str, value) -> str:
    text = str(value).strip().lower().removeprefix("torch.")
    if text not in _DTYPES:
        raise PlannerError(key, f"unknown dtype {value!r}; choose one of: bfloat16, float32")
    if _DTYPES[text] == "fp16":
        raise PlannerError(key, "float16 is not priced for Automodel (no gradient scaler): choose bfloat16 or float32")
    return _DTYPES[text]


def _choice(key: str, value, choices) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise PlannerError(key, f"unknown value {value!r}; choose one of: {', '.join(choices)}")
    return text


def _checkpointing(value) -> int:
    """distributed.activation_checkpointing as _dist_utils._normalize_activation_checkpointing reads it: every
    decoder layer (true / full) or none; "selective" is Automodel's own policy, not priced."""
    text = str(value).strip().lower().replace("-", "_") if value is not None else "false"
    if text in ("true", "on", "full", "enabled", "yes"):
        return 1
    if text in ("false", "off", "none", "disabled", "no"):
        return 0
    if text == "selective":
        raise PlannerError("distributed.activation_checkpointing", "selective is Automodel's own policy, not priced "
                                                                   "by fsdp-plan: choose true (every layer) or false")
    raise PlannerError("distributed.activation_checkpointing", f"{value!r}; choose true, false or full")


def _precision(model: dict, distributed: dict) -> tuple[Precision, str | None]:
    """(precision, reduce dtype where it differs from the precision's own) from the stored dtype and mp_policy."""
    stored = _dtype("model.torch_dtype", model.get("torch_dtype", model.get("dtype", "auto")))
    mp = distributed.get("mp_policy") or {}
    if not isinstance(mp, dict):
        raise PlannerError("distributed.mp_policy", "must be a mapping like {param_dtype: bfloat16, reduce_dtype: "
                                                    "float32}")
    param = _dtype("distributed.mp_policy.param_dtype", mp.get("param_dtype") or "bfloat16")
    reduce = _dtype("distributed.mp_policy.reduce_dtype", mp.get("reduce_dtype") or "float32")
    if param == "fp32" and stored == "bf16":
        raise PlannerError("distributed.mp_policy.param_dtype", "float32 compute over bfloat16 parameters is not "
                                                                "priced: choose bfloat16")
    precision = Precision.FP32 if param == "fp32" else Precision.BF16_PURE if stored == "bf16" else Precision.BF16
    return precision, None if reduce == precision.reduce_dtype else reduce


def from_automodel(data: dict, source: str = "automodel recipe") -> UserSetup:
    """The recipe's FsdpConfig and the training settings it fixes (routing, optimizer, sequence length)."""
    model, distributed = _section(data, "model"), _section(data, "distributed")
    steps, backend = _section(data, "step_scheduler"), model.get("backend") or {}
    if not isinstance(backend, dict):
        raise PlannerError("model.backend", "must be a mapping of BackendConfig fields")
    _choice("distributed.strategy", distributed.get("strategy", "fsdp2"), ("fsdp2",))
    sizes = {n: _int(distributed, f"{n}_size", 1) or 1 for n in ("tp", "cp", "ep", "pp")}
    if sizes["pp"] > 1:
        raise PlannerError("distributed.pp_size", "pipeline stages are not read from Automodel recipes yet: use 1")
    replicas = _int(distributed, "dp_replicate_size", 1) or 1
    moe = distributed.get("moe") or {}
    if sizes["ep"] > 1 and isinstance(moe, dict):  # the MoE parallelizer's blocks: its own flag, default false
        reshard = _bool("distributed.moe.reshard_after_forward", moe.get("reshard_after_forward", False))
    else:
        raw = distributed.get("reshard_after_forward")
        reshard = True if raw is None else _bool("distributed.reshard_after_forward", raw)
    sharding = fsdp2_sharding(replicas > 1, reshard)
    precision, reduce_dtype = _precision(model, distributed)
    norm = _choice("model.backend.rms_norm", backend.get("rms_norm", "torch_fp32"), ("torch", "torch_fp32", "te"))
    dispatcher = _choice("model.backend.dispatcher", backend.get("dispatcher", "deepep"), ("deepep", "torch"))
    if sizes["ep"] > 1 and dispatcher != "deepep":
        raise PlannerError("model.backend.dispatcher", "torch all-gathers the tokens, which fsdp-plan does not price: "
                                                       "choose deepep")
    compiles = _bool("distributed.enable_compile", distributed.get("enable_compile", False))
    config = FsdpConfig(
        sharding=sharding, precision=precision, reduce_dtype=reduce_dtype,
        offload=distributed.get("offload_policy") not in (None, False),
        ac_every=_checkpointing(distributed.get("activation_checkpointing", False)),
        micro_batch=_int(steps, "local_batch_size", 1),
        attention=_ATTENTION[attn := _choice("model.backend.attn", backend.get("attn", "sdpa"), tuple(_ATTENTION))],
        attention_kernel=_ATTENTION_KERNEL.get(attn, "flash2"),
        compile=compiles, compile_loss=False, norm_kernel="te" if norm == "te" else "eager",
        moe_dispatch="deepep" if sizes["ep"] > 1 else "all-to-all",
        sequence_parallel=_bool("distributed.sequence_parallel", distributed.get("sequence_parallel", False)),
        **sizes)
    dp = _int_or_none(distributed, "dp_size")  # dp_replicate x dp_shard (null: the ranks left)
    config = replace(config, **hsdp_fields(sharding, replicas, dp // replicas if dp else None, config.cp,
                                           config.tp)[0])
    optimizer = _section(data, "optimizer")
    target = str(optimizer.get("_target_", "torch.optim.AdamW"))
    training = {"routing": "round-robin" if _bool("model.backend.fake_balanced_gate",
                                                  backend.get("fake_balanced_gate", False)) else "learned"}
    if target in _OPTIMIZERS:
        training["optimizer"] = _OPTIMIZERS[target]
        fused = _bool("optimizer.fused", optimizer.get("fused", False))
        training["optimizer_impl"] = "fused" if fused else "foreach" if _bool(
            "optimizer.foreach", optimizer.get("foreach", True)) else "for-loop"
    dataset = _section(data, "dataset")
    keys = {f"{section}.{key}" for section in ("distributed", "step_scheduler", "optimizer")
            for key in _section(data, section)} | {f"model.backend.{key}" for key in backend}
    global_batch = _int(steps, "global_batch_size", 0) or None
    return UserSetup(
        config=config, fsdp_version=2, source=source, dialect="automodel", explicit=frozenset(keys), wrap="block",
        use_orig_params=True, init="dcp", reduce_dtype=reduce_dtype,  # load_base_model: DCP into the meta model
        seq_len=_int(dataset, "seq_len", 0) or None,
        model=str(model.get("pretrained_model_name_or_path") or (model.get("config") or {}).get(
            "pretrained_model_name_or_path") or "") or None,
        training=tuple(sorted({**training, **({"global_batch": global_batch} if global_batch else {})}.items())),
    )


__all__ = ["is_automodel", "from_automodel"]
