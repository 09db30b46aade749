"""Block memory profiles for models without an activation formula: shipped for the presets, else traced
once and cached on disk.

    spec = with_block_profile(spec, hf_config, seq_len=4096)   # spec.activation_profile is set

The profile (calibration/block_profile.py: the real block at full width on fake tensors) is made for
each compute dtype the planner prices (bf16, which fp16 shares, and fp32) and each attention
implementation the model runs. Each (dtype, attention) is looked up in this order:

1. shipped: the presets that need one (shipped_presets: MLA, gpt-oss's sinks, any generic family) carry
   theirs as package data, planner/catalog/block_profiles/<preset>.json, made by
   `python benchmarks/make_block_profiles.py` at each of SHIPPED_SEQ_LENS and keyed as the cache is but
   without versions (config, schema, dtype, attention, sequence length), so `pip install -e .` without
   transformers gives the same answer as with it, and a cold start traces nothing. Another sequence
   length uses the nearest shipped one's terms (the fit is in tokens and sequence): halfway between two
   shipped lengths their terms price the same activations for gpt-oss and DeepSeek-V3 SDPA, within 5.3%
   for eager and 19% for DeepSeek-V2-Lite SDPA at 1,472 tokens (1,024 vs 2,048; 0.0% above). A shipped
   profile is the answer whatever torch / transformers is installed: each entry records the versions it
   was made with, and tests/unit/test_shipped_profiles.py traces each preset again under the installed
   ones and fails (regenerate) when they disagree. An entry that does not validate (schema, schema
   version) is skipped, as if not shipped.
2. cached: one JSON file per (config, torch and transformers versions, dtype, attention, sequence
   length) under $FSDP_PLANNER_CACHE (default ~/.cache/fsdp-planner)/block-profiles/, written atomically
   and validated when read (a file that does not parse is made again).
3. traced at the requested sequence length (torch, transformers; progress on a terminal), then cached.
After the first profile the search is as fast as for a preset.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from cost_models.specs import ActivationProfile, ActivationTerms, BackwardMoment, ModelSpec, TracedOperators
from planner.errors import PlannerError
from planner.progress import progress

from .spec_cache import SCHEMA_VERSION, _config_key, _versions, cache_dir

PROFILED_DTYPES = ("bf16", "fp32")
# The attention implementations a block trace runs (calibration/block_profile.py); the others are priced by the
# formulas (cost_models/attention_flex.py for flex).
TRACED_ATTENTIONS = ("sdpa", "eager", "flex")
SHIPPED_DIR = Path(__file__).parent.parent / "catalog" / "block_profiles"
SHIPPED_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)  # the shipped profiles are traced at each
MAKE_COMMAND = "python benchmarks/make_block_profiles.py"


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


class ShippedProfiles(BaseModel):
    """A preset's shipped profiles (planner/catalog/block_profiles/<preset>.json): one per dtype x attention."""

    model_config = ConfigDict(extra="forbid")
    preset: str
    made_by: str
    profiles: list[BlockProfileFile]


def profile_key(hf_config: dict, compute_dtype: str, attention: str, seq_len: int, lora_rank: int = 0) -> str:
    lora = {"lora_rank": lora_rank} if lora_rank else {}  # (a full fine-tuning profile's key unchanged)
    return _config_key("block-profile", hf_config, dtype=compute_dtype, attention=attention, seq_len=seq_len, **lora)


def shipped_key(hf_config: dict, compute_dtype: str, attention: str, seq_len: int) -> str:
    return _config_key("block-profile", hf_config, versions=False, dtype=compute_dtype, attention=attention,
                       seq_len=seq_len)


def shipped_seq_len(seq_len: int) -> int:
    """The shipped sequence length whose profile prices seq_len: the nearest by ratio (a tie: the longer)."""
    return min(SHIPPED_SEQ_LENS, key=lambda s: (abs(math.log(s / max(1, seq_len))), -s))


