"""calibration/fit.py: the fit recovers known coefficients from runs the cost model itself generated."""

import dataclasses

import pytest

from calibration.fit import Sample, fit_profile, predicted_step_s, step_time
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec, TrainingSpec
from planner.models import load_preset
from planner.search.words import describe

GPU = GpuSpec(id="test", name="test", memory_bytes=80 * 2**30, hbm_bytes_per_s=2e12,
              peak_flops={"bf16": 300e12, "fp32": 20e12}, intra_node_bus_bytes_per_s=100e9)
MODEL = load_preset("llama2-7b")
CLUSTER = ClusterSpec(gpu=GPU, n_gpus=8, gpus_per_node=8, internode_bytes_per_s=50e9)
TRAINING = TrainingSpec(seq_len=1024)
# What "the cluster" really does: slower compute, more overhead, a slower NVLink than the catalog says.
TRUE = dataclasses.replace(DEFAULT_PROFILE, compute_efficiency={"bf16": 0.45, "fp16": 0.64, "fp32": 0.8},
                           microstep_overhead_s=0.03, intra_node_comm_efficiency=0.4)
CONFIGS = [
    FsdpConfig(sharding="FULL_SHARD", micro_batch=1),
    FsdpConfig(sharding="FULL_SHARD", micro_batch=4, ac_every=1),
    FsdpConfig(sharding="SHARD_GRAD_OP", micro_batch=2, grad_accum=4),
    FsdpConfig(sharding="NO_SHARD", micro_batch=1, grad_accum=2),
]


def sample(config, profile=TRUE, **kw):
    s = Sample(run_id=describe(config), model=MODEL, cluster=CLUSTER, training=TRAINING, config=config, step_s=0.0, **kw)
    return dataclasses.replace(s, step_s=predicted_step_s(s, profile))


def test_fit_recovers_the_coefficients_that_made_the_runs():
    # the runs must expose communication for its efficiency to be identifiable
    assert any(step_time(sample(c), TRUE).exposed_comm_s > 0.05 * sample(c).step_s for c in CONFIGS)
    fit = fit_profile([sample(c) for c in CONFIGS], DEFAULT_PROFILE)
    p = fit.profile
    assert set(fit.fitted) == {"compute_efficiency[bf16]", "microstep_overhead_s", "intra_node_comm_efficiency"}
    assert p.compute_efficiency["bf16"] == pytest.approx(0.45, rel=0.02)
    assert p.microstep_overhead_s == pytest.approx(0.03, rel=0.05)
    assert p.intra_node_comm_efficiency == pytest.approx(0.4, rel=0.05)
    assert fit.step_error_before > 0.2 and fit.step_error_after < 0.005
    # 4 runs for 3 + 4 operator-level unknowns: those keep their defaults, and the report says so
    assert set(fit.identified) == {"compute_efficiency[bf16]", "intra_node_comm_efficiency"}
    assert fit.not_identified == ["microstep_overhead_s"]
    assert any("kept at their starting values" in n and "memory_bound_efficiency" in n for n in fit.notes)
    # and predicts a configuration it never saw
    unseen = FsdpConfig(sharding="FULL_SHARD", micro_batch=2, grad_accum=2, ac_every=2)
    assert predicted_step_s(sample(unseen), p) == pytest.approx(sample(unseen).step_s, rel=0.01)


def test_runs_that_vary_compile_and_sequence_identify_the_memory_bound_rate():
    # compile on/off changes only the memory-bound bytes; 16 runs (compile x attention x seq x micro-batch)
    # made with pointwise kernels at 0.5 of HBM bandwidth (default 0.42) and a slower flash kernel
    true = dataclasses.replace(TRUE, memory_bound_efficiency=0.5, attention_efficiency=0.7)
    runs = []
    for compiled in (False, True):
        for attention in ("sdpa", "eager"):
            for seq in (512, 8192):
                for mb in (1, 2):
                    s = Sample(run_id=f"{compiled}{attention}{seq}{mb}", model=MODEL, cluster=CLUSTER,
                               training=TrainingSpec(seq_len=seq), step_s=0.0,
                               config=FsdpConfig(micro_batch=mb, compile=compiled, attention=attention))
                    runs.append(dataclasses.replace(s, step_s=predicted_step_s(s, true)))
    fit = fit_profile(runs, DEFAULT_PROFILE)
    assert "memory_bound_efficiency" in fit.identified and fit.identified["memory_bound_efficiency"] < 0.1
    assert fit.profile.memory_bound_efficiency == pytest.approx(0.5, rel=0.2)
    assert fit.profile.compute_efficiency["bf16"] == pytest.approx(0.45, rel=0.1)
    # what the runs leave loose stays at its default and is named (the smaller model fits within run noise)
    assert fit.profile.overlap_slowdown == DEFAULT_PROFILE.overlap_slowdown
    assert any("kept at their starting values" in n and "overlap_slowdown" in n for n in fit.notes)
    assert fit.step_error_after < 0.02


