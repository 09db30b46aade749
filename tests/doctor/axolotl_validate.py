"""Validate config YAMLs with axolotl 0.21.0's own entry point (axolotl.utils.config.validate_config: its pydantic
AxolotlInputConfig and every validator), in a process of its own (axolotl's imports patch transformers and set
logging that must not leak into the test session).

stdin: a JSON list of YAML texts; stdout, last line: a JSON list, one entry per text, either {"error": "<the
validation error's last lines>"} or the validated keys fsdp-plan writes.
"""

from __future__ import annotations

import json
import sys

KEYS = ("base_model", "adapter", "load_in_4bit", "lora_r", "lora_alpha", "lora_target_modules", "lora_target_linear",
        "bnb_config_kwargs",
        "sequence_len", "micro_batch_size", "gradient_accumulation_steps", "optimizer", "optim_args", "bf16", "fp16",
        "attn_implementation", "gradient_checkpointing", "dp_replicate_size", "dp_shard_size", "fsdp_version",
        "fsdp_config", "qlora_sharded_model_loading")


def validated(text: str) -> dict:
    import yaml

    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    try:
        cfg = validate_config(DictDefault(yaml.safe_load(text)))
    except Exception as exc:  # pydantic's ValidationError or a validator's ValueError: the message is the finding
        return {"error": "\n".join(str(exc).splitlines()[-4:])}
    return {key: cfg.get(key) for key in KEYS}


if __name__ == "__main__":
    print(json.dumps([validated(text) for text in json.load(sys.stdin)], default=str))
