"""The pipeline rank replay compiled per schedule shape (cost_models/pipeline_rank_replay.py): one replay weighed by
each configuration's bytes, its rows' parts adding up to their totals, and the peak it finds the estimate's."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.memory import estimate_memory
from cost_models.pipeline import rank_stages
from cost_models.pipeline_memory import rank_inputs
from cost_models.pipeline_rank_memory import rank_memory
from cost_models.pipeline_rank_replay import replay, stage_layout, stage_values
from cost_models.pipeline_stage_pieces import shaped_stage_pieces
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig
from cost_models.units import DTYPE_BYTES
from tests.unit.test_pipeline_memory import specs


def weighed(cfg: FsdpConfig, rank: int):
    """The rank's replay and its variables' values under cfg (as rank_memory builds them)."""
    spec, cluster, training = specs(8)
    model, training = rank_inputs(spec, training, cfg)
    d = cfg.shard_group_size(cluster)
    c = DTYPE_BYTES[cfg.precision.compute_dtype]
    p = DTYPE_BYTES[cfg.precision.param_dtype]
    r = DTYPE_BYTES[cfg.gradient_reduce_dtype]
    pieces = [shaped_stage_pieces(model, training, cfg, st, {}) for st in rank_stages(model, cfg, rank)]
    order = replay(cfg.pp_schedule, cfg.pp, cfg.pp_stages_per_rank, cfg.pp_microbatches, rank,
                   tuple(stage_layout(x) for x in pieces), r == c, d > 1)
    mem = rank_memory(model, training, cfg, d, rank, DEFAULT_PROFILE, 0)
    tokens_h = cfg.micro_batch * training.seq_len * model.hidden_size * c  # one microbatch's hidden states (tp 1)
    # the receive buffers: one per microbatch into each stage but the first (activations), the last (gradients)
    buffers = sum(cfg.pp_microbatches * tokens_h * ((not x.stage.embedding) + (not x.stage.head)) for x in pieces)
    values = [mem.breakdown.sharded_params, mem.breakdown.optimizer_state, buffers, tokens_h]
    for x in pieces:
        values += stage_values(x, c, p, r, d)
    return order, np.array(values, dtype=np.int64)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev", "gpipe"])
def test_each_rows_parts_add_up_to_its_total(schedule):
    cfg = FsdpConfig(pp=2, pp_schedule=schedule, micro_batch=2, grad_accum=4, precision="bf16")
    for rank in range(2):
        order, values = weighed(cfg, rank)
        totals = order.totals @ values
        assert len(totals) > 10
        for row in range(len(totals)):
            assert sum(order.parts(row, values)) == totals[row], (schedule, rank, order.whats[row])


def test_checkpointing_shares_one_replay():
    """The replay reads the schedule's shape, not the bytes: every activation checkpointing weighs the same rows."""
    replay.cache_clear()
    for ac in (0, 1, 2):
        ranks = estimate_memory(*specs(8), FsdpConfig(pp=4, pp_schedule="interleaved-1f1b", micro_batch=2,
                                                      grad_accum=8, ac_every=ac), DEFAULT_PROFILE).pipeline_ranks
        assert len(ranks) == 4
    info = replay.cache_info()
    assert info.misses == 4 and info.hits == 8  # one replay per rank, weighed three times


def test_the_peak_is_the_first_largest_row():
    """The peak moment the estimate names is the replay's first row of the largest total (a later equal one is the
    same state again: 1F1B's steady state)."""
    cfg = FsdpConfig(pp=2, pp_schedule="1f1b", micro_batch=2, grad_accum=8)
    spec, cluster, training = specs(8)
    model, local = rank_inputs(spec, training, cfg)
    for rank in range(2):
        order, values = weighed(cfg, rank)
        totals = order.totals @ values
        top = int(np.flatnonzero(totals == totals.max())[0])
        what, mb, stage = order.whats[top]
        mem = rank_memory(model, local, cfg, cfg.shard_group_size(cluster), rank, DEFAULT_PROFILE, 0)
        assert mem.peak_moment.startswith(what) and (mb is None or f"microbatch {mb} " in mem.peak_moment)
        assert mem.peak_allocated_bytes == totals[top]