def test_runs_of_different_widths_identify_the_matmul_curve():
    # Skinny products run below the large-GEMM rate by prod x / (x + x0): per matmul, time goes as
    # (rows + x0) x n x k, so over one model x0 reads like a per-micro-step overhead; models of three widths
    # (one GPU, no communication) tell them apart. Made with x0 = 256 (default 64): recovered, with the
    # large-GEMM fraction and the overhead, and reported as identified.
    true = dataclasses.replace(TRUE, matmul_half_dim=256.0)
    one_gpu = ClusterSpec(gpu=GPU, n_gpus=1, gpus_per_node=1, internode_bytes_per_s=50e9)
    runs = []
    for name in ("llama2-7b", "gpt-1.3b", "gpt-125m"):
        for seq in (64, 512, 4096):
            s = Sample(run_id=f"{name}-{seq}", model=load_preset(name), cluster=one_gpu,
                       training=TrainingSpec(seq_len=seq), step_s=0.0, config=FsdpConfig())
            runs.append(dataclasses.replace(s, step_s=predicted_step_s(s, true)))
    fit = fit_profile(runs, DEFAULT_PROFILE)
    assert "matmul_half_dim" in fit.identified, (fit.identified, fit.not_identified)
    assert fit.profile.matmul_half_dim == pytest.approx(256.0, rel=0.05)
    assert fit.profile.compute_efficiency["bf16"] == pytest.approx(0.45, rel=0.05)
    # one model's runs leave the curve tied to the overhead: kept at its default, and said so
    same_model = fit_profile([r for r in runs if r.model.name == runs[0].model.name], DEFAULT_PROFILE)
    assert same_model.profile.matmul_half_dim == DEFAULT_PROFILE.matmul_half_dim


def test_one_run_fits_compute_efficiency_only():
    fit = fit_profile([sample(CONFIGS[1])], DEFAULT_PROFILE)
    assert fit.fitted == ["compute_efficiency[bf16]", "intra_node_comm_efficiency"]
    assert fit.profile.microstep_overhead_s == DEFAULT_PROFILE.microstep_overhead_s
    assert any("1 runs for 2 unknowns" in n for n in fit.notes)
    assert fit.step_error_after < 0.01  # one run is always matched


def test_emulated_runs_inform_compute_not_communication():
    emulated = [sample(c, emulated=True) for c in CONFIGS]
    for s in emulated:  # the measured step of a fake process group has no communication in it, nor its slowdown
        t = step_time(s, TRUE)
        assert t.overlap_slowdown_s > 0
        assert s.step_s == pytest.approx(t.step_s - t.exposed_comm_s - t.overlap_slowdown_s)
    fit = fit_profile(emulated, DEFAULT_PROFILE)
    assert "intra_node_comm_efficiency" not in fit.fitted
    assert fit.profile.intra_node_comm_efficiency == DEFAULT_PROFILE.intra_node_comm_efficiency
    assert fit.profile.compute_efficiency["bf16"] == pytest.approx(0.45, rel=0.02)


def test_memory_overheads_are_medians_of_gpu_runs():
    runs = [dataclasses.replace(sample(c), peak_allocated_bytes=1000, peak_reserved_bytes=r, non_torch_bytes=n)
            for c, r, n in zip(CONFIGS, (1100, 1080, 1200, 1090), (500, 700, 600, 650))]
    fit = fit_profile(runs, DEFAULT_PROFILE)
    assert fit.profile.fragmentation == pytest.approx(0.095)    # median of 0.10, 0.08, 0.20, 0.09
    assert fit.profile.cuda_context_bytes == 625                # median of 500, 700, 600, 650
    assert {"fragmentation", "cuda_context_bytes"} <= set(fit.fitted)


def test_cpu_runs_keep_memory_overheads():
    fit = fit_profile([dataclasses.replace(sample(c), peak_allocated_bytes=1000) for c in CONFIGS], DEFAULT_PROFILE)
    assert fit.profile.fragmentation == DEFAULT_PROFILE.fragmentation
    assert fit.profile.cuda_context_bytes == DEFAULT_PROFILE.cuda_context_bytes


def test_no_runs_no_fit():
    fit = fit_profile([], DEFAULT_PROFILE)
    assert fit.profile is DEFAULT_PROFILE and fit.fitted == [] and "nothing to fit" in fit.notes[0]


