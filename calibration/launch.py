"""One torchrun job per calibration run: timeouts, process-group kills, and failures turned into records.

A run is a child process group (torchrun and its ranks, started in a new session). It ends one of
three ways, and none of them stops the calibration:
- rank 0 wrote its result file and torchrun exited 0: measured;
- a rank failed: the ranks' error files (written by calibration.runner: "oom" or "crash", with the
  rank's message) or, when a rank died without one (killed, segfault, os._exit), the tail of the log;
- it ran past its timeout (a hung collective, a deadlock): the whole process group gets SIGTERM, then
  SIGKILL after a grace period, and the run is recorded as "timeout".
Its own session keeps a terminal's Ctrl-C away from the ranks (the launcher tears the group down itself),
so on Linux torchrun also gets SIGTERM from the kernel when the launcher dies without a chance to (a
SIGKILL): torchrun then stops its ranks, and no orphaned run keeps computing beside the --resume.

No torch import: the launcher only builds command lines and watches processes.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

KILL_GRACE_S = 5.0
LOG_TAIL_LINES = 15


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of a multi-node job meet: node 0's address and a free port (torchrun's static
    rendezvous, so global rank 0, which writes the result, is on node 0)."""

    host: str
    port: int = 29500

    @classmethod
    def parse(cls, text: str) -> "Rendezvous":
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"rendezvous endpoint must look like HOST:PORT, got {text!r}")
        return cls(host, int(port))


@dataclass(frozen=True)
class Launch:
    """How one job is started: ranks per node, nodes, and (multi-node) the rendezvous and this node's rank."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rendezvous: Rendezvous | None = None
    python: str | None = sys.executable  # None: the `torchrun` script (for commands printed for people)

    def torchrun_args(self, node_rank: int | None = None) -> list[str]:
        start = ["torchrun"] if self.python is None else [self.python, "-m", "torch.distributed.run"]
        args = [*start, "--nproc-per-node", str(self.nproc_per_node)]
        if self.nnodes == 1 and self.rendezvous is None:
            return args + ["--standalone"]
        if self.rendezvous is None:
            raise ValueError("a multi-node run needs a rendezvous endpoint (--rdzv-endpoint HOST:PORT)")
        rank = self.node_rank if node_rank is None else node_rank
        return args + ["--nnodes", str(self.nnodes), "--node-rank", str(rank),
                       "--master-addr", self.rendezvous.host, "--master-port", str(self.rendezvous.port)]


def runner_command(launch: Launch | None, job_path: str | Path, node_rank: int | None = None) -> list[str]:
    """The command of one run: torchrun + calibration.runner, or the runner alone (emulated world size)."""
    tail = ["-m", "calibration.runner", "--job", str(job_path)]
    if launch is None:
        return [sys.executable, *tail]
    return launch.torchrun_args(node_rank) + tail


def shell_line(argv: list[str], env: dict | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + " ".join(shlex.quote(a) for a in argv)


@dataclass
class Outcome:
    status: str                  # "ok", "oom", "crash", "timeout"
    wall_s: float
    returncode: int | None
    result: dict | None = None   # rank 0's result file (status "ok")
    message: str = ""
    rank: int | None = None
    log_tail: list[str] = field(default_factory=list)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent():
    """A preexec_fn that has the kernel send the child SIGTERM when this process dies (Linux; None
    elsewhere). Resolved here, in the parent, so the forked child only makes the one call. The death
    signal fires when the forking thread ends: run_job is called from the main thread."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os._exit(1)

    return preexec


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the run's process group, SIGKILL what is left after a grace period."""
    pgid = proc.pid  # start_new_session: the child leads its own process group
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # torchrun is gone; ranks it could not reap may linger in the group
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    useful = [line for line in lines if line.strip() and "FutureWarning" not in line
              and "return func(*args, **kwargs)" not in line]
    return useful[-n:]


def _rank_errors(error_dir: Path) -> list[dict]:
    errors = []
    for path in sorted(error_dir.glob("rank*.json")):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return errors


