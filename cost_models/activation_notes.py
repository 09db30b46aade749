"""What the activation formulas are known to price roughly for a model: the estimate's notes, each pointing to the
trace tier (cost_models/activations.py's families)."""

from __future__ import annotations

from .activations import ALIBI_FAMILIES, PROFILED_FAMILIES, PYTHON_OP_ACTIVATIONS
from .operators import window_masks
from .specs import Attention, ModelSpec


def quirks(model: ModelSpec, attention: Attention, seq_len: int = 0) -> list[str]:
    """Where the formulas are known to be rough for this model: say so and point to the trace tier."""
    notes = []
    if attention is Attention.SDPA and window_masks(model, seq_len):
        notes.append(f"sliding window {model.sliding_window} <= sequence {seq_len}: SDPA gets an s x s mask that "
                     "each layer saves (counted) and a masked backward whose working set is only approximated; "
                     "verify with `fsdp-plan trace`")
    if model.activation in PYTHON_OP_ACTIVATIONS:
        notes.append(f"activation {model.activation} is written in Python ops (saves 5 f-sized tensors per "
                     "block, 4 under LoRA: 2-2.5x a fused GELU); verify activation memory with `fsdp-plan trace`")
    if model.family in ALIBI_FAMILIES and attention is Attention.SDPA:
        notes.append(f"{model.family} uses an ALiBi bias: SDPA cannot use the flash kernel and s^2 "
                     "attention memory is counted; verify with `fsdp-plan trace`")
    if model.family == "generic" and model.priced_by == "formula":
        why = f" ({model.activation_profile.source})" if model.activation_profile is not None else ""
        notes.append(f"model architecture inferred from an nn.Module{why}: activation memory uses a Llama-style "
                     "block; verify with `fsdp-plan trace`")
    if model.family in ("bert", "opt", "bloom", "mpt", "falcon"):
        notes.append(f"activation accounting for {model.family} follows the generic recipe (not checked "
                     "tensor by tensor against the trace tier); verify with `fsdp-plan trace`")
    if model.family in PROFILED_FAMILIES and model.priced_by == "formula":
        what = "latent attention (MLA)" if model.family != "gpt_oss" else "attention with sinks"
        notes.append(f"{model.family}'s {what} is priced by its formula, not a traced block memory profile "
                     "(install transformers for one: it adds the block's traced operators to the step time); "
                     "verify with `fsdp-plan trace`")
    return notes
