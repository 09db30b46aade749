"""torchrun worker: the trace tier's FSDP2 training step on real tensors, for the families of hf_families.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_families.py \
        --case '{"family": "qwen3_moe", "config": {"precision": "fp32"}, "seq_len": 64}' [--case ...]

Each case builds the family's small model with real weights (calibration.build.build_model, the builder
the trace and calibration runs use: the family's attention implementation, grouped_mm experts), turns
the KV cache off, applies calibration.apply.apply_fsdp2 over the 2 gloo ranks and measures two training
steps with calibration.trace.measure_training_steps - the trace's own measuring loop, optimizer
(calibration.trace.make_optimizer: foreach=False) and foreach adjustment - on real tensors. Nothing of
the trace's fake-tensor machinery runs here (no FakeTensorMode, no fake process group, no mask or
kernel overrides): transformers sees real position ids and real tensors and decides for itself. Rank 0
prints one JSON line per case: {"case": i, "family": ..., "peak_allocated_bytes": n, "peak_phase": ...,
"phases": {...}, "attention": ..., "experts": ...}.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from calibration.apply import TORCH_DTYPES, apply_fsdp2, make_mesh
from calibration.build import build_model, model_kernels
from calibration.trace import make_optimizer, measure_training_steps
from planner.models import block_classes_of
from tests.distributed.cases import serve_cli
from tests.distributed.hf_families import FAMILIES
from tests.distributed.worker_train import config_from_dict


class InPlaceReduceScatter(DefaultReduceScatter):
    """FSDP2's gradient reduce-scatter without gloo's copy of its input.

    gloo's reduce_scatter_tensor all-reduces a clone of the input and copies this rank's chunk out: for a
    moment a second input-sized buffer (a unit's gradients in the reduce dtype) is alive, which NCCL - the
    GPU run the trace models - never allocates. At short sequences that moment is the step's peak (tiny
    Gemma 2 in bf16 at 16 tokens: +6% over the trace, all of it that clone). Here the input is all-reduced
    in place (settled: gloo lets go of it before the call returns, see SettledAllGather) and this rank's chunk
    copied to the output: the same result, and no buffer but FSDP2's own.
    (The tracker then files the input as a backward temporary rather than a reduce-scatter buffer: the
    categories move, the total does not.)"""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        settled(input_tensor, lambda: dist.all_reduce(input_tensor.view(-1), op=op, group=group))
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])


class SettledAllGather(DefaultAllGather):
    """FSDP2's all-gather that returns once gloo has let go of the output buffer.

    gloo's worker thread keeps its own reference to the output tensor until a moment after the op completes.
    When the main thread drops the buffer first (FSDP2's wait_for_unshard) the storage dies later, on gloo's
    thread, and the next allocation may land before it: cp 2 fp32 at 64 tokens peaked at +368,276 B (the root's
    all-gather buffer beside the backward prefetch) in about 1 run in 4, measured 2026-12-02. NCCL's buffers
    die with the main thread's reference, as the trace has it. Here the all-gather runs synchronously and the
    call spins until the output storage's reference count is back to what it was: deterministic."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        settled(output_tensor, lambda: dist.all_gather_single(output_tensor.view(-1), input_tensor, group=group))
        return None


SETTLE_TIMEOUT_S = 5.0


def settled(buffer: torch.Tensor, collective) -> None:
    """Run a synchronous gloo `collective` on `buffer`, then spin until gloo's worker thread has dropped the
    views of it it held (the storage's reference count back to what it was; at most SETTLE_TIMEOUT_S). The
    collective must be given a view of `buffer` (`.view(-1)`), not `buffer` itself: gloo's work holds the tensor it
    was handed, and a reference to that same tensor leaves the storage's count unchanged, so the spin returned at
    once and the storage could die later on gloo's thread (test_torchrun_optimizer's root reduce-scatter input, 2 MB,
    inside the optimizer step's window in about 1 run in 5 on 2 busy cores, measured 2026-12-07; 0 in 14 with the
    view)."""
    before = _storage_use_count(buffer)
    collective()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while _storage_use_count(buffer) > before and time.monotonic() < deadline:
        time.sleep(0)


def _storage_use_count(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def like_nccl(model, reduce_scatter: type[DefaultReduceScatter] | None = InPlaceReduceScatter) -> None:
    """FSDP2's collectives on gloo in every unit of `model`, made to hold memory as NCCL's do: the all-gather
    without gloo's late free (SettledAllGather) and the gradient reduce-scatter without gloo's copy
    (`reduce_scatter`: InPlaceReduceScatter or a subclass; None keeps gloo's own, to measure its copy)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(SettledAllGather())
            if reduce_scatter is not None:
                module.set_custom_reduce_scatter(reduce_scatter())


def run_case(case: dict, rank: int, world: int) -> dict:
    hf_config = FAMILIES[case["family"]]
    config = config_from_dict(case["config"])
    torch.manual_seed(0)  # the same weights on both ranks
    model = build_model(None, hf_config, attention=config.attention.value, device="cpu",
                        dtype=TORCH_DTYPES[config.precision.param_dtype])
    classes = block_classes_of(model)
    attention, experts = model_kernels(model, config.attention.value)
    model.train()
    model.config.use_cache = False
    apply_fsdp2(model, config, classes, make_mesh(config, world, world, "cpu"))
    like_nccl(model)
    optimizer = make_optimizer(model.parameters(), case.get("optimizer", "adamw"))
    # different tokens on each rank (data parallelism); the shapes, hence the memory, are the same
    ids = torch.randint(0, hf_config["vocab_size"], (config.micro_batch, case["seq_len"]),
                        generator=torch.Generator().manual_seed(1 + rank))
    phases = measure_training_steps(model, optimizer, ids, config, vocab_size=hf_config["vocab_size"], is_hf=True)
    peak = max(phases.values(), key=lambda s: s.peak_allocated_bytes)
    return {"family": case["family"], "peak_allocated_bytes": peak.peak_allocated_bytes,
            "peak_phase": peak.peak_phase, "phases": {k: v.to_dict() for k, v in phases.items()},
            "attention": attention, "experts": experts}


if __name__ == "__main__":
    serve_cli(run_case)
