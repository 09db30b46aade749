"""Our LoRA pool bytes (cost_models/rollout_lora_sglang.py) against the LoRAMemoryPool SGLang builds itself, for
catalog models at several TP degrees and ranks; then the csgmv backend's CUDA-graph metadata and the MoE routing
buffers against SGLang's own allocations (sglang_metadata_bytes), and our adapter refusal against what SGLang's adapter
loader raises (sglang_adapter_load_error). SGLang brings dependencies of its own (and pins torch 2.14.1): run it
in an environment of its own that borrows the project's torch 2.13 and transformers, about 2 minutes to set up:

    python3 -m venv /tmp/sglenv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/sglenv/lib/python3.11/site-packages/zz_project.pth
    /tmp/sglenv/bin/pip install --no-deps sglang==0.5.23 pybase64 triton starlette msgspec pyzmq IPython \
        apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed_tensors loguru gguf openai httpx2 partial_json_parser \
        traitlets decorator matplotlib-inline pexpect ptyprocess prompt_toolkit wcwidth stack_data executing \
        asttokens pure_eval jedi parso ipython-pygments-lexers   # IPython's own (sglang/utils.py imports it)
    PYTHONPATH=. /tmp/sglenv/bin/python benchmarks/sglang_lora_check.py
    PYTHONPATH=. /tmp/sglenv/bin/python -m pytest -q -n 0 -p no:cacheprovider tests/unit/test_rl_sglang_lora.py

What runs of SGLang's code: ServerArgs (enable_lora, tp_size) published as the process's runtime context (rank 0),
its ModelConfig of the catalog's config.json (as ModelRunner has it: head_dim filled in where the config has none,
Mixtral's), the model class SGLang runs for it (Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM; the MoE
Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM; DeepseekV2ForCausalLM and
DeepseekV3ForCausalLM with MLA) built on the meta device with stand-in process groups of the TP size (its layers
shard as on GPU rank 0), then LoRAManager.init_lora_shapes (verl's ["all"] resolved against the model, or a list
normalised) and LoRAMemoryPool (init_buffers: every buffer it allocates, on the meta device, the MoE's 4D expert
buffers included); we sum them. Built on the CPU, DeepSeek-V3 keeps its shared expert apart (fused into the FusedMoE
on a CUDA GPU): the pool is sized from the config either way (cost_models/rollout_lora_sglang.py). Llama 4 is not in
the catalog: Scout's and Maverick's text configs (LLAMA4_CONFIGS, as their hub config.json's text_config: 16 experts
on every block; 128 on every other block, dense blocks between), and Maverick's as its checkpoint has it
(Llama4ForConditionalGeneration, the text config under text_config); after the pool, the engine's start as
LoRAManager.init_state runs it (init_lora_modules wraps the model's modules, update_lora_info hands them the pool's
buffers; pinned CPU tensors made unpinned: no accelerator here), and what it raises. Two imports
SGLang makes at module level for code that never runs here are stand-ins: torchvision (multimodal processors; its
wheels need a CUDA torch) and vllm (the CPU rotary kernel's import). The pool's shapes read neither.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

from benchmarks.vllm_kv_check import _config_dir
from cost_models.rollout_lora_sglang import (adapter_refusals, sglang_lora_pool, sglang_target_modules,
                                             start_refusals)
from planner.models import resolve_model

# (model, TP, rank, slots, targets): verl's all-linear at its defaults, the rank unrounded (48), one slot, a list;
# Llama 3 8B at 16: one KV head a rank, replicated; Llama 3.2 1B: the head tied to the embedding
CASES = [("qwen2.5-7b", 1, 32, 8, "all-linear"), ("qwen2.5-7b", 2, 32, 8, "all-linear"),
         ("qwen2.5-7b", 4, 48, 8, "all-linear"), ("qwen2.5-7b", 2, 32, 1, "all-linear"),
         ("qwen2.5-7b", 2, 32, 8, ("q_proj", "v_proj")), ("qwen3-8b", 1, 64, 8, "all-linear"),
         ("qwen3-8b", 8, 48, 8, "all-linear"), ("llama3-8b", 8, 32, 8, "all-linear"),
         ("llama3-8b", 16, 32, 8, "all-linear"), ("qwen2.5-14b", 2, 16, 8, "all-linear"),
         ("llama3.2-1b", 2, 32, 8, "all-linear")]
# Mixtures of experts (every routed expert's 4D buffers on every layer; Qwen2-MoE's and DeepSeek's shared experts and
# DeepSeek's leading dense block 3D) and MLA (DeepSeek-V2-Lite without q_lora_rank, V3 with): verl's all-linear and
# lists; Mixtral at TP 8 one KV head a rank
MOE_CASES = [("qwen3-30b-a3b", 1, 32, 8, "all-linear"), ("qwen3-30b-a3b", 4, 64, 8, "all-linear"),
             ("qwen3-30b-a3b", 2, 16, 8, ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")),
             ("qwen2-moe-a2.7b", 2, 32, 8, "all-linear"), ("mixtral-8x7b", 2, 32, 8, "all-linear"),
             ("mixtral-8x7b", 8, 16, 4, "all-linear"), ("gpt-oss-20b", 2, 32, 8, "all-linear"),
             ("deepseek-v2-lite", 1, 32, 8, "all-linear"), ("deepseek-v2-lite", 2, 32, 8, "all-linear"),
             ("deepseek-v2-lite", 2, 16, 8, ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")),
             ("deepseek-v3", 8, 32, 8, "all-linear"), ("deepseek-v3", 16, 16, 8, ("q_a_proj", "q_b_proj",
                                                                                 "gate_proj", "down_proj"))]
# Llama 4 (Scout: MoE on every block; Maverick: every other block; Maverick's checkpoint class): the pool SGLang
# allocates before its start fails (all-linear, a list with down_proj), and the attention alone (which starts)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA4_CASES = [("llama4-scout", 1, 32, 8, "all-linear"), ("llama4-scout", 4, 32, 8, "all-linear"),
                ("llama4-scout", 2, 16, 8, ("q_proj", "v_proj", "down_proj")),
                ("llama4-maverick", 8, 32, 8, "all-linear"), ("llama4-maverick", 2, 32, 8, ATTENTION),
                ("llama4-maverick", 8, 16, 1, ATTENTION), ("llama4-maverick-mm", 2, 32, 8, ATTENTION)]
# The engine's start with LoRA (name, TP, targets): Llama 4's all-linear under both classes, a list with down_proj, the
# attention alone; MoEs without and with shared experts and a dense model, which start
START_CASES = [("llama4-scout", 4, "all-linear"), ("llama4-maverick", 8, "all-linear"),
               ("llama4-maverick-mm", 8, "all-linear"), ("llama4-scout", 2, ("q_proj", "v_proj", "down_proj")),
               ("llama4-maverick", 2, ATTENTION), ("llama4-maverick-mm", 2, ATTENTION),
               ("qwen3-30b-a3b", 2, "all-linear"), ("qwen2-moe-a2.7b", 2, "all-linear"),
               ("qwen2.5-7b", 2, "all-linear")]
_LLAMA4_TEXT = {"model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "hidden_size": 5120,
                "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
                "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048,
                "num_experts_per_tok": 1, "attention_chunk_size": 8192, "hidden_act": "silu", "rms_norm_eps": 1e-05,
                "rope_theta": 500000.0, "attention_bias": False, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
                "pad_token_id": 200018}
_MAVERICK = {**_LLAMA4_TEXT, "num_local_experts": 128, "interleave_moe_layer_step": 2, "use_qk_norm": False,
             "max_position_embeddings": 1048576, "rope_scaling": None}
LLAMA4_CONFIGS = {
    "llama4-scout": {**_LLAMA4_TEXT, "num_local_experts": 16, "interleave_moe_layer_step": 1, "use_qk_norm": True,
                     "max_position_embeddings": 10485760,
                     "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "llama4-maverick": _MAVERICK,
    "llama4-maverick-mm": {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
                           "text_config": {k: v for k, v in _MAVERICK.items() if k != "architectures"},
                           "vision_config": {"model_type": "llama4_vision_model"}, "tie_word_embeddings": False}}
# The backend's CUDA-graph metadata (name, TP, slots, the decode graph's largest batch): csgmv's rows, and the MoE
# routing buffers where the FusedMoE is wrapped
METADATA_CASES = [("qwen2.5-7b", 2, 8, 256), ("qwen2.5-7b", 2, 1, 512), ("qwen3-30b-a3b", 2, 8, 256),
                  ("mixtral-8x7b", 8, 4, 160), ("deepseek-v2-lite", 2, 1, 100), ("deepseek-v3", 8, 8, 256)]
# Whose all-linear adapter SGLang's loader takes (MLA with and without q_lora_rank, GQA)
ADAPTER_CASES = ["deepseek-v2-lite", "deepseek-v3", "qwen3-30b-a3b", "qwen2.5-7b"]
MODEL_CLASSES = {"qwen2": ("sglang.srt.models.qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("sglang.srt.models.qwen3", "Qwen3ForCausalLM"),
                 "llama": ("sglang.srt.models.llama", "LlamaForCausalLM"),
                 "qwen3_moe": ("sglang.srt.models.qwen3_moe", "Qwen3MoeForCausalLM"),
                 "qwen2_moe": ("sglang.srt.models.qwen2_moe", "Qwen2MoeForCausalLM"),
                 "mixtral": ("sglang.srt.models.mixtral", "MixtralForCausalLM"),
                 "gpt_oss": ("sglang.srt.models.gpt_oss", "GptOssForCausalLM"),
                 "deepseek_v2": ("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM"),
                 "deepseek_v3": ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM"),
                 "llama4_text": ("sglang.srt.models.llama4", "Llama4ForCausalLM"),
                 "llama4": ("sglang.srt.models.mllama4", "Llama4ForConditionalGeneration")}
# Keys of the real config.json the catalog leaves out that SGLang's class reads (DeepSeek-V2-Lite's router)
LEFT_OUT = {"deepseek-v2-lite": {"scoring_func": "softmax"}}
STAND_INS = ("torchvision", "vllm")


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of STAND_INS get a MagicMock module (they are imported, never called, on the path we run)."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        return module

    def exec_module(self, module):
        pass


def _install_stand_ins() -> None:
    """The stand-ins, and torchvision's metadata (transformers reads its version where it sees the module)."""
    if any(isinstance(f, _StandIn) for f in sys.meta_path):
        return
    folder = Path(tempfile.mkdtemp(prefix="sgl-stand-ins-")) / "torchvision-0.28.0.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    sys.path.insert(0, str(folder.parent))
    sys.meta_path.insert(0, _StandIn())


