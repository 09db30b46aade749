"""Hugging Face Hub ids (`--model Qwen/Qwen3-8B`, `org/name@revision`): the model's config.json from the local
Hugging Face cache (offline), else config.json alone through huggingface_hub when the Hub is reachable, else
one line (ModelNotFound, exit 2) saying how to get it.

The cache is read the way huggingface_hub writes it (huggingface_hub 1.x: constants.HF_HUB_CACHE,
file_download.repo_folder_name and try_to_load_from_cache): HF_HUB_CACHE, else HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub (~/.cache by default); <cache>/models--<org>--<name>/refs/<revision> holds a
commit sha and snapshots/<sha>/config.json is the file. huggingface_hub is imported only for a download."""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

from planner.errors import ModelNotFound

# huggingface_hub's repo-id charset (utils/_validators.REPO_ID_REGEX), exactly one '/', and an optional
# @revision (a branch, a tag or a commit sha)
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9_.-]{1,96}/[A-Za-z0-9_.-]{1,96})(?:@(?P<revision>[A-Za-z0-9_.-]+))?")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's constants.ENV_VARS_TRUE_VALUES
CONNECT_TIMEOUT_S = 3.0  # one TCP connect to the Hub before a download: no network -> one line, not 24 s of retries


def is_hub_id(text: str) -> bool:
    """`org/name` (or `org/name@revision`) that names no local path and does not read as a file name."""
    if not _HUB_ID.fullmatch(text) or text.endswith(".json") or text.startswith("."):
        return False
    return not Path(text).exists()


def cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.path.expanduser(os.environ["HF_HUB_CACHE"])))
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):  # the legacy name huggingface_hub still reads
        return Path(os.path.expanduser(os.environ["HUGGINGFACE_HUB_CACHE"]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def split_id(text: str) -> tuple[str, str]:
    """'org/name@rev' -> ('org/name', 'rev'); no revision -> 'main'."""
    m = _HUB_ID.fullmatch(text)
    return m["repo"], m["revision"] or "main"


def cached_config(repo_id: str, revision: str = "main") -> Path | None:
    """The cached snapshot's config.json, or None: refs/<revision> names the commit; a revision that is a
    commit sha names its snapshot directly."""
    repo = cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / revision
    sha = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
    config = repo / "snapshots" / sha / "config.json"
    return config if config.is_file() else None


def config_path(text: str) -> Path:
    """config.json of a hub id: the cache, else a download of that one file, else ModelNotFound."""
    repo_id, revision = split_id(text)
    found = cached_config(repo_id, revision)
    if found is not None:
        return found
    if offline():
        raise _not_found(text, "HF_HUB_OFFLINE is set")
    return _download(text, repo_id, revision)


def name_of_snapshot(path: Path) -> str | None:
    """'<cache>/models--Qwen--Qwen3-8B/snapshots/<sha>/config.json' -> 'Qwen3-8B' (the repo's name, as a
    downloaded folder would be named); None for a path outside a hub cache."""
    parts = Path(path).parts
    if len(parts) >= 4 and parts[-1] == "config.json" and parts[-3] == "snapshots" and parts[-4].startswith("models--"):
        return parts[-4].split("--")[-1]
    return None


def _download(text: str, repo_id: str, revision: str) -> Path:
    try:
        from huggingface_hub import errors, hf_hub_download
        from huggingface_hub.constants import ENDPOINT
    except ImportError:
        raise _not_found(text, "huggingface_hub is not installed (pip install huggingface_hub)") from None
    unreachable = _unreachable(ENDPOINT)
    if unreachable:
        raise _not_found(text, f"the Hub is not reachable ({unreachable})")
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry warnings, one per attempt, would bury the one line
    try:
        return Path(hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache_dir()))
    except errors.GatedRepoError:
        why = "it is gated: accept its licence on the Hub and log in (hf auth login)"
    except errors.RepositoryNotFoundError:
        why = "the Hub has no such model (or it is private: hf auth login)"
    except errors.RevisionNotFoundError:
        why = f"the Hub has no revision {revision!r} of it"
    except errors.EntryNotFoundError:  # remote: no config.json in the repo; local: no network after all
        why = "the download failed (no config.json there, or no network)"
    except (OSError, ValueError) as e:  # HfHubHTTPError is an OSError; a malformed id a ValueError
        why = f"the download failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    finally:
        hub_log.setLevel(level)
    raise _not_found(text, why)


def _unreachable(endpoint: str) -> str | None:
    """Why the Hub cannot be reached directly (None when it can, or when a proxy is configured: huggingface_hub
    goes through it and a direct connect would prove nothing)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        return f"{url.hostname}:{port}: {e.strerror or type(e).__name__}"
    return None


def _not_found(text: str, why: str) -> ModelNotFound:
    repo_id, revision = split_id(text)
    rev = f" --revision {revision}" if revision != "main" else ""
    return ModelNotFound("model", f"{text} is not in the Hugging Face cache ({cache_dir()}) and {why}: get it with "
                                  f"`hf download {repo_id} config.json{rev}`, or pass a config.json path")
