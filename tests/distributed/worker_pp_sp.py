"""torchrun worker: pipeline x tensor parallel with sequence parallel, or x context parallel, for real (gloo, CPU, 4
ranks: pp 2 x tp 2 or pp 2 x cp 2), the emitted snippet (TP) and the trace tier's code path, each against the same
tiny Llama unsplit.

    torchrun --standalone --nproc_per_node=4 tests/distributed/worker_pp_sp.py --case '{"hf_config": {...},
        "config": {"pp": 2, "tp": 2, "pp_schedule": "1f1b", ...}, "seq_len": 64[, "emitted": true]}'

- "emitted": `--emit fsdp2`'s code for the config, exec-ed: its build_pipeline (Stage modules with torchtitan's TP
  plan, local [mb, seq / tp, hidden] shards between stages) and pipeline_step (the schedule under loss_parallel),
  three SGD steps (lr 0.5: a gradient off by any factor moves the next loss) against the unsplit model on the same
  sequences, and every gradient of the first step (full_tensor of the stage's shards) against the unsplit model's.
- otherwise what calibration/trace_pipeline.py traces, on real tensors: torchtitan's mesh (make_pipeline_mesh),
  this rank's StageModules (split_stages), apply_stage_tensor_parallel with sequence parallel (tp > 1) then
  apply_fsdp2 (tp 1: the TP is applied; FSDP over dp_shard x cp), build_schedule with sequence_shards = tp, the
  trace's measuring loop (_measured_steps: two steps of schedule + AdamW under calibration.memtrack) inside
  loss_parallel and, with cp > 1, inside calibration.pipeline.stage_context_parallel (the ids, the labels - the next
  token of each, shifted before the sequence is sharded - and the stages' positions sharded, ring attention; the
  loss next_token_loss), then a third forward / backward whose loss and gradients are compared with the unsplit
  model's on the whole sequences (worker_pp.py's comparison; the result has its fields, so
  pp_checks.check_against_trace / check_numerics read it).

FSDP2's collectives run through worker_families.like_nccl, as in worker_pp.py. Rank 0 prints one JSON line a case.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from calibration.apply import TORCH_DTYPES, apply_fsdp2
from calibration.build import build_model
from calibration.memtrack import MemoryTracker
from calibration.pipeline import apply_stage_tensor_parallel, build_schedule, split_stages, stage_context_parallel, \
    stage_indices, stage_loss
from calibration.tensor_parallel import local_vocab_size, loss_context
from calibration.trace import make_optimizer
from calibration.trace_pipeline import _measured_steps, leaf_inputs_untracked, make_pipeline_mesh
from cost_models.specs import TrainingSpec
from planner.models import block_classes_of, from_hf_config
from tests.distributed.cases import config_from_dict, serve_cli
from tests.distributed.worker_families import like_nccl
from tests.distributed.worker_pp import RecordingSchedule, batch, emitted_pipeline, reference_losses

SGD_STEPS, SGD_LR = 3, 0.5


def _grad_error(modules, names, reference) -> tuple[float, float]:
    """(largest |gradient - the unsplit model's|, largest |gradient|) over this rank's stage parameters."""
    error = largest = 0.0
    for module, fqns in zip(modules, names):
        for name, param in module.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            expected = reference.get_parameter(fqns[name]).grad
            error = max(error, (grad - expected).abs().max().item())
            largest = max(largest, expected.abs().max().item())
    return error, largest


def _stage_names(modules, model_names) -> list[dict]:
    """Each stage's parameter names -> the unsplit model's (taken before TP / FSDP replace the parameters)."""
    return [{n: model_names[id(p)] for n, p in m.named_parameters()} for m in modules]


def run_emitted(case: dict, world: int) -> dict:
    config, code, namespace, reference, schedule, modules, has_first, has_last = emitted_pipeline(case, world)
    hf_config, seq_len = case["hf_config"], case["seq_len"]
    names = [{n: _decoder_name(n) for n, _ in m.named_parameters()} for m in modules]
    optimizers = [torch.optim.SGD([p for m in modules for p in m.parameters()], lr=SGD_LR),
                  torch.optim.SGD(reference.parameters(), lr=SGD_LR)]
    ids = batch(hf_config["vocab_size"], config.micro_batch * config.pp_microbatches, seq_len, 0)
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    losses, expected, grad_error, max_grad = [], [], 0.0, 0.0
    for step in range(SGD_STEPS):
        loss = namespace["pipeline_step"](schedule, has_first, has_last, ids)
        losses.append(loss.item() if loss is not None else 0.0)
        ref = torch.nn.functional.cross_entropy(reference(input_ids=ids).logits.flatten(0, 1).float(),
                                                labels.flatten(), ignore_index=-100)
        ref.backward()
        expected.append(ref.item())
        if step == 0:
            grad_error, max_grad = _grad_error(modules, names, reference)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    # the loss lives on the last stage's ranks (tp 2 of them): their mean
    summed = torch.tensor(losses + [1.0 if has_last else 0.0], dtype=torch.float64)
    dist.all_reduce(summed)
    errors = torch.tensor([grad_error, max_grad], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    return {"losses": (summed[:-1] / summed[-1]).tolist(), "reference_losses": expected,
            "max_grad_error": errors[0].item(), "max_grad": errors[1].item(),
            "max_line": max(map(len, code.splitlines())), "schedule": type(schedule).__name__}


def _decoder_name(stage_name: str) -> str:
    """A Stage parameter's name in the unsplit causal LM: layers.N.* / embed_tokens / norm under model., the head
    as it is."""
    name = stage_name.replace("_checkpoint_wrapped_module.", "")
    return name if name.startswith("lm_head") else f"model.{name}"


def run_traced_path(case: dict, rank: int, world: int) -> dict:
    hf_config, seq_len = case["hf_config"], case["seq_len"]
    config = config_from_dict(case["config"])
    spec = from_hf_config(dict(hf_config), name="tiny-pp")
    torch.manual_seed(0)
    model = build_model(None, hf_config, attention=config.attention.value, device="cpu",
                        dtype=TORCH_DTYPES[config.precision.param_dtype])
    model.train()
    model.config.use_cache = False
    reference = copy.deepcopy(model)
    classes = block_classes_of(model)
    mesh = make_pipeline_mesh(config, world, world, "cpu")
    pp_rank = mesh["pp"].get_local_rank()
    indices = stage_indices(spec, config, pp_rank)
    first, last = 0 in indices, config.pp_stages - 1 in indices
    model_names = {id(p): n for n, p in model.named_parameters()}
    modules = split_stages(model, spec, config, pp_rank)
    names = _stage_names(modules, model_names)
    for module in modules:  # as trace_pipeline._trace_rank: TP (with sequence parallel), then FSDP on dp_shard x cp
        if config.tp > 1:
            apply_stage_tensor_parallel(module, mesh["tp"], classes, config.sequence_parallel)
        apply_fsdp2(module, dataclasses.replace(config, tp=1), classes, mesh)
        like_nccl(module)
    m = config.pp_microbatches
    loss_fn = stage_loss(config)
    schedule = RecordingSchedule(build_schedule(
        modules, indices, config, mesh.get_group("pp"), "cpu", lambda logits, labels: loss_fn(logits, labels) / m,
        seq_len=seq_len, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
        dtype=TORCH_DTYPES[config.precision.compute_dtype], sequence_shards=config.tp))
    stages = nn.ModuleList(modules)
    optimizer = make_optimizer(stages.parameters(), "adamw")
    ids = batch(spec.vocab_size, config.micro_batch * m, seq_len, 0)
    # CP: the next token of each (the first token's wrapping round) as labels, shifted before the sequence is sharded
    labels = torch.roll(ids, -1, 1) if config.cp > 1 else None
    whole = (ids.clone(), None if labels is None else labels.clone())  # the unsplit model's (CP shards them in place)
    with stage_context_parallel(modules, mesh["cp"], [ids] + ([] if labels is None else [labels])):
        tracker = MemoryTracker(stages, optimizer, vocab_size=local_vocab_size(spec.vocab_size, config.tp, True))
        tracker.track_inputs(ids)
        with leaf_inputs_untracked(), loss_context(config.tp, config.sequence_parallel):
            phases = _measured_steps(schedule, optimizer, ids, tracker, first, last, TrainingSpec().optimizer_impl,
                                     labels)
            target = ids if labels is None else labels
            schedule.step(*((ids,) if first else ()), **({"target": target} if last else {}))  # step 3: gradients
    peak = max(phases.values(), key=lambda s: s.peak_allocated_bytes)
    expected_losses = reference_losses(reference, whole[0], 3, whole[1])
    grad_error, max_grad = _grad_error(modules, names, reference)
    # the losses live on the last stage's ranks: tp of them (the same loss), cp of them (each its tokens' mean, of
    # as many tokens): their mean
    losses = torch.tensor(schedule.steps + [1.0] if last else [0.0] * 4, dtype=torch.float64)
    dist.all_reduce(losses)
    errors = torch.tensor([grad_error, max_grad], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    mine = {"rank": rank, "pp_rank": pp_rank, "tp_rank": mesh["tp"].get_local_rank(),
            "cp_rank": mesh["cp"].get_local_rank(), "stages": indices,
            "peak_allocated_bytes": peak.peak_allocated_bytes, "peak_phase": peak.peak_phase,
            "phases": {k: v.to_dict() for k, v in phases.items()}}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks, "losses": (losses[:-1] / losses[-1]).tolist(), "reference_losses": expected_losses,
            "max_grad_error": errors[0].item(), "max_grad": errors[1].item()}


def run_case(case: dict, rank: int, world: int) -> dict:
    return run_emitted(case, world) if case.get("emitted") else run_traced_path(case, rank, world)


if __name__ == "__main__":
    serve_cli(run_case)
