"""Pipeline parallelism for real: a tiny transformers Llama cut into 2 stages, GPipe and 1F1B, FSDP2 on each
stage, two AdamW steps under torchrun (2 ranks, gloo, CPU: pp 2 x dp 1), against the trace tier per stage
(calibration/trace_pipeline.py: the same split, schedule and measuring loop on fake tensors) and against the same
model unpipelined (worker_pp.py says what runs on each side). test_torchrun_pp_dp.py runs pp 2 x dp_shard 2 on 4.

Memory: when this was written GPipe agreed with the trace to the byte on both ranks (3,950,732 and 4,576,968 B),
1F1B on the last stage (2,952,868 B); 1F1B's first stage read 3,126,412 B against the trace's 3,110,028 (+16,384,
under every PYTHONHASHSEED tried), one microbatch's stage output (1 x 64 x 64 fp32) that gloo keeps alive after
its send has completed, until the next send to that peer (a 2-rank check: the last tensor isend-ed through gloo
stays referenced after wait() and after its Work is dropped, the previous ones do not; the fake group keeps
none). NCCL, which the trace models, frees it once the send is waited on. The bound: the real peak is the
trace's plus at most one sent activation, within the real runs' jitter (64 KiB by hash seed, test_torchrun_ep).

Numerics: the pipeline's loss (the last stage's microbatch losses, each divided by the microbatches as the
schedule runs with scale_grads=False) equals the unsplit model's on the same batch at each of 3 steps to 1e-5,
and every gradient after 2 AdamW steps to 1e-6 (when written: losses within 6e-7, gradients within 1.4e-8 of
gradients up to 0.041).

And `--emit fsdp2`'s pipeline snippet, exec-ed on the same 2 ranks, trains two steps like the unsplit model.

The three cases run in the shared 2-rank torchrun launch (cases.shared; about 45 s of it on 2 shared cores), then
one ~5-10 s trace per case.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import shared
from tests.distributed.pp_checks import TIMEOUT_S, cases, check_against_trace, check_numerics, trace_cases

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

CASES = cases(grad_accum=4)  # 4 microbatches of 1 x 64 tokens: 1F1B reaches its steady state on 2 stages
# --emit fsdp2's own code for 1F1B with every block checkpointed, trained by its build_pipeline / pipeline_step
EMITTED = {**CASES[1], "emitted": {**CASES[1]["config"], "activation_checkpointing": "full"}}


launch = shared(__file__, "worker_pp", CASES + [EMITTED], TIMEOUT_S, while_launching=lambda: trace_cases(CASES, 2))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["config"]["pp_schedule"] for c in CASES])
def test_each_stage_matches_its_trace(index):
    real = launch()[index]
    assert [(r["pp_rank"], r["stages"]) for r in real["ranks"]] == [(0, [0]), (1, [1])]
    check_against_trace(real, CASES[index], world=2)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["config"]["pp_schedule"] for c in CASES])
def test_pipeline_computes_the_unpipelined_loss_and_gradients(index):
    check_numerics(launch()[index])


def test_emitted_pipeline_snippet_trains_like_the_unsplit_model():
    """The snippet (Stage modules, FSDP2 per stage, PipelineStage with static shapes, Schedule1F1B) exec-ed on the
    2 ranks: two AdamW steps, the loss of each equal to the unsplit model's on the same batch to 1e-5 (when
    written: 5.545745 / 5.524334 on both sides, within 1e-6), every line at most 100 columns."""
    result = launch()[len(CASES)]
    assert result["schedule"] == "Schedule1F1B" and result["max_line"] <= 100
    assert result["losses"] == pytest.approx(result["reference_losses"], abs=1e-5)
    assert result["losses"][1] < result["losses"][0]
