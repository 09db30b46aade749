"""Hub ids (issue 19, item 3): `--model Qwen/Qwen3-8B` reads the model's config.json from the Hugging Face
cache, in the layout huggingface_hub writes (models--org--name/refs/main -> snapshots/<sha>/config.json, a
symlink into blobs/), offline; else downloads that one file; else says in one line how to get it. No test
touches the network: HF_HUB_OFFLINE=1, or HF_ENDPOINT at a server on the loopback."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from planner.errors import ModelNotFound, PlannerError
from planner.models.resolve import resolve_model
from tests.doctor.cli_run import cli_process

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "planner.cli"]

# Qwen/Qwen3-8B's config.json on the Hub (transformers_version 4.51.0), verbatim
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
# By hand from those fields: a block is q and o 4096 x 4096 (16,777,216 each), k and v 4096 x 8*128
# (4,194,304 each), q/k RMSNorms 2 x 128, the SwiGLU MLP 3 x 4096 x 12288 (150,994,944) and two RMSNorms
# 2 x 4096: 192,946,432. Embedding and (untied) head 151,936 x 4096 = 622,329,856 each, final norm 4096:
# 36 x 192,946,432 + 2 x 622,329,856 + 4096 = 8,190,735,360 (the card: 8.2B, 6.95B without embeddings).
QWEN3_8B_BLOCK_PARAMS = 192_946_432
QWEN3_8B_PARAMS = 8_190_735_360
MAIN_SHA = "b968826d9c46dd6066d109eabc6255188de91218"
# a second revision (a tag): the same model cut to 28 blocks, 8,190,735,360 - 8 x 192,946,432
V1_SHA = "0123456789abcdef0123456789abcdef01234567"
V1_PARAMS = QWEN3_8B_PARAMS - 8 * QWEN3_8B_BLOCK_PARAMS


def write_snapshot(cache: Path, repo_id: str, sha: str, config: dict, ref: str | None = "main") -> Path:
    """One config.json as huggingface_hub caches it: the bytes in blobs/<etag>, snapshots/<sha>/config.json
    a relative symlink to it, refs/<ref> the commit sha (no newline)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    data = json.dumps(config, indent=2).encode()
    blob = repo / "blobs" / hashlib.sha1(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = repo / "snapshots" / sha / "config.json"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(Path("..") / ".." / "blobs" / blob.name)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return link


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    write_snapshot(cache, "Qwen/Qwen3-8B", MAIN_SHA, QWEN3_8B)
    write_snapshot(cache, "Qwen/Qwen3-8B", V1_SHA, {**QWEN3_8B, "num_hidden_layers": 28}, ref="v1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder named like an id
    return cache


def test_hub_id_resolves_from_the_cache_offline(hub_cache):
    spec = resolve_model("Qwen/Qwen3-8B")
    assert spec.name == "Qwen3-8B" and spec.family == "qwen3"
    assert spec.block_params == QWEN3_8B_BLOCK_PARAMS and spec.n_params == QWEN3_8B_PARAMS
    assert (spec.n_layers, spec.hidden_size, spec.n_kv_heads, spec.vocab_size) == (36, 4096, 8, 151936)
    # huggingface_hub's own cache reader finds the same file in this layout
    hf = pytest.importorskip("huggingface_hub")
    found = hf.try_to_load_from_cache("Qwen/Qwen3-8B", "config.json", cache_dir=hub_cache)
    assert Path(found) == hub_cache / "models--Qwen--Qwen3-8B" / "snapshots" / MAIN_SHA / "config.json"


def test_a_revision_is_a_ref_or_a_commit(hub_cache):
    assert resolve_model("Qwen/Qwen3-8B@v1").n_params == V1_PARAMS == 6_647_163_904
    assert resolve_model(f"Qwen/Qwen3-8B@{V1_SHA}").n_params == V1_PARAMS
    assert resolve_model(f"Qwen/Qwen3-8B@{MAIN_SHA}").n_params == QWEN3_8B_PARAMS


def test_the_cache_is_hf_hub_cache_else_hf_home_hub(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))  # <tmp>/hub is HF_HOME/hub
    assert resolve_model("Qwen/Qwen3-8B").n_params == QWEN3_8B_PARAMS
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent / "elsewhere"))
    with pytest.raises(ModelNotFound, match="elsewhere"):
        resolve_model("Qwen/Qwen3-8B")


