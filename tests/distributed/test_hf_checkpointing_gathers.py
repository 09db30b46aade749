"""What planner/doctor/readers/trainers.py and the doctor's checkpointing-outside-fsdp-units finding rest on, measured
with real FSDP under torchrun (2 ranks, gloo, CPU; ~15 s on 2 busy cores): Hugging Face Trainer's own activation
checkpointing wraps each block's call from outside its FSDP unit. Reentrant, under FSDP1, the recompute runs the
unit's pre-forward hook before its pre-backward one, so each checkpointed block is all-gathered once more (the
"redundant AllGather" transformers warns of, huggingface/transformers#30404). Non-reentrant (transformers 5's
default) FSDP1 gathers at pre-backward, before the recompute, which then finds the block gathered; FSDP2 does not
reshard in a forward run inside backward (FSDPParamGroup.post_forward: `if not is_bw()`), so neither adds one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker_hf_checkpointing.py")


def test_only_reentrant_checkpointing_around_fsdp1_units_gathers_again():
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    counts = {(r["fsdp"], r["checkpointed"], r["reentrant"]): r["all_gathers"] for r in rows}
    n_blocks = rows[0]["blocks"]
    for version in (1, 2):
        plain = counts[(version, False, False)]  # the root's and each block's, forward and backward
        assert counts[(version, True, False)] == plain
        assert counts[(version, True, True)] == plain + (n_blocks if version == 1 else 0), counts
