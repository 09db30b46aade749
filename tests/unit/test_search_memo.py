"""planner/search/memo.py: a search prices each configuration once, and a pipeline's memory once across the knobs
the memory estimate does not read (Float8 linears, async TP); the evaluations equal evaluate()'s to the byte."""

from __future__ import annotations

import dataclasses
import itertools

from cost_models.evaluate import evaluate
from cost_models.profile import DEFAULT_PROFILE
from cost_models.schedules import Schedule
from cost_models.specs import FsdpConfig, TrainingSpec
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.search.memo import MEMORY_FREE_FIELDS, Costing


def test_pipeline_memory_is_priced_once_across_float8_and_async_tp_and_equals_evaluate():
    model, cluster = load_preset("llama3-8b"), make_cluster(16, gpu="h100-80gb")
    training = TrainingSpec(seq_len=2048, global_batch=32)
    base = FsdpConfig(micro_batch=1, grad_accum=8, tp=2, pp=4, pp_schedule=Schedule.INTERLEAVED_1F1B,
                      pp_stages_per_rank=2, compile=True, sequence_parallel=True, ac_every=2)
    costing = Costing(model, cluster, training, DEFAULT_PROFILE)
    configs = [dataclasses.replace(base, float8=f8, async_tp=a) for f8, a in itertools.product((False, True), repeat=2)]
    for config in configs + configs:  # the second round: the same Evaluation objects, nothing priced again
        memo = costing.evaluate(config)
        assert memo == evaluate(model, cluster, training, config, DEFAULT_PROFILE)
    assert len(costing.evaluations) == 4 and len(costing.memories) == 1
    # the knobs change the step (Float8's faster matmuls, async TP's hidden collectives), not the allocator's memory;
    # async TP adds its symmetric-memory workspace outside it: 2 x b 1 x s/tp 1,024 x h 4,096 x 2 B + the signal pad
    steps = {costing.evaluations[c].time.step_s for c in configs}
    assert len(steps) == 4
    peaks = {costing.evaluations[c].memory.allocator_reserved_bytes for c in configs}
    assert len(peaks) == 1 and peaks.pop() > 10 * 2**30
    outside = {c.async_tp: costing.evaluations[c].memory.outside_allocator_bytes for c in configs}
    assert outside[True] - outside[False] == 2 * 1024 * 4096 * 2 + 32 * 72 * 4 == 16_786_432
    assert MEMORY_FREE_FIELDS == {"float8", "async_tp"}


def test_plain_mesh_shares_memory_across_backward_prefetch_and_time_across_the_rate_limiter():
    """FSDP1's knobs: the backward prefetch changes only the step (exposed all-gathers), the rate limiter only the
    memory (all-gathers in flight); each is priced once across the other and every evaluation equals evaluate()'s."""
    model, cluster = load_preset("llama3-8b"), make_cluster(16, gpu="h100-80gb")
    training = TrainingSpec(seq_len=2048)
    costing = Costing(model, cluster, training, DEFAULT_PROFILE)
    configs = [FsdpConfig(micro_batch=2, backward_prefetch=p, limit_all_gathers=lim)
               for p, lim in itertools.product((False, True), repeat=2)]
    for config in configs:
        assert costing.evaluate(config) == evaluate(model, cluster, training, config, DEFAULT_PROFILE)
    assert len(costing.evaluations) == 4 and len(costing.estimates) == 2 and len(costing.times) == 2
    assert len(costing.hosts) == 1
    steps = {c.backward_prefetch: costing.evaluations[c].time.step_s for c in configs}
    assert steps[False] > steps[True]  # without prefetch the backward's all-gathers are exposed
    peaks = {c.limit_all_gathers: costing.evaluations[c].memory.peak_allocated_bytes for c in configs}
    assert peaks[False] > peaks[True]  # without the limiter a second block's all-gather is in flight
    # FSDP's own knobs leave the blocks' compute alone (step_time.FSDP_ONLY_FIELDS): one priced compute part for
    # every strategy and offload, each step still its own (SHARD_GRAD_OP gathers once, offload copies the shards)
    others = [FsdpConfig(micro_batch=2, sharding=s, offload=o)
              for s, o in (("SHARD_GRAD_OP", False), ("FULL_SHARD", True))]
    for config in others:
        assert costing.evaluate(config) == evaluate(model, cluster, training, config, DEFAULT_PROFILE)
    assert len(costing.step_parts) == 1 and len({costing.evaluations[c].time.step_s for c in configs + others}) == 4


