"""What a newcomer's terminal shows (issue 19 item 1): the default plan view fits 100 columns; --wide has every
column. Plans from planner.api.plan (searches shared with tests/cli through tests/conftest.py)."""

import functools

import pytest

from planner.api import plan
from planner.line_width import LINE_WIDTH
from planner.reports import table as report

PLANS = {
    "dense": dict(model="gpt-13b", gpus=8),
    "moe": dict(model="mixtral-8x7b", gpus=16, gpu="h100-80gb"),
    "lora": dict(model="llama2-7b", gpus=8, finetune="lora"),
    "mesh": dict(model="llama3.1-70b", gpus=1024, gpu="h100-80gb", global_batch=512),
    "nothing-fits": dict(model="gpt-175b", gpus=8),
    "mla": dict(model="deepseek-v3", gpus=256, gpu="h100-80gb", seq_len=4096),  # its shipped profile's line
}


@functools.cache
def planned(name: str):
    kwargs = dict(PLANS[name])
    return plan(kwargs.pop("model"), **kwargs)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_default_plan_view_fits_100_columns(name):
    text = report.plan_text(planned(name), 5)
    widths = [len(line) for line in text.splitlines()]
    assert max(widths) <= LINE_WIDTH, [line for line in text.splitlines() if len(line) > 100]
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


PLANS["cp"] = dict(model="llama3.1-8b", gpus=8, gpu="h100-96gb", seq_len=131072)


@pytest.mark.parametrize("name", ["dense", "moe", "lora", "mesh", "cp"])
def test_every_dialect_fits_100_columns(name):
    from planner.emit import ARTIFACTS, emit_artifact, recommendation_text
    from planner.errors import PlannerError

    best = planned(name).best
    emitted = {"recommendation": recommendation_text(best)}
    for kind in ARTIFACTS:
        try:
            emitted[kind] = emit_artifact(kind, best)
        except PlannerError:  # a dialect that cannot express the plan says so in one line (tests/unit/test_emit_*)
            continue
    assert len(emitted) >= 6  # fsdp2, torchtitan, torchrun, slurm, pytorchjob and the recommendation at least
    long = {kind: line for kind, text in emitted.items() for line in text.splitlines() if len(line) > 100}
    assert not long, long


def test_fold_moves_comments_and_breaks_commands():
    from planner.emit.format import fold

    code = "    x = compute(a, b)  # " + "why " * 30
    folded = fold(code).splitlines()
    assert folded[-1] == "    x = compute(a, b)" and all(line.startswith("    # ") for line in folded[:-1])
    assert " ".join(" ".join(line.split()[1:]) for line in folded[:-1]) == ("why " * 30).strip()
    command = "torchrun " + " ".join(f"--option{i} value{i}" for i in range(12)) + " train.py"
    lines = fold(command).splitlines()
    assert all(len(line) <= 100 for line in lines) and all(line.endswith(" \\") for line in lines[:-1])
    assert " ".join(line.rstrip(" \\").strip() for line in lines) == command  # the same command for the shell
    continued = "torchrun --a 1 \\\n    --b 2  # " + "note " * 25
    out = fold(continued).splitlines()
    assert out[:2] == ["torchrun --a 1 \\", "    --b 2"] and out[2].startswith("    # note")


def test_narrow_rows_never_look_alike():
    """llama3.1-405b on 1,024 H100s, global batch 512: the top rows differ only in their techniques (compile,
    Float8, async TP), the longest cells: they fold onto a second line rather than leave the table."""
    PLANS["405b"] = dict(model="llama3.1-405b", gpus=1024, gpu="h100-80gb", global_batch=512)
    p = planned("405b")
    table = report.candidates_table(p.candidates, 5)
    body = table.splitlines()[2:]
    rows, current = [], None
    for line in body:
        if line[:1].isdigit():
            current = [line]
            rows.append(current)
        elif current is not None and line.startswith(" "):
            current.append(line)
    assert len(rows) == 5
    assert len({" ".join(" ".join(r).split()[1:]) for r in rows}) == 5  # rows differ past their rank
    assert max(len(line) for line in table.splitlines()) <= 100
