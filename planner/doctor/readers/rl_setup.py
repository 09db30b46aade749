"""What the RL readers (verl.py, trl_grpo.py) return: the `fsdp-plan rl estimate` knobs a file fixes, by the
request's field names (planner/rl/request.py), with the model it names and what the reader had to assume."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RlSetup:
    knobs: dict                  # request field -> value (cluster fields too: gpus, gpus_per_node, gpu, ...)
    source: str
    dialect: str                 # verl-script | verl-overrides | verl-yaml | trl-grpo
    model: str | None = None     # the planner's --model from the `# fsdp-plan:` line, else None
    model_path: str | None = None    # what the file loads (verl's model.path, TRL's model_name_or_path)
    model_key: str = "model"     # the key that names it, for the message when it is not on this machine
    notes: tuple[str, ...] = ()  # what the reader assumed, said beside the estimate
    keys: dict = field(default_factory=dict)   # request field -> the file's key, to name it in an error
