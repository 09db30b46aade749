"""The on-disk cache under $FSDP_PLANNER_CACHE (default ~/.cache/fsdp-planner)/block-profiles/: its keys (config,
schema, torch and transformers versions, and what else a caller names) and the ModelSpec a meta build gives
(cached_spec). block_profiles.py keys its traced and shipped profiles with the same config_key; the spec readers
(resolve.py) cache their meta builds here, so neither imports the other for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from cost_models.specs import ModelSpec

SCHEMA_VERSION = 5  # 2: dense-block terms; 3: terms nested; 4: specs hold MoE dense-layer indices, terms the checkpoint-held inputs; 5: the traced operator inventory
# the cached specs' alone (a shipped profile keeps its key): 2: an MoE's shared-expert and dense-MLP widths read from
# the module (generic._mlp_widths); 3: its eager softmax's dtype (generic.eager_softmax_fp32)
SPEC_READER_VERSION = 3


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


def _config_key(kind: str, hf_config: dict, versions: bool = True, **extra) -> str:
    fields = {"kind": kind, "config": hf_config, "schema": SCHEMA_VERSION, **extra}
    if versions:  # the cache's keys; a shipped profile's have none (it is the answer under any version)
        fields["torch"], fields["transformers"] = _versions()
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached_spec(hf_config: dict, name: str, make) -> ModelSpec:
    """The ModelSpec transformers' meta build gives for this config (`make()`), cached like the profiles:
    a later run neither imports torch nor builds the model."""
    key = _config_key("spec", hf_config, reader=SPEC_READER_VERSION)
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
