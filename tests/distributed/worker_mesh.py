"""torchrun worker: the trace tier's tensor- and context-parallel FSDP2 training step on real tensors (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_mesh.py \
        --case '{"hf_config": {...}, "config": {"tp": 2, "precision": "fp32"}, "seq_len": 64}' [--case ...]

Each case builds the small Hugging Face model with real weights (calibration.build.build_model, the trace's
builder), turns the KV cache off, builds the N-D mesh and applies tensor parallelism then FSDP2 through
calibration.apply (make_mesh, apply_fsdp2: the one code path the trace runs), and measures two training steps
with calibration.trace.measure_training_steps (the trace's measuring loop, loss parallel included). Rank 0
prints one JSON line per case: {"case": i, "peak_allocated_bytes": n, "peak_phase": ..., "phases": {...}}.

FSDP2's collectives run through worker_families.like_nccl: the gradient reduce-scatter in place (gloo's clones its
input, NCCL does not) unless the case says "gloo_reduce_scatter": true, and every all-gather settled (gloo's worker
thread frees its buffer late, at random); test_torchrun_mesh.py names gloo's copies.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from calibration.apply import TORCH_DTYPES, apply_fsdp2, make_mesh
from calibration.build import build_model
from calibration.trace import make_optimizer, measure_training_steps
from planner.models import block_classes_of
from tests.distributed.cases import config_from_dict, serve_cli
from tests.distributed.worker_families import InPlaceReduceScatter, like_nccl


def tp_gradient_check(case: dict) -> dict:
    """The TP plan's numerics: the model with calibration/tensor_parallel.py's plan on the 2 ranks against the
    same weights unsharded on each rank (norm weights perturbed so their gradients matter): the loss and every
    parameter's gradient (full_tensor), fp32, with and without sequence parallel."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from calibration.apply import _block_slots
    from calibration.tensor_parallel import apply_tensor_parallel, loss_context

    torch.manual_seed(0)
    reference = build_model(None, case["hf_config"], device="cpu", dtype=torch.float32)
    reference.config.use_cache = False
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    ids = torch.randint(0, case["hf_config"]["vocab_size"], (2, case["seq_len"]), generator=torch.Generator().manual_seed(1))
    loss_ref = reference(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    out = {}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for sp in (True, False):
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        apply_tensor_parallel(model, mesh, _block_slots(model, block_classes_of(model)), sp)
        with loss_context(2, sp):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
        errors = {name: (full(p.grad) - q.grad).abs().max().item()
                  for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())}
        worst = max(errors, key=errors.get)
        out["sp" if sp else "no_sp"] = {"loss_error": abs(full(loss).item() - loss_ref.item()), "worst": worst,
                                        "max_grad_error": errors[worst],
                                        "qk_norm_grad_error": max(v for k, v in errors.items() if "q_norm" in k or "k_norm" in k)}
    return out


def run_case(case: dict, rank: int, world: int) -> dict:
    if case.get("gradient_check"):
        return tp_gradient_check(case)
    hf_config = case["hf_config"]
    config = config_from_dict(case["config"])
    torch.manual_seed(0)  # the same weights on every rank (TP shards them, FSDP shards the shards)
    model = build_model(None, hf_config, attention=config.attention.value, device="cpu",
                        dtype=TORCH_DTYPES[config.precision.param_dtype])
    classes = block_classes_of(model)
    model.train()
    model.config.use_cache = False
    mesh = make_mesh(config, world, world, "cpu")
    apply_fsdp2(model, config, classes, mesh)
    like_nccl(model, reduce_scatter=None if case.get("gloo_reduce_scatter") else InPlaceReduceScatter)
    optimizer = make_optimizer(model.parameters(), case.get("optimizer", "adamw"))
    # a TP or CP group sees the same tokens: with dp_shard = 1 every rank takes the same ids (CP shards them)
    ids = torch.randint(0, hf_config["vocab_size"], (config.micro_batch, case["seq_len"]),
                        generator=torch.Generator().manual_seed(1))
    phases = measure_training_steps(model, optimizer, ids, config, vocab_size=hf_config["vocab_size"], is_hf=True,
                                    mesh=mesh)  # cp > 1: context_parallel on mesh["cp"], ring attention on CPU
    peak = max(phases.values(), key=lambda s: s.peak_allocated_bytes)
    return {"peak_allocated_bytes": peak.peak_allocated_bytes, "peak_phase": peak.peak_phase,
            "phases": {k: v.to_dict() for k, v in phases.items()}}


if __name__ == "__main__":
    serve_cli(run_case)
