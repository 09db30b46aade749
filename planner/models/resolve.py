"""Where a ModelSpec comes from: presets (planner/catalog/models.json), config.json files or
directories, Hugging Face Hub ids (hub.py), Hugging Face config dicts, dispatched by model_type to the family
readers (families.py), else built on meta by transformers (generic.py); nn.Modules are read by their shapes
(module.py) and, for a family we read, by their config. A string is a local config path if one exists, else a
preset, else a hub id (org/name)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from functools import lru_cache
from pathlib import Path

from cost_models.specs import ModelSpec, SpecError
from planner.errors import ModelNotFound, PlannerError, UnsupportedModel

from . import hub
from .config_reader import Cfg
from .families import BUILDERS
from .module import _infer_shapes, _measure_split, find_blocks, hf_config_dict, is_module

CATALOG_PATH = Path(__file__).parent.parent / "catalog" / "models.json"

# Keys of a preset entry that are ours, not Hugging Face's: stripped before building a torch model.
_PRESET_META_KEYS = ("_source",)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def resolve_model(model, *, trust_remote_code: bool = False) -> ModelSpec:
    """ModelSpec from a preset name, a config.json path (file or directory), a Hub id ('Qwen/Qwen3-8B': its
    config.json from the Hugging Face cache or the Hub), an HF config dict, an nn.Module, or a ModelSpec
    (returned unchanged)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return from_hf_config(model, trust_remote_code=trust_remote_code)
    if is_module(model):
        return from_module(model)
    if names_preset(model):
        return load_preset(model)
    if isinstance(model, (str, Path)):
        path = _config_path(model)
        return from_hf_config(_with_code_dir(read_hf_config(path), path), name=_name_from_path(path),
                              trust_remote_code=trust_remote_code)
    raise PlannerError("model", f"expected a preset name, a config.json path, a dict or an nn.Module, "
                                f"got {type(model).__name__}")


def list_presets() -> list[str]:
    return sorted(_catalog())


def preset_hf_config(name: str) -> dict:
    """The Hugging Face config dict of a preset (without our `_source` note): feed it to
    `transformers.AutoConfig.for_model(**d)` to build the real model."""
    key = _preset_key(name)
    if key is None:
        raise _unknown_preset(name)
    # a deep copy: callers (transformers among them) may rewrite nested fields such as rope_scaling in place,
    # which would change the cached catalog, and with it every later key made of the config
    return copy.deepcopy({k: v for k, v in _catalog()[key].items() if k not in _PRESET_META_KEYS})


def preset_source(name: str) -> str:
    """Where a preset's numbers come from (the catalog's `_source` note)."""
    key = _preset_key(name)
    if key is None:
        raise _unknown_preset(name)
    return _catalog()[key].get("_source", "")


def load_preset(name: str) -> ModelSpec:
    key = _preset_key(name)
    if key is None:
        raise _unknown_preset(name)
    return from_hf_config(preset_hf_config(key), name=key)


def hf_config_of(model) -> dict | None:
    """The HF config dict behind a preset name, a config path or a dict; None for an nn.Module."""
    if isinstance(model, dict):
        return dict(model)
    if names_preset(model):
        return preset_hf_config(model)
    if isinstance(model, (str, Path)):
        path = _config_path(model)
        return _with_code_dir(read_hf_config(path), path)
    return None


def _with_code_dir(cfg: dict, path: Path) -> dict:
    """A remote-code config (auto_map) remembers the directory its code lives in, as transformers does."""
    if cfg.get("auto_map") and not cfg.get("_name_or_path"):
        cfg["_name_or_path"] = str((path if path.is_dir() else path.parent).resolve())
    return cfg


def names_preset(model) -> bool:
    """A preset name, unless a local config of that name exists (the local file wins)."""
    if not isinstance(model, str) or _preset_key(model) is None:
        return False
    path = Path(model)
    return not (path.is_file() or (path / "config.json").is_file())


def _config_path(model: str | Path) -> Path:
    """The config path a non-preset string names (a hub id's: its cached or downloaded config.json);
    ModelNotFound (with close preset names) when the string looks like neither an existing path, a hub id
    nor a path at all (a mistyped preset)."""
    path = Path(model)
    if isinstance(model, Path) or path.exists():
        return path
    if hub.is_hub_id(str(model)):
        return hub.config_path(str(model))
    if _looks_like_path(str(model)):
        return path
    raise _unknown_preset(str(model))