@functools.cache
def _shipped() -> dict[str, tuple[BlockProfileFile, str]]:
    """Every valid shipped profile by its key, with its file's name (read once per process)."""
    index = {}
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        try:
            shipped = ShippedProfiles.model_validate_json(path.read_text(encoding="utf-8"))
        except (OSError, ValidationError, ValueError):
            continue  # tests/unit/test_shipped_profiles.py holds every shipped file valid
        index.update({p.key: (p, path.name) for p in shipped.profiles if p.schema_version == SCHEMA_VERSION})
    return index


def shipped_profile(hf_config: dict, compute_dtype: str, attention: str,
                    seq_len: int) -> tuple[BlockProfileFile, str] | None:
    """The shipped profile that prices this config, dtype, attention and sequence length, with its file's
    name; None when none is shipped."""
    return _shipped().get(shipped_key(hf_config, compute_dtype, attention, shipped_seq_len(seq_len)))


def shipped_presets() -> list[str]:
    """The presets whose activations a block profile prices (a family without a formula): those shipped."""
    from cost_models.activations import PROFILED_FAMILIES

    from .resolve import list_presets, load_preset

    return [name for name in list_presets() if load_preset(name).family in {"generic", *PROFILED_FAMILIES}]


def _read(path: Path, key: str) -> BlockProfileFile | None:
    try:
        profile = BlockProfileFile.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError, ValueError):
        return None
    return profile if profile.key == key and profile.schema_version == SCHEMA_VERSION else None


def load_or_profile(spec: ModelSpec, hf_config: dict, compute_dtype: str, attention: str,
                    seq_len: int, lora_rank: int = 0) -> tuple[BlockProfileFile, str]:
    """The shipped profile for this (config, dtype, attention), else the cached one for this seq_len too, else
    a new one written to the cache; with where it came from: "shipped", "cached" or "made". lora_rank > 0: the
    block under LoRA (none shipped)."""
    shipped = None if lora_rank else shipped_profile(hf_config, compute_dtype, attention, seq_len)
    if shipped is not None:
        return shipped[0], "shipped"
    key = profile_key(hf_config, compute_dtype, attention, seq_len, lora_rank)
    path = cache_dir() / f"{key}.json"
    cached = _read(path, key)
    if cached is not None:
        return cached, "cached"
    from calibration.store import write_atomic

    profile = trace_profile(spec, hf_config, compute_dtype, attention, seq_len, key, lora_rank)
    try:
        write_atomic(path, profile.model_dump_json(indent=1))
    except OSError:
        pass  # an unwritable cache costs a re-profile next time, not a wrong answer
    return profile, "made"


def trace_profile(spec: ModelSpec, hf_config: dict, compute_dtype: str, attention: str, seq_len: int,
                  key: str, lora_rank: int = 0) -> BlockProfileFile:
    """A new profile from a trace of the block (torch, transformers), stored under `key`."""
    from calibration.block_profile import profile_block  # torch, transformers

    try:
        with progress(f"block memory profile of {spec.name} ({compute_dtype}, {attention}, seq {seq_len})"):
            # a copy: transformers completes nested fields (rope_scaling) in place, which would move later keys
            terms, seconds = profile_block(copy.deepcopy(hf_config), block_class=spec.block_class,
                                           compute_dtype=compute_dtype, attention=attention, seq_len=seq_len,
                                           hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                                           n_dense_layers=spec.moe.first_sparse_layer if spec.moe else 0,
                                           lora_spec=spec, lora_rank=lora_rank)
    except Exception as exc:  # noqa: BLE001 - foreign model code: report it as one line
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise PlannerError("model", f"tracing a block of {spec.name} for its memory profile failed "
                                    f"({type(exc).__name__}: {text})") from None
    torch_version, transformers_version = _versions()
    return BlockProfileFile(
        schema_version=SCHEMA_VERSION, key=key, model_type=str(hf_config.get("model_type")),
        compute_dtype=compute_dtype, attention=attention, seq_len=seq_len, torch_version=torch_version,
        transformers_version=transformers_version, seconds=round(seconds, 3), terms=_Terms.of(terms))


