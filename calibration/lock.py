"""One calibration per --out folder: an exclusive flock(2) on DIR/.lock, held for the whole run. The kernel
drops it when the holder's file description closes, so also on a crash, an OOM kill or SIGKILL: a folder
whose run died is free at once, with no stale file to judge. The holder writes its pid and host into the
file so a second calibration can say who holds the folder. Node ranks > 0 of a multi-node calibration share
node 0's folder (a filesystem every node sees) and lock DIR/.lock-node<k> instead. No torch here."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from cost_models.specs import SpecError

LOCK_FILE = ".lock"
HOLDER_WAIT_S = 2.0  # a holder writes its pid right after taking the lock; wait that long to read it


class FolderInUse(SpecError):
    """Another calibration holds the --out folder."""


def lock_path(folder: Path, node_rank: int = 0) -> Path:
    return Path(folder) / (LOCK_FILE if node_rank == 0 else f"{LOCK_FILE}-node{node_rank}")


@contextmanager
def hold(folder: Path, node_rank: int = 0):
    """Hold `folder`'s lock until the block ends; FolderInUse (one line naming the folder and the holder)
    when another process holds it."""
    path = lock_path(folder, node_rank)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the runs' subprocesses (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise FolderInUse("out", f"{folder} is in use by another calibration ({holder}, lock {path}): wait for it "
                                 "to end, or choose another --out") from None
    except BaseException:
        os.close(fd)
        raise
    try:
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock; the file stays (unlinking it would race a next holder)


def _holder(fd: int) -> str:
    """'pid 1234 on host-a since 2026-01-01T00:00:00+00:00' from the lock file, once its holder wrote it."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            record = json.loads(os.pread(fd, 4096, 0))
            return f"pid {record['pid']} on {record['host']} since {record['since']}"
        except (ValueError, KeyError, TypeError):
            if time.monotonic() > deadline:
                return "a process that has not written its pid"
            time.sleep(0.05)
