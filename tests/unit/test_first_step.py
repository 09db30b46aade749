"""The first step against the steady one in every estimate (issue 29): MemoryEstimate.first_step_allocated_bytes,
the step replay's first step alone (step_allocations.step_replayed_reserved), the table line and the JSON field.
Checked against real steps in tests/distributed/test_torchrun_qlora.py (the warm-up step's peak)."""

from __future__ import annotations

from cost_models.units import GiB
from planner import api
from planner.reports.table import estimate_text


def test_llama3_8b_first_step_peaks_without_adams_states():
    c = api.estimate("llama3-8b", 8, gpu="h100-80gb")
    m = c.memory
    # AdamW in fp32 on 8 ranks: 2 states x 8.03e9 parameters x 4 B / 8 = 8.03e9 B (7.48 GiB), made in the first step;
    # the steady peak is in the backward, so the first step's is that much lower
    adam = m.phases["optimizer_step"].optimizer_state
    assert abs(adam - 2 * 4 * c.model.n_params / 8) < 8 * 1024 ** 2  # shards padded to whole rows
    assert m.peak_phase == "backward"
    assert m.first_step_allocated_bytes == m.peak_allocated_bytes - adam
    # replayed: the first step's reserved, at most the two steps' (the second forward can only add segments)
    assert m.outside_allocator_bytes + m.first_step_allocated_bytes < m.first_step_reserved_bytes <= m.peak_reserved_bytes
    first = c.to_dict()["memory"]["first_step"]
    assert first == {"peak_allocated_bytes": m.first_step_allocated_bytes, "optimizer_state_bytes": adam,
                     "peak_reserved_bytes": m.first_step_reserved_bytes}
    text = estimate_text(c)
    assert f"First step: {m.first_step_allocated_bytes / GiB:.1f} GiB allocated at its peak (steady " \
           f"{m.peak_allocated_bytes / GiB:.1f})" in text.replace("\n    ", " ")


def test_offloaded_state_leaves_the_first_step_as_the_steady_one():
    c = api.estimate("llama3-8b", 8, gpu="h100-80gb", offload=True)
    m = c.memory
    assert m.phases["optimizer_step"].optimizer_state == 0
    assert m.first_step_allocated_bytes == m.peak_allocated_bytes
    assert "First step: as the steady one" in estimate_text(c)
