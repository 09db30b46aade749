"""The JSON output contract (issue 11): every `--format json` output of the real CLI validates against the
schema `fsdp-plan schema NAME` prints (planner.schemas), the schemas are valid draft 2020-12, and
docs/schemas/ holds exactly what the models generate. The inputs are picked to reach the optional keys
(compile, float8, LoRA's wrap policy, HSDP's mesh, an int reshard group, nothing fitting, --verify-top).
explain's --format json is new with the schemas: estimate's shape plus the terms explain prints."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

jsonschema = pytest.importorskip("jsonschema")

from planner.schemas import OUTPUTS, SCHEMA_VERSION, json_schema, schema_text  # noqa: E402
from tests.cli.test_float_flags import invoke  # noqa: E402 (fsdp-plan in this process)

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 3000,
              "max_position_embeddings": 4096}  # tests/unit/test_trace.py's TINY["llama"]


def validate(name: str, instance: dict) -> None:
    """Against the JSON Schema (what scripts see), and through the pydantic model it is generated from."""
    validator = jsonschema.Draft202012Validator(json_schema(name))
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:10])
    OUTPUTS[name].model_validate(instance)


def json_of(argv, capsys, codes=(0,)) -> dict:
    code, out, err = invoke([*argv, "--format", "json"], capsys)
    assert code in codes, err
    return json.loads(out)


@pytest.fixture
def tiny_config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


# ------------------------------------------------------------------------------------------ real outputs

@pytest.mark.parametrize("argv, fits", [
    (["--model", "llama2-7b", "--gpus", "16", "--top", "3"], True),
    (["--model", "mixtral-8x7b", "--gpus", "16", "--top", "2"], True),                                  # MoE
    (["--model", "llama2-70b", "--gpus", "2", "--gpu", "a100-40gb", "--top", "2"], False),  # the nearest misses
    (["--model", "llama3-8b", "--gpus", "16", "--finetune", "lora", "--precision", "bf16", "--top", "1"], True),
], ids=["dense", "moe", "misses", "lora"])
def test_plan_json_validates(argv, fits, capsys):
    d = json_of(argv, capsys)
    validate("plan", d)
    assert d["candidates"] and d["candidates"][0]["fits"] is fits


def test_plan_verify_top_json_validates(tiny_config, capsys):
    """--verify-top adds "verification" to the traced candidates and "verified_top" (the trace tier: ~10 s)."""
    pytest.importorskip("transformers")
    d = json_of(["--model", tiny_config, "--gpus", "4", "--seq-len", "256", "--top", "2", "--verify-top", "1"], capsys)
    validate("plan", d)
    assert d["verified_top"] == 1 and "verification" in d["candidates"][0]


@pytest.mark.parametrize("argv", [
    ["--model", "llama2-70b", "--gpus", "64", "--seq-len", "4096", "--micro-batch", "2",
     "--activation-checkpointing", "full"],
    ["--model", "llama3-8b", "--gpus", "16", "--sharding", "HYBRID_SHARD", "--offload", "--reduce-dtype", "bf16"],
    ["--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-80gb", "--compile", "--float8", "--fp8-all-gather",
     "--reshard-after-forward", "8"],
    ["--model", "llama3-8b", "--gpus", "8", "--finetune", "lora", "--precision", "fp32"],
    ["--model", "mixtral-8x7b", "--gpus", "16", "--expert-units", "--expert-shard-dim", "1"],
    ["--model", "llama2-7b", "--gpus", "8", "--sharding", "NO_SHARD", "--precision", "bf16-pure"],
], ids=["ac-full", "hsdp-offload", "compile-float8", "lora", "moe-experts", "no-shard"])
def test_estimate_json_validates(argv, capsys):
    validate("estimate", json_of(["estimate", *argv], capsys))


@pytest.mark.parametrize("setup, codes", [
    ({"sharding_strategy": "FULL_SHARD", "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
      "auto_wrap_policy": "transformer_auto_wrap_policy", "use_orig_params": True}, (0, 1)),
    ({"sharding_strategy": "NO_SHARD"}, (0, 1)),
], ids=["fsdp1-kwargs", "no-shard"])
def test_check_json_validates(setup, codes, tmp_path, capsys):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(setup))
    d = json_of(["check", str(path), "--model", "llama2-7b", "--gpus", "8"], capsys, codes)
    validate("check", d)


def test_check_flags_json_validates(capsys):
    d = json_of(["check", "--model", "llama2-7b", "--gpus", "8", "--sharding", "SHARD_GRAD_OP"], capsys, (0, 1))
    validate("check", d)
    assert d["source"] == "flags"


@pytest.mark.parametrize("argv, chosen_by", [
    (["--model", "llama2-7b", "--gpus", "8"], "plan"),
    (["--model", "mixtral-8x7b", "--gpus", "16", "--activation-checkpointing", "full", "--offload"], "flags"),
], ids=["pick", "flags"])
def test_explain_json_validates(argv, chosen_by, tmp_path, capsys):
    d = json_of(["explain", *argv], capsys)
    validate("explain", d)
    assert d["chosen_by"] == chosen_by and d["explanation"]["memory"] and d["explanation"]["time"]


def test_explain_json_with_plot_keeps_stdout_one_document(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code, out, err = invoke(["explain", "--model", "llama2-7b", "--gpus", "8", "--micro-batch", "1", "--plot",
                             str(tmp_path / "b.svg"), "--format", "json"], capsys)
    assert code == 0, err
    validate("explain", json.loads(out))
    assert "step budget drawn to" in err and (tmp_path / "b.svg").exists()


def test_trace_json_validates(tiny_config, capsys):
    pytest.importorskip("transformers")
    d = json_of(["trace", "--model", tiny_config, "--gpus", "4", "--seq-len", "256"], capsys)
    validate("trace", d)


def test_calibrate_multi_node_json_validates(tmp_path, capsys):
    """Multi-node without --launch runs nothing: the report holds the per-node commands and no runs."""
    d = json_of(["calibrate", "--model", "llama2-7b", "--gpus", "16", "--nodes", "2", "--gpu", "h100-80gb",
                 "--top", "2", "--seq-len", "1024", "--steps", "5", "--rdzv-endpoint", "node0:29400",
                 "--out", str(tmp_path)], capsys)
    validate("calibrate", d)
    assert d["runs"] == [] and d["commands"]


def test_calibrate_report_with_runs_and_a_fit_validates():
    """calibration_json of a report holding a measured run, a failed one and a fit (a torchrun calibration is
    tests/distributed/'s business; here the records are built by hand and rendered by the real writer)."""
    from calibration import store
    from planner.api import estimate
    from planner.reports.table_calibration import calibration_json

    setup = store.RunSetup(model={}, full_n_layers=32, gpu={"id": "a100-80gb"}, n_gpus=8, gpus_per_node=8,
                           internode_bytes_per_s=25e9, training={}, config={"sharding": "FULL_SHARD"},
                           fsdp_version=2, device="cuda", steps=5, warmup=2)
    predicted = store.Predicted(step_s=1.0, peak_allocated_bytes=2 ** 34, peak_reserved_bytes=2 ** 35,
                                exposed_comm_s=0.1, compute_s=0.8, tokens_per_s_per_gpu=4000.0)
    ok = store.RunRecord(run_id="a", model_name="llama2-7b", setup=setup, predicted=predicted,
                         measured=store.Measured(step_s=1.1, step_s_all=[1.1, 1.2], tokens_per_s_per_gpu=3700.0,
                                                 peak_allocated_bytes=2 ** 34, memory_source="cuda_allocator"))
    failed = store.RunRecord(run_id="b", model_name="llama2-7b", setup=setup, predicted=predicted,
                             error=store.RunError(kind="oom", message="CUDA out of memory", rank=3))
    best = estimate("llama2-7b", 8)
    runs = [SimpleNamespace(record=ok, after=SimpleNamespace(time=SimpleNamespace(step_s=1.05)),
                            extrapolated_step_s=None, extrapolated_peak_bytes=None, measured=ok.measured),
            SimpleNamespace(record=failed, after=None, extrapolated_step_s=None, extrapolated_peak_bytes=None,
                            measured=None)]
    fit = SimpleNamespace(fitted=["compute_efficiency:bf16"], step_error_before=0.2, step_error_after=0.05,
                          notes=["one run"], identified={"compute_efficiency:bf16": 0.03}, not_identified=[])
    report = SimpleNamespace(target=SimpleNamespace(name="llama2-7b"), runs=runs, new_run_ids=["a", "b"],
                             skipped_run_ids=[], fit=fit, profile_path=Path("calib/profile.json"), ranked=[runs[0]],
                             best=best, notes=[], commands=[])
    validate("calibrate", json.loads(calibration_json(report)))


def test_a_drifted_output_fails(capsys):
    """The schemas are closed: an extra key, a missing one or a wrong type is an error."""
    d = json_of(["estimate", "--model", "llama2-7b", "--gpus", "8"], capsys)
    validator = jsonschema.Draft202012Validator(json_schema("estimate"))
    for drift in ({**d, "extra": 1}, {k: v for k, v in d.items() if k != "time"},
                  {**d, "config": {**d["config"], "micro_batch": "1"}},
                  {**d, "memory": {**d["memory"], "breakdown": {**d["memory"]["breakdown"], "new_category": 0}}}):
        assert not validator.is_valid(drift)


# ------------------------------------------------------------------------------------------ the schemas

@pytest.mark.parametrize("name", list(OUTPUTS))
def test_schema_command_prints_a_valid_versioned_schema(name, capsys):
    code, out, err = invoke(["schema", name], capsys)
    assert code == 0, err
    schema = json.loads(out)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$id"] == f"urn:fsdp-planner:schema:{name}:v{SCHEMA_VERSION}"
    assert schema["x-schema-version"] == SCHEMA_VERSION and schema["additionalProperties"] is False


def test_schema_bad_name_is_one_line_and_exit_2(capsys):
    code, out, err = invoke(["schema", "nope"], capsys)
    assert code == 2 and out == ""
    assert err == ("error: schema: no schema for 'nope'; choose one of: plan, estimate, trace, calibrate, check, "
                   "explain, rl, rl-estimate\n")


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_docs_schemas_are_current(name):
    path = ROOT / "docs" / "schemas" / f"{name}.schema.json"
    assert path.exists() and path.read_text() == schema_text(name), (
        f"{path} is stale: regenerate with `python -m planner.schemas docs/schemas` (and bump "
        "planner.schemas.SCHEMA_VERSION if the output's shape changed)")
