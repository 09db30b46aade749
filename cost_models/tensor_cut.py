"""Per-token bytes cut into tensors of given widths, as the allocation walks write a lump of activations
(pipeline_allocations' walks, expert_unit_events)."""

from __future__ import annotations


def cut(per_token_bytes: int, widths: list[int]) -> list[int]:
    """Per-token bytes as tensors: each width (bytes per token) while it fits, then the remainder as one."""
    out, left = [], per_token_bytes
    for w in widths:
        if 0 < w <= left:
            out.append(w)
            left -= w
    return out + ([left] if left > 0 else [])
