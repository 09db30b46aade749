"""The CLI's options generated from the request's knobs (planner/request): a command lists the knobs it
takes, in the order --help shows them, and gets typer parameters with each knob's flag, type, default and
help. A command may word a knob's help or default its own way (`As`), never re-declare the knob."""

from __future__ import annotations

import inspect
import math
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Callable, Optional

import typer

from planner.request import Request, knob_table

_KEEP = object()


def finite_float(text: str) -> float:
    """The parser of every float flag: a finite number. float() reads "nan", "inf" and "-inf", which no
    bandwidth or timeout means and which slip past `<= 0` checks (NaN compares false to everything)."""
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise typer.BadParameter(f"{text!r} is not a finite number")
    return value


@dataclass(frozen=True)
class As:
    """A command's own default, help or flags for a knob (explain's "config: ..." flags default to None:
    given or not)."""

    default: object = _KEEP
    help: object = _KEEP
    decls: object = _KEEP


def _base_type(t):
    """int | None -> int; list[str] | None -> list[str]."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0] if len(args) == 1 else t
    return t


def knob_option(name: str, how: As = As(), request=Request) -> inspect.Parameter:
    """The typer parameter of one knob of `request` (a request class: Request, CalibrationRequest)."""
    k = {**knob_table(Request), **knob_table(request)}[name]
    default = k.default if how.default is _KEEP else how.default
    base = k.flag.cli_type or _base_type(k.type)
    hint = Optional[base] if default is None else base
    extra = {"parser": finite_float} if base is float else {}
    help_text = k.flag.help if how.help is _KEEP else how.help
    decls = k.flag.decls if how.decls is _KEEP else how.decls
    option = typer.Option(*decls, help=help_text, **extra)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[hint, option])


def param(name: str, hint, default) -> inspect.Parameter:
    """A command's own option (not a request knob: --top, --format, --out ...): hint is its
    Annotated[type, typer.Option(...)]."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint)


def options(*names: str, request=Request, **how: As) -> list[inspect.Parameter]:
    """The typer parameters of these knobs, in this order; `how`: the command's own wording of some."""
    return [knob_option(n, how.get(n, As()), request) for n in names]


def command(params: list[inspect.Parameter], body: Callable[..., object], doc: str) -> Callable:
    """A function typer reads as a command with `params` (in --help's order) that calls body(**values)."""
    def run(**values):
        return body(**values)

    run.__signature__ = inspect.Signature(params)
    run.__annotations__ = {p.name: p.annotation for p in params}
    run.__doc__ = doc
    return run
