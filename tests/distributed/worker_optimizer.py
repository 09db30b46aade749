"""torchrun worker: the optimizer step of each implementation, for real, on the reference Llama under FSDP2.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_optimizer.py \
        --case '{"impl": "fused", "config": {"precision": "fp32"}, "seq_len": 32}' [--case ...]

Each case builds calibration.reference's Llama at tests/distributed/worker_optimizer.SHAPE with real weights, applies
calibration.apply.apply_fsdp2 over the 2 gloo ranks (worker_families.like_nccl: NCCL's buffer lifetimes) and
measures two training steps with calibration.trace.measure_training_steps, stepping torch.optim.AdamW with the
case's implementation itself (trace_optimizer.make_optimizer(..., impl): foreach=True, fused=True - torch 2.13's
CPU kernel, torch._fused_adamw_ - or foreach=False), so the optimizer-step window is measured, not replaced. Rank 0
prints one JSON line per case: {"case": i, "impl": ..., "optimizer_step": {...}, "forward_backward": {...},
"runs": the implementation torch reports}.
"""

from __future__ import annotations

import torch

from calibration.apply import apply_fsdp2, cast_for_precision, make_mesh
from calibration.reference import Block, build_reference, tiny_llama_spec
from calibration.trace import measure_training_steps
from calibration.trace_optimizer import make_optimizer, runs
from tests.distributed.cases import config_from_dict, serve_cli
from tests.distributed.worker_families import like_nccl

# big enough that the step's tensors dwarf the scalars beside them (Adam's step counters, the token ids); the
# vocabulary (embedding and head, 2 x 1,024 x 256) is the largest tensor, as in real models
SHAPE = dict(n_layers=2, hidden_size=256, n_heads=8, n_kv_heads=2, head_dim=32, ffn_hidden_size=512,
             vocab_size=1024)


def spec():
    return tiny_llama_spec(**SHAPE)


def run_case(case: dict, rank: int, world: int) -> dict:
    config = config_from_dict(case["config"])
    torch.manual_seed(0)
    model = build_reference(spec())
    cast_for_precision(model, config)
    apply_fsdp2(model, config, {Block}, make_mesh(config, world, world, "cpu"))
    like_nccl(model)
    optimizer = make_optimizer(model.parameters(), "adamw", case["impl"])
    ids = torch.randint(0, SHAPE["vocab_size"], (config.micro_batch, case["seq_len"]),
                        generator=torch.Generator().manual_seed(1 + rank))
    phases = measure_training_steps(model, optimizer, ids, config, vocab_size=SHAPE["vocab_size"], is_hf=False,
                                    optimizer_impl=case["impl"])
    return {"impl": case["impl"], "runs": runs(optimizer).value, **{k: v.to_dict() for k, v in phases.items()}}


if __name__ == "__main__":
    serve_cli(run_case)
