"""One table of "this configuration cannot run here" (cost_models.feasibility), read alike by the estimate
(the candidate's reasons), the API (cluster_rejects' PlannerError naming the field) and `fsdp-plan check` (an
error finding with the fix, and no second "out of memory" finding for the same reason). And the two drifts it
fixed: reshard_after_forward equal to the shard group is what FSDP2 runs as True (priced as plain FULL_SHARD,
not refused), and Float8 linears around fp32 compute run (the doctor's warning, not a refusal)."""

import pytest

from cost_models.evaluate import evaluate, unsupported_reasons
from cost_models.feasibility import RULES, as_run, refusals
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig, TrainingSpec
from planner import estimate
from planner.api import cluster_rejects
from planner.doctor import check
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.doctor.readers import UserSetup

SPEC = load_preset("gpt-1.3b")
TRAINING = TrainingSpec(seq_len=1024)

CASES = [  # (config, cluster, field, finding code)
    (FsdpConfig(precision="bf16"), make_cluster(8, gpu="v100-32gb"), "precision", "dtype-not-supported"),
    (FsdpConfig(float8=True), make_cluster(8, gpu="a100-80gb"), "float8", "float8-without-fp8-tensor-cores"),
    (FsdpConfig(reshard_after_forward=3), make_cluster(16, gpu="h100-80gb"), "reshard_after_forward",
     "reshard-after-forward-not-a-divisor"),
    (FsdpConfig(reshard_after_forward=32), make_cluster(16, gpu="h100-80gb"), "reshard_after_forward",
     "reshard-after-forward-not-a-divisor"),  # above the group: FSDP2 raises too
    (FsdpConfig(sharding="HYBRID_SHARD"), make_cluster(12, gpu="h100-80gb", gpus_per_node=8), "gpus_per_node",
     "hybrid-needs-whole-nodes"),
    # the Hopper attention kernels (cost_models/attention_kernels.py): Ampere has FlashAttention-2 only
    (FsdpConfig(attention_kernel="fa3"), make_cluster(8, gpu="a100-80gb"), "attention_kernel",
     "attention-kernel-not-on-gpu"),
]


@pytest.mark.parametrize("config,cluster,field,code", CASES)
def test_every_reader_refuses_alike(config, cluster, field, code):
    (refusal,) = refusals(cluster, config)
    assert (refusal.field, refusal.code) == (field, code)
    e = evaluate(SPEC, cluster, TRAINING, config, DEFAULT_PROFILE)
    assert not e.fits and e.reasons[0] == refusal.reason and unsupported_reasons(cluster, config) == [refusal.reason]
    error = cluster_rejects(cluster, config)
    assert error.field == field and refusal.reason in str(error) and refusal.fix in str(error)
    with pytest.raises(PlannerError):
        estimate(SPEC, cluster.n_gpus, gpu=cluster.gpu.id, gpus_per_node=cluster.gpus_per_node, seq_len=1024,
                 sharding=config.sharding.value, precision=config.precision.value, float8=config.float8,
                 reshard_after_forward=config.reshard_after_forward, attention_kernel=config.attention_kernel.value)
    setup = UserSetup(config=config, fsdp_version=2)
    if not refusal.priced:  # nothing to show a price for: bad input, as the API says it
        with pytest.raises(PlannerError, match=field):
            check(setup, SPEC, cluster.n_gpus, gpus_per_node=cluster.gpus_per_node, gpu=cluster.gpu.id, seq_len=1024)
        return
    r = check(setup, SPEC, cluster.n_gpus, gpus_per_node=cluster.gpus_per_node, gpu=cluster.gpu.id, seq_len=1024)
    found = {f.code: f for f in r.findings}
    assert found[code].severity == "error" and found[code].fix == refusal.fix
    assert "gpu-memory-does-not-fit" not in found  # gpt-1.3b fits: the refusal is not an out-of-memory one
    assert r.has_errors


def test_the_table_covers_each_case_once():
    assert len(RULES) == len({code for *_, code in CASES})


def test_reshard_group_equal_to_the_shard_group_is_plain_full_shard():
    """FSDP2 reads an int equal to the shard group as True (_get_post_forward_mesh_info); before, the estimate
    refused it (fits=False), the API priced it refused and the doctor called it advice."""
    cluster = make_cluster(16, gpu="h100-80gb")
    whole = FsdpConfig(reshard_after_forward=16)
    assert not refusals(cluster, whole) and as_run(whole, cluster) == FsdpConfig()
    assert as_run(FsdpConfig(reshard_after_forward=8), cluster).reshard_after_forward == 8  # a real group: kept
    c = estimate(SPEC, 16, gpu="h100-80gb", seq_len=1024, reshard_after_forward=16)
    plain = estimate(SPEC, 16, gpu="h100-80gb", seq_len=1024)
    assert c.fits and not c.reasons and c.config.reshard_after_forward == 0
    assert (c.memory.peak_reserved_bytes, c.time.step_s) == (plain.memory.peak_reserved_bytes, plain.time.step_s)
    assert c.fully_shard_options()["reshard_after_forward"] is True
    r = check(UserSetup(config=whole, fsdp_version=2), SPEC, 16, gpu="h100-80gb", seq_len=1024)
    assert r.candidate.fits and not r.has_errors
    assert {f.code: f.severity for f in r.findings}["reshard-after-forward-is-the-whole-group"] == "advice"


def test_float8_around_fp32_compute_runs_and_is_a_warning():
    """torchao's Float8 linears take fp32 inputs too; before, the estimate refused them (a reason without a
    rule) and check reported it as "Out of memory" beside the doctor's warning."""
    cluster = make_cluster(16, gpu="h100-80gb")
    fp32 = FsdpConfig(precision="fp32", float8=True)
    assert not refusals(cluster, fp32) and cluster_rejects(cluster, fp32) is None
    assert evaluate(SPEC, cluster, TRAINING, fp32, DEFAULT_PROFILE).fits
    found = {f.code: f.severity for f in check(UserSetup(config=fp32, fsdp_version=2), SPEC, 16, gpu="h100-80gb",
                                              seq_len=1024).findings}
    assert found["float8-without-bf16-compute"] == "warning"
    assert not {code for code, severity in found.items() if severity == "error"}


@pytest.mark.parametrize("config,cluster,field,code", CASES)
def test_no_rule_reads_the_micro_batch(config, cluster, field, code):
    """The search checks a knob combination once for all its micro-batches (planner/search/__init__.py): every rule's
    verdict is the same whatever the micro-batch and accumulation."""
    verdicts = {tuple(r.code for r in refusals(cluster, config.with_batch(mb, accum, config.shard_group_gpus)))
                for mb in (1, 3, 64) for accum in (1, 7)}
    assert verdicts == {(code,)}