_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "peer", "nccl communicator was aborted")


def _failed_ranks(log_text: str) -> dict[int, str]:
    """Every failed rank in torchrun's last failure summary ("Failures:" and "Root Cause"), with its exit code.
    Which one torchrun calls the root cause is a race when ranks die within the same second."""
    _, found, summary = log_text.rpartition("ChildFailedError")
    if not found:
        return {}
    failed, rank = {}, None
    for line in summary.splitlines():
        text = line.strip()
        if text.startswith("rank") and ":" in text and "(local_rank" in text:
            try:
                rank = int(text.split(":", 1)[1].split("(")[0].strip())
            except ValueError:
                rank = None
        elif text.startswith("exitcode") and ":" in text and rank is not None:
            failed.setdefault(rank, text.split(":", 1)[1].strip())
            rank = None
    return failed


def _cause(errors: list[dict], log_text: str) -> dict:
    """The failure that explains the run. An OOM first; then a rank's own error; a rank that lost its peer
    explains nothing when another rank died without an error file (killed, segfault, os._exit)."""
    for error in errors:
        if error.get("kind") == "oom":
            return error
    for error in errors:
        if not any(w in error.get("message", "").lower() for w in _PEER_LOST):
            return error
    reported = {e.get("rank") for e in errors}
    silent = {r: code for r, code in _failed_ranks(log_text).items() if r not in reported}
    if silent:
        # ranks torchrun itself stopped with SIGTERM while tearing the job down are victims, not causes
        rank = min(silent, key=lambda r: ("SIGTERM" in silent[r] or silent[r].startswith("-15"), r))
        return {"kind": "crash", "rank": rank, "message": f"rank {rank} died (exit code {silent[rank]}) without a "
                                                          "Python error; the other ranks lost their peer"}
    if errors:
        return errors[0]
    return {}


def run_job(argv: list[str], *, timeout_s: float, result_path: Path, error_dir: Path, log_path: Path,
            env: dict | None = None, cwd: str | Path | None = None) -> Outcome:
    """Run one job to completion, a failure, or its timeout; never raises for what the job does."""
    result_path, error_dir, log_path = Path(result_path), Path(error_dir), Path(log_path)
    for stale in [result_path, *error_dir.glob("rank*.json")]:
        stale.unlink(missing_ok=True)
    error_dir.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {shell_line(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
                                preexec_fn=_die_with_parent())
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # Ctrl-C: take the run down with us, keep what is on disk
            _kill_group(proc)
            raise
        finally:
            _kill_group(proc)  # also reaps ranks torchrun left behind
    wall_s = time.monotonic() - t0
    tail = _tail(log_path)
    if timed_out:
        return Outcome("timeout", wall_s, None, message=f"no result after {timeout_s:.0f} s: process group killed "
                                                         "(a hung collective or a rank stuck)", log_tail=tail)
    if proc.returncode == 0 and result_path.exists():
        try:
            return Outcome("ok", wall_s, 0, result=json.loads(result_path.read_text()), log_tail=tail)
        except (OSError, json.JSONDecodeError) as exc:
            return Outcome("crash", wall_s, 0, message=f"unreadable result file {result_path}: {exc}", log_tail=tail)
    try:
        log_text = log_path.read_text(errors="replace")
    except OSError:
        log_text = ""
    cause = _cause(_rank_errors(error_dir), log_text)
    if cause:
        return Outcome(cause.get("kind", "crash"), wall_s, proc.returncode, message=cause.get("message", ""),
                       rank=cause.get("rank"), log_tail=tail)
    # no error file and no torchrun summary: killed from outside (the kernel's OOM killer, say)
    oom = any("out of memory" in line.lower() or "killed" in line.lower() for line in tail)
    return Outcome("oom" if oom else "crash", wall_s, proc.returncode,
                   message=f"exit code {proc.returncode}: {' | '.join(tail[-3:])}", log_tail=tail)