def test_runs_that_cannot_separate_the_coefficients_are_flagged():
    # three runs of one shape (one micro-step of 4): efficiency and overhead move them all together
    same = [sample(FsdpConfig(sharding=s, micro_batch=4, ac_every=1)) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")]
    fit = fit_profile(same, DEFAULT_PROFILE)
    assert any("independent combination(s) of the 3 unknowns" in n for n in fit.notes)
    assert fit.step_error_after < 0.01  # still matches what it saw
    assert not any("independent" in n for n in fit_profile([sample(c) for c in CONFIGS], DEFAULT_PROFILE).notes)


# --- the mesh's rates (issue 17 item 6) ----------------------------------------------------------------------------
# TP's collectives at a known fraction of the tier's bus bandwidth: runs at tp 1, 2, 4 and 8 (each with its FSDP
# collectives over the data-parallel ranks left) on one 8-GPU node, two micro-batches each.
TP_TRUE = dataclasses.replace(TRUE, tp_comm_efficiency=0.6)
TP_CONFIGS = [FsdpConfig(sharding="FULL_SHARD", micro_batch=mb, tp=tp) for tp in (1, 2, 4, 8) for mb in (1, 2)]


def test_runs_at_several_tp_degrees_identify_the_tp_collective_rate():
    runs = [sample(c, TP_TRUE) for c in TP_CONFIGS]
    t = step_time(runs[-1], TP_TRUE)  # tp 8: TP's collectives are a large share of the step
    assert t.tp_exposed_comm_s > 0.1 * runs[-1].step_s
    # the rate scales TP's alpha-beta time, bandwidth and per-hop latency alike: 0.6 takes 1 / 0.6 of the time
    assert t.tp_comm_s == pytest.approx(step_time(runs[-1], TRUE).tp_comm_s / 0.6, rel=1e-9)
    fit = fit_profile(runs, DEFAULT_PROFILE)
    assert "tp_comm_efficiency" in fit.identified, (fit.identified, fit.not_identified, fit.notes)
    assert fit.profile.tp_comm_efficiency == pytest.approx(0.6, rel=0.05)
    assert fit.profile.intra_node_comm_efficiency == pytest.approx(0.4, rel=0.05)
    assert fit.profile.compute_efficiency["bf16"] == pytest.approx(0.45, rel=0.05)
    assert fit.step_error_after < 0.01
    # the EP rate had no run to inform it: not fitted, at its default
    assert "ep_comm_efficiency" not in fit.fitted and fit.profile.ep_comm_efficiency == 1.0


def test_the_tp_rate_stays_at_its_default_unless_runs_identify_it():
    # no TP run: not an unknown at all
    assert "tp_comm_efficiency" not in fit_profile([sample(c) for c in CONFIGS], DEFAULT_PROFILE).fitted
    # emulated TP runs made no real collective (their step is priced without communication)
    emulated = fit_profile([sample(c, TP_TRUE, emulated=True) for c in TP_CONFIGS], DEFAULT_PROFILE)
    assert "tp_comm_efficiency" not in emulated.fitted and emulated.profile.tp_comm_efficiency == 1.0
    # one TP run beside one data-parallel run: four unknowns for two runs, the rate not identified -> kept at 1.0
    two = fit_profile([sample(TP_CONFIGS[0], TP_TRUE), sample(TP_CONFIGS[4], TP_TRUE)], DEFAULT_PROFILE)
    assert two.profile.tp_comm_efficiency == 1.0
    assert any("kept at their starting values" in n and "tp_comm_efficiency" in n for n in two.notes)


def test_ep_runs_make_the_all_to_all_rate_an_unknown_priced_on_the_ep_tier():
    # the rate scales the all-to-alls' alpha-beta time (cost_models/expert_parallel.ep_tier) and nothing else
    from calibration.fit import _unknowns

    moe = load_preset("mixtral-8x7b")
    cluster = ClusterSpec(gpu=dataclasses.replace(GPU, memory_bytes=800 * 2**30), n_gpus=8, gpus_per_node=8,
                          internode_bytes_per_s=50e9)
    run = Sample(run_id="ep8", model=moe, cluster=cluster, training=TRAINING, step_s=1.0,
                 config=FsdpConfig(sharding="FULL_SHARD", micro_batch=2, ep=8))
    full, slow = step_time(run, TRUE), step_time(run, dataclasses.replace(TRUE, ep_comm_efficiency=0.5))
    assert full.ep_comm_s > 0
    assert slow.ep_comm_s == pytest.approx(2 * full.ep_comm_s, rel=1e-9)  # bandwidth and per-hop latency alike
    assert slow.total_comm_s - slow.ep_comm_s == pytest.approx(full.total_comm_s - full.ep_comm_s, rel=1e-12)
    assert _unknowns([run])[1] == ["ep_comm_efficiency"]
    assert _unknowns([dataclasses.replace(run, emulated=True)])[1] == []  # an emulated run exchanged nothing
