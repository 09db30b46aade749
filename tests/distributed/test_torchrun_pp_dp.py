"""Pipeline parallelism beside FSDP for real: pp 2 x dp_shard 2 on 4 torchrun ranks (gloo, CPU), GPipe and 1F1B,
each stage fully_shard-ed over its 2 data-parallel ranks; every rank against its pipeline rank's trace and the
loss and gradients against the unsplit model on both data-parallel ranks' sequences (worker_pp.py; the
tolerances and why: test_torchrun_pp.py). When this was written all four ranks equalled the trace to the byte
in both schedules (2,205,324 B on the first stage's ranks; 2,534,696 / 2,245,404 B on the last's, GPipe /
1F1B), losses within 8e-7, gradients within 1.3e-8. The same launch runs `--emit fsdp2`'s snippet for pp 2 x
tp 2 (TP inside each stage) for two steps against the unsplit model.

The shared 4-rank torchrun launch (cases.shared, with test_emit_pp_sp_torchrun.py's cases; about 55 s of it on 2
shared cores), then one ~10 s trace per case.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import shared
from tests.distributed.pp_checks import TIMEOUT_S, cases, check_against_trace, check_numerics, trace_cases

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

CASES = cases(grad_accum=2)  # 2 microbatches per data-parallel rank
# --emit fsdp2's snippet for pp 2 x tp 2 (transformers' TP plan inside each stage, no sequence parallel), GPipe
EMITTED = {**CASES[0], "emitted": {**CASES[0]["config"], "tp": 2, "sequence_parallel": False}}


launch = shared(__file__, "worker_pp", CASES + [EMITTED], TIMEOUT_S, nproc=4,
                while_launching=lambda: trace_cases(CASES, 4))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["config"]["pp_schedule"] for c in CASES])
def test_each_rank_matches_its_stage_trace(index):
    real = launch()[index]
    assert [(r["pp_rank"], r["dp_rank"]) for r in real["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    check_against_trace(real, CASES[index], world=4)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["config"]["pp_schedule"] for c in CASES])
def test_pipeline_with_fsdp_computes_the_unpipelined_loss_and_gradients(index):
    check_numerics(launch()[index])


def test_emitted_pipeline_with_tensor_parallel_stages_trains_like_the_unsplit_model():
    """The snippet's Stage modules with the block TP plan and the head's gathered logits on the last stage, FSDP2
    over dp_shard 1, ScheduleGPipe, on 4 gloo ranks (pp 2 x tp 2): two AdamW steps, each loss equal to the unsplit
    model's to 1e-5 (when written: 5.556800 / 5.530651 on both sides, within 5e-7)."""
    result = launch()[len(CASES)]
    assert result["schedule"] == "ScheduleGPipe" and result["max_line"] <= 100
    assert result["losses"] == pytest.approx(result["reference_losses"], abs=1e-5)
    assert result["losses"][1] < result["losses"][0]