def test_missing_offline_is_one_line_naming_the_cache_and_the_command(hub_cache):
    with pytest.raises(ModelNotFound) as err:
        resolve_model("meta-llama/Llama-3.1-8B")
    assert str(err.value) == (
        f"model: meta-llama/Llama-3.1-8B is not in the Hugging Face cache ({hub_cache}) and HF_HUB_OFFLINE is "
        "set: get it with `hf download meta-llama/Llama-3.1-8B config.json`, or pass a config.json path")
    with pytest.raises(ModelNotFound, match=r"hf download Qwen/Qwen3-8B config.json --revision v9`"):
        resolve_model("Qwen/Qwen3-8B@v9")


def test_a_local_path_wins_then_presets_then_ids(hub_cache, tmp_path):
    # a folder at the id's path: the local config, not the cache
    local = tmp_path / "Qwen" / "Qwen3-8B"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({**QWEN3_8B, "num_hidden_layers": 1}))
    one_block = QWEN3_8B_PARAMS - 35 * QWEN3_8B_BLOCK_PARAMS
    assert resolve_model("Qwen/Qwen3-8B").n_params == one_block
    # a local config named like a preset wins over the preset; a folder without one does not
    assert resolve_model("qwen3-8b").name == "qwen3-8b" and resolve_model("qwen3-8b").n_params == QWEN3_8B_PARAMS
    (tmp_path / "qwen3-8b").mkdir()
    assert resolve_model("qwen3-8b").n_params == QWEN3_8B_PARAMS
    (tmp_path / "qwen3-8b" / "config.json").write_text(json.dumps({**QWEN3_8B, "num_hidden_layers": 1}))
    assert resolve_model("qwen3-8b").n_params == one_block
    # two slashes, a .json name or a ./ path is a path, never an id
    for text in ("a/b/c", "org/name.json", "./org/name"):
        with pytest.raises(PlannerError, match="no such file"):
            resolve_model(text)


# The CLI in this process (tests/doctor/cli_run.py): hub_cache's environment is what resolve_model reads, at each call
# (test_the_cache_is_hf_hub_cache_else_hf_home_hub); the download test below needs a process of its own.
def test_cli_plan_of_the_id_is_the_plan_of_its_config_path(hub_cache, tmp_path):
    folder = tmp_path / "downloaded" / "Qwen3-8B"  # what `hf download --local-dir` would leave
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    by_id = cli_process(["--model", "Qwen/Qwen3-8B", "--gpus", "8"])
    by_path = cli_process(["--model", str(folder), "--gpus", "8"])
    assert by_id.returncode == 0, by_id.stderr[-2000:]
    assert by_id.stdout == by_path.stdout and "Qwen3-8B: 8.19B parameters" in by_id.stdout