class _Group:
    """What SGLang's layers read of a process group while they are built (rank 0 of `size`)."""

    is_first_rank = is_last_rank = True
    cpu_group = device_group = None

    def __init__(self, size: int):
        self.world_size, self.rank_in_group, self.rank, self.ranks = size, 0, 0, list(range(size))


@functools.cache
def _folder(name: str) -> str:
    """The config.json SGLang reads: the catalog's (with LEFT_OUT's keys), or LLAMA4_CONFIGS'."""
    if name in LLAMA4_CONFIGS:
        folder = tempfile.mkdtemp(prefix=f"sgl-{name}-")
        (Path(folder) / "config.json").write_text(json.dumps(LLAMA4_CONFIGS[name]))
        return folder
    folder = _config_dir(name)
    if name in LEFT_OUT:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | LEFT_OUT[name]))
    return folder


@functools.cache
def our_model(name: str):
    """The planner's ModelSpec of a catalog name, or of LLAMA4_CONFIGS' config.json (the generic path)."""
    return resolve_model(_folder(name) if name in LLAMA4_CONFIGS else name)


def _on_cpu(factory):
    """torch.tensor / torch.empty as the LoRA layers call them for their small index tensors, unpinned (no accelerator
    here) and on the CPU where asked for the meta device (they read them back: .cpu(), .tolist())."""
    def made(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        if str(kwargs.get("device")) == "meta":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return made


def _build(name: str, tp: int, rank: int, slots: int, targets, start: bool = False):
    """The LoRAMemoryPool SGLang builds on TP rank 0 (meta tensors), from ServerArgs as verl passes them; with `start`,
    then LoRAManager.init_state's init_lora_modules and update_lora_info on the model (csgmv backend)."""
    _install_stand_ins()
    import importlib
    from types import SimpleNamespace

    import torch
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.mem_pool import LoRAMemoryPool
    from sglang.srt.server_args import ServerArgs

    folder = _folder(name)
    listed = ["all"] if targets == "all-linear" else list(targets)   # verl's sglang_lora_target_modules
    args = ServerArgs(model_path=folder, tp_size=tp, enable_lora=True, max_lora_rank=rank, max_loras_per_batch=slots,
                      lora_target_modules=listed, device="cpu", skip_tokenizer_init=True, load_format="dummy")
    runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
    config = ModelConfig(folder).hf_config   # as ModelRunner passes it: head_dim / v_head_dim filled in
    module, cls = MODEL_CLASSES[config.model_type]
    groups = {g: _Group(tp) for g in ("tp_group", "attn_tp_group", "moe_tp_group", "world_group")}
    groups.update({g: _Group(1) for g in ("pp_group", "attn_cp_group", "moe_ep_group", "moe_dp_group")})
    with runtime_context.get_parallel().override(**groups):
        with torch.device("meta"):
            model = getattr(importlib.import_module(module), cls)(config, quant_config=None)
        shapes = SimpleNamespace(base_model=model, configs={}, lora_refs={}, lora_added_tokens_size=None)
        LoRAManager.init_lora_shapes(shapes, max_lora_rank=rank, target_modules=set(listed))
        pool = LoRAMemoryPool(base_hf_config=config, max_loras_per_batch=slots, dtype=torch.bfloat16,
                              max_lora_rank=shapes.max_lora_rank, target_modules=shapes.target_modules,
                              base_model=model, eviction_policy="lru",
                              lora_added_tokens_size=shapes.lora_added_tokens_size)
        if start:
            backend = ChunkedSgmvLoRABackend(max_loras_per_batch=slots, device=torch.device("meta"), server_args=None)
            manager = SimpleNamespace(base_model=model, base_hf_config=config, target_modules=shapes.target_modules,
                                      lora_backend=backend, experts_shared_outer_loras=False, max_lora_rank=rank,
                                      lora_use_virtual_experts=False, moe_lora_runner_backend=None, memory_pool=pool)
            manager.set_lora_module = lambda *a, **k: LoRAManager.set_lora_module(manager, *a, **k)
            with mock.patch("torch.tensor", _on_cpu(torch.tensor)), mock.patch("torch.empty", _on_cpu(torch.empty)), \
                    mock.patch.object(torch.Tensor, "pin_memory", lambda tensor, *a, **k: tensor):
                LoRAManager.init_lora_modules(manager)
                LoRAManager.update_lora_info(manager)
    return pool


def sglang_pool(name: str, tp: int, rank: int = 32, slots: int = 8, targets="all-linear"):
    """The LoRAMemoryPool SGLang builds on TP rank 0 (meta tensors), from ServerArgs as verl passes them."""
    return _build(name, tp, rank, slots, targets)


def sglang_start_error(name: str, tp: int, targets="all-linear") -> str:
    """What SGLang raises building the pool and starting LoRA on it (rank 32, 8 slots; _build), "" where it starts."""
    try:
        _build(name, tp, 32, 8, targets, start=True)
    except Exception as error:   # where SGLang's engine start fails
        return f"{type(error).__name__} {error}".strip()
    return ""


def sglang_bytes(name: str, tp: int, rank: int = 32, slots: int = 8, targets="all-linear") -> tuple[int, int]:
    """(block buffers, vocabulary buffers) SGLang's LoRAMemoryPool allocates on TP rank 0 (meta tensors)."""
    pool = sglang_pool(name, tp, rank, slots, targets)

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)
    blocks = sum(size(layers) for buffer in (pool.A_buffer, pool.B_buffer) for layers in buffer.values())
    vocab = sum(size(buffer.values()) for buffer in (pool.embedding_A_buffer, pool.embedding_B_buffer,
                                                     pool.lm_head_A_buffer, pool.lm_head_B_buffer,
                                                     pool.new_embeddings_buffer))
    return blocks, vocab


