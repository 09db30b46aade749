"""Shared fixtures."""

import dataclasses
import os
import sys
from unittest import mock

import pytest

# Under pytest-xdist (the README's `-n 2` on 2 cores) each worker computes on one thread, as torchrun's ranks do:
# two workers of two OpenMP threads each oversubscribe the cores, and their threads spin waiting for each other
# (the KV-cache measurement of tests/unit/test_apply.py: 74 s with 2 threads, 23 s with 1, on 2 busy cores).
# Subprocesses (the CLI, torchrun and its ranks) inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _load_accelerate(tmp_path, text: str, extra_args=()):
    """Load the YAML with accelerate's own loader, then resolve it the way `accelerate launch` does
    into environment variables and a FullyShardedDataParallelPlugin."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    loaded = load_config_from_file(str(path))
    args = launch_command_parser().parse_args(["--config_file", str(path), *extra_args, "train.py"])
    args = _validate_launch_command(args)[0]
    env = prepare_multi_gpu_env(args)  # also sets the torchrun arguments on args
    # sync_module_states needs an accelerator to build the plugin; its value is checked in env instead.
    plugin_env = {**env, "FSDP_SYNC_MODULE_STATES": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}
    with mock.patch.dict(os.environ, plugin_env):
        plugin = FullyShardedDataParallelPlugin()
    return loaded, env, plugin, args



def _run_hf_snippet(text: str) -> dict:
    """Run an emitted `--emit hf-trainer` snippet as a training script would and return what it defines (its
    TrainingArguments `args`, a compiled loss's `compute_loss_func`). This machine has no GPU, where bf16=True
    refuses to construct without use_cpu=True: the snippet carries that line commented, and it is uncommented
    here. The environment (transformers sets FSDP_* variables) and accelerate's process state are restored
    afterwards."""
    from accelerate.state import AcceleratorState

    namespace = {}
    with mock.patch.dict(os.environ):
        exec(compile(text.replace("# use_cpu=True,", "use_cpu=True,"), "<hf-trainer snippet>", "exec"), namespace)
    AcceleratorState._reset_state(reset_partial_state=True)
    return namespace


def _build_training_arguments(text: str):
    return _run_hf_snippet(text)["args"]


@pytest.fixture
def training_arguments():
    """transformers' TrainingArguments built from an emitted snippet, as a function (snippet_text)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return _build_training_arguments


@pytest.fixture
def hf_snippet():
    """What an emitted `--emit hf-trainer` snippet defines, as a function (snippet_text) -> namespace."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return _run_hf_snippet


@pytest.fixture
def load_accelerate():
    """accelerate's own config loader and launch-time resolution, as a function (tmp_path, yaml_text)."""
    pytest.importorskip("accelerate")
    return _load_accelerate


def _attention_saved_bytes(model, run):
    """(run()'s result, the bytes each layer's self_attn saved for backward while it ran): unique storages through
    saved_tensors_hooks, the attention's inputs (normed hidden states, rotary tables) and the parameters aside,
    per-token tensors only (dim >= 2: no per-layer constants such as Gemma 3's fp32 (1 + w) norm weights, nor the
    0-dim scalars torch's score_mod example trace saves on CPU)."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, per_layer = {}, []

    def pack(t):
        if t.dim() >= 2:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def before(_module, args, kwargs):
        saved.clear()
        skip.add((args[0] if args else kwargs["hidden_states"]).untyped_storage().data_ptr())
        skip.update(t.untyped_storage().data_ptr() for t in kwargs["position_embeddings"])

    def after(*_):
        per_layer.append(sum(n for ptr, n in saved.items() if ptr not in skip))

    hooks = []
    for layer in model.model.layers:
        hooks += [layer.self_attn.register_forward_pre_hook(before, with_kwargs=True),
                  layer.self_attn.register_forward_hook(after)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = run()
    finally:
        for handle in hooks:
            handle.remove()
    return result, per_layer


@pytest.fixture
def attention_saved_bytes():
    """_attention_saved_bytes as a function (model, run) -> (run(), bytes per layer)."""
    return _attention_saved_bytes


@pytest.fixture(autouse=True, scope="session")
def _planner_cache(tmp_path_factory):
    """Block profiles and specs of generic models are cached under a test-session directory, not ~/.cache.
    Under pytest-xdist the workers share one (the directory above each worker's own basetemp): a profile one
    worker traced is not traced again by the other (the cache writes atomically; a race costs a second trace)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "fsdp-planner-cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("fsdp-planner-cache")
    os.environ["FSDP_PLANNER_CACHE"] = str(path)


@pytest.fixture(autouse=True, scope="session")
def _click_command_built_once():
    """An in-process `fsdp-plan` call (planner.cli.main, typer's CliRunner) builds the click command from the typer
    app on every call (typer.main.get_command reads each command's signature): 0.16 s of a 0.17 s call that stops
    at a bad flag (measured 2026-12-07, loaded machine), over the suite's hundreds of in-process calls. The app's
    commands are registered once, at import, and click builds a fresh context per call, so each worker builds
    the command once and every call parses with it."""
    import typer.main

    build, built = typer.main.get_command, {}

    def built_once(typer_instance):
        if typer_instance not in built:
            built[typer_instance] = build(typer_instance)
        return built[typer_instance]

    typer.main.get_command = built_once
    yield
    typer.main.get_command = build


TORCHRUN_GROUP = "torchrun"
# Files whose tests start torchrun: tests/distributed/, and these beside it (each test there marked `distributed`).
TORCHRUN_FILES: tuple[str, ...] = ()


def work_unit(nodeid: str) -> str:
    """The README's test command runs `-n 2 --dist loadgroup` (pytest-xdist): each test file is one unit of work
    (its module fixtures and caches built once, on one worker), and every file that starts torchrun is one unit, so
    two 2-rank gloo jobs never share the 2 cores while timing-sensitive kill / resume checks run."""
    path = nodeid.split("::", 1)[0]
    return TORCHRUN_GROUP if path.startswith("tests/distributed/") or path in TORCHRUN_FILES else path


def pytest_xdist_make_scheduler(config, log):
    """loadgroup by work_unit. xdist 3.8's own loadgroup reads `xdist_group` marks by appending "@group" to
    item._nodeid on the workers, which pytest 9 no longer reads (Node.nodeid comes from item._id): every test was
    scheduled alone, so a module's fixtures were built on both workers (test_calibrate's 125 s calibration twice,
    measured 2026-12-02) and torchrun jobs overlapped. This scheduler groups on the controller from the node ids."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A test marked `distributed` outside the torchrun files would escape the torchrun unit: refuse it."""
    for item in items:
        if item.get_closest_marker("distributed") and work_unit(item.nodeid) != TORCHRUN_GROUP:
            raise pytest.UsageError(f"{item.nodeid} is marked distributed: add its file to TORCHRUN_FILES "
                                    "(tests/conftest.py) so that it runs in the torchrun unit")


# The planner's searches, shared within tests/doctor and tests/cli: `check` plans the model on the cluster
# (planner.api.plan_for; ~6,000 candidates for llama3-8b on 16 GPUs, 5-14 s on 2 cores) to compare a setup against
# the best, and `plan` / `explain` / `--emit` in-process calls repeat the same few inputs. A search depends only on
# its inputs (model, cluster, training, profile, space: frozen dataclasses, keyed by their value repr), never on the
# setup checked, so it runs once per worker and later calls get a copy of its result (fresh lists of the same frozen
# Evaluations). tests/unit, which tests the search and cost models themselves (some by patching them), is left out.
SHARED_SEARCH_DIRS = ("tests/doctor/", "tests/cli/")
_SEARCHES: dict[str, object] = {}


def _shared_search(search):
    def shared(spec, cluster, training, profile, space):
        key = repr((spec, cluster, training, profile, space))
        if " at 0x" in key:  # an object without a value repr: not shared
            return search(spec, cluster, training, profile, space)
        if key not in _SEARCHES:
            _SEARCHES[key] = search(spec, cluster, training, profile, space)
        result = _SEARCHES[key]
        return dataclasses.replace(result, fitting=list(result.fitting), misses=list(result.misses),
                                   skipped=list(result.skipped), notes=list(result.notes))
    return shared


# The allocator replay of a reported estimate's reserved memory (planner.api.replayed), shared the same way: a
# pipeline's replays every rank (~5 s for the 405B pp 8 plan of tests/cli/test_pipeline_cli.py, which its CLI run
# and its API tests both report). It depends only on its arguments (frozen, keyed by their value repr).
_REPLAYS: dict[str, object] = {}


def _shared_replay(replayed):
    def shared(evaluation, spec, cluster, training, profile, ways=None):
        key = repr((evaluation, spec, cluster, training, profile, ways))
        if " at 0x" in key:
            return replayed(evaluation, spec, cluster, training, profile, ways)
        if key not in _REPLAYS:
            _REPLAYS[key] = replayed(evaluation, spec, cluster, training, profile, ways)
        return _REPLAYS[key]
    return shared


@pytest.fixture(autouse=True)
def _share_searches(request, monkeypatch):
    if request.node.path.relative_to(request.config.rootpath).as_posix().startswith(SHARED_SEARCH_DIRS):
        import planner.api

        monkeypatch.setattr(planner.api, "search", _shared_search(planner.api.search))
        monkeypatch.setattr(planner.api, "replayed", _shared_replay(planner.api.replayed))
