"""A knob is a request field declared once: its type and default (the dataclass field), its CLI flag and help
text (the field's metadata). The API's signatures, the CLI's typer options and the routing of keyword
arguments into groups are all read from these declarations (planner/request/groups.py holds them)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Flag:
    """How a knob is spelled on the command line. decls: typer's declarations ("--gpus", "-g" or
    "--offload/--no-offload"; empty: an API-only knob); cli_type: the flag's value type where it is not the
    field's (a size: the text "80GiB", the API also takes bytes)."""

    decls: tuple[str, ...] = ()
    help: str | None = None
    cli_type: object = None


def knob(default=None, *decls: str, help: str | None = None, cli_type=None):
    """A request field with its flag; `default` is the API's and the CLI's."""
    return field(default=default, metadata={"flag": Flag(tuple(decls), help, cli_type)})


@dataclass(frozen=True)
class Knob:
    name: str
    group: str            # the attribute of Request holding it ("cluster", "config.mesh", ...), "" at the top
    type: object          # the field's type, resolved
    default: object
    flag: Flag


def knobs_of(cls, group: str = "") -> list[Knob]:
    """The knobs of a request dataclass in declaration order, nested groups (fields without a flag whose type
    is a dataclass) flattened after their parent's own knobs in place."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata:
            out.append(Knob(f.name, group, hints[f.name], f.default, f.metadata["flag"]))
        elif dataclasses.is_dataclass(hints[f.name]):
            out.extend(knobs_of(hints[f.name], f"{group}.{f.name}".lstrip(".")))
    return out


@functools.cache
def knob_table(cls) -> dict[str, Knob]:
    """Name -> knob for a request class; a name declared twice is a bug in the declarations."""
    table = {}
    for k in knobs_of(cls):
        if k.name in table:
            raise TypeError(f"knob {k.name!r} declared twice ({table[k.name].group!r}, {k.group!r})")
        table[k.name] = k
    return table
