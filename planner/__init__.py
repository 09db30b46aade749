"""fsdp-planner: sharding planner and auto-configuration advisor for PyTorch FSDP.

    from planner import plan, estimate
    p = plan("gpt-13b", gpus=8)
    p.best.fsdp_kwargs(model)        # kwargs for FullyShardedDataParallel(model, **kwargs)
    p.best.apply_fully_shard(model)  # FSDP2, unit by unit
    trace("llama2-7b", gpus=8)       # the real FSDP2 step on fake tensors (needs transformers)

Importing this package does not import torch.
"""

from .api import Candidate, Plan, estimate, plan
from .errors import PlannerError
from .request import ClusterRequest, ConfigRequest, MeshRequest, SearchRequest, TrainingRequest
from .tracing import trace

__all__ = ["plan", "estimate", "trace", "Plan", "Candidate", "PlannerError", "ClusterRequest", "TrainingRequest",
           "ConfigRequest", "MeshRequest", "SearchRequest"]
