"""planner.search explores selective-op checkpointing, per-block compile, Float8 (+ FP8 all-gather) and
resharding to the node, where each applies, and keeps the variants apart when it dedupes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig, Precision, Sharding, TrainingSpec
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.search import SearchSpace, _distinct, search, suggestions
from planner.search.words import describe

SPEC = load_preset("llama3-8b")
TRAINING = TrainingSpec(seq_len=4096)
SMALL = SearchSpace(shardings=(Sharding.FULL_SHARD, Sharding.SHARD_GRAD_OP, Sharding.HYBRID_SHARD), offload=(False,),
                    backward_prefetch=(True,), limit_all_gathers=(True,), micro_batches=(1, 2))


def _configs(cluster, space=SMALL):
    r = search(SPEC, cluster, TRAINING, DEFAULT_PROFILE, space)
    return [e.config for e in r.fitting + r.misses]


def test_h100_two_nodes_explores_every_technique_where_it_applies():
    configs = _configs(make_cluster(16, gpu="h100-80gb"))
    assert any(c.selective_op_ac and c.ac_every == 0 for c in configs)
    assert {c.compile for c in configs} == {False, True}
    float8 = [c for c in configs if c.float8]
    assert float8 and all(c.precision in (Precision.BF16, Precision.BF16_PURE) for c in float8)
    # the FP8 all-gather goes with Float8 under FULL_SHARD / HYBRID_SHARD, and nowhere else
    assert all(c.fp8_all_gather == (c.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)) for c in float8)
    assert not any(c.fp8_all_gather for c in configs if not c.float8)
    # FULL_SHARD over 2 nodes of 8: blocks reshard to the node (8) after forward, or not; no other strategy. With
    # tp ranks inside the node, the node's share of the shard group: 8 / tp
    plain = [c for c in configs if c.model_parallel == 1]
    assert {c.reshard_after_forward for c in plain if c.sharding is Sharding.FULL_SHARD} == {0, 8}
    assert {c.reshard_after_forward for c in configs if c.sharding is not Sharding.FULL_SHARD} == {0}
    for tp in (2, 4):
        assert {c.reshard_after_forward for c in configs
                if c.sharding is Sharding.FULL_SHARD and c.tp == tp and c.cp == 1} == {0, 8 // tp}


def test_no_float8_without_fp8_tensor_cores_no_reshard_on_one_node():
    configs = _configs(make_cluster(8, gpu="a100-80gb"))
    assert not any(c.float8 or c.fp8_all_gather for c in configs)
    assert not any(c.reshard_after_forward for c in configs)  # one node: the shard group is the node
    assert {c.compile for c in configs} == {False, True}


def test_no_float8_for_fp32_compute():
    space = replace(SMALL, precisions=(Precision.FP32,))
    assert not any(c.float8 for c in _configs(make_cluster(16, gpu="h100-80gb"), space))


def test_calibrate_s_cpu_device_explores_no_compile():
    """calibrate --device cpu plans on a GpuSpec with id "cpu" (calibration.store.HostSpec.gpu_spec): inductor
    would add ~15 s per CPU run and measure nothing a GPU's cost model uses."""
    cpu = make_cluster(2, gpu="a100-80gb")
    cpu = replace(cpu, gpu=replace(cpu.gpu, id="cpu"))
    assert not any(c.compile for c in _configs(cpu))
    assert SearchSpace().compile_for(cpu) == (False,)
    assert SearchSpace(compile=(True,)).compile_for(cpu) == (True,)  # asked for explicitly: still explored


def test_dedupe_keeps_technique_variants_apart():
    cluster = make_cluster(16, gpu="h100-80gb")
    r = search(SPEC, cluster, TRAINING, DEFAULT_PROFILE, SMALL)
    base = r.fitting[0]
    variants = [base, replace(base, config=replace(base.config, compile=not base.config.compile)),
                replace(base, config=replace(base.config, backward_prefetch=not base.config.backward_prefetch))]
    kept = _distinct(variants)
    assert len(kept) == 2 and kept[1].config.compile != base.config.compile  # prefetch-only variant dropped


def test_describe_and_suggestions_handle_selective_op():
    config = FsdpConfig(ac_every="selective-op", compile=True, float8=True, fp8_all_gather=True,
                        reshard_after_forward=8)
    text = describe(config)
    assert "selective-op activation checkpointing" in text and "torch.compile per block" in text
    assert "Float8 linears with FP8 all-gather" in text and "resharded to 8 ranks" in text
    assert "AC selective-op" in describe(config, compact=True) and "reshard to 8" in describe(config, compact=True)
    assert describe(FsdpConfig()).count("no activation checkpointing") == 1
    # a selective-op miss: the full-checkpointing suggestion must not combine the two (SpecError)
    cluster = make_cluster(8, gpu="h100-80gb")
    big = load_preset("llama2-70b")
    from cost_models.evaluate import evaluate

    miss = evaluate(big, cluster, TRAINING, FsdpConfig(ac_every="selective-op", micro_batch=8), DEFAULT_PROFILE)
    assert not miss.fits
    assert isinstance(suggestions(big, cluster, TRAINING, DEFAULT_PROFILE, miss), list)


@pytest.mark.parametrize("space", [SearchSpace(compile=(False,), float8=(False,), reshard_to_node=(False,),
                                               ac_every=(0, 4, 2, 1))])
def test_the_old_space_is_still_one_setting_away(space):
    configs = _configs(make_cluster(16, gpu="h100-80gb"), replace(space, **{k: getattr(SMALL, k) for k in (
        "shardings", "offload", "backward_prefetch", "limit_all_gathers", "micro_batches")}))
    assert not any(c.compile or c.float8 or c.selective_op_ac or c.reshard_after_forward for c in configs)


def test_the_kernels_a_config_runs_are_named_where_its_techniques_are():
    """The table's techniques cell and the artifacts' summary line name the kernels the plan priced (a Liger plan
    showed only "compile" while its snippet applied Liger)."""
    from planner.search.words import technique_words

    liger = FsdpConfig(compile=True, norm_kernel="liger", rope_kernel="liger", swiglu_kernel="liger",
                       loss_kernel="liger")
    assert technique_words(liger, compact=True) == ["compile", "liger"]
    assert technique_words(liger) == ["torch.compile per block", "Liger kernels"]
    mixed = FsdpConfig(norm_kernel="te", loss_kernel="chunked", attention_kernel="cudnn")
    assert technique_words(mixed, compact=True) == ["te RMSNorm", "chunked loss", "cudnn"]
    assert technique_words(mixed) == ["TE RMSNorm", "chunked loss", "cuDNN attention"]
    assert technique_words(FsdpConfig()) == []  # the model's own ops and FlashAttention-2: nothing to add
