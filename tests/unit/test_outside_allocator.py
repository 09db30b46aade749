"""The memory outside PyTorch's caching allocator, term by term (cost_models/outside_allocator.py): values worked by
hand from NCCL's documented buffer sizes, the mesh's communicators, explain's listing, the override interface."""

import pytest

from cost_models.outside_allocator import TERMS, outside_allocator_terms, parse_overrides, process_groups
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.specs import FsdpConfig, SpecError
from cost_models.units import GiB, KiB, MiB
from planner.hardware import make_cluster

# NCCL's defaults (src/init.cc): LL 8 lines x 512 threads x 8 steps x 16 B, LL128 120 x 640 x 8 x 8 B, Simple 4 MiB
LL, LL128, SIMPLE = 524_288, 4_915_200, 4_194_304
CONNECTION = LL + LL128 + SIMPLE            # 9,633,792 B: one ring channel's receive buffers
NVLS_HEAD = 16 * 2 * 128 * KiB * 8          # 32 MiB: NVLS channels x 2 x chunk x steps


def terms(cluster, config, profile=DEFAULT_PROFILE, **kw) -> dict:
    return {t.name: t.bytes for t in outside_allocator_terms(cluster, config, profile, **kw)}


def test_fsdp_on_one_h100_node_by_hand():
    # one communicator (the 1-D mesh over the world reuses the default group): 24 ring channels of the three
    # protocols' buffers, NVLS over the 8 GPUs of the NVSwitch, Hopper's context
    t = terms(make_cluster(8, "h100-80gb"), FsdpConfig())
    assert [g.name for g in process_groups(make_cluster(8, "h100-80gb"), FsdpConfig())] == ["fsdp"]
    assert t["nccl"] == 24 * CONNECTION == 231_211_008
    assert t["nvls"] == 8 * NVLS_HEAD == 268_435_456
    assert t["cuda_context"] == int(0.5 * GiB)
    assert sum(t.values()) == 536_870_912 + 231_211_008 + 268_435_456     # 0.965 GiB, inside hardware.md's 0.5-1 GB
    assert set(t) == set(TERMS)


def test_a_2d_mesh_has_a_communicator_per_dimension_and_the_world():
    # FSDP 2 x TP 8 on 2 nodes: TP inside a node (NVLS), FSDP across nodes (ranks 8 apart), the world's own group
    cluster, config = make_cluster(16, "h100-80gb"), FsdpConfig(tp=8)
    groups = {g.name: g for g in process_groups(cluster, config)}
    assert set(groups) == {"tp", "fsdp", "world"}
    assert groups["tp"].in_domain and not groups["fsdp"].in_domain and not groups["world"].in_domain
    t = terms(cluster, config)
    assert t["nccl"] == 3 * 24 * CONNECTION and t["nvls"] == 8 * NVLS_HEAD


def test_pcie_parts_and_pipelines_and_async_tp():
    # L40S: PCIe only, 4 ring channels, no NVLS
    t = terms(make_cluster(8, "l40s"), FsdpConfig())
    assert t["nccl"] == 4 * CONNECTION and t["nvls"] == 0
    # pp 4: the busiest rank's two neighbours, a 2-rank communicator each, 2 channels of Simple
    assert terms(make_cluster(32, "h100-80gb"), FsdpConfig(pp=4))["pp_p2p"] == 2 * 2 * SIMPLE
    # async TP: 2 x b x s/tp x h x 2 B (the matmul + reduce-scatter's two output chunks) + the signal pad
    from cost_models.specs import TrainingSpec
    from planner.models import load_preset

    model = load_preset("llama3-8b")
    config = FsdpConfig(tp=8, compile=True, async_tp=True, micro_batch=2)
    t = terms(make_cluster(64, "h100-80gb"), config, model=model, training=TrainingSpec(seq_len=8192))
    assert t["symmetric_memory"] == 2 * 2 * 1024 * 4096 * 2 + 32 * 72 * 4 == 33_563_648


