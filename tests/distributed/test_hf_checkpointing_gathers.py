"""What planner/doctor/readers/trainers.py and the doctor's checkpointing-outside-fsdp-units finding rest on, measured
with real FSDP under torchrun (2 ranks, gloo, CPU; in the shared launch, cases.shared: 0.5 CPU s of it): Hugging
Face Trainer's own activation checkpointing wraps each block's call from outside its FSDP unit. Reentrant, under FSDP1, the recompute runs the
unit's pre-forward hook before its pre-backward one, so each checkpointed block is all-gathered once more (the
"redundant AllGather" transformers warns of, huggingface/transformers#30404). Non-reentrant (transformers 5's
default) FSDP1 gathers at pre-backward, before the recompute, which then finds the block gathered; FSDP2 does not
reshard in a forward run inside backward (FSDPParamGroup.post_forward: `if not is_bw()`), so neither adds one."""

from __future__ import annotations

import itertools

import pytest

from tests.distributed.cases import shared

pytestmark = pytest.mark.distributed

CASES = [{"fsdp": version, "checkpointed": checkpointed, "reentrant": reentrant}
         for version, checkpointed, reentrant in itertools.product((1, 2), (False, True), (False, True))
         if checkpointed or not reentrant]
launch = shared(__file__, "worker_hf_checkpointing", CASES, timeout_s=180)


def test_only_reentrant_checkpointing_around_fsdp1_units_gathers_again():
    rows = launch()
    counts = {(r["fsdp"], r["checkpointed"], r["reentrant"]): r["all_gathers"] for r in rows}
    n_blocks = rows[0]["blocks"]
    for version in (1, 2):
        plain = counts[(version, False, False)]  # the root's and each block's, forward and backward
        assert counts[(version, True, False)] == plain
        assert counts[(version, True, True)] == plain + (n_blocks if version == 1 else 0), counts
