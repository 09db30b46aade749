"""One calibration per --out folder (issue 19, item 8): `fsdp-plan calibrate` holds an flock on DIR/.lock for
the whole run. Two started at once on one folder: the second exits 2 with one line naming the folder and the
first's pid, and results.jsonl holds the first's run alone (before the lock, both ran: two host.json
probes, both runs appended). A holder killed with SIGKILL leaves the folder free: --resume takes it over.

The cheapest real calibration: the tiny Llama as rank 0 of an emulated 2-rank job (one process, no torchrun),
one configuration, no fit (as tests/cli/test_calibrate_cli.py's relative --out run): five calibrate
processes (two refused at once), one CPU probe, two whole runs and one killed mid-run. 36 s of CPU for both
tests (140 s wall on the 2 cores at load 8)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from calibration import lock, store

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
ARGS = [sys.executable, "-m", "planner.cli", "calibrate", "--factory", "tests.distributed.calib_models:small_llama",
        "--gpus", "1", "--emulate-world-size", "2", "--device", "cpu", "--seq-len", "128", "--global-batch", "4",
        "--steps", "2", "--warmup", "1", "--timeout", "120", "--sharding", "FULL_SHARD", "--no-fit"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _start(out: Path, log: Path, *extra: str) -> subprocess.Popen:
    # a file, not a pipe nobody reads while it runs; its own session, so its group can be killed whole
    return subprocess.Popen([*ARGS, "--out", str(out), *extra], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"), start_new_session=True)


def _busy_line(out: Path, pid: int) -> str:
    return (f"error: out: {out} is in use by another calibration (pid {pid} on {socket.gethostname()} since ")


def _holder_pid(out: Path) -> int | None:
    try:
        return json.loads((out / lock.LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="session")  # once per run: xdist may interleave modules, which re-ran module fixtures
def raced(tmp_path_factory):
    """Two of the same calibration started at once on one folder, both ended: (folder, processes, stderrs)."""
    tmp_path = tmp_path_factory.mktemp("raced")
    out = tmp_path / "runs"
    logs = [tmp_path / "a.stderr", tmp_path / "b.stderr"]
    procs = [_start(out, logs[0]), _start(out, logs[1])]
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return out, procs, [log.read_text() for log in logs]


def test_two_calibrations_at_once_on_one_folder_the_second_exits_2(raced):
    out, procs, errs = raced
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], (codes, [e[-2000:] for e in errs])
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    line = errs[loser].strip()
    assert "\n" not in line and line.startswith(_busy_line(out, procs[winner].pid)), errs[loser]
    assert line.endswith(f", lock {out}/.lock): wait for it to end, or choose another --out")
    # results.jsonl: the winner's one run, once; one probe of the CPU, one run folder
    records = store.read_records(out / store.RESULTS_FILE)
    assert len(records) == 1 and records[0].error is None and records[0].measured.step_s > 0
    assert [p.name for p in (out / "runs").iterdir()] == [records[0].run_id]
    assert errs[winner].count("measuring the CPU") == 1 and "measuring the CPU" not in errs[loser]
    assert _holder_pid(out) == procs[winner].pid  # the file stays; its flock went with the process


def test_a_killed_holders_folder_is_free_and_resume_takes_it_over(raced, tmp_path):
    out = tmp_path / "runs"
    out.mkdir()
    shutil.copy(raced[0] / "host.json", out / "host.json")  # the same CPU: no second probe of it
    # the run hangs at its second step (an injected fault of rank 0): the holder is alive mid-run
    holder = _start(out, tmp_path / "holder.stderr", "--fault", "0:0:hang:1")
    try:
        deadline = time.monotonic() + 240
        while holder.poll() is None and time.monotonic() < deadline and not any(
                "injected fault 'hang'" in p.read_text(errors="replace") for p in out.glob("runs/*/log.txt")):
            time.sleep(0.5)
        assert holder.poll() is None, (tmp_path / "holder.stderr").read_text()[-2000:]
        assert _holder_pid(out) == holder.pid
        # while it holds the folder, --resume is refused like any other calibration
        refused = subprocess.run([*ARGS, "--out", str(out), "--resume"], cwd=ROOT, env=ENV, capture_output=True,
                                 text=True, timeout=120)
        assert refused.returncode == 2 and refused.stderr.startswith(_busy_line(out, holder.pid)), refused.stderr
        os.killpg(holder.pid, signal.SIGKILL)  # no handler, no finally block: only the kernel releases the lock
        assert holder.wait(timeout=30) == -signal.SIGKILL
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
    assert not (out / store.RESULTS_FILE).exists() or not store.read_records(out / store.RESULTS_FILE)
    resumed = subprocess.Popen([*ARGS, "--out", str(out), "--resume"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert _holder_pid(out) == resumed.pid
    records = store.read_records(out / store.RESULTS_FILE)
    assert len(records) == 1 and records[0].error is None and records[0].measured.step_s > 0
