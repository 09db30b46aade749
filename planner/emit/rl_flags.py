"""The `# fsdp-plan: --flag value ...` comment line that --emit verl / trl write for the knobs the framework has no
key for (the GPU type, the vLLM version, mean lengths...), and its reading back by `fsdp-plan check`
(planner/doctor/readers/verl.py, trl_grpo.py): the flags are `fsdp-plan rl estimate`'s own (planner/rl/request.py)."""

from __future__ import annotations

import re
import shlex
import typing

from planner.errors import PlannerError

MARK = "fsdp-plan:"


def _table():
    from planner.request.knobs import knob_table

    from planner.rl.request import RlRequest

    return knob_table(RlRequest)


def _flag(k, value) -> list[str]:
    decls = k.flag.decls[0]
    if "/" in decls:  # --x/--no-x
        on, off = decls.split("/")
        return [on if value else off]
    return [decls, str(value)]


def planner_flags(r, names) -> str:
    """--model and the request fields `names` that differ from their default, as `fsdp-plan rl estimate` flags."""
    table, out = _table(), ["--model", str(r.model)]
    for name in names:
        k = table[name]
        value = getattr(r.cluster, name) if k.group == "cluster" else getattr(r, name)
        if value is not None and value != k.default:
            out += _flag(k, value)
    return shlex.join(out)


def read_planner_flags(text: str) -> dict:
    """The request fields of a `# fsdp-plan:` line in `text` (none: {}); `model` among them when it has --model."""
    line = next((m.group(1) for m in re.finditer(rf"^\s*#\s*{MARK}(.*)$", text, re.M)), None)
    if line is None:
        return {}
    by_flag = {}
    for name, k in _table().items():
        for decl in k.flag.decls:
            for i, spelled in enumerate(decl.split("/")):
                by_flag[spelled] = (name, k, None if "/" not in decl else i == 0)
    tokens, out = shlex.split(line), {}
    while tokens:
        flag = tokens.pop(0)
        if flag not in by_flag:
            raise PlannerError(MARK, f"unknown flag {flag!r} in the '# {MARK}' line; valid: the flags of "
                                     "`fsdp-plan rl estimate --help`")
        name, k, switch = by_flag[flag]
        if switch is not None:
            out[name] = switch
            continue
        if not tokens:
            raise PlannerError(MARK, f"{flag} has no value in the '# {MARK}' line")
        out[name] = typed(name, tokens.pop(0), flag)
    return out


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def typed(name: str, text, where: str):
    """`text` (as written in a script or a YAML) as the request field `name`'s type; `where`: the key or flag
    to name when it does not read."""
    k = _table()[name]
    base = k.flag.cli_type or next(t for t in (typing.get_args(k.type) or (k.type,)) if t is not type(None))
    if isinstance(text, base) and not (base is int and isinstance(text, bool)):
        return text
    value = str(text).strip().strip("'\"")
    try:
        if base is bool:
            return _BOOLS[value.lower()]
        return int(value) if base is int else float(value) if base is float else value
    except (KeyError, ValueError):
        kind = "true or false" if base is bool else f"a number ({base.__name__})"
        raise PlannerError(where, f"{text!r} is not {kind}") from None
