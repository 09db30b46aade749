"""A calibration run's pipeline: this rank's stages and torch's schedule, for calibration/runner.py (pp > 1).

The stages are cut by calibration/pipeline.py (split_stages, build_schedule), the code the pipeline trace runs
(calibration/trace_pipeline.py): torchtitan's mesh [pp, dp_replicate, dp_shard, cp, tp] (make_pipeline_mesh),
this pipeline rank's StageModules of the transformers model, apply_fsdp2 on each (checkpointing, compile,
fully_shard per block then the stage root, reshard_after_forward=False under PP) on the data-parallel sub-mesh,
then the meta parameters materialised and initialised as worker_model.apply_config does for a whole model. One step is
schedule.step over the local batch (config.pp_microbatches microbatches of micro_batch sequences) and the
optimizer step; the loss handed to the schedule is the model's divided by the microbatches (build_schedule sets
scale_grads=False, as torchtitan), so a step's gradients are those of the local batch's mean loss, as a run
without a pipeline accumulates them.

The loss exists on the last stage's ranks only and is averaged from there; memory is per rank and a pipeline
rank's figure is the largest of its data-parallel ranks' (rank_peaks), as the planner reports each pipeline rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cost_models.specs import FsdpConfig, ModelSpec

from .apply import TORCH_DTYPES, apply_fsdp2, cast_for_precision
from .pipeline import build_schedule, causal_lm_loss, split_stages, stage_indices
from .trace_pipeline import leaf_inputs_untracked, make_pipeline_mesh
from .worker_model import init_module_params, snapshot_buffers

PIPELINE_RUNS = "the calibration runner pipelines transformers models (base_model_pp_plan) with FSDP alone inside " \
                "each stage (tp = cp = ep = 1), as the pipeline trace does"


class PipelineRun:
    """This rank's stages of `model` (built with its parameters on meta, buffers real) and the schedule over them.

    stages: an nn.ModuleList of the FSDP2 stage roots (the optimizer's parameters, what memtrack tracks: one
    model whose units run forward once per microbatch); step(batches) runs one schedule step."""

    def __init__(self, model: nn.Module, spec: ModelSpec, config: FsdpConfig, classes: set[type], world: int,
                 gpus_per_node: int, device: torch.device, seq_len: int):
        if config.tp * config.cp * config.ep > 1:
            raise ValueError(f"pp={config.pp}: {PIPELINE_RUNS}")
        self.config = config
        self.mesh = make_pipeline_mesh(config, world, gpus_per_node, device.type)
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.indices = stage_indices(spec, config, self.pp_rank)
        self.first, self.last = 0 in self.indices, config.pp_stages - 1 in self.indices
        cast_for_precision(model, config)
        buffers = snapshot_buffers(model)
        modules = split_stages(model, spec, config, self.pp_rank)
        for module in modules:
            apply_fsdp2(module, config, classes, self.mesh)
            module.to_empty(device=device)
            for sub in module.modules():
                init_module_params(sub, buffers)
        self.stages = nn.ModuleList(modules)
        self.stages._calibration_mesh = self.mesh  # worker_step.check_same_sequences reads the mesh from here
        n = config.pp_microbatches
        self.schedule = build_schedule(modules, self.indices, config, self.mesh.get_group("pp"), device,
                                       lambda logits, ids: causal_lm_loss(logits, ids) / n, seq_len=seq_len,
                                       hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                                       dtype=TORCH_DTYPES[config.precision.compute_dtype])

    def step(self, batches: list[torch.Tensor]) -> torch.Tensor | None:
        """Forward and backward of the local batch (the micro-batches stacked) through the pipeline: the first
        stage's ranks feed the ids, the last stage's take them as targets. The local batch's mean loss on the last
        stage's ranks, else None."""
        ids = torch.cat(batches)
        losses: list[torch.Tensor] = []
        targets = {"target": ids, "losses": losses} if self.last else {}
        self.schedule.step(*((ids,) if self.first else ()), **targets)
        return torch.stack(losses).sum().detach() if self.last else None

    def tracked(self):
        """What the step runs inside under calibration.memtrack: zero-bubble and DualPipeV's input-gradient pass
        (autograd.grad on the stage inputs) beside the tracker's module hooks (trace_pipeline.leaf_inputs_untracked,
        as the pipeline trace runs it)."""
        return leaf_inputs_untracked()

    def mean_loss(self, loss: torch.Tensor | None, device: torch.device) -> float:
        """The last step's loss averaged over the last stage's ranks (one per data-parallel rank), on every rank."""
        t = torch.tensor([float(loss) if loss is not None else 0.0, 1.0 if loss is not None else 0.0],
                         dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return (t[0] / t[1]).item()

    def rank_peaks(self, peak_allocated_bytes: int, peak_reserved_bytes: int | None = None,
                   peak_phase: str = "unknown", breakdown: dict | None = None) -> list[dict]:
        """Every pipeline rank's peak (the largest of its data-parallel ranks'), gathered on every rank: the fields
        of calibration.store.PipelineRankPeak."""
        mine = {"pp_rank": self.pp_rank, "stages": list(self.indices), "peak_allocated_bytes": int(peak_allocated_bytes),
                "peak_reserved_bytes": peak_reserved_bytes, "peak_phase": peak_phase,
                "memory_breakdown": dict(breakdown or {})}
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out: dict[int, dict] = {}
        for rank in every:
            best = out.get(rank["pp_rank"])
            if best is None or rank["peak_allocated_bytes"] > best["peak_allocated_bytes"]:
                out[rank["pp_rank"]] = rank
        return [out[r] for r in sorted(out)]
