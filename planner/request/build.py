"""Keyword arguments -> Request: each knob routed to its group by name (knobs.knob_table), over the groups
given whole (estimate(model, cluster=ClusterRequest(...), ...)); an unknown name is one PlannerError line."""

from __future__ import annotations

import dataclasses
import inspect

from ..errors import PlannerError
from .groups import ClusterRequest, ConfigRequest, MeshRequest, Request, SearchRequest, TrainingRequest
from .knobs import knob_table

GROUP_TYPES = {"cluster": ClusterRequest, "training": TrainingRequest, "config": ConfigRequest,
               "mesh": MeshRequest, "search": SearchRequest}


def knob_names(*groups: str) -> tuple[str, ...]:
    """The knobs of these groups ("" the top level, "config" its own knobs, "config.mesh" the mesh's), in
    declaration order."""
    return tuple(k.name for k in knob_table(Request).values() if k.group in groups)


def build_request(model=None, gpus=None, *, valid: tuple[str, ...] | None = None,
                  valid_groups: tuple[str, ...] = tuple(GROUP_TYPES), **kwargs) -> Request:
    """The Request of an API call: `kwargs` holds knobs by name and whole groups (cluster=, training=,
    config=, mesh=, search=); a knob given beside its group replaces the group's value. `valid`: the knob names
    this call takes (None: every knob), `valid_groups` the groups."""
    table = knob_table(Request)
    groups = {name: kwargs.pop(name) for name in list(kwargs) if name in valid_groups}
    for name in kwargs:
        if name not in table or name == "model" or (valid is not None and name not in valid):
            names = ", ".join(valid if valid is not None else [n for n in table if n != "model"])
            raise PlannerError(name, f"unknown argument; valid: {names}, {', '.join(valid_groups)}")
    for name, value in groups.items():
        if value is not None and not isinstance(value, GROUP_TYPES[name]):
            raise PlannerError(name, f"expected a {GROUP_TYPES[name].__name__}, got {type(value).__name__}")
    if gpus is not None:
        kwargs["gpus"] = gpus
    by_group: dict[str, dict] = {}
    for name, value in kwargs.items():
        by_group.setdefault(table[name].group, {})[name] = value

    def part(name: str, base):
        given = by_group.get(name, {})
        return dataclasses.replace(base, **given) if given else base

    mesh = part("config.mesh", groups.get("mesh") or (groups.get("config") or ConfigRequest()).mesh)
    config = dataclasses.replace(part("config", groups.get("config") or ConfigRequest()), mesh=mesh)
    top = by_group.get("", {})
    return Request(model=model, trust_remote_code=top.get("trust_remote_code", False), trainer=top.get("trainer"),
                   alloc_conf=top.get("alloc_conf"),
                   outside_allocator=top.get("outside_allocator"),
                   cluster=part("cluster", groups.get("cluster") or ClusterRequest()),
                   training=part("training", groups.get("training") or TrainingRequest()),
                   config=config, search=part("search", groups.get("search") or SearchRequest()))


def flat(request: Request, names: tuple[str, ...]) -> dict:
    """The knobs `names` of a request by name (the inverse of build_request for those knobs)."""
    table = knob_table(Request)
    out = {}
    for name in names:
        holder = request
        for part in filter(None, table[name].group.split(".")):
            holder = getattr(holder, part)
        out[name] = getattr(holder, name)
    return out


def api_signature(head: list[inspect.Parameter], names: tuple[str, ...], tail: list[inspect.Parameter] = (),
                  groups: tuple[str, ...] = tuple(GROUP_TYPES)) -> inspect.Signature:
    """A readable signature for help(): the function's own parameters, then every knob it takes as a
    keyword with its declared type and default, then its own keywords (`tail`) and the groups it takes."""
    table = knob_table(Request)
    knobs = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=table[n].default,
                               annotation=table[n].type) for n in names if n not in ("gpus",)]
    groups = [inspect.Parameter(g, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=GROUP_TYPES[g] | None)
              for g in groups]
    return inspect.Signature([*head, *knobs, *tail, *groups])