def test_nccl_variables_change_the_buffers_as_nccl_reads_them():
    cluster, config = make_cluster(8, "h100-80gb"), FsdpConfig()
    base = terms(cluster, config)
    bigger = terms(cluster, config, Profile(outside_allocator=parse_overrides(["NCCL_BUFFSIZE=8388608"])))
    assert bigger["nccl"] - base["nccl"] == 24 * 4 * MiB
    off = terms(cluster, config,
                Profile(outside_allocator=parse_overrides(["NCCL_NVLS_ENABLE=0", "NCCL_PROTO=^LL128"])))
    assert off["nvls"] == 0 and off["nccl"] == 24 * (LL + SIMPLE)
    assert terms(cluster, config, Profile(outside_allocator=(("NCCL_MAX_NCHANNELS", 8),)))["nccl"] == 8 * CONNECTION


def test_a_measured_context_replaces_the_context_and_nccl_terms():
    # calibration measures (total - free) - memory_reserved: the context and the run's communicators together
    t = terms(make_cluster(8, "h100-80gb"), FsdpConfig(), Profile(cuda_context_bytes=700 * MiB))
    assert t["cuda_context"] == 700 * MiB and t["nccl"] == t["nvls"] == t["pp_p2p"] == 0
    assert sum(t.values()) == 700 * MiB
    assert terms(make_cluster(2, "h100-80gb"), FsdpConfig(), Profile(cuda_context_bytes=0))["cuda_context"] == 0


@pytest.fixture(scope="module")
def default_and_overridden():
    from planner.api import estimate

    setup = dict(gpu="h100-80gb", micro_batch=1, seq_len=2048)
    return estimate("llama3.2-1b", 8, **setup), estimate("llama3.2-1b", 8, outside_allocator=["nccl=1"], **setup)


def test_an_override_changes_the_total_by_exactly_its_amount(default_and_overridden):
    c, o = default_and_overridden
    nccl = next(t.bytes for t in c.memory.outside_allocator if t.name == "nccl")
    assert o.memory.peak_reserved_bytes - c.memory.peak_reserved_bytes == GiB - nccl
    assert o.memory.allocator_reserved_bytes == c.memory.allocator_reserved_bytes
    # fits counts everything on the GPU; the allocator's part is what torch.cuda.max_memory_reserved shows
    assert c.memory.peak_reserved_bytes == c.memory.allocator_reserved_bytes + c.memory.outside_allocator_bytes
    assert c.to_dict()["memory"]["outside_allocator_bytes"] == c.memory.outside_allocator_bytes == 1_036_517_376


def test_explain_lists_every_term_with_its_source(default_and_overridden):
    from planner.reports.explain import memory_terms

    rows = {term: (formula, source) for term, formula, source in memory_terms(default_and_overridden[1])}
    for name in TERMS:
        formula, source = rows[f"outside the allocator: {name}"]
        assert formula.split(":")[0].endswith(" GiB") and source
    assert rows["outside the allocator: nccl"][0].startswith("1.00 GiB: overridden (was 0.22 GiB")
    assert "DataPtr" in rows["inside the allocator, not counted again"][1]       # cuBLAS: in the allocator


def test_bad_overrides_are_one_line_naming_the_field(capsys):
    from planner.cli import main

    with pytest.raises(SpecError, match="outside_allocator: unknown term 'context'; choose one of: cuda_context"):
        parse_overrides(["context=1"])
    with pytest.raises(SpecError, match="NCCL_BUFFSIZE='4M': an integer"):
        parse_overrides(["NCCL_BUFFSIZE=4M"])
    assert parse_overrides(["cuda_context=0.5", "nccl=512MiB"]) == (("cuda_context", GiB // 2), ("nccl", 512 * MiB))
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--model", "llama3.2-1b", "--gpus", "8", "--outside-allocator", "nccl"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: outside_allocator: 'nccl' is not TERM=GiB; terms: cuda_context, nccl, nvls")
