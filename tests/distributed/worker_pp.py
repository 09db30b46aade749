"""torchrun worker: the pipeline trace's training step on real tensors (gloo, CPU), and the same model unpipelined.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_pp.py \
        --case '{"hf_config": {...}, "config": {"pp": 2, "pp_schedule": "1f1b", "grad_accum": 4}, "seq_len": 64}'

Each case builds the small Hugging Face model with real weights (calibration.build.build_model, seed 0 on every
rank), keeps an unsplit copy, and runs what calibration/trace_pipeline.py traces: torchtitan's mesh [pp,
dp_replicate, dp_shard, cp, tp] (make_pipeline_mesh), this pipeline rank's stages (calibration.pipeline
.split_stages), apply_fsdp2 on each (FSDP2 over dp_shard, reshard_after_forward=False under PP), torch's
schedule with static metadata (build_schedule) and the trace's measuring loop (trace_pipeline._measured_steps:
two steps of schedule.step + AdamW under calibration.memtrack, every stage of the rank tracked as one model). The
loss handed to the schedule is the model's own divided by the microbatches (the schedule runs with
scale_grads=False, as torchtitan's): one step's gradients are then those of the local batch's mean loss.

Then the numerics: the unsplit copy takes the same two AdamW steps on the whole data-parallel batch (every dp
rank's sequences), and a third forward / backward on both sides compares the loss of each step and every
gradient (full_tensor of the stage's shards against the copy's).

A case with "emitted": {FsdpConfig fields} instead runs `--emit fsdp2`'s pipeline snippet for that config (exec-ed:
its build_pipeline and pipeline_step, two AdamW steps) against the unsplit model; rank 0 prints {"case": i,
"losses", "reference_losses", "max_line", "schedule"}.

FSDP2's collectives run through worker_families.like_nccl (the gradient reduce-scatter in place: gloo's clones its
input, NCCL does not; the all-gathers settled), as in worker_mesh.py. Rank 0 prints one JSON line per case: {"case": i, "ranks": [{"rank", "pp_rank",
"dp_rank", "stages", "peak_allocated_bytes", "peak_phase", "phases"}, ...] (every global rank), "losses": [3
steps], "reference_losses": [...], "max_grad_error": x, "max_grad": y}.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from calibration.apply import TORCH_DTYPES, apply_fsdp2
from calibration.build import build_model
from calibration.memtrack import MemoryTracker
from calibration.pipeline import build_schedule, causal_lm_loss, split_stages, stage_indices
from calibration.trace import make_optimizer
from calibration.trace_pipeline import _measured_steps, leaf_inputs_untracked, make_pipeline_mesh
from cost_models.specs import ClusterSpec, FsdpConfig, TrainingSpec
from planner.models import block_classes_of, from_hf_config
from tests.distributed.cases import config_from_dict, serve_cli
from tests.distributed.worker_families import like_nccl


class RecordingSchedule:
    """The schedule, with each step's microbatch losses kept (the measuring loop passes a throwaway list)."""

    def __init__(self, schedule):
        self.schedule, self.steps = schedule, []

    def step(self, *args, target=None, losses=None):
        kept: list = []
        out = self.schedule.step(*args, target=target, losses=kept if target is not None else None)
        self.steps.append(sum(loss.detach().item() for loss in kept))
        return out


def batch(vocab: int, rows: int, seq_len: int, dp_rank: int) -> torch.Tensor:
    """Data-parallel rank `dp_rank`'s sequences (the same on every pipeline rank of that copy)."""
    return torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(1 + dp_rank))


def reference_losses(reference: nn.Module, ids: torch.Tensor, steps: int,
                     labels: torch.Tensor | None = None) -> list[float]:
    """The unsplit model's loss on `ids` at each of `steps` steps, AdamW (the trace's, foreach=False) between
    them; the last step's gradients are left in place. labels: targets already shifted (calibration.pipeline.
    next_token_loss), else the model's own loss on the ids."""
    from calibration.pipeline import next_token_loss

    optimizer = make_optimizer(reference.parameters(), "adamw")
    losses = []
    for step in range(steps):
        loss = (reference(input_ids=ids, labels=ids).loss if labels is None
                else next_token_loss(reference(input_ids=ids).logits, labels))
        loss.backward()
        losses.append(loss.item())
        if step < steps - 1:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses


class EmittedPipeline(NamedTuple):
    config: FsdpConfig
    code: str
    namespace: dict
    reference: nn.Module
    schedule: object
    modules: list
    has_first: bool
    has_last: bool


def emitted_pipeline(case: dict, world: int) -> EmittedPipeline:
    """`--emit fsdp2`'s snippet for the case's config (its "emitted" fields, else its "config"), exec-ed, and its
    build_pipeline run on the tiny model (seed 0, fp32), beside an unsplit copy."""
    from planner.emit import emit_fsdp2
    from tests.distributed.worker_emit_mesh import GPU

    hf_config, seq_len = case["hf_config"], case["seq_len"]
    config = config_from_dict(case["emitted"] if isinstance(case.get("emitted"), dict) else case["config"])
    cluster = ClusterSpec(gpu=GPU, n_gpus=world, gpus_per_node=world, internode_bytes_per_s=1e10)
    code = emit_fsdp2(config, from_hf_config(dict(hf_config), name="tiny-pp"), cluster, TrainingSpec(seq_len=seq_len))
    namespace: dict = {}
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)
    torch.manual_seed(0)
    model = build_model(None, hf_config, device="cpu", dtype=torch.float32)
    reference = copy.deepcopy(model)
    return EmittedPipeline(config, code, namespace, reference, *namespace["build_pipeline"](model, "cpu"))


