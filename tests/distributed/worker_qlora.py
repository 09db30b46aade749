"""torchrun worker: one QLoRA training step of a tiny transformers Llama (bitsandbytes 4-bit base, peft adapters)
under FSDP2 or FSDP1 on CPU / gloo, measured by calibration.memtrack as the cost model's ledger is.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_qlora.py \
        --case '{"fsdp_version": 2, "hidden": 256, "layers": 2, "seq": 256, "double_quant": true}' ...

Each case: rank 0 saves the tiny checkpoint (under the case's "out" folder, else a temporary one removed at exit),
every rank loads it quantized (calibration.qlora.load_qlora), wraps
it with calibration.apply (FULL_SHARD, bf16), runs a warm-up step and one measured step. Rank 0 prints one JSON
line per case: the peak and breakdown on each rank (and of the measured step's forward), the bytes of the QuantStates on each rank (what the tracker
cannot see: no parameter, made before it), the packed parameters' nbytes and the losses.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

VOCAB = 512
MICRO_BATCH = 2
LORA_RANK = 8


def spec_of(case: dict):
    """The case's tiny Llama, its LoRA on the case's "targets" (attention, the default, or all-linear)."""
    from dataclasses import replace

    from calibration.reference import tiny_llama_spec

    h = case["hidden"]
    spec = tiny_llama_spec(hidden_size=h, n_heads=4, n_kv_heads=2, head_dim=h // 4, ffn_hidden_size=2 * h,
                           vocab_size=case.get("vocab", VOCAB), n_layers=case["layers"])
    return replace(spec, lora_targets=case.get("targets", "attention"))


_OUT: list[str] = []


def _out(case: dict, rank: int) -> str:
    """The case's "out", else one temporary folder for the process group (rank 0's, removed when it exits)."""
    if "out" in case:
        return case["out"]
    if not _OUT:
        made = [tempfile.mkdtemp(prefix="qlora-") if rank == 0 else None]
        dist.broadcast_object_list(made, src=0)
        if rank == 0:
            atexit.register(shutil.rmtree, made[0], True)
        _OUT.append(made[0])
    return _OUT[0]


def tiny_checkpoint(case: dict, rank: int, spec) -> str:
    """The case's tiny transformers Llama in bf16, saved once by rank 0 (every rank waits for it): its path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(_out(case, rank), f"tiny-{case['hidden']}-{case['layers']}-{spec.vocab_size}")
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        config = LlamaConfig(hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
                             num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
                             num_key_value_heads=spec.n_kv_heads, vocab_size=spec.vocab_size,
                             max_position_embeddings=4096, tie_word_embeddings=False)
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    dist.barrier()
    return path


def measured_steps(model, spec, case: dict, rank: int) -> dict:
    """A warm-up step and one measured step of `model` (AdamW over what trains) on a fixed batch per rank, under
    calibration.memtrack: the warm-up's peak ("first": the optimizer state made in its step), the measured step's
    forward peak (the tracker sees gemm_4bit's) and peak ("snapshot"), the losses."""
    from calibration.memtrack import MemoryTracker

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    torch.manual_seed(rank)
    ids = torch.randint(0, spec.vocab_size, (MICRO_BATCH, case["seq"]))
    tracker = MemoryTracker(model, optimizer, vocab_size=spec.vocab_size)
    losses = []
    with tracker:
        for i in range(2):
            if i:
                first = tracker.snapshot().to_dict()
                tracker.reset()
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss  # HF Trainer's compute_loss keeps the loss, not the outputs
            forward = tracker.snapshot().to_dict()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"snapshot": tracker.snapshot().to_dict(), "forward": forward, "first": first, "losses": losses}


def run_case(case: dict, rank: int, world: int) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from calibration.apply import apply_fsdp1, apply_fsdp2, make_mesh
    from calibration.qlora import load_qlora, quant_state_bytes
    from cost_models.specs import FsdpConfig, TrainingSpec

    spec = spec_of(case)
    path = tiny_checkpoint(case, rank, spec)
    training = TrainingSpec(seq_len=case["seq"], finetune="qlora", lora_rank=LORA_RANK,
                            double_quant=case.get("double_quant", True), quant=case.get("quant", "nf4"))
    fsdp = FsdpConfig(sharding="FULL_SHARD", precision="bf16", micro_batch=MICRO_BATCH, ac_every=case.get("ac", 0))
    model = load_qlora(path, spec, training, fsdp.precision)
    packed = sum(p.nbytes for p in model.parameters() if type(p).__name__ == "Params4bit")
    state = quant_state_bytes(model)
    if case["fsdp_version"] == 2:
        apply_fsdp2(model, fsdp, {LlamaDecoderLayer}, make_mesh(fsdp, world, world, "cpu"))
    else:
        model = apply_fsdp1(model, fsdp, {LlamaDecoderLayer}, gpus_per_node=world, device_id=torch.device("cpu"),
                            trainable_mixed=True)
    state_after = quant_state_bytes(model)
    gathered = [None] * world
    dist.all_gather_object(gathered, {**measured_steps(model, spec, case, rank), "quant_state_bytes": state_after})
    return {"packed_param_bytes": packed, "quant_state_bytes_before": state, "ranks": gathered}


if __name__ == "__main__":
    from tests.distributed.cases import serve_cli

    serve_cli(run_case)
