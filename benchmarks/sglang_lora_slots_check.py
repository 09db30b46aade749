"""Does SGLang serve verl's adapter from one LoRA pool slot (max_loras_per_batch 1)? SGLang 0.5.23's own slot
bookkeeping driven through the calls verl 0.9.1 makes, on the pool SGLang builds for the issue's job (Qwen2.5-7B,
TP 2, rank 32, verl's all-linear; meta tensors: benchmarks/sglang_lora_check.py sglang_pool). Run it in that
benchmark's environment:

    PYTHONPATH=. /tmp/sglenv/bin/python benchmarks/sglang_lora_slots_check.py

What verl does (read in verl 0.9.1): every generate request names its one adapter (async_sglang_server.py generate:
lora_path = SGLANG_LORA_NAME); each weight sync unloads it before loading the new one under the same name
(sglang_rollout.py ServerAdapter.update_weights: unload_lora_adapter, then load_lora_adapter_from_tensor); its
server's start polls /health_generate (http_server_engine.py), a base-model request, before any adapter exists.
What runs of SGLang's code: LoRAMemoryPool.prepare_lora_batch (the scheduler's fetch_new_loras: a slot for each
adapter of the batch, the base model (None) counted as one, evicting one no batch needs), remove_lora (what
LoRAManager._unload_lora_adapter calls once the registry has waited for the adapter's requests:
lora_registry.wait_for_unload) and LoRAManager.validate_lora_batch (the scheduler admits a request only while its
batch's adapters fit the slots: scheduler.py, else it waits). Stubbed: the copy of an adapter's weights into its
slot (load_lora_weight_to_buffer: meta tensors, and no adapter files here) - the slot it is given is recorded.
"""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.sglang_lora_check import sglang_pool

ADAPTER = "verl_actor_lora_name"   # verl's SGLANG_LORA_NAME; SGLang gives each load its own id (v1, v2 below)


def verl_steps(slots: int) -> list[tuple[str, object]]:
    """(step, what SGLang answers) through two weight syncs and rollouts with `slots` slots."""
    pool = sglang_pool("qwen2.5-7b", 2, 32, slots)   # first: it installs the benchmark's import stand-ins
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.mem_pool import EMPTY_SLOT

    loaded = []
    pool.load_lora_weight_to_buffer = lambda uid, buffer_id, *rest: loaded.append((uid, buffer_id))
    manager = SimpleNamespace(max_loras_per_batch=slots, num_pinned_loras=0, memory_pool=pool, lora_refs={})

    def admit(uids: set) -> bool:
        return LoRAManager.validate_lora_batch(manager, uids)

    def batch(uids: set) -> dict:
        assert admit(uids), uids
        pool.prepare_lora_batch(uids, {}, [], {}, None, None)
        return {b: u for b, u in enumerate(pool.buffer_id_to_uid) if u is not EMPTY_SLOT}

    steps = [("start: /health_generate (base model)", batch({None})),
             ("rollout 1: every request names v1", batch({"v1"})),
             ("sync 2: unload v1 (remove_lora's slot)", pool.remove_lora("v1")),
             ("rollout 2: every request names v2", batch({"v2"})),
             ("a base request beside v2's: admitted now", admit({"v2", None})),
             ("slots v1 then v2 were copied to", [b for u, b in loaded if u is not None])]
    return steps


def main() -> None:
    verl_steps(1)
    import sglang

    print(f"SGLang {sglang.__version__}: verl's adapter through LoRAMemoryPool's slots (qwen2.5-7b TP 2 rank 32)")
    for slots in (1, 8):
        print(f"max_loras_per_batch {slots}:")
        for step, answer in verl_steps(slots):
            print(f"  {step:44} {answer}")


if __name__ == "__main__":
    main()
