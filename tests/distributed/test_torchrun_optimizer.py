"""The optimizer step of each implementation, for real: a 2-rank gloo FSDP2 run of calibration.reference's Llama
(worker_optimizer.py) steps torch.optim.AdamW foreach=True, fused=True (torch 2.13's CPU kernel) and foreach=False,
measured by calibration.memtrack; against it, the estimate's optimizer-step phase (cost_models/optimizer_step.py) and
the trace tier's (a foreach=False step on fake tensors, its temporaries swapped for the implementation's:
calibration/trace_optimizer.step_window).

When this was written (fp32, 2 x 1,024 x 256 vocabulary, 2 blocks of 256 / 512, 32 tokens), per rank: the real
step windows 16,397,140 (foreach), 13,117,780 (fused), 14,166,868 B (for-loop); the temporaries 3,279,360 B (one
fp32 copy of the 819,840-parameter shard), 0 and 1,049,088 B (the final norm's quotient, 512 B, beside two copies
of the head's shard). The trace matched each window to the byte; the estimate each temporaries figure to the byte
and each window within 340 B (Adam's 21 fp32 step counters and the token ids, which it leaves out). bf16-pure
halves each figure (measured as well: 1,639,680 / 0 / 524,544 B). The tolerance, 0.1% of the window, is far below
what a wrong implementation would move it: the foreach copy is 25% of the fused window, the for-loop's 8%.

The cases run in the shared 2-rank torchrun launch (cases.shared; ~4 CPU s of it, both ranks, measured 2026-12-06),
then three traces (~3 s each).
"""

from __future__ import annotations

import functools

import pytest

from cost_models.specs import FsdpConfig, TrainingSpec
from tests.distributed.cases import shared
from tests.distributed.worker_optimizer import spec

pytestmark = pytest.mark.distributed

IMPLS = ("foreach", "fused", "for-loop")
CONFIG = {"precision": "fp32"}
SEQ_LEN = 32
TOLERANCE = 0.001


launch = shared(__file__, "worker_optimizer", [{"impl": impl, "config": CONFIG, "seq_len": SEQ_LEN} for impl in IMPLS],
                timeout_s=300, while_launching=lambda: [traced(impl) for impl in IMPLS])


def real() -> dict:
    return {r["impl"]: r for r in launch()}


def estimated(impl: str):
    from cost_models.memory import estimate_memory
    from cost_models.profile import Profile
    from planner.hardware import make_cluster

    memory = estimate_memory(spec(), make_cluster(2), TrainingSpec(seq_len=SEQ_LEN, optimizer_impl=impl),
                             FsdpConfig(**CONFIG), Profile())
    return memory.phases["optimizer_step"]


@pytest.mark.parametrize("impl", IMPLS)
def test_the_real_step_runs_the_implementation_and_the_estimate_prices_it(impl):
    run = real()[impl]
    assert run["runs"] == impl  # the optimizer torch built steps with it
    window, step = run["optimizer_step"], estimated(impl)
    assert window["breakdown"]["optimizer_temporaries"] == step.optimizer_temporaries
    assert step.optimizer_temporaries == {"foreach": 3_279_360, "fused": 0, "for-loop": 1_049_088}[impl]
    assert step.total_bytes == pytest.approx(window["peak_allocated_bytes"], rel=TOLERANCE)


@functools.cache  # traced while the shared launch runs (cases.shared's while_launching)
def traced(impl: str):
    from calibration.trace import trace_memory

    return trace_memory(spec(), FsdpConfig(**CONFIG), n_gpus=2, gpus_per_node=2, seq_len=SEQ_LEN,
                        optimizer_impl=impl).phases["optimizer_step"]


@pytest.mark.parametrize("impl", IMPLS)
def test_the_trace_gives_each_implementations_step_window(impl):
    window = real()[impl]["optimizer_step"]
    step = traced(impl)
    assert step.peak_allocated_bytes == pytest.approx(window["peak_allocated_bytes"], rel=TOLERANCE)
    assert step.breakdown["optimizer_temporaries"] == window["breakdown"]["optimizer_temporaries"]