def sglang_metadata_bytes(name: str, tp: int, slots: int, max_bs: int) -> int:
    """The int32 / fp32 rows SGLang's default LoRA backend (csgmv) allocates for the decode CUDA graphs of `max_bs`
    requests (ChunkedSgmvLoRABackend.init_decode_cuda_graph_batch_info, one token a request), and on a mixture of
    experts the routing buffers for the first FusedMoE (base_backend.py init_cuda_graph_moe_buffers, as
    lora_manager.py init_lora_cuda_graph_moe_buffers calls it: the wrapper's w13 weight as its device), on the meta
    device for verl's all-linear pool at rank 32."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend

    pool = sglang_pool(name, tp, 32, slots)
    backend = ChunkedSgmvLoRABackend(max_loras_per_batch=slots, device=torch.device("meta"), server_args=None)
    backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=max_bs, num_tokens_per_req=1)
    tensors = [v for v in vars(backend.cuda_graph_batch_info).values() if isinstance(v, torch.Tensor)]
    moe = next((m for m in pool.base_model.modules() if isinstance(m, FusedMoE)), None)
    if moe is not None and {"gate_up_proj", "down_proj"} <= pool.target_modules:
        wrapper = SimpleNamespace(base_layer=moe, _quant_info=SimpleNamespace(w13_weight=moe.w13_weight))
        backend.init_cuda_graph_moe_buffers(max_bs, slots, torch.bfloat16, wrapper)
        tensors += list(backend.moe_cg_buffers.values())
    return sum(t.numel() * t.element_size() for t in tensors)


def sglang_adapter_load_error(name: str) -> str:
    """What SGLang's adapter loader (lora/lora.py LoRAAdapter.normalize_qkv_proj, run on each layer's weights at every
    load_lora_adapter_from_tensors) raises on one layer of verl's all-linear attention adapter for the model (PEFT's
    names of its attention linears; zero tensors: the shapes do not matter to it), or "" where it loads."""
    _install_stand_ins()
    import torch
    from sglang.srt.lora.lora import LoRAAdapter

    model = resolve_model(name)
    if model.kv_lora_rank:   # DeepSeek's attention linears (transformers' DeepseekV2Attention)
        linears = ["q_a_proj", "q_b_proj"] if model.q_lora_rank else ["q_proj"]
        linears += ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    else:
        linears = ["q_proj", "k_proj", "v_proj", "o_proj"]
    weights = {f"base_model.model.model.layers.0.self_attn.{linear}.lora_{ab}.weight": torch.zeros(1, 1)
               for linear in linears for ab in "AB"}
    try:
        LoRAAdapter.normalize_qkv_proj(None, list(weights), weights)
    except Exception as error:   # what its caller, _load_lora_adapter_from_tensors, turns into a failed load
        return type(error).__name__
    return ""


def our_start_refused(name: str, targets="all-linear") -> bool:
    model = our_model(name)
    return bool(start_refusals(model, sglang_target_modules(targets if isinstance(targets, str) else list(targets),
                                                            model)))


def our_metadata_bytes(name: str, tp: int, slots: int, max_bs: int) -> int:
    return sglang_lora_pool(resolve_model(name), tp, 32, max_loras_per_batch=slots, max_bs=max_bs).metadata_bytes


def ours(name: str, tp: int, rank: int = 32, slots: int = 8, targets="all-linear") -> tuple[int, int]:
    model = our_model(name)
    b = sglang_lora_pool(model, tp, rank, max_loras_per_batch=slots,
                         targets=sglang_target_modules(targets if isinstance(targets, str) else list(targets), model))
    return b.blocks_bytes, b.vocab_bytes


def main() -> None:
    _install_stand_ins()
    import sglang

    print(f"SGLang {sglang.__version__}: LoRAMemoryPool bytes on TP rank 0, bf16 (blocks + vocabulary)")
    same = 0
    for name, tp, rank, slots, targets in CASES + MOE_CASES + LLAMA4_CASES:
        a, b = ours(name, tp, rank, slots, targets), sglang_bytes(name, tp, rank, slots, targets)
        same += a == b
        shown = targets if isinstance(targets, str) else ",".join(targets)
        print(f"{name:16} TP {tp:2} rank {rank:2} slots {slots} {shown:14} ours {a[0]:>13,} + {a[1]:>11,}  "
              f"SGLang {b[0]:>13,} + {b[1]:>11,}  {'same' if a == b else 'DIFFERENT'}")
    print(f"{same} of {len(CASES + MOE_CASES + LLAMA4_CASES)} the same")
    print("The engine's start with LoRA (LoRAMemoryPool, init_lora_modules, update_lora_info; rank 32, 8 slots)")
    same = 0
    for name, tp, targets in START_CASES:
        error, refused = sglang_start_error(name, tp, targets), our_start_refused(name, targets)
        same += refused == bool(error)
        shown = targets if isinstance(targets, str) else ",".join(targets)
        print(f"{name:18} TP {tp} {shown:27} SGLang {error[:60] or 'starts':60}  ours {'refused' if refused else 'priced'}"
              f"  {'same' if refused == bool(error) else 'DIFFERENT'}")
    print(f"{same} of {len(START_CASES)} the same")
    print("The LoRA backend's CUDA-graph metadata (csgmv; MoE routing buffers), bytes")
    same = 0
    for name, tp, slots, max_bs in METADATA_CASES:
        a, b = our_metadata_bytes(name, tp, slots, max_bs), sglang_metadata_bytes(name, tp, slots, max_bs)
        same += a == b
        print(f"{name:16} TP {tp:2} slots {slots} decode batch {max_bs:3}  ours {a:>9,}  SGLang {b:>9,}  "
              f"{'same' if a == b else 'DIFFERENT'}")
    print(f"{same} of {len(METADATA_CASES)} the same")
    print("verl's all-linear attention adapter through SGLang's loader (normalize_qkv_proj)")
    for name in ADAPTER_CASES:
        refused = bool(adapter_refusals(resolve_model(name)))
        error = sglang_adapter_load_error(name)
        print(f"{name:16} SGLang {error or 'loads':8}  ours {'refused' if refused else 'priced':8}  "
              f"{'same' if refused == bool(error) else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