def with_block_profile(spec: ModelSpec, hf_config: dict, seq_len: int,
                       attentions: tuple[str, ...] | None = None, lora_rank: int = 0) -> ModelSpec:
    """spec with activation_profile set for every profiled dtype x attention (default: all the model runs);
    lora_rank > 0: lora_activation_profile, the block's under LoRA (its saved bytes price the ledger's blocks)."""
    started = time.perf_counter()
    entries, origins, first_seconds = [], [], 0.0
    attentions = tuple(a for a in attentions or spec.attention_choices if a in TRACED_ATTENTIONS)
    if not attentions:
        return spec
    for attention in attentions:
        for dtype in PROFILED_DTYPES:
            try:
                profile, origin = load_or_profile(spec, hf_config, dtype, attention, seq_len, lora_rank)
            except PlannerError as exc:
                if lora_rank:  # the formulas price LoRA's blocks, as without a profile
                    return spec
                # model code that does not run on fake tensors: priced by the generic recipe, and said so
                failed = ActivationProfile(terms=(), source=f"no block memory profile: {exc.args[0].split(': ', 1)[-1]}")
                return dataclasses.replace(spec, activation_profile=failed)
            entries.append((dtype, attention, profile.terms.activation_terms()))
            origins.append((origin, profile))
            first_seconds += profile.seconds
    took = time.perf_counter() - started
    kind = "LoRA block memory profile" if lora_rank else "block memory profile"
    shipped = [profile for origin, profile in origins if origin == "shipped"]
    if len(shipped) == len(origins):
        file = shipped_profile(hf_config, shipped[0].compute_dtype, shipped[0].attention, seq_len)[1]
        source = (f"shipped {kind} ({len(entries)} dtype x attention, traced at seq "
                  f"{shipped[0].seq_len} with torch {shipped[0].torch_version}, transformers "
                  f"{shipped[0].transformers_version}: planner/catalog/block_profiles/{file})")
    else:
        source = (f"traced {kind} ({len(entries)} dtype x attention, seq {seq_len}): "
                  + (f"made in {took:.1f} s, cached in {cache_dir()}" if any(o == "made" for o, _ in origins)
                     else f"cached in {cache_dir()} (first made in {first_seconds:.1f} s)"))
    if lora_rank:
        return dataclasses.replace(spec, lora_activation_profile=ActivationProfile(
            terms=tuple(entries), source=f"{source} (rank {lora_rank})"))
    return dataclasses.replace(spec, activation_profile=ActivationProfile(terms=tuple(entries), source=source))


def needs_block_profile(spec: ModelSpec, hf_config: dict | None) -> bool:
    """A model read from transformers' build (no family reader) gets its activations from a profile, and so
    does a family of activations.PROFILED_FAMILIES (MLA, sinks) when its profile is shipped (a preset) or
    transformers is installed to trace it. Those families have formulas now, within 0.1% of the shipped
    profiles (tests/unit/test_shipped_profiles.py), but the profile stays preferred: it also carries the
    block's traced operator inventory for the step time and its checkpoint-held inputs; without either the
    formula prices them, and its note says to verify."""
    from importlib.util import find_spec

    from cost_models.activations import PROFILED_FAMILIES

    if hf_config is None or spec.activation_profile is not None:
        return False
    if spec.family == "generic":
        return True
    return spec.family in PROFILED_FAMILIES and (
        shipped_profile(hf_config, PROFILED_DTYPES[0], spec.attention_choices[0], SHIPPED_SEQ_LENS[0]) is not None
        or find_spec("transformers") is not None)


def profile_difference(made: BlockProfileFile, other: BlockProfileFile, rel: float = 1e-6) -> str | None:
    """Where two profiles' terms differ by more than `rel` of a value (plus a millibyte: fits of the same
    trace differ in the last float digits), as one line; None when they agree."""

    def walk(a, b, where: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                return f"{where}: fields {sorted(a.keys() ^ b.keys())}"
            return next((d for k in a if (d := walk(a[k], b[k], f"{where}.{k}")) is not None), None)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            if len(a) != len(b):
                return f"{where}: {len(a)} vs {len(b)} entries"
            return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := walk(x, y, f"{where}[{i}]")) is not None),
                        None)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return None if abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-3 else f"{where}: {a} vs {b}"
        return None if a == b else f"{where}: {a!r} vs {b!r}"

    return walk(made.terms.model_dump(), other.terms.model_dump(), "terms")
