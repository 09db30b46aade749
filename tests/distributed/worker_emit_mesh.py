"""torchrun worker: the TP snippet `--emit fsdp2` writes, run for real on 2 CPU ranks (gloo), against the same
tiny transformers Llama trained in one process.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_emit_mesh.py --case '{"tp": 2}' [...]

Each --case is FsdpConfig fields (tp = the world size: dp_shard 1), with "family": "starcoder2" (or
"starcoder2-untied") for a tiny Starcoder2 (its MLP c_fc / c_proj, biases, LayerNorms), or "qwen3" for a tiny
Qwen3 (q / k norms over head_dim), instead of the Llama. Both sides start from
the same weights (seed 0), see the same batches and take SGD steps; the snippet's micro-step is its own forward_backward with
sequence parallel (context and loss parallel as written), else the plain next-token loss on the gathered
logits. Rank 0 prints one JSON line per case: {"case": i, "parallel": [losses], "reference": [losses]}.
"""

from __future__ import annotations

import copy

import torch

from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec
from planner.emit import emit_fsdp2
from planner.models import from_hf_config, load_preset
from tests.distributed.cases import serve_cli

STEPS, SEQ_LEN, BATCH, LR = 3, 16, 2, 0.5
LR_STARCODER2 = 0.2   # at 0.5 its loss rises (4.894 -> 4.964 in one process); at 0.2 it falls (4.894 -> 4.852)
GPU = GpuSpec(id="cpu", name="CPU", memory_bytes=2**34, hbm_bytes_per_s=1e11, peak_flops={"fp32": 1e12},
              intra_node_bus_bytes_per_s=1e10)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                                        max_position_embeddings=256, attn_implementation="sdpa"))


def tiny_starcoder2(tied: bool = True):
    """Starcoder2's own layout: LayerNorms, biases on every linear, the plain MLP c_fc / c_proj, tied embeddings
    (transformers' default; untied for its plan without sequence parallel)."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    torch.manual_seed(0)
    return Starcoder2ForCausalLM(Starcoder2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                                                  max_position_embeddings=256, sliding_window=None,
                                                  tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None,
                                                  attn_implementation="sdpa"))


def tiny_qwen3():
    """Qwen3's q / k norms over head_dim on each rank's heads (transformers' replicated_with_grad_allreduce)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=128,
                                        max_position_embeddings=256, tie_word_embeddings=False,
                                        attn_implementation="sdpa"))


def next_token_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def train_both(config: FsdpConfig, world: int, family: str = "llama") -> dict:
    starcoder2 = family.startswith("starcoder2")
    reference = tiny_starcoder2(tied=family == "starcoder2") if starcoder2 else \
        tiny_qwen3() if family == "qwen3" else tiny_llama()
    reference.config.use_cache = False
    model = copy.deepcopy(reference)
    namespace: dict = {}
    spec = load_preset("llama3-8b") if family == "llama" else from_hf_config(reference.config.to_dict())
    code = emit_fsdp2(config, spec, ClusterSpec(gpu=GPU, n_gpus=world, gpus_per_node=world,
                                                internode_bytes_per_s=1e10))
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)
    made = {}
    real_mesh = namespace["init_device_mesh"]
    namespace["init_device_mesh"] = lambda *a, **k: made.setdefault("mesh", real_mesh(*a, **k))
    model = namespace["apply_fsdp"](model, device="cpu")
    lr = LR_STARCODER2 if starcoder2 else LR
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in (model, reference)]
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
    case = dict(case)
    family = case.pop("family", "llama")   # the tiny model the snippet is applied to
    return train_both(FsdpConfig(**case), world, family)


if __name__ == "__main__":
    serve_cli(run_case)
