"""peft's target_modules as a setup writes it -> the lora_targets knob the plan prices (ModelSpec.lora_targets):
attention (the attention projections) or all-linear (the MLP's linears too); and its lora_dropout -> the knob of that
name (cost_models/lora_dropout.py). Read by axolotl.py (lora_target_modules, lora_target_linear, lora_dropout) and
python_qlora.py (a script's LoraConfig(target_modules=..., lora_dropout=...)).

Names are transformers' module names of the families the planner prices. peft's own default (target_modules
None: its per-family table, q_proj and v_proj for Llama) and any subset of the attention projections are priced
as all four (an upper bound, silently: the common case); any MLP linear as every MLP linear (an upper bound, said
in a note when only some are named); names of neither kind are left unpriced, said in a note.
"""

from __future__ import annotations

from cost_models.spec_values import check_probability
from cost_models.specs import LoraTargets

ALL_LINEAR = LoraTargets.ALL_LINEAR.value  # peft's word; axolotl's lora_target_linear: true means the same
ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv",
                       "query", "key", "value", "out_proj", "dense"})
GATED_MLP = frozenset({"gate_proj", "up_proj", "down_proj"})
MLP = GATED_MLP | {"gate_up_proj", "fc1", "fc2", "c_fc", "w1", "w2", "w3", "dense_h_to_4h", "dense_4h_to_h"}


def lora_targets(target_modules, all_linear: bool = False) -> tuple[str, tuple[str, ...]]:
    """(the knob's value, notes) of peft's target_modules (a name, a list of names, "all-linear" or None: peft's
    default); all_linear: axolotl's lora_target_linear, every linear whatever the list says."""
    if all_linear or (isinstance(target_modules, str) and target_modules.strip().lower() == ALL_LINEAR):
        return ALL_LINEAR, ()
    names = {target_modules} if isinstance(target_modules, str) else set(target_modules or ())
    names = {str(n).rpartition(".")[2] for n in names}  # "self_attn.q_proj" names q_proj in every block
    mlp, other = names & MLP, names - ATTENTION - MLP
    notes = ()
    if mlp and mlp & GATED_MLP and not GATED_MLP <= mlp:
        notes += (f"LoRA adapters on {', '.join(sorted(mlp))} are priced on every MLP linear ({ALL_LINEAR}): an "
                  "upper bound",)
    if other:
        notes += (f"LoRA adapters on {', '.join(sorted(other))} are not priced (the blocks' attention and MLP "
                  "linears are)",)
    return (ALL_LINEAR if mlp else LoraTargets.ATTENTION.value), notes


def lora_dropout(value, field: str) -> tuple[str, float]:
    """The lora_dropout knob of what a setup writes under `field` (None: peft's and axolotl's default, 0)."""
    return "lora_dropout", check_probability(field, 0.0 if value is None else value)
