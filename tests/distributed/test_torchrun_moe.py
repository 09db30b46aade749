"""A tiny transformers Mixtral (grouped_mm experts) trained under FSDP2 by torchrun: 2 ranks, gloo, CPU.

Every case runs in the shared 2-rank launch (tests/distributed/worker_moe.py; cases.shared). Checks: the loss
falls below 0.7x its first value in 8 AdamW steps; with 3 experts on 2 ranks FSDP2 pads the stacked
expert tensors on dim 0 (rank 0 holds 2 rows of the 3: the layout cost_models/moe.py prices), and the
emitted FSDP2 code with its shard_placement_fn fix uncommented, or a plan with expert_shard_dim=1 (applied
by calibration.apply or by its emitted code), shards them on dim 1 instead (no padding); a plan with
expert_units wraps each block's experts module as an FSDP unit of its own (applied and emitted);
every fp32 case follows the same loss trajectory (layout and padding change memory, not math).
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import shared

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

TIMEOUT_S = 180

CASES = [
    {"experts": 4, "config": {"sharding": "FULL_SHARD", "precision": "fp32"}},
    {"experts": 3, "config": {"sharding": "FULL_SHARD", "precision": "fp32"}},            # padded: 2 rows per rank
    {"experts": 3, "config": {"sharding": "FULL_SHARD", "precision": "fp32"}, "emitted": True, "shard_dim1": True},
    {"experts": 3, "config": {"sharding": "SHARD_GRAD_OP", "precision": "fp32", "activation_checkpointing": "full"}},
    {"experts": 4, "config": {"sharding": "FULL_SHARD", "precision": "bf16"}, "emitted": True},
    {"experts": 3, "config": {"sharding": "FULL_SHARD", "precision": "fp32", "expert_shard_dim": 1}},  # the plan's option
    {"experts": 3, "config": {"sharding": "FULL_SHARD", "precision": "fp32", "expert_shard_dim": 1}, "emitted": True},
    # routed experts as FSDP units of their own: through calibration.apply (under checkpointing too) and the emitted code
    {"experts": 3, "config": {"sharding": "FULL_SHARD", "precision": "fp32", "expert_units": True,
                              "activation_checkpointing": "full"}},
    {"experts": 3, "config": {"sharding": "FULL_SHARD", "precision": "fp32", "expert_units": True}, "emitted": True},
]


launch = shared(__file__, "worker_moe", CASES, TIMEOUT_S)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_moe_loss_decreases(index):
    result = launch()[index]
    losses = result["losses"]
    assert result["experts_implementation"] == "grouped_mm"
    assert len(losses) == 8 and all(loss == loss and loss < 10 for loss in losses), losses
    assert losses[-1] < 0.7 * losses[0], losses


def test_stacked_experts_are_padded_on_dim_0_unless_the_fix_shards_dim_1():
    by_case = dict(enumerate(launch()))
    # gate_up_proj is (E, 2 x 96, 64); each rank's shard
    assert by_case[0]["gate_up_shards"] == [[2, 192, 64], [2, 192, 64]] and by_case[0]["shard_dim"] == 0
    # ceil(3 / 2) = 2 rows per rank: rank 0 holds 2 experts, rank 1 one expert and a padding row
    assert by_case[1]["gate_up_shards"] == [[2, 192, 64], [1, 192, 64]] and by_case[1]["shard_dim"] == 0
    # the emitted fix: dim 1 (192 rows) splits evenly, every rank holds half of each of the 3 experts
    assert by_case[2]["gate_up_shards"] == [[3, 96, 64], [3, 96, 64]] and by_case[2]["shard_dim"] == 1
    # expert_shard_dim=1 through calibration.apply and through the code the plan emits for it: the same
    for i in (5, 6):
        assert by_case[i]["gate_up_shards"] == [[3, 96, 64], [3, 96, 64]] and by_case[i]["shard_dim"] == 1


def test_expert_units_wrap_the_experts_apart():
    for result in launch():
        assert result["experts_are_units"] == bool(result["config"].get("expert_units")), result["config"]


def test_padding_and_layout_do_not_change_the_math():
    fp32 = [r for r in launch() if r["config"]["precision"] == "fp32" and r["experts"] == 3]
    assert len(fp32) == 7
    for result in fp32[1:]:
        assert result["losses"] == pytest.approx(fp32[0]["losses"], rel=1e-4), (result["config"], result["losses"])
