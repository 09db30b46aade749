"""torchrun worker: train the tiny reference Llama under FSDP on CPU/gloo, one case after another.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_train.py \
        --case '{"fsdp_version": 1, "config": {"sharding": "FULL_SHARD", "precision": "fp32"}}' [--case ...]

A case's "config" is FsdpConfig.to_dict() JSON (any subset) plus optional "gpus_per_node" (HYBRID meshes),
"emitted": true (run the snippet planner/emit/ writes instead of calibration.apply) and "lora": r (peft adapters
of rank r through calibration.lora, the base frozen). All cases share one process group to keep CI time low (the
tests run them in the shared launch, cases.shared). Rank 0 prints one JSON line per case:
{"case": i, "fsdp_version": v, "config": {...}, "losses": [...], "checkpointed_blocks": n,
"frozen_moved": bool, "grads": {"trainable": n, "frozen": n}, "compiled_blocks": n}, the loss averaged over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from calibration.apply import apply_fsdp1, apply_fsdp2, cast_for_precision, grad_scaler_for, make_mesh
from calibration.reference import Block, build_reference, tiny_llama_spec
from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec, TrainingSpec
from cost_models.units import GiB
from planner.emit import emit_fsdp1, emit_fsdp2
from tests.distributed.cases import config_from_dict, learnable_batch, serve_cli

STEPS = 8
SEQ_LEN = 32
LR = 3e-3
LORA_LR = 1e-2  # adapters start at B = 0 and train a few thousand weights: a LoRA-sized step. At 3e-2 the bf16
# cases spiked at step 5 on CPUs with AMX-BF16 (oneDNN's AMX kernels round differently): 8-step loss ratio 0.978
# with AMX, 0.927 with ONEDNN_MAX_CPU_ISA=AVX2; at 1e-2 it is 0.923 on both (measured 2026-12-02)
PERIOD = 8


def train(fsdp_version: int, data: dict, rank: int, world: int) -> tuple[list[float], int, dict]:
    data = dict(data)
    gpus_per_node = data.pop("gpus_per_node", world)
    emitted = data.pop("emitted", False)
    lora_rank = data.pop("lora", 0)
    config = config_from_dict(data)
    torch.manual_seed(0)  # same initial weights on every rank (sync_module_states=False)
    spec = tiny_llama_spec(n_layers=4)
    model = build_reference(spec)
    if lora_rank:
        from calibration.lora import add_lora

        model = add_lora(model, spec, lora_rank, {Block}, config.precision)
    if not emitted:  # the emitted snippet casts for bf16-pure itself
        cast_for_precision(model, config)
    if emitted:
        model = apply_emitted(fsdp_version, config, world, gpus_per_node, model, lora=bool(lora_rank))
    elif fsdp_version == 1:
        model = apply_fsdp1(model, config, {Block}, gpus_per_node=gpus_per_node, device_id=torch.device("cpu"),
                            trainable_mixed=bool(lora_rank))
    else:
        apply_fsdp2(model, config, {Block}, make_mesh(config, world, gpus_per_node, "cpu"))
    checkpointed = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    frozen = [p for p in model.parameters() if not p.requires_grad]
    frozen_before = [_local(p).detach().clone() for p in frozen]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LORA_LR if lora_rank else LR)
    scaler = grad_scaler_for(config, device="cpu")
    ids = learnable_batch(config.micro_batch, SEQ_LEN, rank, PERIOD)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if len(losses) == 1:  # gradients exist between backward and the next zero_grad
            grads = {"trainable": sum(p.grad is not None for p in model.parameters() if p.requires_grad),
                     "frozen": sum(p.grad is not None for p in frozen)}
    moved = any(not torch.equal(_local(p), before) for p, before in zip(frozen, frozen_before))
    compiled = sum(m._compiled_call_impl is not None for m in model.modules())  # nn.Module.compile() in place
    return losses, checkpointed, {"frozen_moved": moved, "grads": grads, "compiled_blocks": compiled}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def apply_emitted(fsdp_version: int, config: FsdpConfig, world: int, gpus_per_node: int, model, lora: bool = False):
    """Run the code planner/emit/ writes for users, to prove it trains like calibration.apply."""
    gpu = GpuSpec(id="cpu", name="CPU", memory_bytes=GiB, hbm_bytes_per_s=1e11, intra_node_bus_bytes_per_s=1e10)
    cluster = ClusterSpec(gpu=gpu, n_gpus=world, gpus_per_node=gpus_per_node, internode_bytes_per_s=1e9)
    emit = emit_fsdp1 if fsdp_version == 1 else emit_fsdp2
    namespace: dict = {}
    training = TrainingSpec(finetune="lora" if lora else "full")
    code = emit(config, tiny_llama_spec(n_layers=4), cluster, training)
    exec(compile(code, f"<emit_fsdp{fsdp_version}>", "exec"), namespace)
    return namespace["apply_fsdp"](model, device=torch.device("cpu"))


def run_case(case: dict, rank: int, world: int) -> dict:
    version, data = case["fsdp_version"], case["config"]
    losses, checkpointed, state = train(version, data, rank, world)
    return {"fsdp_version": version, "config": data, "losses": losses, "checkpointed_blocks": checkpointed, **state}


if __name__ == "__main__":
    serve_cli(run_case)
