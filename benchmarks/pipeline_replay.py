"""A pipeline estimate's reserved memory from its own allocation order against the trace's (issue 27 item 1).

    python benchmarks/pipeline_replay.py            # traces 3 configs x 2 pipeline ranks: ~1 min each on 2 cores

For each pipeline rank of each config: the trace tier's allocations (calibration.trace_pipeline, recorded by
calibration/alloc_sequence.py) and the estimate's (cost_models/pipeline_allocations.py), each replayed through
cost_models/caching_allocator.py under PyTorch's default settings and under expandable_segments:True: peak
allocated and reserved (MiB, no CUDA context) and the estimate's error on reserved. The model is an 8-block Llama
wide enough for its tensors to live in the large pool as a full-size model's do (h 2048, MLP 7168, 2,048 tokens:
8 MiB residual-stream tensors, 28 MiB MLP activations), pp 2 x FSDP 2 on 4 fake ranks, 4 microbatches of 1, bf16.
"""

from __future__ import annotations

from cost_models.caching_allocator import AllocatorSettings, replay
from cost_models.pipeline_allocations import replay_rank
from cost_models.specs import FsdpConfig
from cost_models.units import MiB
from planner.api import resolve_inputs

ARCH = {"model_type": "llama", "_name_or_path": "llama-8w", "hidden_size": 2048, "intermediate_size": 7168,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 16000,
        "max_position_embeddings": 2048}
GPUS, SEQ_LEN = 4, 2048
# (schedule, stages per rank, checkpoint every k blocks: 1 = full, 0 = none)
CONFIGS = [("1f1b", 0, 1), ("interleaved-1f1b", 2, 1), ("1f1b", 0, 0)]
SETTINGS = {"defaults": AllocatorSettings(), "expandable": AllocatorSettings(expandable_segments=True)}


def main() -> None:
    from calibration.trace_pipeline import trace_pipeline

    spec, _, training = resolve_inputs(dict(ARCH), GPUS, gpus_per_node=GPUS, seq_len=SEQ_LEN)
    print(f"{'schedule':18} {'AC':4} {'rank':4} {'settings':10} {'trace alloc':>11} {'trace res':>9} "
          f"{'est alloc':>9} {'est res':>8} {'error':>7}")
    for schedule, v, ac in CONFIGS:
        config = FsdpConfig(precision="bf16", ac_every=ac, micro_batch=1, grad_accum=4, pp=2, pp_schedule=schedule,
                            pp_stages_per_rank=v)
        traced = trace_pipeline(spec, config, n_gpus=GPUS, gpus_per_node=GPUS, seq_len=SEQ_LEN, hf_config=dict(ARCH))
        for rank, t in enumerate(traced):
            for name, settings in SETTINGS.items():
                tr = replay(t.allocation_events, settings, snapshots=False)
                est = replay_rank(spec, training, config, GPUS // 2, rank, settings)
                print(f"{schedule:18} {'full' if ac else 'none':4} {rank:4} {name:10} "
                      f"{tr.peak_allocated_bytes / MiB:11.0f} {tr.peak_reserved_bytes / MiB:9.0f} "
                      f"{est.peak_allocated_bytes / MiB:9.0f} {est.peak_reserved_bytes / MiB:8.0f} "
                      f"{100 * (est.peak_reserved_bytes / tr.peak_reserved_bytes - 1):+6.1f}%")


if __name__ == "__main__":
    from calibration.hash_seed import pin_hash_seed

    pin_hash_seed()  # the traced allocation order follows the hash seed (calibration/hash_seed.py)
    main()
