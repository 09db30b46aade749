"""The progress of a calibration on stderr: a ticking bar with the time left on a terminal only (piped or captured,
as CI sees it, no bar), and one line per finished run either way (its outcome: the run's log, not progress)."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """On a terminal, a bar that ticks every second with the time left while a run runs; one line per finished run
    ("run i/n: candidate: outcome") and per note on any stream."""

    def __init__(self, total: int, stream=None):
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.durations: list[float] = []
        self.label, self.started, self.expected = "", 0.0, 0.0
        self._stop = threading.Event()
        self._thread = None
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def _eta(self) -> float:
        per_run = sum(self.durations) / len(self.durations) if self.durations else self.expected
        running = max(0.0, per_run - (time.monotonic() - self.started)) if self.label else 0.0
        return running + per_run * max(0, self.total - self.done - (1 if self.label else 0))

    def _line(self) -> str:
        width = 20
        filled = int(width * self.done / max(1, self.total))
        bar = "=" * filled + (">" if self.done < self.total else "") + " " * (width - filled - 1)
        elapsed = time.monotonic() - self.started if self.label else 0.0
        current = f"run {self.done + 1}/{self.total}: {self.label}, {elapsed:.0f} s" if self.label else "done"
        return f"[{bar[:width]}] {current}; ~{self._eta():.0f} s left"

    def start(self, label: str, expected_s: float) -> None:
        self.label, self.started, self.expected = label, time.monotonic(), expected_s
        if self.tty:
            self._stop.clear()
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            print("\r" + self._line() + "   ", end="", file=self.stream, flush=True)

    def end(self, message: str) -> None:
        if self._thread:
            self._stop.set()
            self._thread.join()
            print("\r" + " " * 100 + "\r", end="", file=self.stream)
        self.durations.append(time.monotonic() - self.started)
        print(f"run {self.done + 1}/{self.total}: {self.label}: {message}", file=self.stream, flush=True)
        self.done += 1
        self.label = ""

    def note(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

