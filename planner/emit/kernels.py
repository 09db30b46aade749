"""The plan's kernels (FsdpConfig.norm_kernel / rope_kernel / swiglu_kernel / loss_kernel, cost_models/kernels.py) in
Hugging Face TrainingArguments, and back: use_liger_kernel applies Liger Kernel's patches to the model
(transformers/integrations/liger.py apply_liger_kernel -> liger_kernel.transformers._apply_liger_kernel_to_instance),
liger_kernel_config passes them their switches - for a Llama-like model rope, rms_norm, swiglu and
fused_linear_cross_entropy default on, cross_entropy off (apply_liger_kernel_to_llama, liger-kernel 0.8.5).
Transformer Engine's kernels and torchtitan's chunked loss have no TrainingArguments setting: the artifact says so
in a comment. torchtitan 0.3's chunked loss is loss.num_chunks in its job (torchtitan_kernel_flags, and back)."""

from __future__ import annotations

from cost_models.kernels import TORCHTITAN_LOSS_CHUNKS
from cost_models.specs import FsdpConfig, Kernel, LossKernel

from planner.errors import PlannerError

# liger_kernel_config's switch -> the FsdpConfig field it sets (liger on / eager off)
LIGER_SWITCHES = {"rope": "rope_kernel", "rms_norm": "norm_kernel", "swiglu": "swiglu_kernel",
                  "fused_linear_cross_entropy": "loss_kernel"}
_LIGER_DEFAULTS = {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True,
                   "cross_entropy": False}


def _liger(config: FsdpConfig, field_name: str) -> bool:
    return getattr(config, field_name).value == "liger"


def hf_liger_arguments(config: FsdpConfig) -> list[str]:
    """TrainingArguments lines for the plan's Liger kernels ([] without any); liger_kernel_config when only some."""
    switches = {key: _liger(config, name) for key, name in LIGER_SWITCHES.items()}
    if not any(switches.values()):
        return []
    lines = ["    use_liger_kernel=True,  # Liger Kernel 0.8.5 (pip install liger-kernel==0.8.5), as planned"]
    if not all(switches.values()):
        pairs = ", ".join(f'"{key}": {on}' for key, on in {**switches, "cross_entropy": False}.items())
        lines.append(f"    liger_kernel_config={{{pairs}}},")
    return lines


def hf_kernel_notes(config: FsdpConfig) -> list[str]:
    """What TrainingArguments cannot set of the plan's kernels."""
    te = [name.removesuffix("_kernel") for name in ("norm_kernel", "rope_kernel", "swiglu_kernel")
          if getattr(config, name) is Kernel.TE]
    notes = []
    if te:
        notes.append(f"Transformer Engine kernels ({', '.join(te)}): TrainingArguments has no such setting; swap the "
                     "model's modules for te.RMSNorm / fused RoPE / te.ops.SwiGLU before Trainer(...), as planned")
    if config.loss_kernel is LossKernel.CHUNKED:
        notes.append("chunked loss (torchtitan's ChunkedLossWrapper, 8 chunks): TrainingArguments has no such "
                     "setting; pass the equivalent as Trainer(compute_loss_func=...) on the model's hidden states")
    return notes


def from_hf_liger(data: dict) -> dict:
    """FsdpConfig's kernel fields from TrainingArguments' use_liger_kernel / liger_kernel_config ({} without Liger);
    PlannerError on a switch the planner does not price (Liger's unfused cross_entropy) or does not know."""
    on = data.get("use_liger_kernel", False)
    if not isinstance(on, bool):
        raise PlannerError("use_liger_kernel", f"expected true or false, got {on!r}")
    if not on:
        return {}
    given = data.get("liger_kernel_config") or {}
    if not isinstance(given, dict):
        raise PlannerError("liger_kernel_config", f"must be a mapping of switches, got {given!r}")
    unknown = sorted(set(given) - set(_LIGER_DEFAULTS))
    if unknown:
        raise PlannerError(f"liger_kernel_config.{unknown[0]}", f"not a switch fsdp-plan prices; choose among: "
                                                               f"{', '.join(_LIGER_DEFAULTS)}")
    switches = {**_LIGER_DEFAULTS, **given}
    if switches["cross_entropy"]:
        raise PlannerError("liger_kernel_config.cross_entropy", "Liger's unfused cross-entropy is not priced; use "
                                                                "fused_linear_cross_entropy (the default)")
    return {name: "liger" if switches[key] else "eager" for key, name in LIGER_SWITCHES.items()}


