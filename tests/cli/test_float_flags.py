"""Every float flag of every command takes finite numbers only (issue 11): `nan`, `inf` and `-inf` are read
by float() but mean no bandwidth or timeout, so they end in the usual one line naming the flag and exit 2.

The flags are found by walking the typer app, so a float flag added later is covered without editing this
file. Runs `planner.cli.main` in-process (the console entry point) and a few real subprocesses.
"""

import math
import subprocess
import sys

import pytest
import typer.main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import app, main

# Arguments under which each command would run (and, before the fix, did run) with any finite value.
BASE = {
    None: ["--model", "gpt-125m", "--gpus", "8"],
    "estimate": ["estimate", "--model", "gpt-125m", "--gpus", "8"],
    "trace": ["trace", "--model", "gpt-125m", "--gpus", "8"],
    "check": ["check", "--model", "gpt-125m", "--gpus", "8", "--sharding", "FULL_SHARD", "--precision", "bf16"],
    "explain": ["explain", "--model", "gpt-125m", "--gpus", "8"],
    "calibrate": ["calibrate", "--model", "gpt-125m", "--gpus", "8", "--emit", "slurm"],  # prints, runs nothing
    "rl": ["rl", "--model", "qwen2.5-7b", "--gpus", "8"],
    "rl estimate": ["rl", "estimate", "--model", "qwen2.5-7b", "--gpus", "8"],
}


def _float_flags():
    group = typer.main.get_command(app)
    commands = [(None, group)] + [(name, cmd) for name, cmd in group.commands.items()]
    commands += [(f"{name} {sub}", subcommand) for name, cmd in group.commands.items()  # fsdp-plan rl estimate
                 for sub, subcommand in getattr(cmd, "commands", {}).items()]
    return [(name, param.opts[0]) for name, cmd in commands for param in cmd.params
            if getattr(getattr(param, "type_descriptor", None), "annotation", None) is float]


FLOAT_FLAGS = _float_flags()


def invoke(argv, capsys):
    """(exit code, stdout, stderr) of `fsdp-plan ARGV`; an exception escaping main() fails the test."""
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_walk_finds_every_known_float_flag():
    assert set(FLOAT_FLAGS) >= {(None, "--internode-gbps"), ("estimate", "--pcie-gb-per-s"),
                                ("check", "--intra-node-gb-per-s"), ("explain", "--internode-gbps"),
                                ("trace", "--internode-gbps"), ("calibrate", "--timeout"),
                                ("rl", "--gpu-memory-utilization"), ("rl estimate", "--gpu-memory-utilization")}
    assert {name for name, _ in FLOAT_FLAGS} <= set(BASE)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("command,flag", FLOAT_FLAGS, ids=[f"{c or 'plan'}{f}".replace(" ", "-") for c, f in FLOAT_FLAGS])
def test_non_finite_value_is_one_line_naming_the_flag(command, flag, value, capsys):
    code, out, err = invoke([*BASE[command], flag, value], capsys)
    assert code == 2, (out, err)
    assert err.strip() == f"error: Invalid value for '{flag}': '{value}' is not a finite number"
    assert out == ""


# One value through a real process (`python -m planner.cli`); inf and -inf of the same flag and command are
# test_non_finite_value_is_one_line_naming_the_flag's [plan--internode-gbps] cases, in-process.
@pytest.mark.parametrize("value", ["nan"])
def test_console_entry_point_rejects_the_issue_command(value):
    r = subprocess.run([sys.executable, "-m", "planner.cli", "--model", "gpt-13b", "--gpus", "8",
                        "--internode-gbps", value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"error: Invalid value for '--internode-gbps': '{value}' is not a "
                                             "finite number"]


_float_text = st.one_of(st.floats().map(repr), st.floats().map(str), st.integers().map(str),
                        st.sampled_from(["NaN", "+inf", "-Infinity", "1e999", "-0.0", "5e-324", "0x10", "1_0"]),
                        st.text(max_size=12))


# capsys is safe to share across examples: invoke() reads (and so empties) it every time.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command_flag=st.sampled_from([("estimate", "--internode-gbps"), ("estimate", "--pcie-gb-per-s"),
                                     (None, "--intra-node-gb-per-s"), ("calibrate", "--timeout")]),
       text=_float_text)
def test_any_text_for_a_float_flag_is_a_result_or_one_line(command_flag, text, capsys):
    command, flag = command_flag
    code, out, err = invoke([*BASE[command], f"{flag}={text}"], capsys)  # `=`: a leading "-" stays the value
    assert "Traceback" not in out + err
    assert code in (0, 2), (code, err)
    try:
        finite = math.isfinite(float(text))
    except ValueError:
        finite = False
    if not finite:
        assert code == 2, (text, out)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
