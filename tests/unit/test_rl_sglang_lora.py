"""Our LoRA pool bytes (cost_models/rollout_lora_sglang.py) against the LoRAMemoryPool SGLang 0.5.23 builds itself for
the catalog's models on the meta device at each TP degree (benchmarks/sglang_lora_check.py: SGLang's model class,
LoRAManager.init_lora_shapes, LoRAMemoryPool.init_buffers). SGLang installs in an environment of its own (the
benchmark says how); here it is skipped. With sglang 0.5.23: 11 of 11 the same (2026-12-07)."""

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:   # before the stand-ins: they must not reach other tests' imports
    pytest.skip("SGLang is not importable in this environment: it installs in one of its own "
                "(benchmarks/sglang_lora_check.py says how)", allow_module_level=True)

from benchmarks.sglang_lora_check import CASES, ours, sglang_bytes  # noqa: E402


@pytest.mark.parametrize("name, tp, rank, slots, targets", CASES)
def test_lora_pool_is_sglangs(name, tp, rank, slots, targets):
    """Qwen2.5-7B / 14B, Qwen3-8B, Llama 3 8B (at TP 16 one KV head a rank, replicated), Llama 3.2 1B (the head tied
    to the embedding), verl's all-linear and a list of targets, 8 slots or 1, ranks 16-64: the same bytes."""
    assert ours(name, tp, rank, slots, targets) == sglang_bytes(name, tp, rank, slots, targets)
