"""cost_models/memory_shape.py: the ledger's shape, priced once across FSDP's own knobs, gives estimate_memory the same
estimate to the byte as pricing each candidate whole; the ledger's cheap moments keep MemoryBreakdown's fields."""

from __future__ import annotations

import itertools

from cost_models.memory import _Moment, estimate_memory
from cost_models.memory_types import MemoryBreakdown
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import Finetune, FsdpConfig, TrainingSpec
from planner.hardware import make_cluster
from planner.models import load_preset


def test_moment_fields_are_memory_breakdowns_in_order():
    # the ledger sums a moment's fields for its total and builds the peak's MemoryBreakdown from them positionally
    moment = _Moment(sharded_params=1, activations=5, collective_buffers=7)
    assert MemoryBreakdown(*moment) == MemoryBreakdown(sharded_params=1, activations=5, collective_buffers=7)
    assert sum(moment) == MemoryBreakdown(*moment).total_bytes == 13


def _shared_equals_whole(model, cluster, training, configs) -> dict:
    shapes: dict = {}
    for config in configs:
        assert estimate_memory(model, cluster, training, config, DEFAULT_PROFILE, shapes=shapes) == \
            estimate_memory(model, cluster, training, config, DEFAULT_PROFILE)
    return shapes


def test_fsdp_knobs_share_one_shape_and_price_the_same():
    """Strategy, offload, rate limiter, reshard group, shard group and accumulation: 2 x 2 x 2 x 2 configurations of one
    shape (Llama 3 8B, micro-batch 2, every 2nd block checkpointed, on 32 H100s); one shape priced, 16 estimates equal
    to pricing each whole, and the peaks differ (the knobs still move the model states and the buffers)."""
    model, cluster = load_preset("llama3-8b"), make_cluster(32, gpu="h100-80gb")
    training = TrainingSpec(seq_len=2048)
    configs = [FsdpConfig(sharding=sh, offload=off, limit_all_gathers=lim, micro_batch=2, ac_every=2, grad_accum=acc,
                          reshard_after_forward=8 if sh == "FULL_SHARD" else 0)
               for sh, off, lim, acc in itertools.product(("FULL_SHARD", "SHARD_GRAD_OP"), (False, True),
                                                          (False, True), (1, 4))]
    shapes = _shared_equals_whole(model, cluster, training, configs)
    assert len(shapes) == 1
    peaks = {estimate_memory(model, cluster, training, c, DEFAULT_PROFILE).peak_allocated_bytes for c in configs}
    assert len(peaks) > 8


def test_moe_qlora_and_mesh_shapes_price_the_same():
    """The ledger's other paths through the shared shape: MoE with expert units (Mixtral, dim-1 copy-outs), QLoRA's
    dequantized moments, TP with sequence parallel and CP; one shape per (model, mesh, knobs the shape reads)."""
    cluster = make_cluster(64, gpu="h100-80gb")
    mixtral = load_preset("mixtral-8x7b")
    moe = [FsdpConfig(sharding=sh, expert_units=True, expert_shard_dim=dim, ac_every=ac)
           for sh, dim, ac in itertools.product(("FULL_SHARD", "HYBRID_SHARD"), (0, 1), (0, 1))]
    # one shape per checkpointing: the experts' sharding (dim 0 or 1) is memory.py's counts', not the shape's
    assert len(_shared_equals_whole(mixtral, cluster, TrainingSpec(seq_len=4096), moe)) == 2
    llama = load_preset("llama3-8b")
    qlora = TrainingSpec(seq_len=2048, finetune=Finetune.QLORA)
    assert len(_shared_equals_whole(llama, cluster, qlora, [FsdpConfig(sharding=sh, ac_every=ac) for sh, ac in
                                                            itertools.product(("FULL_SHARD", "NO_SHARD"), (0, 1))])) == 2
    mesh = [FsdpConfig(sharding=sh, tp=2, cp=2, compile=True, micro_batch=1) for sh in ("FULL_SHARD", "HYBRID_SHARD")]
    assert len(_shared_equals_whole(llama, cluster, TrainingSpec(seq_len=32768), mesh)) == 1
