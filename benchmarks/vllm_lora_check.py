"""Our LoRA buffer bytes (cost_models/rollout_lora.py) against the buffers vLLM's own LoRA manager allocates, for
catalog models at several TP degrees. Run it in vLLM's own environment (benchmarks/vllm_kv_check.py says how):

    PYTHONPATH=. /tmp/vllmenv/bin/python benchmarks/vllm_lora_check.py
    PYTHONPATH=. /tmp/vllmenv/bin/python -m pytest -q -n 0 tests/unit/test_rl_vllm_lora.py

What runs of vLLM's code: the model class its registry picks for the catalog's config.json, built on the meta device
(shapes, no memory) under a stand-in TP group of the given size (rank 0: the layers shard as on a GPU rank), then
LoRAModelManager (lora/model_manager.py: which modules it wraps, create_lora_weights of each) with verl's engine
args (max_loras 1, max_lora_rank); we sum every lora_a_stacked / lora_b_stacked / embeddings_tensors it made. The
punica wrapper's index buffers: PunicaWrapperGPU built on the meta device (its LoRAKernelMeta import needs Triton,
absent on CPU: handed to it), the GPU tensors it holds summed.
"""

from __future__ import annotations

from benchmarks.vllm_kv_check import _config_dir
from cost_models.rollout_lora import vllm_lora_buffers
from planner.models import resolve_model

CASES = [("qwen2.5-7b", 1), ("qwen2.5-7b", 4), ("qwen3-8b", 1), ("qwen3-8b", 2), ("qwen3-8b", 8),
         ("llama3-8b", 8), ("llama3-8b", 16), ("qwen2.5-14b", 2)]   # Llama at 16: one KV head on each rank, replicated


class _TpGroup:
    """What the layers read of vLLM's TP group while they are built (world size, this rank)."""

    is_first_rank = is_last_rank = True

    def __init__(self, world_size: int):
        self.world_size, self.rank_in_group, self.rank, self.ranks = world_size, 0, 0, list(range(world_size))


def vllm_bytes(name: str, tp: int, rank: int = 32, fully_sharded: bool = False) -> int:
    """The bytes of the LoRA buffers vLLM's LoRAModelManager allocates on one TP rank (meta tensors)."""
    import torch
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config import LoRAConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.model_executor.model_loader.utils import initialize_model

    parallel_state._TP, parallel_state._PP = _TpGroup(tp), _TpGroup(1)
    model_config = ModelConfig(model=_config_dir(name), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=5120)
    lora = LoRAConfig(max_lora_rank=rank, max_loras=1, fully_sharded_loras=fully_sharded)
    lora.verify_with_model_config(model_config)   # lora_dtype auto -> the model's
    config = VllmConfig(model_config=model_config, lora_config=lora,
                        parallel_config=ParallelConfig(tensor_parallel_size=tp))
    with set_current_vllm_config(config), torch.device("meta"):
        model = initialize_model(vllm_config=config)
        manager = LoRAModelManager(model, 256, 8192, model_config.get_vocab_size(), lora, torch.device("meta"), config)
    total = 0
    for module in manager.model.modules():
        for attr in ("lora_a_stacked", "lora_b_stacked", "embeddings_tensors"):
            held = getattr(module, attr, None)
            for t in (held if isinstance(held, tuple) else (held,) if held is not None else ()):
                total += t.numel() * t.element_size()
    return total


def vllm_punica_bytes(max_num_batched_tokens: int = 8192, max_num_seqs: int = 256) -> int:
    """The GPU tensors PunicaWrapperGPU (lora/punica_wrapper/punica_gpu.py) holds for verl's one adapter."""
    import torch
    import vllm.lora.punica_wrapper.punica_gpu as punica_gpu
    from vllm.config.lora import LoRAConfig
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    punica_gpu.LoRAKernelMeta = LoRAKernelMeta   # imported there only where Triton is
    wrapper = punica_gpu.PunicaWrapperGPU(max_num_batched_tokens, max_num_seqs, torch.device("meta"),
                                          lora_config=LoRAConfig(max_lora_rank=32, max_loras=1))
    held = [*vars(wrapper).values(), *vars(wrapper.token_mapping_meta).values(),
            *vars(wrapper.prompt_mapping_meta).values()]
    return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor) and t.is_meta)


def ours(name: str, tp: int, rank: int = 32, fully_sharded: bool = False) -> int:
    """Ours without the punica wrapper's index buffers (not built here)."""
    b = vllm_lora_buffers(resolve_model(name), tp, rank, fully_sharded=fully_sharded)
    return b.blocks_bytes + b.vocab_bytes


def main() -> None:
    import vllm

    print(f"vLLM {vllm.__version__}: LoRA buffers per GPU, max_loras 1, rank 32, bf16")
    same = 0
    for name, tp in CASES:
        for sharded in (False, True) if tp > 1 else (False,):
            a, b = ours(name, tp, fully_sharded=sharded), vllm_bytes(name, tp, fully_sharded=sharded)
            same += a == b
            print(f"{name:12} TP {tp} fully_sharded {sharded!s:5}  ours {a:>12,}  vLLM {b:>12,}  "
                  f"{'same' if a == b else 'DIFFERENT'}")
    for tokens, seqs in ((8192, 256), (4096, 512)):
        a, b = vllm_lora_buffers(resolve_model("qwen2.5-7b"), 1, 32, max_num_batched_tokens=tokens,
                                 max_num_seqs=seqs).metadata_bytes, vllm_punica_bytes(tokens, seqs)
        same += a == b
        print(f"punica index buffers, {tokens} tokens, {seqs} seqs: ours {a:,}  vLLM {b:,}  "
              f"{'same' if a == b else 'DIFFERENT'}")
    print(f"{same} the same")


if __name__ == "__main__":
    main()
