"""Our LoRA buffer bytes (cost_models/rollout_lora.py) against the buffers vLLM's own LoRA manager allocates, for
catalog models at several TP degrees. Run it in vLLM's own environment (benchmarks/vllm_kv_check.py says how):

    PYTHONPATH=. /tmp/vllmenv/bin/python benchmarks/vllm_lora_check.py
    PYTHONPATH=. /tmp/vllmenv/bin/python -m pytest -q -n 0 tests/unit/test_rl_vllm_lora.py

What runs of vLLM's code: the model class its registry picks for the catalog's config.json, built on the meta device
(shapes, no memory) under a stand-in TP group of the given size (rank 0: the layers shard as on a GPU rank), then
LoRAModelManager (lora/model_manager.py: which modules it wraps, create_lora_weights of each) with verl's engine
args (max_loras 1, max_lora_rank); we sum every lora_a_stacked / lora_b_stacked / embeddings_tensors it made (an
MoE's w13 / w2 buffers: FusedMoEWithLoRA built past the GPU kernel it binds last, and under stand-in EP / DP groups
of one rank, vLLM without expert parallelism as verl starts it). The
punica wrapper's index buffers: PunicaWrapperGPU built on the meta device (its LoRAKernelMeta import needs Triton,
absent on CPU: handed to it), the GPU tensors it holds summed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks.sglang_lora_check import LLAMA4_CONFIGS
from benchmarks.vllm_kv_check import _config_dir as _catalog_config_dir
from cost_models.rollout_lora import vllm_lora_buffers
from planner.models import from_hf_config, resolve_model

CASES = [("qwen2.5-7b", 1), ("qwen2.5-7b", 4), ("qwen3-8b", 1), ("qwen3-8b", 2), ("qwen3-8b", 8),
         ("llama3-8b", 8), ("llama3-8b", 16), ("qwen2.5-14b", 2),   # Llama at 16: one KV head on each rank, replicated
         ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 4), ("mixtral-8x7b", 2), ("gpt-oss-20b", 1), ("gpt-oss-20b", 2),
         ("deepseek-v2-lite", 1), ("deepseek-v2-lite", 2), ("deepseek-v2-lite", 8),   # MLA without q_lora_rank
         ("deepseek-v3", 1), ("deepseek-v3", 8),   # fused_qkv_a_proj; both: shared experts, leading dense blocks
         ("qwen2-moe-a2.7b", 1), ("qwen2-moe-a2.7b", 2),   # a gated shared expert
         # not in the catalog (the generic reader): a shared expert in every sparse block; Maverick's interleaved
         # dense blocks (intermediate_size_mlp); Llama4ForCausalLM is a LlamaForCausalLM (embedding_modules)
         ("llama4-scout", 1), ("llama4-scout", 4), ("llama4-maverick", 8)]
# FusedMoEWithLoRA / FusedMoE3DWithLoRA's buffers (tuples of tensors; their lora_a_stacked are lists of views)
MOE_BUFFERS = ("w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked", "w2_lora_b_stacked")


class _TpGroup:
    """What the layers read of vLLM's TP group while they are built (world size, this rank)."""

    is_first_rank = is_last_rank = True

    def __init__(self, world_size: int):
        self.world_size, self.rank_in_group, self.rank, self.ranks = world_size, 0, 0, list(range(world_size))
        self.device_group = self.cpu_group = self   # an MoE block reads its EP group's device group's size / rank

    def size(self) -> int:
        return self.world_size


def _moe_lora_without_its_kernel() -> None:
    """FusedMoEWithLoRA.__init__ binds the GPU's modular MoE kernel last, after every attribute create_lora_weights
    reads; the CPU's unquantized method has none and raises there. Let that raise pass, and set_mapping hand the
    kernel nothing: the buffers are the same."""
    from vllm.lora.layers.base import BaseLayerWithLoRA
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA

    init = FusedMoEWithLoRA.__init__
    if getattr(init, "cpu_stand_in", False):
        return

    def without_kernel(self, base_layer) -> None:
        try:
            init(self, base_layer)
        except RuntimeError as exc:
            if "Old-style modular kernel" not in str(exc):
                raise

    without_kernel.cpu_stand_in = True
    FusedMoEWithLoRA.__init__ = without_kernel
    FusedMoEWithLoRA.set_mapping = BaseLayerWithLoRA.set_mapping


def _config_dir(name: str) -> str:
    """config.json of a catalog preset, or of Llama 4's text configs (benchmarks/sglang_lora_check.py)."""
    if name not in LLAMA4_CONFIGS:
        return _catalog_config_dir(name)
    folder = Path(tempfile.mkdtemp(prefix=f"vllm-lora-{name}-"))
    (folder / "config.json").write_text(json.dumps({**LLAMA4_CONFIGS[name], "torch_dtype": "bfloat16"}))
    return str(folder)


def _spec(name: str):
    return from_hf_config(dict(LLAMA4_CONFIGS[name]), name=name) if name in LLAMA4_CONFIGS else resolve_model(name)


def vllm_bytes(name: str, tp: int, rank: int = 32, fully_sharded: bool = False) -> int:
    """The bytes of the LoRA buffers vLLM's LoRAModelManager allocates on one TP rank (meta tensors)."""
    import torch
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config import LoRAConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.model_executor.model_loader.utils import initialize_model

    _moe_lora_without_its_kernel()
    parallel_state._TP, parallel_state._PP = _TpGroup(tp), _TpGroup(1)
    # an MoE's layers read these too: vLLM without expert parallelism (verl's default), one data-parallel rank
    parallel_state._EP, parallel_state._DP, parallel_state._PCP = _TpGroup(1), _TpGroup(1), _TpGroup(1)
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
        for attr in ("lora_a_stacked", "lora_b_stacked", "embeddings_tensors", *MOE_BUFFERS):
            held = getattr(module, attr, None)
            if isinstance(held, list):   # FusedMoEWithLoRA's per-expert views of the MoE buffers
                continue
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
    b = vllm_lora_buffers(_spec(name), tp, rank, fully_sharded=fully_sharded)
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
