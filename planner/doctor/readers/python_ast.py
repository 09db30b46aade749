"""The Python snippets `fsdp-plan check` reads (planner/doctor/readers/python_code.py), parsed with `ast` and never
run: the module's constants, every call by the name it is called by, the dicts of keyword arguments a function
body builds (`fsdp_kwargs = dict(...)`, `fsdp_kwargs["offload_policy"] = ...`, `{**fsdp_kwargs, ...}`) as they
stand where each call is made, the `if i % K == 0` around a call, and the comment text (the notes an emitter writes
where the code lives in the user's own hooks). A value that is not a literal the snippet spells out is one
PlannerError line naming it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from planner.errors import PlannerError

WORLD = "world"  # dist.get_world_size(): the ranks the snippet runs on, which it does not say


@dataclass
class CallSite:
    """One call: its name as written ("torch.optim.AdamW", "block.compile"), the node, the keyword arguments as
    the snippet has them at that point (spread dicts resolved), and the K of an enclosing `if i % K == 0`."""

    name: str
    node: ast.Call
    kwargs: dict = field(default_factory=dict)
    every: int = 0
    looped: bool = False  # inside a for / while loop of its function

    @property
    def short(self) -> str:
        return self.name.rpartition(".")[2]

    def arg_name(self, index: int = 0) -> str | None:
        args = self.node.args
        return dotted(args[index]) if len(args) > index else None


def dotted(node) -> str | None:
    """'torch.optim.AdamW' for a Name / Attribute chain (a call's callee: its name), else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call):
        base = dotted(node.func)
        return f"{base}()" if base else None
    return None


class Snippet:
    """A parsed snippet: constants (module-level NAME = literal), calls (every call, in source order), functions,
    attribute assignments (dotted target -> node) and the comments' text."""

    def __init__(self, text: str, source: str):
        self.text, self.source = text, source
        try:
            self.tree = ast.parse(text)
        except SyntaxError as exc:
            raise PlannerError("config", f"{source} is not valid Python: {exc.msg} (line {exc.lineno})") from None
        except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, nesting too deep for the parser
            raise PlannerError("config", f"{source} cannot be parsed as Python: {type(exc).__name__}") from None
        self.constants: dict[str, object] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        self.calls: list[CallSite] = []
        self.attr_assigns: dict[str, ast.AST] = {}
        self.imports: dict[str, str] = {}  # name as bound -> "module.name"
        self.bound: dict[str, ast.Call] = {}  # a name bound to a call's result, where the walk has reached
        self.every_of: dict[str, int] = {}  # a comprehension's name -> K of its `if i % K == 0` (0: none)
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    self.constants[node.targets[0].id] = ast.literal_eval(node.value)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    pass  # not a literal: a module-level expression (Block = modeling.X, strategy = ...)
            elif isinstance(node, ast.FunctionDef):
                self.functions[node.name] = node
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.imports[alias.asname or alias.name.partition(".")[0]] = alias.name
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and dotted(target):
                        self.attr_assigns[dotted(target)] = node.value
        self._walk(self.tree.body, {}, 0, False)

    # ------------------------------------------------------------ calls, in order, with the dicts as they stand

    def _walk(self, body: list, env: dict, every: int, looped: bool) -> None:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef):
                self._walk(stmt.body, dict(env), 0, False)
                continue
            if isinstance(stmt, ast.If):
                k = _every_k(stmt.test)
                self._calls_in(stmt.test, env, every, looped)
                self._walk(stmt.body, env, k or every, looped)
                self._walk(stmt.orelse, env, every, looped)
                continue
            if isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
                for part in ("iter", "test", "items"):
                    for node in _as_list(getattr(stmt, part, None)):
                        self._calls_in(node, env, every, looped)
                inner = looped or isinstance(stmt, (ast.For, ast.While))
                self._walk(stmt.body, env, every, inner)
                for part in ("orelse", "finalbody"):
                    self._walk(getattr(stmt, part, []), env, every, looped)
                for handler in getattr(stmt, "handlers", []):
                    self._walk(handler.body, env, every, looped)
                continue
            if isinstance(stmt, ast.ClassDef):
                self._walk(stmt.body, {}, 0, False)
                continue
            self._calls_in(stmt, env, every, looped)
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target = stmt.targets[0]
                if isinstance(target, ast.Name) and isinstance(stmt.value, (ast.SetComp, ast.ListComp)):
                    # checkpointed = {block for i, block in enumerate(blocks) if i % K == 0}
                    self.every_of[target.id] = next((k for gen in stmt.value.generators for test in gen.ifs
                                                     if (k := _every_k(test))), 0)
                elif isinstance(target, ast.Name) and _is_dict(stmt.value):
                    env[target.id] = self._dict_of(stmt.value, env)
                elif isinstance(target, ast.Name) and isinstance(stmt.value, ast.Call):
                    self.bound[target.id] = stmt.value  # mp = MixedPrecisionPolicy(...): read where it is passed
                elif (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                      and target.value.id in env and isinstance(target.slice, ast.Constant)):
                    env[target.value.id] = {**env[target.value.id], target.slice.value: stmt.value}

    def _calls_in(self, node, env: dict, every: int, looped: bool) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and (name := dotted(sub.func)):
                self.calls.append(CallSite(name, sub, self._kwargs_of(sub, env), every, looped))

    def _kwargs_of(self, call: ast.Call, env: dict) -> dict:
        out = {}
        for kw in call.keywords:
            if kw.arg is None:
                out.update(self._spread(kw.value, env))
            else:
                out[kw.arg] = self.bound.get(kw.value.id, kw.value) if isinstance(kw.value, ast.Name) else kw.value
        return out

    def _spread(self, node, env: dict) -> dict:
        if isinstance(node, ast.Name) and node.id in env:
            return env[node.id]
        if _is_dict(node):
            return self._dict_of(node, env)
        return {f"**{ast.unparse(node)}": node}  # not a dict the snippet builds: refused where a reader reads it

    def _dict_of(self, node, env: dict) -> dict:
        if isinstance(node, ast.Call):  # dict(a=..., **b)
            return self._kwargs_of(node, env)
        out = {}
        for key, value in zip(node.keys, node.values):
            if key is None:
                out.update(self._spread(value, env))
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                out[key.value] = value
            else:
                raise PlannerError("kwargs", f"cannot read the key {ast.unparse(key)}: write it as a string")
        return out

    # ------------------------------------------------------------ queries

    def named(self, *names: str) -> list[CallSite]:
        """The calls whose last name part is one of `names` (torch.optim.AdamW matches "AdamW")."""
        return [c for c in self.calls if c.short in names]

    def value(self, node, key: str):
        """The literal `node` spells: a constant, a module constant by name, `torch.bfloat16`-style attributes as
        their dotted name, dist.get_world_size() (and // of it) as WORLD; else PlannerError naming `key`."""
        if isinstance(node, ast.Name) and node.id in self.constants:
            return self.constants[node.id]
        if isinstance(node, ast.Name) and node.id in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[node.id]
        if isinstance(node, ast.Attribute):
            return dotted(node)
        if isinstance(node, ast.Call) and dotted(node.func) in ("dist.get_world_size",
                                                                 "torch.distributed.get_world_size"):
            return WORLD
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and \
                self.value(node.left, key) == WORLD:
            return WORLD
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(self.value(e, key) for e in node.elts)
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError):
            raise PlannerError(key, f"cannot read {ast.unparse(node)!r}: fsdp-plan check reads literals "
                                    "(True / False, numbers, torch.<dtype>) and the snippet's constants") from None

    def comments(self) -> str:
        """Every comment's text joined by spaces, whitespace collapsed (folded comments read as one line)."""
        parts = [m.group(1) for m in re.finditer(r"#\s?(.*)$", self.text, flags=re.M)]
        return " ".join(" ".join(parts).split())

    def says(self, note: str) -> bool:
        """The comments hold `note` (whitespace-insensitive)."""
        return " ".join(note.split()) in self.comments()


def _as_list(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def _is_dict(node) -> bool:
    return isinstance(node, ast.Dict) or (isinstance(node, ast.Call) and dotted(node.func) == "dict" and not node.args)


def _every_k(test) -> int:
    """K of `i % K == 0` (K >= 2), else 0."""
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.left, ast.BinOp) and isinstance(test.left.op, ast.Mod)
            and isinstance(test.left.right, ast.Constant) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == 0 and isinstance(test.left.right.value, int)):
        return test.left.right.value if test.left.right.value >= 2 else 0
    return 0
