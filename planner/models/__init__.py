"""ModelSpec from a preset name, a Hugging Face config.json, or an nn.Module.

    resolve_model("llama2-7b")                 preset from planner/catalog/models.json
    resolve_model("path/to/config.json")       or a directory holding one, or the config as a dict
    resolve_model("Qwen/Qwen3-8B")             a Hub id: its config.json from the HF cache or the Hub (hub.py)
    resolve_model(torch_module)                counted on whatever device it lives (meta is fine)

resolve.py: presets, config files, dispatch by model_type; families.py: one reader per family with a
formula; module.py: the nn.Module path. torch and transformers are imported inside the functions that
need them, never at module import: `fsdp-plan --model llama2-7b ...` must start without loading torch.
"""

from .module import block_classes_of, from_module
from .resolve import (_catalog, from_hf_config, hf_config_of, list_presets, load_preset, preset_hf_config,
                      preset_source, read_hf_config, resolve_model, supported_model_types)

__all__ = ["resolve_model", "list_presets", "preset_hf_config", "preset_source", "load_preset", "hf_config_of",
           "read_hf_config", "from_hf_config", "supported_model_types", "block_classes_of", "from_module"]
