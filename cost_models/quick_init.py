"""A faster __init__ for the frozen dataclasses a search builds by the ten thousand (FsdpConfig, MemoryEstimate,
MemoryBreakdown, TimeBreakdown, ...).

The __init__ dataclasses generates for frozen=True sets each field through object.__setattr__ (frozen's own
__setattr__ refuses assignment); for a class without slots or descriptors on its fields that stores the value in the
instance dict. quick_init gives the class an __init__ of the same signature - the same defaults and default factories,
then __post_init__ - that stores the fields in the instance dict directly: the same object, about 3x faster to make
(issue 27 item 6: ~600,000 field assignments in the TP search of benchmarks/search_speed.py).
"""

from __future__ import annotations

from dataclasses import MISSING, fields

_NO_VALUE = object()  # a default factory's field left out
_REPLACEABLE: set[type] = set()  # the quick_init classes without __post_init__ (replaced() copies them)


def quick_init(cls):
    """cls (a frozen dataclass: positional-or-keyword init fields, no slots) with the faster __init__."""
    if not cls.__dataclass_params__.frozen or "__slots__" in vars(cls):
        raise TypeError(f"quick_init: {cls.__name__} is not a frozen dataclass with an instance dict")
    params, lines, env = [], [], {"_NO_VALUE": _NO_VALUE}
    for f in fields(cls):
        if not f.init or f.kw_only or f.name in ("self", "fields_"):
            raise TypeError(f"quick_init: {cls.__name__}.{f.name} is not a plain init field")
        if f.default is not MISSING:
            env[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            env[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_NO_VALUE")
            lines.append(f"if {f.name} is _NO_VALUE: {f.name} = _factory_{f.name}()")
        else:  # (dataclass() itself refuses one after a field with a default)
            params.append(f.name)
        lines.append(f"fields_[{f.name!r}] = {f.name}")
    if hasattr(cls, "__post_init__"):
        lines.append("self.__post_init__()")
    else:
        _REPLACEABLE.add(cls)
    source = f"def __init__(self, {', '.join(params)}):\n    fields_ = self.__dict__\n" + "".join(
        f"    {line}\n" for line in lines)
    exec(source, env)  # noqa: S102 - the source is made above from the class's own field names
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init
    return cls


def replaced(obj, **changes):
    """dataclasses.replace(obj, **changes) of a quick_init class without __post_init__ (nothing to check or derive
    again): a new instance holding obj's fields with the changes, without replace()'s pass over every field."""
    cls = obj.__class__
    if cls not in _REPLACEABLE:
        raise TypeError(f"replaced: {cls.__name__} is not a quick_init class without __post_init__")
    unknown = changes.keys() - cls.__dataclass_fields__.keys()
    if unknown:
        raise TypeError(f"replaced: {cls.__name__} has no field {', '.join(sorted(unknown))}")
    new = object.__new__(cls)
    new.__dict__.update(obj.__dict__, **changes)
    return new