def test_ledger_without_a_pipeline_is_priced_once_across_float8_and_async_tp():
    """The same sharing without PP (no EP: no DeepEP buffer among the outside terms): one ledger, four evaluations
    equal to evaluate()'s, async TP's symmetric-memory workspace (2 x b 1 x s/tp 1,024 x h 4,096 x 2 B + the signal
    pad) the only difference in what the GPU must hold."""
    model, cluster = load_preset("llama3-8b"), make_cluster(16, gpu="h100-80gb")
    training = TrainingSpec(seq_len=2048)
    costing = Costing(model, cluster, training, DEFAULT_PROFILE)
    configs = [FsdpConfig(micro_batch=1, tp=2, compile=True, float8=f8, async_tp=a)
               for f8, a in itertools.product((False, True), repeat=2)]
    for config in configs:
        assert costing.evaluate(config) == evaluate(model, cluster, training, config, DEFAULT_PROFILE)
    assert len(costing.memories) == 1 and len(costing.estimates) == 4
    reserved = {c.async_tp: costing.evaluations[c].memory.peak_reserved_bytes for c in configs if not c.float8}
    assert reserved[True] - reserved[False] == 16_786_432


def test_compute_parts_shared_across_one_compute_dtype_and_the_pipeline_fields():
    """The blocks' and the mesh's seconds read of the precision its compute dtype alone, and no pipeline field
    (step_time._PARTS_FIELDS): bf16 and bf16-pure, and a pipeline of the same blocks, share one priced compute part,
    fp32 has its own; every evaluation equals evaluate()'s."""
    model, cluster = load_preset("llama3-8b"), make_cluster(16, gpu="h100-80gb")
    training = TrainingSpec(seq_len=2048, global_batch=32)
    costing = Costing(model, cluster, training, DEFAULT_PROFILE)
    configs = [FsdpConfig(micro_batch=1, grad_accum=4, tp=2, precision="bf16"),
               FsdpConfig(micro_batch=1, grad_accum=4, tp=2, precision="bf16-pure"),
               FsdpConfig(micro_batch=1, grad_accum=8, tp=2, precision="bf16", pp=2)]
    for config in configs:
        assert costing.evaluate(config) == evaluate(model, cluster, training, config, DEFAULT_PROFILE)
    assert len(costing.step_parts) == 1 and len({costing.evaluations[c].time.step_s for c in configs}) == 3
    fp32 = FsdpConfig(micro_batch=1, grad_accum=4, tp=2, precision="fp32")
    assert costing.evaluate(fp32) == evaluate(model, cluster, training, fp32, DEFAULT_PROFILE)
    assert len(costing.step_parts) == 2


def test_a_ledger_with_offload_is_its_twin_without_offload_with_the_states_on_the_host():
    """cost_models/offload_moments.py: a search's ledger with CPU offload is made from the same configuration's without
    it (its moments less the sharded states), and one without a backward prefetch is the same with or without the rate
    limiter; equal to evaluate()'s to the byte (repr: ints stay ints); QLoRA's QuantState stays on the GPU. Llama3-8B full fine-tuning on 16 GPUs, FULL_SHARD mb 2: both peak at the same moment,
    before any sharded gradient is made; offload takes the fp32 params' and Adam's two states' shards off the GPU,
    12 B x 8,030,261,248 / 16 = 6,022,695,936 B of the peak."""
    cluster = make_cluster(16, gpu="h100-80gb")
    for name, training in (("llama3-8b", TrainingSpec(seq_len=2048)),
                           ("llama3-8b", TrainingSpec(seq_len=2048, finetune="qlora"))):
        model = load_preset(name)
        costing = Costing(model, cluster, training, DEFAULT_PROFILE)
        configs = [FsdpConfig(micro_batch=mb, sharding=s, offload=o, limit_all_gathers=lim) for mb, s, o, lim in
                   itertools.product((1, 2), ("FULL_SHARD", "SHARD_GRAD_OP"), (False, True), (True, False))]
        for config in configs:
            memo, alone = costing.evaluate(config), evaluate(model, cluster, training, config, DEFAULT_PROFILE)
            assert repr(memo) == repr(alone)
        # per micro-batch FULL_SHARD's with and without the rate limiter, SHARD_GRAD_OP's one (nothing prefetched)
        assert len(costing.ledgers) == 2 * 3
    full = load_preset("llama3-8b")
    costing = Costing(full, cluster, TrainingSpec(seq_len=2048), DEFAULT_PROFILE)
    on, off = (costing.evaluate(FsdpConfig(micro_batch=2, offload=o)).memory for o in (False, True))
    assert on.peak_moment == off.peak_moment
    assert on.peak_allocated_bytes - off.peak_allocated_bytes == 12 * 8_030_261_248 // 16 == 6_022_695_936
