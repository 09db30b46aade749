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
        "compile", "float8", "backward_prefetch", "grad_accum", "fsdp_version", "mixed_precision_dtypes",
        # HF TrainingArguments
        "fsdp", "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "parallelism_config",
        "gradient_checkpointing", "gradient_checkpointing_kwargs", "torch_compile"]
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

# torchtitan overrides: --section.option flags (any value, = or space, bare booleans) and the same as a TOML job file
TT_NAMES = ["parallelism.data_parallel_shard_degree", "parallelism.data_parallel_replicate_degree",
            "parallelism.fsdp_reshard_after_forward", "parallelism.tensor_parallel_degree", "training.local_batch_size",
            "training.global_batch_size", "training.seq_len", "training.mixed_precision_param", "training.dtype",
            "training.enable_cpu_offload", "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option",
            "compile.enable", "compile.components", "model.converters", "quantize.linear.float8.enable_fsdp_float8_all_gather"]
tt_values = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=10) | st.sampled_from(
    ["op", "2", "-1", "never", "float32", "bfloat16", "full", "selective", "float8", "model,loss"])

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.lists(st.tuples(st.sampled_from(TT_NAMES) | st.text(max_size=8), tt_values, st.sampled_from(["=", " "])),
                      min_size=1, max_size=6), as_toml=st.booleans())
def test_check_torchtitan_never_tracebacks(flags, as_toml, tmp_path, capsys):
    import shlex
    if as_toml:
        path = tmp_path / "job.toml"
        path.write_text("".join(f"[{n.rpartition('.')[0] or 'x'}]\n{n.rpartition('.')[2] or 'y'} = {json.dumps(v)}\n"
                                for n, v, _ in flags if v is not None))
    else:
        path = tmp_path / "overrides.txt"
        path.write_text(" ".join(f"--{n}" if v is True else f"--{n}{sep}{shlex.quote(str(v))}" for n, v, sep in flags))
    code, out, err = invoke(["check", str(path), "--model", "gpt-125m", "--gpus", "8"], capsys)
    assert code in (0, 1, 2), (code, err[-500:])
    assert "Traceback" not in err and "Traceback" not in out, err[-1500:]
