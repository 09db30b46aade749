"""verl 0.9.1's LoRA weight-sync paths on real FSDP ranks (CPU, gloo), with verl's own functions
(verl/utils/fsdp_utils.py): what cost_models/rl_host.py (sync_host_terms) and rl_strategy.py (merged_sync_bytes)
rest on. A tiny Qwen2 (h 256, 2 layers, V 1,024, fp32) with PEFT LoRA all-linear (r 8), wrapped FSDP2
(fully_shard per layer, then the root) or FSDP1 (the layer wrap, use_orig_params=True - verl's own default is False
with a LoRA wrap policy - SHARDED_STATE_DICT on a device mesh, as verl sets it). Run:

    .venv/bin/torchrun --nproc-per-node 2 benchmarks/verl_sync_check.py

1. The first sync of an adapter under load_format dummy, collect_lora_params(base_sync_done=False): every
   parameter whole, on the host, on every rank - the base's bytes (n_base x 4) per rank.
2. model.lora.merge: backup_base_model_weights (merged_lora_context(backup_adapters=True)) holds on the host the
   rank's shard: FSDP2 the base alone (disable_adapter, "lora" filtered), FSDP1 every flat parameter, adapters too;
   the tensors sent (state_dict() inside the context, full_tensor(), bf16) are the base's keys, equal to PEFT's
   merge_and_unload, and the base is restored exactly after.
Prints one line per strategy from rank 0."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardedStateDictConfig, ShardingStrategy, StateDictType, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def _model():
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False)
    base = Qwen2ForCausalLM(cfg).float()
    n_base = sum(p.numel() for p in base.parameters())
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                           init_lora_weights=False)), n_base


def check(strategy: str, mesh) -> dict:
    from verl.utils import fsdp_utils as fu

    model, n_base = _model()
    n_all = sum(p.numel() for p in model.parameters())
    merged_ref = copy.deepcopy(model).merge_and_unload().state_dict()
    with model.disable_adapter():
        base_ref = {k: v.clone() for k, v in fu.normalize_peft_param_name(model.state_dict()).items()}
    if strategy == "fsdp2":
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        module = fully_shard(model, mesh=mesh)
    else:
        module = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}), use_orig_params=True,
                      device_mesh=mesh, device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD)
        FSDP.set_state_dict_type(module, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())
    world = dist.get_world_size()
    first = fu.collect_lora_params(module, layered_summon=False, base_sync_done=False)
    backup = fu.backup_base_model_weights(module)
    with fu.merged_lora_context(module, backup_adapters=True):
        params = fu.normalize_peft_param_name(module.state_dict())
        sent = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).to(torch.bfloat16) for k, v in params.items()}
    after = fu.normalize_peft_param_name(module.state_dict())
    after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in after.items()}
    return {
        "first sync on the host (B)": (_local_bytes(first.values()), n_base * 4),
        "first sync whole, on cpu": all(not hasattr(t, "to_local") and t.device.type == "cpu" for t in first.values()),
        "merge backup (B; base shard, all shard)": (_local_bytes(backup.values()), n_base * 4 // world,
                                                    n_all * 4 // world),
        "sent keys = base keys": sorted(sent) == sorted(merged_ref),
        "sent - merge_and_unload (max abs, bf16)": max((sent[k].float() - merged_ref[k].bfloat16().float()).abs().max()
                                                       .item() for k in merged_ref),
        "restored - base (max abs)": max((after[k] - base_ref[k]).abs().max().item() for k in base_ref),
    }


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for strategy in ("fsdp2", "fsdp"):
        out = check(strategy, mesh)
        if dist.get_rank() == 0:
            print(strategy, out, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
