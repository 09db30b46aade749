"""`fsdp-plan check` over malformed inputs (issue 11): random FSDP kwargs / accelerate keys with values of any
type, raw text as YAML, a directory for a file: always an exit code (0, 1 findings, 2 bad input), never a
traceback. Found: int() of a null or a list (fsdp_version, grad_accum), and a YAML key holding lone
surrogates that could not be printed."""
import json, sys
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from planner.cli import main

def invoke(argv, capsys):
    try:
        main(argv); code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err

KEYS = ["sharding_strategy", "mixed_precision", "auto_wrap_policy", "limit_all_gathers", "use_orig_params", "micro_batch",
        "activation_checkpointing", "reshard_after_forward", "cpu_offload", "fsdp_config", "distributed_type", "num_processes",
        "compile", "float8", "backward_prefetch", "grad_accum", "fsdp_version", "mixed_precision_dtypes"]
values = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True) | st.text(max_size=12),
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=6)

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), values, max_size=5), as_yaml=st.booleans())
def test_check_never_tracebacks(data, as_yaml, tmp_path, capsys):
    path = tmp_path / ("c.yaml" if as_yaml else "c.json")
    try:
        text = json.dumps(data)
    except ValueError:
        return
    path.write_text(text)
    code, out, err = invoke(["check", str(path), "--model", "gpt-125m", "--gpus", "8"], capsys)
    assert code in (0, 1, 2), (code, err[-500:])
    assert "Traceback" not in err and "Traceback" not in out, err[-1500:]

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_check_raw_text(text, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, out, err = invoke(["check", str(path), "--model", "gpt-125m", "--gpus", "8"], capsys)
    assert code in (0, 1, 2) and "Traceback" not in err, err[-1500:]

def test_check_directory(tmp_path, capsys):
    code, out, err = invoke(["check", str(tmp_path), "--model", "gpt-125m", "--gpus", "8"], capsys)
    assert code == 2 and "Traceback" not in err, err
