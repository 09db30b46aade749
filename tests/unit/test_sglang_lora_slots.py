"""verl's adapter served from one SGLang LoRA pool slot: SGLang 0.5.23's own slot bookkeeping (LoRAMemoryPool
prepare_lora_batch / remove_lora, LoRAManager.validate_lora_batch) driven through verl 0.9.1's calls
(benchmarks/sglang_lora_slots_check.py says which). SGLang installs in an environment of its own
(benchmarks/sglang_lora_check.py says how); here it is skipped. With sglang 0.5.23: passed (2026-12-07)."""

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:   # before the stand-ins: they must not reach other tests' imports
    pytest.skip("SGLang is not importable in this environment: it installs in one of its own "
                "(benchmarks/sglang_lora_check.py says how)", allow_module_level=True)

from benchmarks.sglang_lora_slots_check import verl_steps  # noqa: E402


def test_one_slot_serves_verls_adapter_across_syncs():
    """One slot: the start's base request takes it, the first rollout's adapter evicts the base, the sync's unload
    frees slot 0 and the next adapter takes it - every batch admitted, the adapters copied to slot 0 each time. The
    one thing a slot refuses: a base request beside the adapter's (it waits; verl sends none during a rollout).
    With SGLang's 8, two slots ever hold anything (the base's and the adapter's)."""
    one = dict(verl_steps(1))
    assert list(one.values()) == [{0: None}, {0: "v1"}, 0, {0: "v2"}, False, [0, 0]]
    eight = dict(verl_steps(8))
    assert list(eight.values()) == [{0: None}, {0: None, 1: "v1"}, 1, {0: None, 1: "v2"}, True, [1, 1]]
