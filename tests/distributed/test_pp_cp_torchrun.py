"""Pipeline x context parallel for real (issue 27 item 3, CP inside pipeline stages): 4 torchrun ranks (gloo, CPU) as
pp 2 x cp 2, 1F1B over 4 microbatches of 1 x 256 tokens (128 a CP rank), the 4-block tiny Llama of pp_checks.py,
fp32.

What runs is the trace tier's code path (worker_pp_sp.run_traced_path, as calibration/trace_pipeline.py runs it):
each rank's StageModules with FSDP2 over dp_shard x cp, torch's schedule inside calibration.pipeline.
stage_context_parallel (torch's context_parallel sharding the ids, the labels - shifted before, as torchtitan's -
and each stage's position ids, load-balanced; ring attention on the CPU SDPA kernel, calibration/context_parallel.py),
(1, 128, 64) tensors between stages, the loss on pre-shifted labels (calibration.pipeline.next_token_loss).

- numerics (pp_checks.check_numerics): the loss of each of 3 steps and every gradient against the unsplit model on
  the whole sequences. When written: losses 5.557849 / 5.547022 / 5.536592 on both sides within 1.2e-7, gradients
  within 9.0e-8 of gradients up to 0.012.
- memory (pp_checks.check_against_trace): every rank's peak against its pipeline rank's trace (fake tensors, the full
  world, cp coordinate 0). When written: pp rank 0 4,040,332 B real (cp rank 0) vs 4,007,564 traced (+32,768: one
  sent (1, 128, 64) fp32 stage output gloo keeps), pp rank 1 3,634,212 vs 3,626,020 (+8,192); cp rank 1 of each
  131,072 / 65,536 B below cp rank 0 (its ring steps update all its queries against half the keys; rank 0's
  update half its queries, the merge's torch.cat: the larger transients, the ones the trace and the estimate price).
- the estimate (cost_models/pipeline_memory.py, the ring's saved and working bytes per token of
  cost_models/context_parallel.py in each stage's pieces) against the trace, per pipeline rank: -0.36% / -0.33%
  when written (-4.45% / -2.14% before the ring's terms and the in-place MLP moment).

The shared 4-rank launch (cases.shared, with test_emit_pp_sp_torchrun.py's and test_torchrun_pp_dp.py's cases); its
trace (~15 s of a core) runs while the job does. The three files with -n 0 on 2 shared cores, 2026-12-07: 56.1 s wall
(57 CPU s) without this file, 64.5 s (68 CPU s) with it.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import shared
from tests.distributed.pp_checks import TIMEOUT_S, TINY, check_against_trace, check_estimate, check_numerics, \
    trace_cases

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

SEQ_LEN = 256  # 2 chunks of 64 tokens a CP rank: the ring's transients a visible share of the peak
CASE = {"hf_config": TINY, "config": {"pp": 2, "cp": 2, "precision": "fp32", "pp_schedule": "1f1b", "grad_accum": 4},
        "seq_len": SEQ_LEN}
ESTIMATE_TOLERANCE = 0.01  # the ring's terms and the stage pieces, each rank's peak

launch = shared(__file__, "worker_pp_sp", [CASE], TIMEOUT_S, nproc=4, while_launching=lambda: trace_cases([CASE], 4))


def test_pipeline_with_context_parallel_computes_the_unsplit_loss_and_gradients():
    check_numerics(launch()[0])


def test_each_rank_matches_its_pipeline_ranks_trace():
    real = launch()[0]
    assert [(r["pp_rank"], r["cp_rank"]) for r in real["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    check_against_trace(real, CASE, world=4)


def test_the_estimate_prices_each_pipeline_rank_as_traced():
    check_estimate(CASE, 4, rel=ESTIMATE_TOLERANCE)
