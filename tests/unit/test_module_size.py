"""No module over about 400 lines in calibration/, cost_models/ and planner/ (issue 19 item 9: small modules with
one job). Counted from the source as `wc -l` counts it; nothing is imported."""

from __future__ import annotations

import pytest

from tests.unit.test_import_graph import ROOT, module_names

MAX_LINES = 400


def line_counts(package: str) -> dict[str, int]:
    """Module -> its number of lines (newlines, as wc -l), for every .py under the package."""
    return {name: path.read_bytes().count(b"\n") for name, path in module_names(ROOT, (package,)).items()}


def test_line_counts_are_wc_l(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n\ny = 2\n")  # 3 lines
    names = module_names(tmp_path, ("pkg",))
    assert {n: p.read_bytes().count(b"\n") for n, p in names.items()} == {"pkg": 0, "pkg.a": 3}


@pytest.mark.parametrize("package", ["calibration", "cost_models", "planner"])
def test_no_module_over_400_lines(package):
    counts = line_counts(package)
    assert len(counts) > 10  # the package was found
    over = {name: n for name, n in counts.items() if n > MAX_LINES}
    assert over == {}, f"modules over {MAX_LINES} lines in {package}/ (split them by job): {over}"
