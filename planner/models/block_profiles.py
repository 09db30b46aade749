"""Block memory profiles for models without an activation formula: traced once, cached on disk.

    spec = with_block_profile(spec, hf_config, seq_len=4096)   # spec.activation_profile is set

The profile (calibration/block_profile.py: the real block at full width on fake tensors) is made for
each compute dtype the planner prices (bf16, which fp16 shares, and fp32) and each attention
implementation the model runs, at the requested sequence length. It is cached as one JSON file per
(config, torch and transformers versions, dtype, attention, sequence length) under
$FSDP_PLANNER_CACHE (default ~/.cache/fsdp-planner)/block-profiles/, written atomically and validated
when read (a file that does not parse is made again). After the first profile the search is as fast as
for a preset.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from cost_models.specs import ActivationProfile, ActivationTerms, BackwardMoment, ModelSpec, TracedOperators
from planner.errors import PlannerError

SCHEMA_VERSION = 5  # 2: dense-block terms; 3: terms nested; 4: specs hold MoE dense-layer indices, terms the checkpoint-held inputs; 5: the traced operator inventory
PROFILED_DTYPES = ("bf16", "fp32")


class _Moment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grad_bytes: int
    const_bytes: float
    per_token: float
    per_token_per_seq: float
    experts_done: bool = False


class _Operators(BaseModel):
    model_config = ConfigDict(extra="forbid")
    matmuls: list[tuple[int, int, float, int]]
    attention_flops_per_token: float
    attention_reference_flops: float
    memory_forward_bytes_per_token: float
    memory_backward_bytes_per_token: float


class _Terms(BaseModel):
    """ActivationTerms as stored (an MoE model's leading dense blocks nested)."""

    model_config = ConfigDict(extra="forbid")
    saved_per_token: float
    saved_per_token_per_seq: float
    backward_moments: list[_Moment]
    dense: _Terms | None = None
    checkpoint_held: tuple[float, float, float, float]
    operators: _Operators | None = None

    @classmethod
    def of(cls, terms: ActivationTerms) -> _Terms:
        ops = terms.operators
        return cls(saved_per_token=terms.saved_per_token, saved_per_token_per_seq=terms.saved_per_token_per_seq,
                   backward_moments=[_Moment(**dataclasses.asdict(m)) for m in terms.backward_moments],
                   dense=None if terms.dense is None else cls.of(terms.dense), checkpoint_held=terms.checkpoint_held,
                   operators=None if ops is None else _Operators(**{**dataclasses.asdict(ops),
                                                                     "matmuls": list(ops.matmuls)}))

    def activation_terms(self) -> ActivationTerms:
        ops = self.operators
        return ActivationTerms(saved_per_token=self.saved_per_token, saved_per_token_per_seq=self.saved_per_token_per_seq,
                               backward_moments=tuple(BackwardMoment(**m.model_dump()) for m in self.backward_moments),
                               dense=None if self.dense is None else self.dense.activation_terms(),
                               checkpoint_held=self.checkpoint_held,
                               operators=None if ops is None else TracedOperators(
                                   **{**ops.model_dump(), "matmuls": tuple(tuple(m) for m in ops.matmuls)}))


class BlockProfileFile(BaseModel):
    """One cached profile: what it was made from and the fitted terms."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int
    key: str
    model_type: str
    compute_dtype: str
    attention: str
    seq_len: int
    torch_version: str
    transformers_version: str
    seconds: float
    terms: _Terms


def cache_dir() -> Path:
    root = os.environ.get("FSDP_PLANNER_CACHE") or Path.home() / ".cache" / "fsdp-planner"
    return Path(root) / "block-profiles"


def _versions() -> tuple[str, str]:
    """torch and transformers versions from the installed metadata (no import: a cached run stays fast)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch"), version("transformers")
    except PackageNotFoundError:
        return "none", "none"


def _config_key(kind: str, hf_config: dict, **extra) -> str:
    torch_version, transformers_version = _versions()
    blob = json.dumps({"kind": kind, "config": hf_config, "torch": torch_version, "transformers": transformers_version,
                       "schema": SCHEMA_VERSION, **extra}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached_spec(hf_config: dict, name: str, make) -> ModelSpec:
    """The ModelSpec transformers' meta build gives for this config (`make()`), cached like the profiles:
    a later run neither imports torch nor builds the model."""
    key = _config_key("spec", hf_config)
    path = cache_dir() / f"spec-{key}.json"
    from calibration.store import model_spec_from_dict  # pydantic, no torch

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") == key:  # a file that does not hold a valid spec is made again
            return dataclasses.replace(model_spec_from_dict(data["spec"]), name=name)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    spec = make()
    from calibration.store import write_atomic

    try:
        write_atomic(path, json.dumps({"key": key, "spec": dataclasses.asdict(spec)}, indent=1))
    except OSError:
        pass
    return spec


def profile_key(hf_config: dict, compute_dtype: str, attention: str, seq_len: int) -> str:
    return _config_key("block-profile", hf_config, dtype=compute_dtype, attention=attention, seq_len=seq_len)


def _read(path: Path, key: str) -> BlockProfileFile | None:
    try:
        profile = BlockProfileFile.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError, ValueError):
        return None
    return profile if profile.key == key and profile.schema_version == SCHEMA_VERSION else None


def load_or_profile(spec: ModelSpec, hf_config: dict, compute_dtype: str, attention: str,
                    seq_len: int) -> tuple[BlockProfileFile, bool]:
    """The cached profile for this (config, dtype, attention, seq_len), or a new one written to the cache;
    the flag says whether it was cached."""
    key = profile_key(hf_config, compute_dtype, attention, seq_len)
    path = cache_dir() / f"{key}.json"
    cached = _read(path, key)
    if cached is not None:
        return cached, True
    from calibration.block_profile import profile_block  # torch, transformers
    from calibration.store import write_atomic

    try:
        terms, seconds = profile_block(hf_config, block_class=spec.block_class, compute_dtype=compute_dtype,
                                       attention=attention, seq_len=seq_len, hidden_size=spec.hidden_size,
                                       vocab_size=spec.vocab_size,
                                       n_dense_layers=spec.moe.first_sparse_layer if spec.moe else 0)
    except Exception as exc:  # noqa: BLE001 - foreign model code: report it as one line
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise PlannerError("model", f"tracing a block of {spec.name} for its memory profile failed "
                                    f"({type(exc).__name__}: {text})") from None
    torch_version, transformers_version = _versions()
    profile = BlockProfileFile(
        schema_version=SCHEMA_VERSION, key=key, model_type=str(hf_config.get("model_type")),
        compute_dtype=compute_dtype, attention=attention, seq_len=seq_len, torch_version=torch_version,
        transformers_version=transformers_version, seconds=round(seconds, 3), terms=_Terms.of(terms))
    try:
        write_atomic(path, profile.model_dump_json(indent=1))
    except OSError:
        pass  # an unwritable cache costs a re-profile next time, not a wrong answer
    return profile, False


def with_block_profile(spec: ModelSpec, hf_config: dict, seq_len: int,
                       attentions: tuple[str, ...] | None = None) -> ModelSpec:
    """spec with activation_profile set for every profiled dtype x attention (default: all the model runs)."""
    started = time.perf_counter()
    entries, made, first_seconds = [], 0, 0.0
    for attention in attentions or spec.attention_choices:
        for dtype in PROFILED_DTYPES:
            try:
                profile, cached = load_or_profile(spec, hf_config, dtype, attention, seq_len)
            except PlannerError as exc:
                # model code that does not run on fake tensors: priced by the generic recipe, and said so
                failed = ActivationProfile(terms=(), source=f"no block memory profile: {exc.args[0].split(': ', 1)[-1]}")
                return dataclasses.replace(spec, activation_profile=failed)
            entries.append((dtype, attention, profile.terms.activation_terms()))
            first_seconds += profile.seconds
            made += not cached
    took = time.perf_counter() - started
    source = (f"traced block memory profile ({len(entries)} dtype x attention, seq {seq_len}): "
              + (f"made in {took:.1f} s, cached in {cache_dir()}" if made
                 else f"cached in {cache_dir()} (first made in {first_seconds:.1f} s)"))
    return dataclasses.replace(spec, activation_profile=ActivationProfile(terms=tuple(entries), source=source))


def needs_block_profile(spec: ModelSpec, hf_config: dict | None) -> bool:
    """A model read from transformers' build (no family reader) gets its activations from a profile, and so
    does a family whose attention has no formula (activations.PROFILED_FAMILIES) where transformers is
    installed (without it: the formula, whose note says to verify)."""
    from importlib.util import find_spec

    from cost_models.activations import PROFILED_FAMILIES

    if hf_config is None or spec.activation_profile is not None:
        return False
    return spec.family == "generic" or (spec.family in PROFILED_FAMILIES and find_spec("transformers") is not None)
