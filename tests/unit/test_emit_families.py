"""Emitted code names real transformers modules and classes for every preset's family."""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest

pytest.importorskip("transformers")

from planner.api import plan  # noqa: E402
from planner.models import list_presets, load_preset  # noqa: E402

ONE_PER_FAMILY = sorted({load_preset(n).family: n for n in list_presets()}.values())


@pytest.mark.parametrize("preset", ONE_PER_FAMILY)
def test_lightning_snippet_imports_the_block_class(preset):
    """The Lightning snippet imports the modeling module by path: it must exist and hold the block class
    (gemma3_text lives in transformers.models.gemma3)."""
    from planner.emit import emit_lightning

    # A spec: no block profile to trace. Lightning's FSDPStrategy holds no mesh (a TP / CP / EP / PP pick is
    # refused in one line), so the search is pinned to FSDP alone (tp = cp = ep = pp = 1) and the snippet is the
    # best FSDP-only pick: a MoE preset prices ~4,000 candidates (~3 s on 2 busy cores), not ~16,000 with pp
    # 1-8 nor ~36,000 with the whole mesh.
    p = plan(load_preset(preset), 64, gpu="h100-80gb", seq_len=1024, tp=1, cp=1, ep=1, pp=1)
    best = p.best or p.misses[0]
    config = dataclasses.replace(best.config, tp=1, cp=1, ep=1, async_tp=False, sequence_parallel=True)
    code = emit_lightning(config, p.model, p.cluster)
    module_path = re.search(r"from (transformers\.models\.\w+) import (modeling_\w+) as modeling", code)
    assert module_path, code
    module = importlib.import_module(f"{module_path[1]}.{module_path[2]}")
    assert hasattr(module, p.model.block_class)
