"""Does FSDP1 run peft's all-linear LoRA on an MoE? (issue 28; cost_models/moe_lora.fsdp1_refusals)

    for w in "attention peft flat" "all-linear peft flat" "all-linear peft orig" "all-linear blocks orig"; do
        .venv/bin/torchrun --nproc_per_node 2 benchmarks/peft_moe_fsdp1.py $w; done      # ~20 s each, CPU

Two gloo ranks on the CPU, memory_accuracy.py's Mixtral small config (4 blocks, E 8), peft's get_peft_model (rank 4) on
the attention projections or all-linear (the router and the stacked experts as ParamWrappers), FSDP1 wrapped with
peft's fsdp_auto_wrap_policy ("peft": every leaf with a trainable weight a unit, and the blocks; verl's is_lora policy
is the same lambda) or the blocks alone ("blocks"), use_orig_params False ("flat") or True ("orig"); one forward and
backward of 32 tokens. 2026-12-07, torch 2.13 CPU, peft 0.22, transformers 5.24: attention runs; all-linear fails under
every wrapping ("Output 0 of View is a view and its base or another view of its base has been modified inplace" with
flat parameters and with the blocks alone, "inconsistent tensor size" with peft's policy and original parameters; the
blocks alone with flat parameters cannot mix frozen and trainable tensors in one unit).
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def main(targets: str, wrap: str, params: str) -> None:
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy

    from benchmarks.memory_accuracy import arch_config
    from calibration.build import build_model

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build_model(None, arch_config("mixtral"), device="cpu", dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION if targets == "attention"
                                             else targets))
    block = type(model.base_model.model.model.layers[0])
    policy = fsdp_auto_wrap_policy(model) if wrap == "peft" else functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={block})
    try:
        model = FSDP(model, auto_wrap_policy=policy, use_orig_params=params == "orig", device_id=torch.device("cpu"))
        ids = torch.randint(0, 1000, (1, 32))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        result = f"runs (loss {float(out.loss):.4f})"
    except (RuntimeError, ValueError) as exc:
        result = f"fails: {type(exc).__name__}: {str(exc)[:160]}"
    if dist.get_rank() == 0:
        print(f"{targets} / {wrap} wrap / {params} params: {result}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
