"""ModelSpec from a preset name, a Hugging Face config.json, or an nn.Module.

    resolve_model("llama2-7b")                 preset from planner/catalog/models.json
    resolve_model("path/to/config.json")       or a directory holding one, or the config as a dict
    resolve_model("Qwen/Qwen3-8B")             a Hub id: its config.json from the HF cache or the Hub (hub.py)
    resolve_model(torch_module)                counted on whatever device it lives (meta is fine)

resolve.py: presets, config files, modules, dispatch by model_type; families.py: one reader per family with
a formula; generic.py: transformers' meta build; module.py: an nn.Module's shapes. torch and transformers are
imported inside the functions that need them, never at module import: `fsdp-plan --model llama2-7b ...` must
start without loading torch.
"""

from .resolve import (_catalog, block_classes_of, from_hf_config, from_module, hf_config_of, list_presets, load_preset,
                      preset_hf_config, preset_source, read_hf_config, resolve_model, supported_model_types)

__all__ = ["resolve_model", "list_presets", "preset_hf_config", "preset_source", "load_preset", "hf_config_of",
           "read_hf_config", "from_hf_config", "supported_model_types", "block_classes_of", "from_module"]
