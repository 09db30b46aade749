"""Calibration files: results.jsonl (one run per line) and profile.json (fitted coefficients).

Both are pydantic-validated at the edges (`extra="forbid"`, a `schema_version`), so a file from a newer
or older fsdp-plan, or one edited by hand into a shape we do not understand, fails with a message that
names the file, the line and the field, rather than planning with silently wrong numbers.

- results.jsonl is appended one line per run as each run ends (`append_record`: write, flush, fsync), so
  a crash, an OOM or a killed calibration loses at most the run in progress. A torn last line (the
  process died mid-write) is skipped with a warning when read; any other bad line is an error.
- profile.json is written whole, atomically (temp file in the same directory, fsync, os.replace).
- A profile carries the fingerprint of the cluster it was fitted on (device name, devices per node,
  nodes, torch and NCCL versions). `check_fingerprint` refuses a profile from another cluster unless
  forced; `check_profile_gpu` refuses one fitted on another GPU type for a plan.

No torch here: `fsdp-plan --profile FILE` loads profiles without paying for `import torch`.

The files' shapes live in calibration/store_schema.py and the spec <-> dict conversions in spec_dicts.py; both are
re-exported here (`store.RunRecord`, `store.model_spec_from_dict`), the namespace calibration's callers use.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from cost_models.profile import Profile

from .spec_dicts import gpu_spec_dict, model_spec_from_dict
from .store_schema import (PROFILE_FILE, PROFILE_SCHEMA_VERSION, PROFILE_SCHEMA_VERSIONS_READ, RESULTS_FILE,
                           SCHEMA_VERSION, Coefficients, Fingerprint, FitSummary, HostProbe, HostSpec, Measured,
                           PipelineRankPeak, Predicted, ProfileFile, RunError, RunRecord, RunSetup, StoreError)

__all__ = [  # the re-exported names (see the docstring) and this module's own
    "PROFILE_FILE", "PROFILE_SCHEMA_VERSION", "PROFILE_SCHEMA_VERSIONS_READ", "RESULTS_FILE", "SCHEMA_VERSION",
    "Coefficients", "Fingerprint", "FitSummary", "HostProbe", "HostSpec", "Measured", "PipelineRankPeak", "Predicted",
    "ProfileFile", "RunError", "RunRecord", "RunSetup", "StoreError", "gpu_spec_dict", "model_spec_from_dict",
    "run_id", "write_atomic", "append_record", "TornLine", "drop_torn_line", "read_results", "read_records",
    "write_profile", "load_profile_file", "check_profile_gpu", "check_fingerprint", "load_profile", "cpu_name",
]


# ------------------------------------------------------------------------------------------ helpers

def run_id(setup: RunSetup) -> str:
    """Stable id of a run from what defines it (not from when it ran): --resume matches on it."""
    key = setup.model_dump(exclude={"gpu"})
    key["gpu"] = setup.gpu.get("id")
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, text: str) -> None:
    """Write the whole file or nothing: temp file beside it, fsync, os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def append_record(path: str | Path, record: RunRecord) -> None:
    """Append one run as one line, durably (flush + fsync) before returning. A file whose last record lacks
    its newline gets one first, so the two records stay two lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = record.model_dump_json() + "\n"
    with open(path, "a+b") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class TornLine:
    """The last line of a results.jsonl cut short: its writer was killed mid-write (append_record writes
    one line per run, so only the last line can be torn). `offset`: the bytes before it, all whole lines."""

    path: Path
    line: int
    offset: int
    size_bytes: int

    def note(self) -> str:
        return (f"{self.path}:{self.line}: skipped a torn last line ({self.size_bytes} bytes; a run was killed "
                "while writing its record), the runs before it are kept")


def drop_torn_line(torn: TornLine) -> None:
    """Cut the torn fragment off, so the next record appended starts a line of its own."""
    with open(torn.path, "r+b") as f:
        f.truncate(torn.offset)
        f.flush()
        os.fsync(f.fileno())


def _where(exc: ValidationError) -> str:
    e = exc.errors()[0]
    loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
    return f"{loc}: {e['msg']}"


def read_results(path: str | Path) -> tuple[list[RunRecord], TornLine | None]:
    """Every run in a results.jsonl, validated, and its torn last line if it has one (skipped: not JSON, not
    UTF-8, and no newline after it). Any other bad line is a StoreError naming it. A missing file is ([], None)."""
    path = Path(path)
    if not path.exists():
        return [], None
    data = path.read_bytes()
    lines = data.split(b"\n")
    records, torn, offset = [], None, 0
    for number, raw in enumerate(lines, 1):
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if number == len(lines):  # the last piece of a split has no newline after it
                torn = TornLine(path, number, start, len(raw))
                continue
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "invalid UTF-8"
            raise StoreError("results", f"{path}:{number} is not JSON: {why}") from None
        version = entry.get("schema_version") if isinstance(entry, dict) else None
        if version != SCHEMA_VERSION:
            raise StoreError("results", f"{path}:{number} has schema_version {version!r}; this fsdp-plan reads "
                                        f"{SCHEMA_VERSION}")
        try:
            records.append(RunRecord.model_validate(entry))
        except ValidationError as exc:
            raise StoreError("results", f"{path}:{number}: {_where(exc)}") from None
    return records, torn


def read_records(path: str | Path) -> list[RunRecord]:
    """Every run in a results.jsonl (read_results), warning about a torn last line."""
    records, torn = read_results(path)
    if torn is not None:
        warnings.warn(torn.note())
    return records


def write_profile(path: str | Path, profile_file: ProfileFile) -> None:
    write_atomic(path, profile_file.model_dump_json(indent=2) + "\n")


def load_profile_file(path: str | Path) -> ProfileFile:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError("profile", f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError("profile", f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise StoreError("profile", f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, dict) or data.get("kind") != "fsdp-plan-profile":
        raise StoreError("profile", f"{path} is not an fsdp-plan profile (written by `fsdp-plan calibrate`)")
    if data.get("schema_version") not in PROFILE_SCHEMA_VERSIONS_READ:
        readable = " or ".join(str(v) for v in PROFILE_SCHEMA_VERSIONS_READ)
        raise StoreError("profile", f"{path} has schema_version {data.get('schema_version')!r}; this fsdp-plan "
                                    f"reads {readable}: calibrate again")
    if data.get("schema_version") == 2 and isinstance(data.get("coefficients"), dict):
        for name in ("tp_comm_efficiency", "ep_comm_efficiency"):  # not in schema 2: a mesh field there is an error
            if name in data["coefficients"]:
                raise StoreError("profile", f"{path}: coefficients.{name} is not a schema_version 2 field")
    if data.get("schema_version") < 5 and isinstance(data.get("coefficients"), dict):
        data["coefficients"].pop("cpu_optimizer_params_per_s", None)  # a flat rate no fit set (store_schema.py)
    try:
        return ProfileFile.model_validate(data)
    except ValidationError as exc:
        raise StoreError("profile", f"{path}: {_where(exc)}") from None


def check_profile_gpu(profile_file: ProfileFile, gpu_id: str, path: str | Path = "profile",
                      force: bool = False) -> None:
    """A plan for GPU type `gpu_id` may use the profile only if it was fitted on that GPU type."""
    if force or profile_file.gpu_id == gpu_id:
        return
    raise StoreError("profile", f"{path} was fitted on {profile_file.gpu_id} ({profile_file.fingerprint.describe()}), "
                                f"this plan is for {gpu_id}; its coefficients would mislead. Calibrate on this "
                                "cluster, or pass --force-profile to use it anyway")


def check_fingerprint(profile_file: ProfileFile, here: Fingerprint, path: str | Path = "profile",
                      force: bool = False) -> None:
    """Refuse a profile fitted on another cluster (device, devices per node, torch, NCCL) unless forced."""
    diffs = here.mismatches(profile_file.fingerprint)
    if diffs and not force:
        raise StoreError("profile", f"{path} comes from another cluster ({'; '.join(diffs)}). Calibrate here, "
                                    "or pass --force-profile to use it anyway")


def load_profile(path: str | Path, *, gpu_id: str | None = None, force: bool = False) -> Profile:
    """The cost-model Profile in a profile.json, checked against the plan's GPU type when given."""
    pf = load_profile_file(path)
    if gpu_id is not None:
        check_profile_gpu(pf, gpu_id, path, force)
    return pf.profile()


def cpu_name() -> str:
    """The host CPU's model name (a CPU run's device name in its fingerprint)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"
