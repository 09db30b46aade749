"""The attention implementation a plan priced (FsdpConfig.attention), in transformers' words, for the emitters
that write it and the `check` readers that read it back (planner/doctor/readers/).

transformers picks its own implementation when the user loads a model (modeling_utils.py
get_correct_attn_implementation, 5.x: SDPA where the model supports it, else eager; FlexAttention only when
asked), so an artifact that only names the plan's attention in a comment runs another one: gpt-oss has no SDPA
(its sinks) and falls back to eager, whose s x s scores the flex plan never priced. The Python snippets therefore
set it on the model before wrapping, always (not only where the default differs): what transformers picks
depends on its version and on the loader's own attn_implementation, and a call that names the current one is a
no-op (PreTrainedModel.set_attn_implementation compares first).
"""

from __future__ import annotations

from planner.errors import PlannerError

# FsdpConfig.attention -> transformers' attn_implementation (modeling_utils.py: "sdpa", "eager", "flex_attention")
HF_NAMES = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention"}
# the fused attention on flash-attention 3's Hopper kernels (attention_kernel fa3): transformers runs them as its
# own implementation (modeling_utils.py ALL_ATTENTION_FUNCTIONS "flash_attention_3", the flash_attn_3 package)
FA3_NAME = "flash_attention_3"
CONSTANT = "ATTN_IMPLEMENTATION"
KWARGS = "model_init_kwargs"  # TRL's SFTConfig / GRPOConfig name for from_pretrained's keyword arguments
YAML_KEY = "attn_implementation:"  # the accelerate YAML's comment line (accelerate has no attention key)


def hf_name(config) -> str:
    if config.attention.value == "sdpa" and config.attention_kernel.value == "fa3":
        return FA3_NAME
    return HF_NAMES[config.attention.value]


def from_hf_name(name, key: str) -> dict:
    """The FsdpConfig fields of a transformers attn_implementation (attention, and flash-attention 3's kernel);
    PlannerError naming `key` otherwise."""
    if name == FA3_NAME:
        return {"attention": "sdpa", "attention_kernel": "fa3"}
    planned = {hf: ours for ours, hf in HF_NAMES.items()}.get(name)
    if planned is None:
        raise PlannerError(key, f"{name!r} is not priced by fsdp-plan; choose one of: "
                                f"{', '.join((*HF_NAMES.values(), FA3_NAME))}")
    return {"attention": planned}


def transformers_default(choices: tuple[str, ...]) -> str:
    """What transformers 5 runs when nobody asks (get_correct_attn_implementation(None)): SDPA where the model runs
    it, else eager. `choices`: ModelSpec.attention_choices."""
    return "sdpa" if "sdpa" in choices else "eager"


def constant_line(config) -> str:
    return f"{CONSTANT} = \"{hf_name(config)}\"  # the attention the plan priced (transformers' name)"


def set_lines() -> list[str]:
    """Set it on a Hugging Face model, before FSDP wraps it (nothing to do on another nn.Module)."""
    return ["# the attention the plan priced, whatever the loader picked (gpt-oss without it: eager)",
            "if hasattr(model, \"set_attn_implementation\"):  # a Hugging Face model",
            f"    model.set_attn_implementation({CONSTANT})"]


def lightning_lines(config) -> list[str]:
    """Lightning's snippet has no apply_fsdp: a function for the LightningModule to call on its model."""
    return [constant_line(config), "", "",
            "def set_attention(model):",
            "    \"\"\"Call in the LightningModule's configure_model, before FSDPStrategy wraps the model.\"\"\"",
            *(f"    {line}" for line in set_lines()), "", ""]


def hf_trainer_lines(config) -> list[str]:
    """TrainingArguments has no attention field: the keyword arguments to load the model with."""
    return ["# the attention the plan priced: TrainingArguments has no field for it, so load the model",
            f"# with from_pretrained(name, **{KWARGS}) (TRL: SFTConfig({KWARGS}=...));",
            "# without it transformers runs SDPA where the model has it, else eager",
            f"{KWARGS} = {{\"attn_implementation\": \"{hf_name(config)}\"}}"]


def yaml_comment(config) -> str:
    """The accelerate YAML's line (a comment: accelerate has no key for it), read back by read_yaml_comment."""
    name = hf_name(config)
    return (f"{YAML_KEY} {name} (the attention the plan priced; accelerate has no key for it: load the model "
            f"with from_pretrained(..., attn_implementation=\"{name}\"))")


def read_yaml_comment(text: str) -> dict | None:
    """The FsdpConfig fields (from_hf_name) of yaml_comment's line, None where the file has none."""
    for line in text.splitlines():
        body = line.strip().removeprefix("#").strip()
        if line.lstrip().startswith("#") and body.startswith(YAML_KEY):
            words = body.removeprefix(YAML_KEY).split()
            return from_hf_name(words[0] if words else "", "attn_implementation")
    return None