def read_hf_config(path: str | Path) -> dict:
    """Parse a config.json (or the config.json inside a directory); PlannerError on any failure."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"no config.json in directory {path}" if path.is_dir() else f"no such file: {path}"
        raise PlannerError("model", f"{where} (and it is not a preset name)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PlannerError("model", f"{file} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlannerError("model", f"cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise PlannerError("model", f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def from_hf_config(cfg: dict, name: str | None = None, *, trust_remote_code: bool = False) -> ModelSpec:
    """ModelSpec with exact parameter counts from a Hugging Face config dict: a family reader where we have
    one (no torch), else the model transformers builds on the meta device (generic.py). Remote code
    (auto_map) needs trust_remote_code and the directory holding the code (the config's _name_or_path)."""
    if not isinstance(cfg, dict):
        raise PlannerError("model", f"a Hugging Face config must be a dict, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise PlannerError("model", "config is missing required key 'model_type' "
                                    f"(supported: {', '.join(supported_model_types())})")
    if name is None:
        name = Path(str(cfg.get("_name_or_path") or model_type)).name or model_type
    builder = BUILDERS.get(model_type)
    if builder is None or cfg.get("auto_map"):
        return from_transformers(cfg, name, trust_remote_code=trust_remote_code)
    fields = builder(Cfg(cfg, model_type))
    try:
        return ModelSpec(name=name, family=model_type, **fields)
    except SpecError as e:  # a size the config allows but the spec rejects (e.g. a zero)
        raise PlannerError("model", f"config of {name!r}: {e}") from None


def from_transformers(cfg: dict, name: str, *, trust_remote_code: bool = False) -> ModelSpec:
    """ModelSpec of any causal LM transformers can build, read from the model built on meta (cached on disk
    by config and versions: spec_cache.cached_spec)."""
    from .generic import hf_config_object
    from .spec_cache import cached_spec

    if cfg.get("auto_map") and not trust_remote_code:
        hf_config_object(cfg)  # raises the one-line refusal
    return cached_spec(cfg, name, lambda: _read_built_model(cfg, name, trust_remote_code))


def _read_built_model(cfg: dict, name: str, trust_remote_code: bool) -> ModelSpec:
    from .generic import build_on_meta, hf_config_object

    config = hf_config_object(cfg, trust_remote_code=trust_remote_code)
    return from_module(build_on_meta(config, trust_remote_code=trust_remote_code), name=name)


def from_module(module, name: str | None = None) -> ModelSpec:
    """ModelSpec from an nn.Module, reading only shapes (works on the meta device, allocates nothing).

    A transformers model of a supported type takes its shape fields from its config; anything else
    is inferred from the repeated block's nn.Linear / nn.Embedding layers (family "generic").
    Parameter counts always come from the module itself.
    """
    name = name or type(module).__name__
    blocks = find_blocks(module, _hf_block_class_name(module))
    split = _measure_split(module, blocks)
    hf_dict = hf_config_dict(module)
    try:
        if hf_dict is not None and hf_dict.get("model_type") in BUILDERS:
            spec = from_hf_config(hf_dict, name=name)
            if spec.n_dense_layers:  # blocks of two sizes (MoE): the config's split is exact, the mean is not
                split = {k: v for k, v in split.items() if k not in ("block_params", "root_other_params")}
            return dataclasses.replace(spec, **split)
        spec = ModelSpec(name=name, family="generic", **_infer_shapes(module, blocks, hf_dict or {}), **split)
        if hf_dict is not None:  # a transformers model without a family reader
            from .generic import refine_from_module

            spec = refine_from_module(spec, module, blocks, hf_dict)
        return spec
    except PlannerError:
        raise
    except SpecError as e:  # e.g. a module with no parameters in its blocks
        raise PlannerError("model", f"cannot describe module {name!r}: {e}") from None


def block_classes_of(module) -> set[type]:
    """The repeated block class(es) of a module: the FSDP auto-wrap units."""
    return {type(block) for block in find_blocks(module, _hf_block_class_name(module))}


def _hf_block_class_name(module) -> str | None:
    """The decoder-layer class name transformers uses for this module's model_type, if supported."""
    hf_dict = hf_config_dict(module)
    if hf_dict is None or hf_dict.get("model_type") not in BUILDERS:
        return None
    try:
        return from_hf_config(hf_dict).block_class
    except PlannerError:
        return None


def supported_model_types() -> list[str]:
    return sorted(BUILDERS)


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _catalog() -> dict[str, dict]:
    return json.loads(CATALOG_PATH.read_text(encoding="utf-8"))


def _preset_key(name: str) -> str | None:
    """Catalog key for a preset name, case-insensitively; None when it is not one."""
    lowered = name.strip().lower()
    return next((key for key in _catalog() if key.lower() == lowered), None)


def _unknown_preset(name: str) -> ModelNotFound:
    close = difflib.get_close_matches(name.strip().lower(), list_presets(), n=4, cutoff=0.5)
    hint = f"did you mean: {', '.join(close)}?" if close else f"presets: {', '.join(list_presets())}"
    return ModelNotFound("model", f"unknown model {name!r}: not a preset nor an existing config path; {hint}")


def _looks_like_path(text: str) -> bool:
    return text.endswith(".json") or "/" in text or "\\" in text or text.startswith(".")


def _name_from_path(path: Path) -> str:
    """'models/llama/config.json' -> 'llama'; 'tiny.json' -> 'tiny'; a hub cache snapshot's -> the repo's name."""
    if hub.name_of_snapshot(path):
        return hub.name_of_snapshot(path)
    if path.is_dir():
        return path.resolve().name
    return path.resolve().parent.name if path.stem == "config" else path.stem
