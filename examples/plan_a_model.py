"""Plan Llama 3 8B on two 8 x H100 nodes with 8k sequences, then print the chosen config as FSDP2 code.

    python examples/plan_a_model.py
"""

from planner import plan
from planner.emit import emit_artifact

p = plan("llama3-8b", gpus=16, gpu="h100-80gb", seq_len=8192)
best = p.best
print(f"{p.model.name}: {p.model.n_params:,} parameters; {p.n_costed} configurations costed, "
      f"{len(p.candidates)} fit")
print("best:", best.config.to_dict())
print(f"peak memory {best.memory.peak_reserved_bytes / 2**30:.1f} GiB of "
      f"{p.cluster.gpu.memory_bytes / 2**30:.0f} GiB, step {best.time.step_s:.2f} s, "
      f"{best.time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {100 * best.time.mfu:.1f}%")
print()
print(emit_artifact("fsdp2", best))
