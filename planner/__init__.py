"""fsdp-planner: sharding planner and auto-configuration advisor for PyTorch FSDP.

    from planner import plan, estimate
    p = plan("gpt-13b", gpus=8)
    p.best.fsdp_kwargs(model)        # kwargs for FullyShardedDataParallel(model, **kwargs)
    p.best.apply_fully_shard(model)  # FSDP2, unit by unit

Importing this package does not import torch.
"""

from .api import Candidate, Plan, estimate, plan
from .errors import PlannerError

__all__ = ["plan", "estimate", "Plan", "Candidate", "PlannerError"]
