"""torchrun worker: the trace tier's expert-parallel FSDP2 training step on real tensors (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_ep.py \
        --case '{"hf_config": {...}, "config": {"ep": 2, "precision": "fp32"}, "seq_len": 64}' [--case ...]

Each case builds the small Hugging Face MoE model with real weights (calibration.build.build_model, the trace's
builder) and applies expert parallelism then FSDP2 through calibration.apply.apply_fsdp2 (the one code path the
trace runs: transformers' ep_plan and AllToAllEP, here with its own split sizes read back from the routed counts,
the experts fully_shard-ed over efsdp), and measures two training steps with
calibration.trace.measure_training_steps (the trace's measuring loop). Rank 0 prints one JSON line per case:
{"case": i, "peak_allocated_bytes": n, "peak_phase": ..., "phases": {...}, "local_experts": [...],
"split_sizes": [...], "loss_after": x, "gloo_copy_bytes": n (the largest reduce-scatter input gloo would clone)}.

gloo's own buffer copies, which NCCL does not make: its reduce_scatter_tensor all-reduces a clone of the input
(tests/distributed/worker_families.py), swapped as there for an in-place all-reduce (InPlaceReduceScatter) on
every FSDP unit - the dense units over dp_shard and, with efsdp > 1, the experts' units - so the measured peak is
the NCCL run's (worker_families.like_nccl, which also settles the all-gathers); "gloo_reduce_scatter": true keeps
gloo's clone, to name what it costs. gloo's all_to_all_single
(the dispatch and combine) writes into the output tensor the functional collective allocates: no copy of its own.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from calibration.apply import TORCH_DTYPES, apply_fsdp2, make_mesh
from calibration.build import build_model
from calibration.trace import make_optimizer, measure_training_steps
from planner.models import block_classes_of
from tests.distributed.cases import config_from_dict, serve_cli
from tests.distributed.worker_families import InPlaceReduceScatter, like_nccl


def _record_split_sizes(model) -> list:
    """Wrap every AllToAllEP's dispatch to record the split sizes its all-to-all of counts gave (real routing
    counts read back to the host): balanced routing makes them T k / ep each."""
    seen = []
    from transformers.distributed.expert_parallel import AllToAllEP

    original = AllToAllEP._dispatch_tokens

    def dispatch(self, hidden_states, top_k_index, top_k_weights):
        out = original(self, hidden_states, top_k_index, top_k_weights)
        seen.append((list(out[3].send_sizes), list(out[3].recv_sizes)))
        return out

    AllToAllEP._dispatch_tokens = dispatch
    return seen


class _RecordingReduceScatter(InPlaceReduceScatter):
    """InPlaceReduceScatter that remembers the largest input it reduced: the clone gloo would have made."""

    largest = 0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        type(self).largest = max(type(self).largest, input_tensor.numel() * input_tensor.element_size())
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def run_case(case: dict, rank: int, world: int) -> dict:
    hf_config = case["hf_config"]
    config = config_from_dict(case["config"])
    torch.manual_seed(0)  # the same weights on every rank (EP keeps each rank's experts, FSDP shards the rest)
    model = build_model(None, hf_config, attention=config.attention.value, device="cpu",
                        dtype=TORCH_DTYPES[config.precision.param_dtype])
    classes = block_classes_of(model)
    model.train()
    model.config.use_cache = False
    apply_fsdp2(model, config, classes, make_mesh(config, world, world, "cpu"))
    # FSDP2's gradient reduce-scatters without gloo's clone (unless the case measures it), all-gathers settled
    like_nccl(model, reduce_scatter=None if case.get("gloo_reduce_scatter") else _RecordingReduceScatter)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    local = list(experts.gate_up_proj.to_local().shape)
    seen = _record_split_sizes(model)
    optimizer = make_optimizer(model.parameters(), case.get("optimizer", "adamw"))
    ids = torch.randint(0, hf_config["vocab_size"], (config.micro_batch, case["seq_len"]),
                        generator=torch.Generator().manual_seed(1 + rank))  # each rank its own sequences
    phases = measure_training_steps(model, optimizer, ids, config, vocab_size=hf_config["vocab_size"], is_hf=True)
    peak = max(phases.values(), key=lambda s: s.peak_allocated_bytes)
    with torch.no_grad():  # the step trained: a finite loss after it
        loss = model(input_ids=ids, labels=ids).loss.detach().float()
    dist.all_reduce(loss)
    shards = [None] * world
    dist.all_gather_object(shards, local)
    return {"peak_allocated_bytes": peak.peak_allocated_bytes, "peak_phase": peak.peak_phase,
            "phases": {k: v.to_dict() for k, v in phases.items()}, "local_experts": shards,
            "split_sizes": seen[0] if seen else None, "loss_after": loss.item() / world,
            "experts_are_units": isinstance(experts, FSDPModule), "gloo_copy_bytes": _RecordingReduceScatter.largest}


if __name__ == "__main__":
    serve_cli(run_case)
