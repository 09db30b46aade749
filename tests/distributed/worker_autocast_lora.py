"""torchrun worker: one LoRA (or QLoRA) step of a tiny transformers Llama under FSDP1 wrapped the way HF Trainer and
accelerate wrap a peft model (autocast around the forward), on CPU / gloo, measured by calibration.memtrack.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_autocast_lora.py \
        --case '{"hidden": 256, "layers": 2, "seq": 128}' ...

What it copies, from the installed sources (accelerate 1.16, transformers 5.24, peft 0.21):
- the wrap policy: peft.utils.other.fsdp_auto_wrap_policy (the model's _no_split_modules blocks, and every leaf
  whose weight trains, each adapter linear, a unit of its own), which transformers' Trainer puts on accelerate's
  plugin for a PEFT model (distributed/fsdp.py update_fsdp_plugin_peft);
- MixedPrecision as accelerate's FullyShardedDataParallelPlugin.set_mixed_precision("bf16") makes it (param,
  reduce and buffer dtypes bf16; cast_forward_inputs left False), and the FullyShardedDataParallel keywords
  of Accelerator.prepare_model (use_orig_params True: transformers' fsdp_config default; BACKWARD_PRE);
- the forward under torch.autocast(bf16) with its outputs converted to fp32 (Accelerator.prepare_model:
  autocast_context, convert_outputs_to_fp32), wrapped before FSDP as prepare_model does; on CPU here;
- the upcast of trainable flat parameters not in fp32 after wrapping (prepare_model; peft's adapters are fp32
  already: autocast_adapter_dtype).
The base loads in bf16 (the plan's "from_pretrained(dtype=torch.bfloat16)"); "qlora": true loads it in 4 bits
(calibration.qlora.load_qlora) and sets the quant storage dtype as the mixed precision (update_fsdp_plugin_peft).
Rank 0 prints one JSON line per case: each rank's peak and breakdown (and the forward's), the losses.
"""

from __future__ import annotations

import contextlib
from types import MethodType

import torch
import torch.distributed as dist

from tests.distributed.worker_qlora import LORA_RANK, measured_steps, spec_of, tiny_checkpoint


def lora_model(path: str, case: dict):
    """The checkpoint at `path` in bf16 with peft adapters on the spec's targets (fp32: autocast_adapter_dtype)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from calibration.lora import lora_target_names
    from calibration.qlora import load_qlora
    from cost_models.specs import TrainingSpec

    spec = spec_of(case)
    if case.get("qlora"):
        return load_qlora(path, spec, TrainingSpec(seq_len=case["seq"], finetune="qlora", lora_rank=LORA_RANK), "bf16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu")
    targets = lora_target_names(model.model.layers[0], spec.lora_shapes)
    config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, bias="none", target_modules=targets)
    return get_peft_model(model, config)


def wrap_as_accelerate(model):
    """FSDP1 as HF Trainer + accelerate wrap a PEFT model under mixed_precision "bf16" (see the docstring)."""
    from accelerate.utils import convert_outputs_to_fp32
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # accelerate utils/dataclasses.py set_mixed_precision: param_dtype, reduce_dtype and (FSDP1) buffer_dtype
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward.__func__)  # prepare_model's native_amp
    model.forward = MethodType(convert_outputs_to_fp32(forward), model)
    model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=fsdp_auto_wrap_policy(model),
                 mixed_precision=mixed, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False,
                 use_orig_params=True, limit_all_gathers=True, sync_module_states=False, device_id=torch.device("cpu"))
    for unit in FSDP.fsdp_modules(model):  # prepare_model's upcast of trainable low-precision flat parameters
        param = unit._flat_param if unit._has_params else None
        if param is not None and param.dtype != torch.float32 and param.requires_grad:
            param.data = param.data.to(torch.float32)
            unit._handle._orig_param_dtype = torch.float32
    return model


@contextlib.contextmanager
def cuda_autocast_flag():
    """torch.is_autocast_enabled() without a device reads CUDA's autocast flag: on a GPU, under HF's autocast, True,
    so peft's bitsandbytes layer casts nothing (tuners/lora/bnb.py Linear4bit.forward); on CPU it would read False
    and cast. Read the CPU flag in its place while a QLoRA case runs, as a GPU run reads CUDA's."""
    original = torch.is_autocast_enabled
    torch.is_autocast_enabled = lambda device_type=None: original(device_type or "cpu")
    try:
        yield
    finally:
        torch.is_autocast_enabled = original


def run_case(case: dict, rank: int, world: int) -> dict:
    with cuda_autocast_flag() if case.get("qlora") else contextlib.nullcontext():
        return _run_case(case, rank, world)


def _run_case(case: dict, rank: int, world: int) -> dict:
    spec = spec_of(case)
    model = wrap_as_accelerate(lora_model(tiny_checkpoint(case, rank, spec), case))
    units = sum(1 for m in model.modules() if type(m).__name__ == "FullyShardedDataParallel")
    gathered = [None] * world
    dist.all_gather_object(gathered, measured_steps(model, spec, case, rank))
    return {"units": units, "ranks": gathered}


if __name__ == "__main__":
    from tests.distributed.cases import serve_cli

    serve_cli(run_case)
