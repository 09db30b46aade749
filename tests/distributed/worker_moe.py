"""torchrun worker: train a tiny transformers Mixtral (grouped_mm experts) under FSDP2 on CPU/gloo.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_moe.py \
        --case '{"experts": 3, "config": {"sharding": "FULL_SHARD", "precision": "fp32"}}' [--case ...]

Each case builds the model with random weights through calibration.build.build_model (the builder the
trace and calibration runs use), with `experts` routed experts per layer (3 on 2 ranks: FSDP2 pads the
stacked expert tensors to 2 rows per rank), and wraps it with calibration.apply.apply_fsdp2 or, with
"emitted": true, with the code planner/emit/ writes; "shard_dim1": true uncomments the emitted
shard_placement_fn fix (stacked experts sharded on dim 1, no padding). Rank 0 prints one JSON line per
case: {"case": i, "experts": E, "config": {...}, "losses": [...], "gate_up_shards": [each rank's shard shape of
gate_up_proj], "shard_dim": 0 ...}, the loss averaged over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from calibration.apply import apply_fsdp2, cast_for_precision, make_mesh
from calibration.build import build_model
from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec, TrainingSpec
from cost_models.units import GiB
from planner.emit import emit_fsdp2
from planner.models import block_classes_of, from_hf_config
from tests.distributed.cases import config_from_dict, learnable_batch, serve_cli

STEPS = 8
SEQ_LEN = 32
LR = 3e-3
PERIOD = 8


def tiny_mixtral(n_experts: int) -> dict:
    # widths: multiples of 16 bytes (grouped_mm's strides) in fp32 and bf16
    return dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=n_experts, num_experts_per_tok=2,
                max_position_embeddings=256, tie_word_embeddings=False)


def apply_emitted(config: FsdpConfig, spec, world: int, model, shard_dim1: bool):
    """Run the FSDP2 code planner/emit/ writes (with its padding fix uncommented when asked)."""
    gpu = GpuSpec(id="cpu", name="CPU", memory_bytes=GiB, hbm_bytes_per_s=1e11, intra_node_bus_bytes_per_s=1e10)
    cluster = ClusterSpec(gpu=gpu, n_gpus=world, gpus_per_node=world, internode_bytes_per_s=1e9)
    code = emit_fsdp2(config, spec, cluster, TrainingSpec())
    if shard_dim1:
        fix = "# from torch.distributed.tensor import Shard"
        assert fix in code, "the emitted code offers no padding fix"
        lines = code.splitlines()
        start = next(i for i, line in enumerate(lines) if line.strip() == fix)
        # the import, then the shard_placement_fn lambda on two lines (folded at 100 columns)
        lines[start:start + 3] = [line.replace("# ", "", 1) for line in lines[start:start + 3]]
        code = "\n".join(lines)
    namespace: dict = {}
    exec(compile(code, "<emit_fsdp2>", "exec"), namespace)
    return namespace["apply_fsdp"](model, device=torch.device("cpu"))


def run_case(case: dict, rank: int, world: int) -> dict:
    config = config_from_dict(case["config"])
    cfg = tiny_mixtral(case["experts"])
    spec = from_hf_config(cfg, name="tiny-mixtral")
    torch.manual_seed(0)  # same initial weights on every rank
    model = build_model(spec, cfg, device="cpu")
    model.config.use_cache = False
    if case.get("emitted"):
        model = apply_emitted(config, spec, world, model, case.get("shard_dim1", False))
    else:
        cast_for_precision(model, config)
        apply_fsdp2(model, config, block_classes_of(model), make_mesh(config, world, world, "cpu"))
    experts = model.model.layers[0].mlp.experts
    gate_up = experts.gate_up_proj
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = learnable_batch(config.micro_batch, SEQ_LEN, rank, PERIOD)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    shapes = [None] * world
    dist.all_gather_object(shapes, list(gate_up.to_local().shape))  # every rank's shard of gate_up_proj
    from torch.distributed.fsdp import FSDPModule

    return {**case, "losses": losses, "gate_up_shards": shapes, "shard_dim": gate_up.placements[0].dim,
            "experts_implementation": model.config._experts_implementation,
            "experts_are_units": isinstance(experts, FSDPModule)}


if __name__ == "__main__":
    serve_cli(run_case)
