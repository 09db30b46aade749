"""The pipeline estimate's replay against the trace's at Llama 3.1 405B's widths (issue 27: the 405B rows' gap).

    python benchmarks/pipeline_replay_wide.py       # 3 traces on fake tensors, ~10 s of CPU each

benchmarks/pipeline_replay.py checks the estimate's allocations (cost_models/pipeline_allocations.py) on a model
of width 2048; the 405B rows of benchmarks/frontier_accuracy.py run at h 16,384, MLP 53,248, 128 / 8 heads,
vocabulary 128,256, 4 x 8,192 tokens a microbatch. Fake tensors cost nothing, so this traces those widths for real:
a middle pipeline stage (rank 1 of pp 4; 2 blocks a stage, 8 microbatches, 1F1B, full checkpointing, bf16, FSDP 2)
without TP and with TP 8 (sequence parallel), and the first stage (rank 0, the embedding's) with TP 8 (its gradient
the whole table: cost_models/tensor_parallel.embedding_grad_extra_params), the trace tier's allocations
(calibration.trace_pipeline, eager torch: no compile, no Float8, no async TP) and the estimate's, each replayed through
cost_models/caching_allocator.py; GiB, without the memory outside the allocator.
"""

from __future__ import annotations

from cost_models.caching_allocator import AllocatorSettings, replay
from cost_models.pipeline_allocations import replay_rank
from cost_models.pipeline_memory import rank_inputs
from cost_models.specs import FsdpConfig
from cost_models.units import GiB
from planner.api import resolve_inputs

ARCH = {"model_type": "llama", "_name_or_path": "llama-405b-widths", "hidden_size": 16384,
        "intermediate_size": 53248, "num_hidden_layers": 8, "num_attention_heads": 128, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192}
SEQ_LEN, PP, FSDP = 8192, 4, 2
CASES = ((1, 1), (8, 1), (8, 0))  # (tp, pipeline rank)
SETTINGS = {"expandable": AllocatorSettings(expandable_segments=True), "defaults": AllocatorSettings()}


def main() -> None:
    from calibration.trace_pipeline import trace_pipeline

    print(f"{'tp':>3} {'rank':>4} {'settings':10} {'trace alloc':>11} {'trace res':>9} {'est alloc':>9} {'est res':>8} "
          f"{'alloc err':>9} {'res err':>8}")
    for tp, rank in CASES:
        gpus = PP * tp * FSDP
        spec, _, training = resolve_inputs(dict(ARCH), gpus, gpus_per_node=8, seq_len=SEQ_LEN)
        config = FsdpConfig(precision="bf16", ac_every=1, micro_batch=4, grad_accum=8, pp=PP, tp=tp,
                            pp_schedule="1f1b")
        traced = trace_pipeline(spec, config, n_gpus=gpus, gpus_per_node=8, seq_len=SEQ_LEN, hf_config=dict(ARCH),
                                ranks=(rank,))[0]
        local, local_training = rank_inputs(spec, training, config)
        for name, settings in SETTINGS.items():
            tr = replay(traced.allocation_events, settings, snapshots=False)
            est = replay_rank(local, local_training, config, FSDP, rank, settings)
            print(f"{tp:3} {rank:4} {name:10} {tr.peak_allocated_bytes / GiB:11.2f} "
                  f"{tr.peak_reserved_bytes / GiB:9.2f} {est.peak_allocated_bytes / GiB:9.2f} {est.peak_reserved_bytes / GiB:8.2f} "
                  f"{100 * (est.peak_allocated_bytes / tr.peak_allocated_bytes - 1):+8.1f}% "
                  f"{100 * (est.peak_reserved_bytes / tr.peak_reserved_bytes - 1):+7.1f}%")


if __name__ == "__main__":
    from calibration.hash_seed import pin_hash_seed

    pin_hash_seed()  # the traced allocation order follows the hash seed (calibration/hash_seed.py)
    main()
