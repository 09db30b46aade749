"""torchrun worker: the TP snippet `--emit fsdp2` writes, run for real on 2 CPU ranks (gloo), against the same
tiny transformers Llama trained in one process.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_emit_mesh.py --case '{"tp": 2}' [...]

Each --case is FsdpConfig fields (tp = the world size: dp_shard 1). Both sides start from the same weights
(seed 0), see the same batches and take SGD steps; the snippet's micro-step is its own forward_backward with
sequence parallel (context and loss parallel as written), else the plain next-token loss on the gathered
logits. Rank 0 prints one JSON line per case: {"case": i, "parallel": [losses], "reference": [losses]}.
"""

from __future__ import annotations

import copy

import torch

from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec
from planner.emit import emit_fsdp2
from planner.models import load_preset
from tests.distributed.cases import serve_cli

STEPS, SEQ_LEN, BATCH, LR = 3, 16, 2, 0.5
GPU = GpuSpec(id="cpu", name="CPU", memory_bytes=2**34, hbm_bytes_per_s=1e11, peak_flops={"fp32": 1e12},
              intra_node_bus_bytes_per_s=1e10)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                                        max_position_embeddings=256, attn_implementation="sdpa"))


def next_token_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def train_both(config: FsdpConfig, world: int) -> dict:
    reference = tiny_llama()
    reference.config.use_cache = False
    model = copy.deepcopy(reference)
    namespace: dict = {}
    code = emit_fsdp2(config, load_preset("llama3-8b"), ClusterSpec(gpu=GPU, n_gpus=world, gpus_per_node=world,
                                                                    internode_bytes_per_s=1e10))
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)
    made = {}
    real_mesh = namespace["init_device_mesh"]
    namespace["init_device_mesh"] = lambda *a, **k: made.setdefault("mesh", real_mesh(*a, **k))
    model = namespace["apply_fsdp"](model, device="cpu")
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (model, reference)]
    generator = torch.Generator().manual_seed(1)
    losses: dict = {"parallel": [], "reference": []}
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (BATCH, SEQ_LEN), generator=generator)
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        ref = next_token_loss(reference(input_ids=ids).logits, labels)
        ref.backward()
        if "forward_backward" in namespace:
            loss = namespace["forward_backward"](model, made["mesh"], ids.clone())
        else:
            loss = next_token_loss(model(input_ids=ids).logits, labels)
            loss.backward()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        losses["parallel"].append(loss.item())
        losses["reference"].append(ref.item())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return losses


def run_case(case: dict, rank: int, world: int) -> dict:
    return train_both(FsdpConfig(**case), world)


if __name__ == "__main__":
    serve_cli(run_case)