def run_emitted(case: dict, world: int) -> dict:
    """`--emit fsdp2`'s pipeline snippet for this case's config, exec-ed and trained for two AdamW steps with its
    own build_pipeline and pipeline_step, against the unsplit model on the same (every dp rank's) sequences."""
    config, code, namespace, reference, schedule, modules, has_first, has_last = emitted_pipeline(case, world)
    hf_config, seq_len = case["hf_config"], case["seq_len"]
    optimizer = make_optimizer([p for m in modules for p in m.parameters()], "adamw")
    mesh = namespace["device_mesh"]("cpu")
    dp_rank, dp = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()
    rows = config.micro_batch * config.pp_microbatches
    ids = batch(hf_config["vocab_size"], rows, seq_len, dp_rank)
    losses = []
    for _ in range(2):
        loss = namespace["pipeline_step"](schedule, has_first, has_last, ids)
        losses.append(loss.item() if loss is not None else 0.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    summed = torch.tensor(losses + [1.0 if has_last else 0.0], dtype=torch.float64)  # a TP group: one loss per rank
    dist.all_reduce(summed)
    everything = torch.cat([batch(hf_config["vocab_size"], rows, seq_len, d) for d in range(dp)])
    return {"losses": (summed[:-1] / summed[-1]).tolist(), "reference_losses": reference_losses(reference, everything, 2),
            "max_line": max(map(len, code.splitlines())), "schedule": type(schedule).__name__}


def run_case(case: dict, rank: int, world: int) -> dict:
    if "emitted" in case:
        return run_emitted(case, world)
    hf_config, seq_len = case["hf_config"], case["seq_len"]
    config = config_from_dict(case["config"])
    spec = from_hf_config(dict(hf_config), name="tiny-pp")
    torch.manual_seed(0)  # the same weights on every rank: each keeps its stages, FSDP shards them
    model = build_model(None, hf_config, attention=config.attention.value, device="cpu",
                        dtype=TORCH_DTYPES[config.precision.param_dtype])
    model.train()
    model.config.use_cache = False
    reference = copy.deepcopy(model)
    classes = block_classes_of(model)
    mesh = make_pipeline_mesh(config, world, world, "cpu")
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp_shard_cp"]
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    indices = stage_indices(spec, config, pp_rank)
    first, last = 0 in indices, config.pp_stages - 1 in indices
    model_names = {id(p): n for n, p in model.named_parameters()}
    modules = split_stages(model, spec, config, pp_rank)
    names = [{n: model_names[id(p)] for n, p in m.named_parameters()} for m in modules]
    for module in modules:
        apply_fsdp2(module, config, classes, mesh)
        like_nccl(module)
    m = config.pp_microbatches
    schedule = RecordingSchedule(build_schedule(
        modules, indices, config, mesh.get_group("pp"), "cpu", lambda logits, ids: causal_lm_loss(logits, ids) / m,
        seq_len=seq_len, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
        dtype=TORCH_DTYPES[config.precision.compute_dtype]))
    stages = nn.ModuleList(modules)
    optimizer = make_optimizer(stages.parameters(), "adamw")
    rows = config.micro_batch * m
    ids = batch(spec.vocab_size, rows, seq_len, dp_rank)
    tracker = MemoryTracker(stages, optimizer, vocab_size=spec.vocab_size)
    tracker.track_inputs(ids)
    with leaf_inputs_untracked():  # zero-bubble / DualPipeV's autograd.grad under the tracker, as in the trace
        phases = _measured_steps(schedule, optimizer, ids, tracker, first, last, TrainingSpec().optimizer_impl)
    peak = max(phases.values(), key=lambda s: s.peak_allocated_bytes)
    schedule.step(*((ids,) if first else ()), **({"target": ids} if last else {}))  # step 3: gradients only

    # the unsplit model on every dp rank's sequences: two AdamW steps, then the third's loss and gradients
    everything = torch.cat([batch(spec.vocab_size, rows, seq_len, d) for d in range(dp)])
    expected_losses = reference_losses(reference, everything, 3)
    grad_error = max_grad = 0.0
    for module, fqns in zip(modules, names):
        for name, param in module.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            expected = reference.get_parameter(fqns[name]).grad
            grad_error = max(grad_error, (grad - expected).abs().max().item())
            max_grad = max(max_grad, expected.abs().max().item())
    # losses live on the last stage's ranks, one per dp rank: their mean is the whole batch's
    losses = torch.tensor(schedule.steps if last else [0.0] * 3, dtype=torch.float64)
    dist.all_reduce(losses)
    errors = torch.tensor([grad_error, max_grad], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    mine = {"rank": rank, "pp_rank": pp_rank, "dp_rank": dp_rank, "stages": indices,
            "peak_allocated_bytes": peak.peak_allocated_bytes, "peak_phase": peak.peak_phase,
            "phases": {k: v.to_dict() for k, v in phases.items()}}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks, "losses": (losses / dp).tolist(), "reference_losses": expected_losses,
            "max_grad_error": errors[0].item(), "max_grad": errors[1].item()}


if __name__ == "__main__":
    serve_cli(run_case)
