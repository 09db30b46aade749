"""What a newcomer's terminal shows (issue 19 item 1): the default plan view fits 100 columns; --wide has every
column. Plans from planner.api.plan (searches shared with tests/cli through tests/conftest.py)."""

import functools

import pytest

from planner import report
from planner.api import plan

PLANS = {
    "dense": dict(model="gpt-13b", gpus=8),
    "moe": dict(model="mixtral-8x7b", gpus=16, gpu="h100-80gb"),
    "lora": dict(model="llama2-7b", gpus=8, finetune="lora"),
    "mesh": dict(model="llama3.1-70b", gpus=1024, gpu="h100-80gb", global_batch=512),
    "nothing-fits": dict(model="gpt-175b", gpus=8),
}


@functools.cache
def planned(name: str):
    kwargs = dict(PLANS[name])
    return plan(kwargs.pop("model"), **kwargs)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_default_plan_view_fits_100_columns(name):
    text = report.plan_text(planned(name), 5)
    widths = [len(line) for line in text.splitlines()]
    assert max(widths) <= report.NARROW_WIDTH, [line for line in text.splitlines() if len(line) > 100]
    assert "tok/s/GPU" in text and "peak GiB" in text  # the figures a reader needs first are never dropped


def test_wide_view_has_every_column_and_narrow_says_what_moved():
    p = planned("dense")
    wide = report.plan_text(p, 5, wide=True)
    header = next(line for line in wide.splitlines() if line.startswith("#  "))
    assert header.split() == " ".join(report._HEADERS).split()
    assert max(len(line) for line in wide.splitlines()) > 200  # why the narrow view exists
    narrow = report.plan_text(p, 5)
    # gpt-13b on 8 A100s: every top-5 row is bf16 without offload, accumulation 1 (checked in the wide table)
    assert "every row:" in narrow and "precision bf16" in narrow and "offload no" in narrow
    for c in p.candidates[:5]:
        assert f"{c.time.tokens_per_s_per_gpu:,.0f}" in narrow
