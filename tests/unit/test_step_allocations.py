"""A plain FSDP step's reserved memory from a replay of its own allocations (issue 27 item 1;
cost_models/step_allocations.py), against the trace tier's replay of the allocations torch makes.

No trace runs here: the traced figures are the trace tier's at full size (`fsdp-plan trace --model llama3.1-8b --gpus
16 --gpu h100-80gb --seq-len 8192 --micro-batch 1 --global-batch 64 --activation-checkpointing full`, docs/accuracy.md
"At full size, pipelines": 23.84 GiB allocated, its replay 30.35 GiB with the 0.75 GiB context of then) and
benchmarks/allocator_replay.py's smaller ones. Each estimate here takes ~0.3 s of CPU.
"""

import pytest

from cost_models.caching_allocator import AllocatorSettings
from cost_models.memory import estimate_memory
from cost_models.profile import DEFAULT_PROFILE
from cost_models.step_allocations import replays, step_replay
from cost_models.units import GiB
from planner.api import estimate, plan

LLAMA_8B = dict(gpu="h100-80gb", seq_len=8192, micro_batch=1, global_batch=64, activation_checkpointing="full")
TRACED_ALLOCATED_GIB, TRACED_REPLAY_GIB = 23.84, 30.35 - 0.75   # the full-size trace's, context taken out


@pytest.fixture(scope="module")
def fsdp16():
    return estimate("llama3.1-8b", 16, **LLAMA_8B)


def test_a_plain_step_reserves_what_the_traces_replay_does(fsdp16):
    """The trace's replay reserves 1.24 x its allocated peak where the flat rule says 1.05. Measured at this commit:
    the estimate's replay 30.66 GiB (+3.6% on the trace's 29.60), its events' allocated peak the ledger's 23.84 GiB
    to 0.1%. Tolerance 5% (the pipeline replays' band on traced rows, docs/accuracy.md)."""
    m = fsdp16.memory
    walk = step_replay(fsdp16.model, fsdp16.cluster, fsdp16.training, fsdp16.config, snapshots=False)
    assert walk.peak_allocated_bytes == pytest.approx(m.peak_allocated_bytes, rel=0.005)
    assert m.peak_allocated_bytes / GiB == pytest.approx(TRACED_ALLOCATED_GIB, rel=0.005)
    assert m.allocator_reserved_bytes == walk.peak_reserved_bytes
    assert m.allocator_reserved_bytes / GiB == pytest.approx(TRACED_REPLAY_GIB, rel=0.05)
    assert m.allocator_reserved_bytes > 1.2 * m.peak_allocated_bytes
    assert any("replayed through the caching allocator" in n for n in m.notes)


def test_expandable_segments_strand_less(fsdp16):
    # one segment per stream and pool mapped in 20 MiB pages: 28.26 GiB at this commit, between allocated and defaults
    walk = step_replay(fsdp16.model, fsdp16.cluster, fsdp16.training, fsdp16.config,
                       AllocatorSettings(expandable_segments=True), snapshots=False)
    assert fsdp16.memory.peak_allocated_bytes < walk.peak_reserved_bytes < fsdp16.memory.allocator_reserved_bytes
    assert walk.peak_reserved_bytes / GiB == pytest.approx(28.26, abs=0.05)


def test_fits_stays_on_the_flat_rule_with_a_warning():
    """A GPU of 30 GiB: the flat rule (23.84 x 1.05 + outside ~ 25.8 GiB) fits, the replay (~31.4) would not - c10
    frees its cached segments and retries before an out-of-memory error, so it is a warning, not a refusal."""
    c = estimate("llama3.1-8b", 16, gpu_memory="30GiB", **LLAMA_8B)
    assert c.fits and c.memory.peak_reserved_bytes > 30 * GiB
    assert any(n.startswith("warning: the replay's reserved") for n in c.memory.notes)


def test_what_keeps_the_flat_rule(fsdp16):
    spec, training, config = fsdp16.model, fsdp16.training, fsdp16.config
    assert replays(spec, training, config, 16) is None
    assert replays(spec, training, config, 1) == "a shard group of one rank"
    offload = estimate("llama3.1-8b", 16, offload=True, **LLAMA_8B)
    # the ledger's own figure: the flat rule, max(allocated 16.36 GiB, the loss backward's reserved) x 1.05
    ledger = estimate_memory(offload.model, offload.cluster, offload.training, offload.config, DEFAULT_PROFILE)
    assert offload.memory.peak_reserved_bytes == ledger.peak_reserved_bytes
    assert offload.memory.allocator_reserved_bytes >= int(offload.memory.peak_allocated_bytes * 1.05)
    assert not any("replayed through" in n for n in offload.memory.notes)


def test_plan_shows_estimates_reserved_for_a_plain_step():
    """plan's pick (Plan.best replays it on first use, as the CLI's replay_top does the rows it prints) = estimate of
    its config = what the replay says; the search's figures stay flat."""
    p = plan("llama3.2-1b", 4, pp=1, tp=1, cp=1, ep=1, global_batch=8, seq_len=1024)
    best = p.best
    assert p.replayed == 1 and p.candidates[1].memory.peak_reserved_bytes == estimate_memory(
        p.model, p.cluster, p.training, p.candidates[1].config, DEFAULT_PROFILE).peak_reserved_bytes   # flat
    cfg = best.config
    again = estimate("llama3.2-1b", 4, sharding=cfg.sharding.value, precision=cfg.precision.value, compile=cfg.compile,
                     micro_batch=cfg.micro_batch, activation_checkpointing=cfg.activation_checkpointing,
                     global_batch=8, seq_len=1024, pp=1, tp=1, cp=1)
    assert best.memory.peak_reserved_bytes == again.memory.peak_reserved_bytes
    assert best.memory.notes[0].startswith("reserved") and "the step's allocations replayed" in best.memory.notes[0]
    assert best.memory.allocator_reserved_bytes == step_replay(best.model, best.cluster, best.training, cfg,
                                                               snapshots=False).peak_reserved_bytes
