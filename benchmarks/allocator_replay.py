"""Reserved against allocated memory of traced steps: the caching allocator replay (issue 27 item 1).

    python benchmarks/allocator_replay.py

For each configuration: the trace tier's peak allocated (planner.tracing.trace), the replay's peak allocated
(512 B-rounded blocks) and peak reserved (cost_models/caching_allocator.py over the step's recorded
allocations, calibration/alloc_sequence.py), their ratio, and the trace report's reserved both ways (replay +
CUDA context, and the flat allocated x 1.05 + context it replaces); then the estimate's allocator reserved (its own
step replayed: cost_models/step_allocations.py) against the trace's replay, and the flat rule's. No GPU: these are
the model's figures, not measurements of an allocator.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory_accuracy import ARCHS  # noqa: E402

from cost_models.units import GiB  # noqa: E402
from planner.tracing import trace  # noqa: E402

# llama3-gqa widened to ~0.6B parameters (hidden 2048, 8 layers, V 32000): segments of hundreds of MiB, where
# the 20 MiB large-pool granularity no longer dominates as it does in the small grid models
WIDE_LLAMA = dict(ARCHS["llama3-gqa"], _name_or_path="llama-0.6b", hidden_size=2048, intermediate_size=8192,
                  num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)
CONFIGS = [
    ("llama3-gqa", ARCHS["llama3-gqa"], 8, dict(precision="bf16", micro_batch=2, seq_len=2048)),
    ("qwen2-tied", ARCHS["qwen2-tied"], 8, dict(precision="bf16", micro_batch=2, seq_len=2048,
                                                activation_checkpointing="full")),
    ("llama-0.6b", WIDE_LLAMA, 8, dict(precision="bf16", micro_batch=2, seq_len=2048)),
    ("llama-0.6b", WIDE_LLAMA, 8, dict(precision="bf16", micro_batch=2, seq_len=2048,
                                       activation_checkpointing="full")),
]


def _flat(r) -> int:
    """The allocator's reserved by the flat rule (allocated x 1.05), as the estimate gave it before its replay."""
    from cost_models.memory import estimate_memory

    c = r.candidate
    return estimate_memory(c.model, c.cluster, c.training, c.config, r.profile).allocator_reserved_bytes


def _vs(estimated: int, traced: int) -> str:
    return f"{estimated / GiB:.3f} ({100 * (estimated / traced - 1):+.1f}%)"


def main() -> None:
    print(f"{'model':<12} gpus  {'config':<72} allocated  replay alloc  reserved  "
          "reserved/allocated  report replay+ctx  report flat  estimate (error)  flat (error)  (GiB)")
    for name, cfg, gpus, kwargs in CONFIGS:
        started = time.perf_counter()
        r = trace(dict(cfg), gpus, **kwargs)
        a = r.traced.allocator
        knobs = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        print(f"{name:<12} {gpus:>4}  {knobs:<72} {r.traced.peak_allocated_bytes / GiB:>9.3f}  "
              f"{a.peak_allocated_bytes / GiB:>12.3f}  {a.peak_reserved_bytes / GiB:>8.3f}  "
              f"{a.peak_reserved_bytes / r.traced.peak_allocated_bytes:>18.3f}  "
              f"{r.replay_reserved_bytes / GiB:>17.3f}  {r.flat_reserved_bytes / GiB:>11.3f}  "
              f"{_vs(r.candidate.memory.allocator_reserved_bytes, a.peak_reserved_bytes)}  "
              f"{_vs(_flat(r), a.peak_reserved_bytes)}  "
              f"({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    from calibration.hash_seed import pin_hash_seed

    pin_hash_seed()  # the traced allocation order follows the hash seed (calibration/hash_seed.py)
    main()
