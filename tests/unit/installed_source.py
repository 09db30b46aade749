"""A function compiled out of an installed package's source file without importing the package (verl's __init__
needs ray; importing trl takes ~20 s here): the names its module would give it come from the caller's namespace."""

import ast
import importlib.util
from pathlib import Path

import pytest


def function_from(package: str, relative_path: str, name: str, namespace: dict):
    """`name` from `package`/`relative_path` as installed, its annotations dropped (they may name what the namespace
    leaves out); skips the test where the package is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} not installed")
    source = (Path(spec.origin).parent / relative_path).read_text()
    node = next(n for n in ast.parse(source).body if getattr(n, "name", "") == name)
    node.returns = None
    for arg in node.args.args:
        arg.annotation = None
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"{package}/{relative_path}", "exec"), namespace)
    return namespace[name]
