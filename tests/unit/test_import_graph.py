"""No import circles in planner/, cost_models/ or calibration/ (issue 19 item 9): the modules form a graph that
points one way, counting every import - module-level and inside functions (lazy), absolute and relative - since a
lazy import hides a circle at import time but not from the reader. Read from the source with ast: nothing is
imported."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("planner", "cost_models", "calibration")


def module_names(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package by its __init__.py)."""
    names = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            names[name.removesuffix(".__init__")] = path
    return names


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules among `packages` it imports anywhere in its source. `from X import a` names the
    submodule X.a when a is one, else X itself."""
    names = module_names(root, packages)
    graph = {name: set() for name in names}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in names]
                targets = subs if len(subs) == len(node.names) else [target, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in names and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; iterative."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        u = stack.pop()
                        on_stack.discard(u)
                        component.append(u)
                        if u == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w), on_stack.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return sorted(found)


@functools.cache
def _repo_graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


def _cycles_of(package: str) -> tuple[list[list[str]], str]:
    """The circles touching `package`, and the edges inside each (what the failure prints)."""
    graph = _repo_graph()
    found = [c for c in cycles(graph) if any(m.split(".")[0] == package for m in c)]
    edges = "\n".join(f"{m} -> {sorted(graph[m] & set(c))}" for c in found for m in c)
    return found, edges


def test_the_walk_finds_circles_through_lazy_and_relative_imports(tmp_path):
    # pkg.a imports pkg.b at module level (relative); pkg.b imports pkg.a inside a function (absolute);
    # pkg.c imports pkg.b only (`from . import b`); pkg.d imports nothing of pkg: one circle, {a, b}
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import thing\n")
    (pkg / "b.py").write_text("thing = 1\n\ndef late():\n    from pkg.a import thing\n    return thing\n")
    (pkg / "c.py").write_text("from . import b\n")
    (pkg / "d.py").write_text("import json\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.b"}, "pkg.d": set()}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_planner_has_no_import_circle():
    found, edges = _cycles_of("planner")
    assert found == [], f"import circles in planner/:\n{found}\nedges inside them:\n{edges}"


def test_cost_models_has_no_import_circle():
    found, edges = _cycles_of("cost_models")
    assert found == [], f"import circles in cost_models/:\n{found}\nedges inside them:\n{edges}"


def test_calibration_has_no_import_circle():
    found, edges = _cycles_of("calibration")
    assert found == [], f"import circles in calibration/:\n{found}\nedges inside them:\n{edges}"
