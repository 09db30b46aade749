"""TRL 1.16's weight sync on real FSDP ranks (CPU, gloo), with its own code: what cost_models/rl_trl_server.py and
rl_strategy.py rest on. Run:

    .venv/bin/torchrun --nproc-per-node 2 benchmarks/trl_sync_check.py

1. PEFT's merge_adapter (what vllm_generation.py _iter_named_params runs before the walk, on sharded parameters:
   gather_params is a no-op under FSDP) on one LoRA linear: under FSDP2 the delta (lora_B @ lora_A) is a DTensor
   Shard(0) of the weight's shape, and the merged weight is right; under FSDP1 (use_orig_params, as TRL's
   accelerate_configs/fsdp1.yaml) the adapters are 1-D flat views: the merge raises or gives a wrong weight, as
   the views fall on the ranks.
2. TRL's FSDP1 walk (VLLMGeneration._iter_fsdp1_params, compiled out of its file) feeding a list as vLLM's
   packed_tensor.pack_tensors keeps it (server mode): once the walk moves to the next unit, the earlier unit's
   tensors have lost their storage (FSDP1 frees the summoned flat parameter), while the packer would still
   concatenate them.
Prints one line per check from rank 0."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(torch.nn.Module):
    def __init__(self, width: int = 64, linears: int = 2):
        super().__init__()
        self.a = torch.nn.Linear(width, width, bias=False)
        self.b = torch.nn.Linear(width, width, bias=False) if linears == 2 else torch.nn.Identity()

    def forward(self, x):
        return self.b(self.a(x))


def model(blocks: int = 3, linears: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(linears=linears) for _ in range(blocks)])


def merge(strategy: str, blocks: int = 3, linears: int = 2) -> str:
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model(blocks, linears), LoraConfig(r=4, target_modules=["a"], init_lora_weights=False))
    full = {n: p.detach().clone() for n, p in peft.named_parameters()}
    lin = peft.base_model.model[0].a
    if strategy == "fsdp2":
        for block in peft.base_model.model:
            fully_shard(block)
        fully_shard(peft)
        delta = lin.get_delta_weight("default")
        shape = f"delta {delta.placements} local {tuple(delta.to_local().shape)} of {tuple(delta.shape)}; "
        peft.merge_adapter()
        merged = lin.base_layer.weight.full_tensor()
    else:
        wrapped = FSDP(peft, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                       device_id=torch.device("cpu"))
        shape = f"lora_A local {tuple(lin.lora_A['default'].weight.shape)}; "
        try:
            peft.merge_adapter()
        except RuntimeError as error:   # the flat views' shapes do not multiply
            return f"merge_adapter under {strategy}, {blocks} blocks of {linears} linears: {shape}raises {str(error).splitlines()[0]}"
        with FSDP.summon_full_params(wrapped):
            merged = lin.base_layer.weight.detach().clone()
    prefix = "base_model.model.0.a."
    right = full[prefix + "base_layer.weight"] + (full[prefix + "lora_B.default.weight"]
                                                  @ full[prefix + "lora_A.default.weight"]) * lin.scaling["default"]
    return f"merge_adapter under {strategy}, {blocks} blocks of {linears} linears: {shape}merged weight right: {torch.allclose(merged, right, atol=1e-5)}"


def fsdp1_walk_storage() -> str:
    site = Path(sys.modules["torch"].__file__).parents[1]
    cls = next(n for n in ast.parse((site / "trl/generation/vllm_generation.py").read_text()).body
               if getattr(n, "name", "") == "VLLMGeneration")
    namespace = {"FSDP": FSDP}
    for node in cls.body:
        if getattr(node, "name", "") in ("_iter_fsdp1_params", "_fix_param_name_to_vllm"):
            node.returns = None
            for arg in node.args.args:
                arg.annotation = None
            exec(compile(ast.Module(body=[node], type_ignores=[]), "vllm_generation.py", "exec"), namespace)
    walker = type("Walker", (), {k: namespace[k] for k in ("_iter_fsdp1_params", "_fix_param_name_to_vllm")})()
    wrapped = FSDP(model(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                   device_id=torch.device("cpu"))
    held, seen = [], []
    for name, param in walker._iter_fsdp1_params(wrapped):
        held.append((name, param.contiguous().view(-1).view(torch.uint8)))   # pack_tensors' view of it
        seen.append(f"after {name}: " + ", ".join(f"{n} {t.untyped_storage().nbytes()} B" for n, t in held))
        if len(held) == 3:
            break
    return "FSDP1 walk into the packer's list (storage of each held tensor): " + "; ".join(seen)


def main() -> None:
    dist.init_process_group("gloo")
    lines = [merge("fsdp2"), merge("fsdp1"), merge("fsdp1", 2, 1), fsdp1_walk_storage()]
    if dist.get_rank() == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
