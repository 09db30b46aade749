"""A hard kill of `fsdp-plan calibrate` itself (SIGKILL, no chance to clean up) in the middle of a
calibration, then `--resume` (issue 11, edges): nothing measured is lost, the runs recorded before the
kill are not measured again, no rank of the run in flight outlives the kill, and a torn last line of
results.jsonl (the kill landing mid-write) is reported and skipped.

Two candidates of the tiny Llama on 2 gloo ranks, 2 + 1 steps each; the kill lands while run 2's torchrun
job is up. Before calibration.launch asked the kernel for a death signal, that job (its own session, so not in
calibrate's process group) outlived the kill and finished its run unrecorded beside the resume. The CPU is not
probed (DIR/host.json written first, as test_calibrate_mesh.py does; the probe is tested by test_calibrate.py):
three torchrun jobs, run 1, run 2 killed and run 2 again, ~40 CPU s (each job costs ~8 CPU s of start-up and
`import torch`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from calibration import store
from tests.distributed.test_calibrate_mesh import host_probe

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["calibrate", "--factory", "tests.distributed.calib_models:small_llama", "--gpus", "2", "--device", "cpu",
        "--seq-len", "128", "--global-batch", "8", "--steps", "2", "--warmup", "1", "--timeout", "120",
        "--top", "2"]
TORN = b'{"schema_version": 1, "run_id": "kil'


def _pids_of(marker: str) -> list[int]:
    """Processes whose command line names `marker` (this test's --out): torchrun and its ranks."""
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found if int(p) != os.getpid()]


def _survivors(marker: str, wait_s: float) -> list[str]:
    """What is still running under `marker` after `wait_s` seconds (their command lines)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = _pids_of(marker)
        if not pids or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    lines = []
    for pid in pids:
        try:
            lines.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return lines


def _kill_pids(marker: str) -> None:
    for pid in _pids_of(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _records(path: Path) -> list[store.RunRecord]:
    return store.read_results(path)[0]  # a missing file: []


def test_sigkill_mid_calibration_then_resume_loses_nothing_and_skips_the_torn_line(tmp_path):
    out = tmp_path / "calib"
    out.mkdir()
    (out / "host.json").write_text(json.dumps(host_probe()))
    results = out / store.RESULTS_FILE
    jobs = str(out / "jobs")  # every torchrun job's (and rank's) command line names its job file there
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "planner.cli", *ARGS, "--out", str(out)]
    first_log = tmp_path / "first.stderr"  # a file, not a pipe nobody reads while it runs
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(first_log, "wb"),
                            start_new_session=True)
    try:
        # until run 1 is in results.jsonl and run 2's torchrun job is up
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            recorded = _records(results)
            if recorded and len(recorded) < 2 and _pids_of(jobs):
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"calibrate ended before the kill:\n{first_log.read_text()[-3000:]}"
        assert _pids_of(jobs), "no run in flight at the kill"
        time.sleep(1.0)  # let the ranks start, so the kill finds a whole torchrun tree
        os.kill(proc.pid, signal.SIGKILL)  # calibrate itself: no handler, no finally block runs
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # and its process group, as a terminal's kill would
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        # the run in flight dies with it: no torchrun agent or rank keeps computing on its own (and
        # finishing the run: a result file nobody will record)
        at_kill = _survivors(jobs, wait_s=0)
        left = _survivors(jobs, wait_s=15)
        assert not left, "torchrun processes outlived the SIGKILL of calibrate:\n" + "\n".join(left)
        finished = sorted(p.parent.name for p in (out / "runs").glob("*/result.json"))
        assert len(finished) == len(_records(results)), (finished, at_kill)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_pids(jobs)

    before_bytes = results.read_bytes()
    before, torn = store.read_results(results)
    assert torn is None and len(before) == 1, first_log.read_text()[-3000:]
    assert all(r.measured is not None for r in before), [r.error for r in before]
    # the kill landing mid-write of the next record: a partial JSON line with no newline
    with open(results, "ab") as f:
        f.write(TORN)

    t0 = time.monotonic()
    resumed = subprocess.run([*cmd, "--resume", "--format", "json"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=400, start_new_session=True)
    wall = time.monotonic() - t0
    assert resumed.returncode == 0, f"exit {resumed.returncode}\n{resumed.stderr[-5000:]}"
    report = json.loads(resumed.stdout)
    # a real calibration's JSON report is what its schema says (fsdp-plan schema calibrate)
    jsonschema = pytest.importorskip("jsonschema")
    from planner.schemas import json_schema
    jsonschema.Draft202012Validator(json_schema("calibrate")).validate(report)
    before_ids = [r.run_id for r in before]
    # nothing measured is lost and nothing measured is measured again
    assert report["skipped_runs"] == before_ids
    assert len(report["new_runs"]) == 2 - len(before) and not set(report["new_runs"]) & set(before_ids)
    assert f"--resume: {len(before)} run(s) already in {results}, skipped" in resumed.stderr
    assert f"run {2 - len(before)}/{2 - len(before)}" in resumed.stderr and "run 2/" not in resumed.stderr
    # the torn fragment is reported (stderr as it happens, and in the report) and gone from the file
    note = f"{results}:{len(before) + 1}: skipped a torn last line ({len(TORN)} bytes;"
    assert note in resumed.stderr and any(note in n for n in report["notes"]), report["notes"]
    data = results.read_bytes()
    assert data.startswith(before_bytes) and TORN not in data and data.endswith(b"\n")
    after, torn = store.read_results(results)
    assert torn is None
    assert after[:len(before)] == before  # the same records, the same values
    assert [r.run_id for r in after] == before_ids + report["new_runs"]
    assert len({r.run_id for r in after}) == 2 and all(r.measured is not None for r in after)
    # the fit saw every measured run, the ones from before the kill included
    profile = json.loads((out / store.PROFILE_FILE).read_text())
    assert profile["fit"]["n_runs"] == 2 and profile["runs"] == [r.run_id for r in after]
    assert not _pids_of(jobs)
    print(f"killed after {len(before)} run(s); resume measured {len(report['new_runs'])} in {wall:.0f} s")