def test_cli_missing_id_exits_2_with_one_line(hub_cache):
    r = cli_process(["--model", "Qwen/Qwen9-1B", "--gpus", "8"])
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: model: Qwen/Qwen9-1B is not in the Hugging Face cache (")
    assert "`hf download Qwen/Qwen9-1B config.json`" in r.stderr


def test_python_api_plans_an_id_as_its_path(hub_cache):
    from planner.api import plan

    snapshot = hub_cache / "models--Qwen--Qwen3-8B" / "snapshots" / MAIN_SHA / "config.json"
    by_id, by_path = plan("Qwen/Qwen3-8B", gpus=8), plan(str(snapshot), gpus=8)
    assert by_id.model == by_path.model and by_id.model.n_params == QWEN3_8B_PARAMS
    assert by_id.n_costed == by_path.n_costed > 0 and by_id.to_dict() == by_path.to_dict()


class _FakeHub(BaseHTTPRequestHandler):
    """The two requests hf_hub_download makes for a small file (HEAD for the commit and etag, GET for the
    bytes), for Qwen/Qwen3-8B/resolve/main/config.json alone; any other repo: the Hub's 404."""

    body = json.dumps(QWEN3_8B).encode()
    served: list[str] = []

    def _answer(self, send_body: bool) -> None:
        self.served.append(f"{self.command} {self.path}")
        if self.path != "/Qwen/Qwen3-8B/resolve/main/config.json":
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", MAIN_SHA)
        self.send_header("ETag", f'"{hashlib.sha1(self.body).hexdigest()}"')
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        if send_body:
            self.wfile.write(self.body)

    def do_HEAD(self):
        self._answer(False)

    def do_GET(self):
        self._answer(True)

    def log_message(self, *args):
        pass


def test_an_id_not_cached_is_downloaded_alone_into_the_cache(tmp_path):
    """HF_ENDPOINT at a loopback server: config.json is fetched (no other file), lands in the cache in
    huggingface_hub's layout, and the next resolve reads it offline. In a subprocess: huggingface_hub reads
    HF_ENDPOINT once, at import."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cache = tmp_path / "hub"
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and "OFFLINE" not in k}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_CACHE=str(cache), HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")
    code = "from planner.models.resolve import resolve_model as r; import sys; print(r(sys.argv[1]).n_params)"
    try:
        got = subprocess.run([sys.executable, "-c", code, "Qwen/Qwen3-8B"], capture_output=True, text=True,
                             env=env, timeout=120, cwd=tmp_path)
        missing = subprocess.run([*CLI, "--model", "Qwen/Qwen9-1B", "--gpus", "8"], capture_output=True,
                                 text=True, env=env, timeout=120, cwd=tmp_path)
    finally:
        server.shutdown()
    assert got.returncode == 0, got.stderr[-2000:]
    assert int(got.stdout) == QWEN3_8B_PARAMS
    assert {s.split()[1] for s in _FakeHub.served} == {"/Qwen/Qwen3-8B/resolve/main/config.json",
                                                       "/Qwen/Qwen9-1B/resolve/main/config.json"}
    snapshot = cache / "models--Qwen--Qwen3-8B" / "snapshots" / MAIN_SHA / "config.json"
    assert json.loads(snapshot.read_text()) == QWEN3_8B
    assert (cache / "models--Qwen--Qwen3-8B" / "refs" / "main").read_text() == MAIN_SHA
    offline = subprocess.run([sys.executable, "-c", code, "Qwen/Qwen3-8B"], capture_output=True, text=True,
                             env={**env, "HF_HUB_OFFLINE": "1"}, timeout=120, cwd=tmp_path)
    assert int(offline.stdout) == QWEN3_8B_PARAMS
    # a repo the Hub does not have: one line, exit 2
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "the Hub has no such model (or it is private: hf auth login)" in missing.stderr


def test_calibrate_runs_a_hub_llama_as_transformers_builds_it(hub_cache):
    """A preset Llama runs as our reference Llama built from the spec; a hub id's (like a config path's) as the
    model transformers builds from its config.json, so a config with biases is run with them."""
    from planner.calibrating import CalibrationRequest
    from planner.calibrating.request import resolve_target
    from planner.models import preset_hf_config

    config = {**preset_hf_config("llama3.2-1b"), "attention_bias": True}
    write_snapshot(hub_cache, "meta-llama/Llama-3.2-1B", MAIN_SHA, config)
    by_id = resolve_target(CalibrationRequest(out_dir="unused", gpus=2, model="meta-llama/Llama-3.2-1B"))
    assert by_id.source == "hf" and by_id.hf_config == config
    # 1,235,814,400 (the preset: 16 blocks of 60,821,504, the tied 128,256 x 2048 embedding, the final norm)
    # + the q, k, v, o biases: 16 x (2048 + 512 + 512 + 2048)
    assert by_id.spec.n_params == 1_235_814_400 + 16 * 5120
    preset = resolve_target(CalibrationRequest(out_dir="unused", gpus=2, model="llama3.2-1b"))
    assert preset.source == "reference" and preset.hf_config is None and preset.spec.n_params == 1_235_814_400


def test_a_remote_code_id_without_its_code_in_the_cache_is_one_line(hub_cache):
    """config.json alone (what a download fetches) of an auto_map model: its code files are not there."""
    pytest.importorskip("transformers")
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    write_snapshot(hub_cache, "org/custom", MAIN_SHA, {"model_type": "custom_x", "auto_map": auto_map})
    with pytest.raises(PlannerError, match="pass --trust-remote-code"):
        resolve_model("org/custom")
    with pytest.raises(PlannerError) as err:
        resolve_model("org/custom", trust_remote_code=True)
    assert err.value.field == "model" and "\n" not in str(err.value)
    assert "models--org--custom/snapshots" in str(err.value) and "configuration_x.py" in str(err.value)
