"""The trace tier against real memory, family by family: today's dense and mixture-of-experts families
(tests/distributed/hf_families.py) traced on fake tensors and run for real under torchrun (2 ranks,
gloo, CPU), the same FSDP2 step on both sides (worker_families.py says what the real side runs).

Each case compares calibration.trace.trace_memory's peak_allocated_bytes at world size 2 with the real
run's peak (rank 0, the second of two steps, the trace's measuring loop and foreach adjustment). When this
was written every case agreed to the byte (bf16 at 128 tokens: 1,967,572 bytes for starcoder2 ...
4,777,708 for gpt_oss; fp32, every other block checkpointed, 2 x 64 tokens: 2,853,180 for qwen3_moe,
5,253,804 for gpt_oss). The tolerance, 1%, is what the issue aims for; what it guards against, measured
on the same cases at 128 tokens: tracing without the trace tier's packed-sequence answer
(calibration.trace._real_run_masking) puts the SDPA families 1.7-4.3% above their real runs, the
materialised s x s mask of every layer.

The cases run in the shared 2-rank torchrun launch (cases.shared; ~14 CPU s of it, both ranks, measured
2026-12-06), then one trace per case (~2 s each).
"""

from __future__ import annotations

import functools

import pytest

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")

from tests.distributed.cases import shared  # noqa: E402
from tests.distributed.hf_families import FAMILIES, MOE  # noqa: E402

TIMEOUT_S = 300
TOLERANCE = 0.01

# Every family in bf16 mixed precision (the GPU default), 128 tokens: the s x s masks a wrong mask choice
# would add are then a few percent of the peak. Then fp32 with every other block checkpointed and two
# sequences per micro-batch for two mixture-of-experts families (fp32 runs the experts' grouped_mm outside
# its bf16-only meta function, see calibration.trace._grouped_mm_shapes_any_dtype).
CASES = [{"family": name, "config": {"precision": "bf16"}, "seq_len": 128} for name in FAMILIES] + [
    {"family": name, "config": {"precision": "fp32", "activation_checkpointing": "every-2", "micro_batch": 2},
     "seq_len": 64} for name in ("qwen3_moe", "gpt_oss")]
EAGER_ONLY = {"gemma2", "gpt_oss"}  # transformers' _supports_sdpa = False


def _id(case: dict) -> str:
    return "-".join([case["family"], *(str(v) for v in case["config"].values()), str(case["seq_len"])])


_real_runs = shared(__file__, "worker_families", CASES, TIMEOUT_S,
                    while_launching=lambda: [trace_case(i) for i in range(len(CASES))])


def real_runs() -> tuple[dict, ...]:
    results = _real_runs()
    assert [r["family"] for r in results] == [c["family"] for c in CASES]
    return results


@functools.cache  # traced while the shared launch runs (cases.shared's while_launching)
def trace_case(index: int):
    from calibration.build import build_model
    from calibration.trace import trace_memory
    from planner.models import from_module
    from tests.distributed.worker_train import config_from_dict

    case = CASES[index]
    hf_config = FAMILIES[case["family"]]
    config = config_from_dict(case["config"])
    spec = from_module(build_model(None, hf_config, attention=config.attention.value, device="meta"),
                       name=case["family"])
    return trace_memory(spec, config, n_gpus=2, gpus_per_node=2, seq_len=case["seq_len"], hf_config=hf_config)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_id(c) for c in CASES])
def test_trace_peak_matches_the_real_run(index):
    case = CASES[index]
    real = real_runs()[index]
    traced = trace_case(index)
    family = case["family"]
    # built as a GPU run builds it: eager where SDPA is refused, grouped_mm experts for MoE layers
    assert real["attention"] == traced.attention == ("eager" if family in EAGER_ONLY else "sdpa")
    assert real["experts"] == traced.experts == ("grouped_mm" if family in MOE else None)
    measured = real["peak_allocated_bytes"]
    relative = traced.peak_allocated_bytes / measured - 1
    assert abs(relative) <= TOLERANCE, (
        f"{family}: trace {traced.peak_allocated_bytes:,} vs real {measured:,} bytes ({100 * relative:+.2f}%); "
        f"trace {traced.peak_phase} {traced.breakdown}; real {real['peak_phase']} "
        f"{real['phases'][max(real['phases'], key=lambda k: real['phases'][k]['peak_allocated_bytes'])]['breakdown']}")
    # the model states are counted, not timed: the same to the byte
    for key in ("sharded_params", "sharded_grads", "optimizer_state"):
        assert traced.phases["optimizer_step"].breakdown[key] == real["phases"]["optimizer_step"]["breakdown"][key], key