def torchtitan_kernel_flags(config: FsdpConfig, version: str) -> tuple[list, list[str]]:
    """((name, value, comment) flags, notes) for the plan's kernels in a torchtitan job: 0.3's ChunkedLossWrapper
    (torchtitan/components/loss.py; the llama3 configs' own loss) takes loss.num_chunks; torchtitan's models run
    their own norms, RoPE and SwiGLU and have no Liger or TE switch."""
    flags, notes = [], []
    if config.loss_kernel is LossKernel.CHUNKED and version == "0.3":
        flags.append(("loss.num_chunks", TORCHTITAN_LOSS_CHUNKS, "ChunkedLossWrapper: lm_head and the loss in 8 "
                                                                 "sequence chunks, as planned"))
    elif version == "0.3" and config.loss_kernel is LossKernel.EAGER:
        notes.append("the plan priced the model's plain cross-entropy; every torchtitan 0.3 model config takes "
                     "ChunkedLossWrapper (no flag selects another loss): less memory than planned (--trainer "
                     "torchtitan plans it chunked)")
    elif config.loss_kernel is LossKernel.CHUNKED:
        notes.append(f"chunked loss: torchtitan {version} has no ChunkedLossWrapper (0.3 has): its loss holds the "
                     "whole logits, more memory than planned")
    elif config.loss_kernel is LossKernel.LIGER:
        notes.append("Liger's fused linear cross-entropy: torchtitan has no such loss; 0.3's chunked loss "
                     "(--loss-kernel chunked) is its own way to keep the logits out of memory")
    other = [name.removesuffix("_kernel") for name in ("norm_kernel", "rope_kernel", "swiglu_kernel")
             if getattr(config, name) is not Kernel.EAGER]
    if other:
        notes.append(f"{', '.join(other)} kernels (Liger / Transformer Engine): torchtitan's models run their own "
                     "ops (compiled with compile.enable); the plan priced the kernels")
    return flags, notes


def from_torchtitan_loss(settings: dict) -> dict:
    """FsdpConfig's loss_kernel from a torchtitan job's loss.num_chunks ({} without it); PlannerError on a chunk
    count the planner does not price."""
    if "loss.num_chunks" not in settings:
        return {}
    value = settings["loss.num_chunks"]
    if str(value).strip() != str(TORCHTITAN_LOSS_CHUNKS):
        raise PlannerError("loss.num_chunks", f"{value!r}; fsdp-plan prices ChunkedLossWrapper's default of "
                                              f"{TORCHTITAN_LOSS_CHUNKS} chunks")
    return {"loss_kernel": "chunked"}


# the model families liger_kernel.transformers has an apply_liger_kernel_to_<family> for (0.8.5, text models)
LIGER_FAMILIES = ("llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "qwen2", "qwen3", "qwen3_moe",
                  "phi3", "olmo2", "olmo3", "granite", "glm4", "gpt_oss", "deepseek_v2", "deepseek_v3")


def code_liger_lines(config: FsdpConfig, family: str) -> list[str]:
    """Module-level code for the snippets (--emit fsdp2 / fsdp1): apply_kernels(model), Liger's patch of the model
    instance with the plan's switches, to call before apply_fsdp (it swaps the norms' and MLPs' modules and the
    forward's loss); [] without Liger kernels."""
    switches = {key: _liger(config, name) for key, name in LIGER_SWITCHES.items()}
    if not any(switches.values()):
        return []
    if family not in LIGER_FAMILIES:
        return [f"# Liger kernels: liger-kernel 0.8.5 has no apply_liger_kernel_to_{family}; the plan priced them", ""]
    args = [f"{key}={on}" for key, on in {**switches, "cross_entropy": False}.items()]
    return [f"from liger_kernel.transformers import apply_liger_kernel_to_{family}  # liger-kernel 0.8.5, as planned",
            "", "",
            "def apply_kernels(model):",
            "    \"\"\"The plan's Liger kernels: call before apply_fsdp (they swap modules FSDP then wraps).\"\"\"",
            f"    apply_liger_kernel_to_{family}(",
            f"        {', '.join(args[:3])},",  # the block's kernels, then the loss's: 100 columns
            f"        {', '.join(args[3:])}, model=model)", ""]
