"""calibration/launch.py: every way a run can end becomes an outcome; hung runs lose their whole process group."""

import json
import sys
import time

import pytest

from calibration import launch


def job(tmp_path, code: str, timeout_s: float = 30):
    argv = [sys.executable, "-c", code]
    return launch.run_job(argv, timeout_s=timeout_s, result_path=tmp_path / "result.json",
                          error_dir=tmp_path / "errors", log_path=tmp_path / "log.txt")


def test_result_file_and_exit_0_is_ok(tmp_path):
    out = job(tmp_path, f"import json; json.dump({{'measured': 1}}, open({str(tmp_path / 'result.json')!r}, 'w'))")
    assert out.status == "ok" and out.result == {"measured": 1} and out.returncode == 0


def test_rank_error_files_name_the_cause(tmp_path):
    errors = tmp_path / "errors"
    code = (f"import json, os; os.makedirs({str(errors)!r}, exist_ok=True)\n"
            f"json.dump({{'kind': 'crash', 'rank': 0, 'message': 'Connection closed by peer'}}, "
            f"open({str(errors / 'rank0.json')!r}, 'w'))\n"
            f"json.dump({{'kind': 'oom', 'rank': 1, 'message': 'CUDA out of memory. Tried to allocate 2 GiB'}}, "
            f"open({str(errors / 'rank1.json')!r}, 'w'))\n"
            "raise SystemExit(1)")
    out = job(tmp_path, code)
    assert (out.status, out.rank) == ("oom", 1) and "Tried to allocate" in out.message


def test_rank_that_dies_silently_is_named_from_torchruns_summary(tmp_path):
    """Rank 1 exits without a Python error; rank 0 reports only that its peer left (as gloo does), and
    torchrun's "Root Cause" names rank 0 (a race when both die within the same second, seen in CI runs)."""
    errors = tmp_path / "errors"
    summary = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
               "Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 3 (pid: 7)\n"
               "Root Cause (first observed failure):\n[0]:\n  host      : h\n  rank      : 0 (local_rank: 0)\n"
               "  exitcode  : 1 (pid: 8)\n")
    code = (f"import json, os; os.makedirs({str(errors)!r}, exist_ok=True)\n"
            f"json.dump({{'kind': 'crash', 'rank': 0, 'message': 'RuntimeError: Read error: Connection reset by peer'}}, "
            f"open({str(errors / 'rank0.json')!r}, 'w'))\n"
            f"print({summary!r}); raise SystemExit(1)")
    out = job(tmp_path, code)
    assert out.status == "crash" and out.rank == 1
    assert out.message.startswith("rank 1 died (exit code 3 (pid: 7)) without a Python error")


def test_ranks_torchrun_terminated_are_not_the_cause(tmp_path):
    """Rank 1 exits; torchrun SIGTERMs rank 0 before it can write an error file."""
    summary = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
               "Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 8)  (SIGTERM)\n"
               "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
               "  exitcode  : 3 (pid: 7)\n")
    out = job(tmp_path, f"print({summary!r}); raise SystemExit(1)")
    assert out.status == "crash" and out.rank == 1 and "exit code 3" in out.message


def test_stale_files_from_an_earlier_attempt_are_ignored(tmp_path):
    (tmp_path / "result.json").write_text(json.dumps({"old": True}))
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank0.json").write_text(json.dumps({"kind": "oom", "rank": 0, "message": "old"}))
    out = job(tmp_path, "raise SystemExit(2)")
    assert out.status == "crash" and out.returncode == 2 and "old" not in out.message


def test_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # the job starts a grandchild that would outlive a plain kill of the job's own process
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(600)")
    t0 = time.monotonic()
    out = job(tmp_path, code, timeout_s=3)
    assert out.status == "timeout" and "process group killed" in out.message
    assert time.monotonic() - t0 < 3 + 2 * launch.KILL_GRACE_S
    time.sleep(0.2)
    assert not _alive(int(pid_file.read_text()))


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent that may never reap it (PID 1 here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_torchrun_command_lines():
    single = launch.Launch(nproc_per_node=8)
    assert single.torchrun_args()[-3:] == ["--nproc-per-node", "8", "--standalone"]
    multi = launch.Launch(nproc_per_node=8, nnodes=2, rendezvous=launch.Rendezvous.parse("node0:29500"))
    args = multi.torchrun_args(node_rank=1)
    assert args[args.index("--node-rank") + 1] == "1" and args[args.index("--master-addr") + 1] == "node0"
    assert launch.runner_command(None, "j.json")[1:] == ["-m", "calibration.runner", "--job", "j.json"]
    with pytest.raises(ValueError, match="HOST:PORT"):
        launch.Rendezvous.parse("node0")


def test_exposed_communication_is_comm_time_without_compute():
    from calibration.exposed_comm import exposed_time, union_length

    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    # comm 0-4 and 6-8, compute 1-2 and 3-7: exposed 0-1, 2-3, 7-8
    assert exposed_time([(0, 4), (6, 8)], [(1, 2), (3, 7)]) == 3
    assert exposed_time([(0, 1)], []) == 1 and exposed_time([], [(0, 1)]) == 0


def test_calibration_progress_draws_no_bar_when_piped():
    """Piped or captured stderr (CI, `2> log`): no bar and no time-left line, only each finished run's outcome,
    named; on a terminal the bar ticks while the run runs and the same line stays when it ends."""
    import io

    from planner.calibrating.progress import Progress

    piped = io.StringIO()
    progress = Progress(2, piped)
    progress.start("FULL_SHARD bf16 mb 2", expected_s=5.0)
    assert piped.getvalue() == ""
    progress.end("ok: step 0.123 s")
    progress.start("SHARD_GRAD_OP bf16 mb 2", expected_s=5.0)
    progress.end("CRASH (rank 1): died")
    assert piped.getvalue().splitlines() == ["run 1/2: FULL_SHARD bf16 mb 2: ok: step 0.123 s",
                                             "run 2/2: SHARD_GRAD_OP bf16 mb 2: CRASH (rank 1): died"]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    progress = Progress(1, terminal)
    progress.start("FULL_SHARD bf16 mb 2", expected_s=5.0)
    time.sleep(1.2)  # one tick of the bar
    progress.end("ok: step 0.1 s")
    drawn = terminal.getvalue()
    assert "run 1/1: FULL_SHARD bf16 mb 2, " in drawn and "s left" in drawn
    assert drawn.endswith("run 1/1: FULL_SHARD bf16 mb 2: ok: step 0.1 s\n")
