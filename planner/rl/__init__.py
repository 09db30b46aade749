"""RL post-training (verl GRPO with FSDP workers and a co-located rollout engine), issue 28: the request (verl's
knob names), one configuration priced phase by phase (evaluate.py) and its report (report.py). The cost models
are cost_models/rollout_engine.py, rl_batch.py, rl_phases.py and rl_host.py."""

from planner.rl.evaluate import RlEstimate, evaluate_rl, rl_estimate
from planner.rl.request import RlRequest, rl_request

__all__ = ["RlEstimate", "RlRequest", "evaluate_rl", "rl_estimate", "rl_request"]
