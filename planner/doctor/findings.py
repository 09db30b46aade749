"""What the doctor's rules return and read: a Finding (severity, message, fix) and the Context of one
checked setup (the user's setup priced, the planner's pick beside it)."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.profile import Profile
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec

from planner.api import Candidate
from planner.doctor.readers import UserSetup

ERROR, WARNING, ADVICE = "error", "warning", "advice"
SEVERITY_ORDER = {ERROR: 0, WARNING: 1, ADVICE: 2}


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    message: str
    fix: str

    def to_dict(self) -> dict:
        return {"code": self.code, "severity": self.severity, "message": self.message, "fix": self.fix}


@dataclass(frozen=True)
class Context:
    setup: UserSetup
    candidate: Candidate            # the estimate of the user's config
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    best: Candidate | None          # the planner's pick for the same model, cluster and batch
    dynamic_control_flow: bool
    unwrapped_extra_bytes: int      # memory the estimate lacks when there is no auto-wrap policy
    profile: Profile
    model_use_cache: bool | None = None  # use_cache in the model's own config (config.json, HF dict, module)
    best_same_techniques: Candidate | None = None  # the planner's best with the user's compile / Float8 choices

    @property
    def config(self) -> FsdpConfig:
        return self.setup.config


def _techniques(config: FsdpConfig) -> tuple:
    """What changes the model code rather than FSDP's settings: compile, Float8 (+ its FP8 all-gather)."""
    return config.compile, config.float8
