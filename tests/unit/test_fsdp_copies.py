"""FSDP1's and FSDP2's copies around their collectives (cost_models/fsdp_copies.py), worked by hand: a small model
(the one tests/distributed/test_fsdp_copies_torchrun.py counts op by op on gloo ranks) and Llama 3 8B's step, whose
FSDP1 and FSDP2 prices differ by exactly those bytes at the memory-bound rate."""

import pytest

from cost_models.fsdp_copies import accumulate_bytes, gather_copy_bytes, predivide_factor, reduce_copy_bytes
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig, Precision, TrainingSpec
from cost_models.step_time import estimate_step_time
from planner.hardware import make_cluster
from planner.models import load_preset

N = 2 * 2 * 64 * 64  # two blocks of two 64 x 64 linears: 16,384 parameters, 8,192 a block


def _small(fsdp2: bool, precision: str, reduce_dtype: str, d: int) -> float:
    """Two micro-steps of the small model under FULL_SHARD: each block gathered twice, the second step's shard added."""
    p, c = Precision(precision), 2
    per_step = 2 * gather_copy_bytes(fsdp2, p, N * c, N, N * c, d) + reduce_copy_bytes(fsdp2, p, reduce_dtype, N, d, d)
    return 2 * per_step + accumulate_bytes(p, N, d)


def test_bf16_with_fp32_reduction_by_hand():
    """d = 2. FSDP1 per micro-step: the shard casts 4 gathers x 4,096 x (4 + 2) = 98,304; the split's backward cat
    16,384 x (2 + 2) = 65,536; the cast to fp32 16,384 x (2 + 4) = 98,304; the pre-divide (factor 2) 16,384 x 8 =
    131,072: 393,216. FSDP2: the foreach casts 98,304; all_gather_copy_in 4 x 4,096 x 4 = 65,536; the copy-out
    4 x 8,192 x 4 = 131,072; _chunk_cat 16,384 x 6 = 98,304: 393,216 too. Both add the second step's shard,
    8,192 x 12 = 98,304: 884,736 B. At d = 4 FSDP1 post-divides the shard too (4 / factor 2 = 2): 802,816; FSDP2
    671,744."""
    assert _small(False, "bf16", "fp32", 2) == _small(True, "bf16", "fp32", 2) == 2 * 393_216 + 98_304 == 884_736
    assert _small(False, "bf16", "fp32", 4) == 2 * (49_152 + 65_536 + 98_304 + 131_072 + 4_096 * 8) + 49_152 \
        == 802_816
    assert _small(True, "bf16", "fp32", 4) == 2 * (49_152 + 32_768 + 131_072 + 98_304) + 49_152 == 671_744


def test_bf16_pure_and_mixed_reductions_by_hand():
    """bf16-pure, d = 2: FSDP1 has no cast, the cat 65,536 and the bf16 pre-divide 65,536 a step, + 8,192 x 6:
    311,296; FSDP2 copies in and out every gather (65,536 + 131,072) and packs 16,384 x 4: 573,440. bf16 with a
    bf16 reduction: FSDP1 skips the flat cast (casts + cat + pre-divide 98,304 + 65,536 + 65,536) but casts the
    shard to fp32, 8,192 x 6: 655,360; FSDP2 917,504. bf16-pure with an fp32 reduction: 737,280 each."""
    assert _small(False, "bf16-pure", "bf16", 2) == 2 * (65_536 + 65_536) + 49_152 == 311_296
    assert _small(True, "bf16-pure", "bf16", 2) == 2 * (65_536 + 131_072 + 65_536) + 49_152 == 573_440
    assert _small(False, "bf16", "bf16", 2) == 2 * (98_304 + 65_536 + 65_536 + 49_152) + 98_304 == 655_360
    assert _small(True, "bf16", "bf16", 2) == 917_504
    assert _small(False, "bf16-pure", "fp32", 2) == _small(True, "bf16-pure", "fp32", 2) == 737_280


def test_predivide_factor_by_hand():
    """torch's loop doubles the factor while it divides W and W / factor stays above it: 8 -> 4 (then 2 / 4 is not
    above 4), 128 -> 16, 3 -> 2 (post-divide 1.5); the torchrun test runs FSDP1 at W = 2 and 4."""
    assert [predivide_factor(w) for w in (1, 2, 3, 4, 8, 128, 512)] == [1, 2, 2, 2, 4, 16, 32]


def test_llama3_8b_step_differs_by_the_copies():
    """Llama 3 8B on 8 x H100, bf16 with fp32 reduction, 2 micro-steps: blocks B = 32 x 218,112,000 parameters,
    root R = 1,050,677,248 (gathered once). Per micro-step FSDP2 moves, per gathered element, 2 x 4 (copy-out) +
    2 x 2 / 8 (copy-in) + (4 + 2) / 8 (cast) = 5.25, per reduced 2 + 4, and 12 / 8 / 2 to accumulate: 17.25 B + 12 R;
    FSDP1 0.75 per gathered element, 4 (cat) + 6 (cast) + 8 (pre-divide by 4) + 1 (post-divide by 2) per reduced,
    0.75: 21.25 B + 20.5 R. The step differs by 2 micro-steps x (4 B + 8.5 R) bytes at HBM x 0.42."""
    model, cluster = load_preset("llama3-8b"), make_cluster(8, "h100-80gb")
    config, training = FsdpConfig(precision="bf16", grad_accum=2), TrainingSpec(seq_len=4096)
    B, R = 32 * 218_112_000, 1_050_677_248
    assert model.n_layers * model.block_params == B and model.root_params == R
    rate = cluster.gpu.hbm_bytes_per_s * DEFAULT_PROFILE.memory_bound_efficiency
    terms1, terms2 = {}, {}
    t1 = estimate_step_time(model, cluster, training, config, DEFAULT_PROFILE, terms1, fsdp2=False)
    t2 = estimate_step_time(model, cluster, training, config, DEFAULT_PROFILE, terms2)
    assert terms2["fsdp_copy_s"] == pytest.approx((17.25 * B + 12 * R) / rate, rel=1e-12)
    assert terms1["fsdp_copy_s"] == pytest.approx((21.25 * B + 20.5 * R) / rate, rel=1e-12)
    assert t1.step_s - t2.step_s == pytest.approx(2 * (4 * B + 8.5 * R) / rate, rel=1e-9)
