"""Plan a LoRA fine-tune of Llama 2 13B on one 8 x A100-80GB node at 4k tokens, next to full fine-tuning,
and print the FSDP1 wrapping it needs (adapters in units of their own). --trace re-checks the LoRA pick
with the trace tier (the real FSDP2 step with peft adapters on fake tensors; needs transformers and peft).

    python examples/lora_finetune.py [--trace]
"""

import argparse

from planner import plan
from planner.emit import emit_artifact

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--trace", action="store_true", help="trace the LoRA pick (about a minute on 2 cores)")
args = parser.parse_args()

common = dict(gpus=8, gpu="a100-80gb", seq_len=4096, global_batch=64)
for finetune in ("full", "lora"):
    p = plan("llama2-13b", finetune=finetune, lora_rank=16, **common)
    b = p.best
    m = b.memory.breakdown
    print(f"{finetune:>4}: {b.config.sharding.value}, {b.config.activation_checkpointing} checkpointing, "
          f"micro-batch {b.config.micro_batch} x {b.config.grad_accum}; peak {b.memory.peak_reserved_bytes / 2**30:.1f} "
          f"GiB (params {m.sharded_params / 2**30:.1f}, grads + optimizer {(m.sharded_grads + m.optimizer_state) / 2**30:.2f}, "
          f"activations {m.activations / 2**30:.1f}); {b.time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
print()
print(emit_artifact("fsdp1", b))  # b: the LoRA pick

if args.trace:
    from planner.tracing import trace_candidate
    from planner.models import hf_config_of

    report = trace_candidate(b, hf_config_of("llama2-13b"))
    print(f"traced peak {report.traced.peak_allocated_bytes / 2**30:.2f} GiB, estimate "
          f"{b.memory.peak_allocated_bytes / 2**30:.2f} GiB ({100 * report.relative_error:+.2f}%)")
