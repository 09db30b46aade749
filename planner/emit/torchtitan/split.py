"""The plan's stage split in torchtitan's own terms, so --emit torchtitan names it in two short flags instead of a
list of every block's name (module_fqns_per_model_part: thousands of characters on one line for a deep model).

torchtitan 0.3 (distributed/pipeline_parallel.py, _generate_llm_fqn_per_model_part) splits n_layers blocks over
S stages counting the embedding as `first_stage_less_layers` blocks and norm + head as `last_stage_less_layers`:
effective = n_layers + first + last, each stage effective // S blocks, the first effective % S stages one more,
the first and last stage less their weights. S is pp x 2 for looped schedules and pp for single-stage ones,
unless `pipeline_parallel_layers_per_stage` sets S = ceil(effective / layers_per_stage).
"""

from __future__ import annotations

import math


def generated_blocks_per_stage(n_layers: int, n_stages: int, first: int, last: int) -> tuple[int, ...] | None:
    """Blocks per stage torchtitan's generator makes (None where it raises: empty stages, a weight above the
    blocks per stage)."""
    if n_stages == 1:
        return (n_layers,)
    effective = n_layers + first + last
    per_stage, extra = divmod(effective, n_stages)
    if per_stage == 0 or first > per_stage or last > per_stage:
        return None
    counts = [per_stage + (s < extra) for s in range(n_stages)]
    counts[0] -= first
    counts[-1] -= last
    return tuple(counts) if sum(counts) == n_layers else None


def split_flags(n_layers: int, blocks: tuple[int, ...], pp: int, looped: bool) -> dict | None:
    """torchtitan parallelism options that make its generator split exactly `blocks` (None: no weights up to 2
    do; then module_fqns_per_model_part must list them)."""
    n_stages = len(blocks)
    default_stages = pp * (2 if looped else 1)
    weights = sorted(((f, l) for f in range(3) for l in range(3)), key=lambda w: (w != (1, 1), sum(w), w))
    for first, last in weights:  # torchtitan's defaults (1, 1) first, then the lightest that make the split
        if generated_blocks_per_stage(n_layers, n_stages, first, last) != blocks:
            continue
        flags = {"pipeline_parallel_first_stage_less_layers": first, "pipeline_parallel_last_stage_less_layers": last}
        if n_stages == default_stages:
            return flags
        effective = n_layers + first + last
        for per_stage in range(1, effective + 1):  # a layers_per_stage that gives this many stages
            if math.ceil(effective / per_stage) == n_stages:
                return {**flags, "pipeline_parallel_layers_per_stage": per_stage}
    return None
