"""One calibration per --out folder (issue 19, item 8): `fsdp-plan calibrate` holds an flock on DIR/.lock for
the whole run. Two started at once on one folder: the second exits 2 with one line naming the folder and the
first's pid, and results.jsonl holds the first's run alone (before the lock, both ran: two host.json
probes, both runs appended). A holder killed with SIGKILL leaves the folder free: --resume takes it over.
The two started at once are given `--out runs` as in the README, from their own working directory: the probe
and the run (started with cwd at the checkout) write where the user ran from (before, the probe wrote
ROOT/runs/probe.json and the CPU measurement "failed (crash): exit code 0"); and a torn last line there (a hard
kill mid-write) is reported and dropped by --resume, which keeps the run.

The cheapest real calibration: the tiny Llama as rank 0 of an emulated 2-rank job (one process, no torchrun
but the CPU probe's one rank), one configuration, no fit: six calibrate processes (two refused at once, one
resume that runs nothing), one CPU probe, two whole runs and one killed mid-run. ~45 s of CPU for the three
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


def _start(out: Path, log: Path, *extra: str, cwd: Path = ROOT) -> subprocess.Popen:
    # a file, not a pipe nobody reads while it runs; its own session, so its group can be killed whole
    return subprocess.Popen([*ARGS, "--out", str(out), *extra], cwd=cwd, env=ENV, stdout=subprocess.DEVNULL,
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
    """Two of the same calibration started at once on one folder (`--out runs` from tmp_path), both ended:
    (folder, processes, stderrs)."""
    tmp_path = tmp_path_factory.mktemp("raced")
    out = tmp_path / "runs"
    logs = [tmp_path / "a.stderr", tmp_path / "b.stderr"]
    procs = [_start(Path("runs"), log, cwd=tmp_path) for log in logs]
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
    assert (out / "host.json").exists()  # the probe wrote under the user's cwd, as the run did
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


def test_resume_in_a_relative_out_skips_a_torn_line(raced, tmp_path):
    """A hard kill mid-write leaves a torn last line: --resume (`--out runs` from the user's cwd, here a copy of
    the raced folder) keeps the run, reports the line and drops it, and runs nothing."""
    out = tmp_path / "runs"
    shutil.copytree(raced[0], out)
    results = out / store.RESULTS_FILE
    records = store.read_records(results)
    with open(results, "a") as f:
        f.write('{"schema_version": 1, "run_id": "tor')
    again = subprocess.run([*ARGS, "--out", "runs", "--resume"], cwd=tmp_path, env=ENV, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"note: {results}:2: skipped a torn last line (36 bytes;" in again.stdout
    assert store.read_results(results) == (records, None)
