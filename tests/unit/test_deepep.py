"""DeepEP dispatch / combine and Automodel's round-robin gate as cost_models/expert_parallel.py prices them: each
figure below is worked by hand from the module docstring's sources (DeepEP's README bandwidths, Automodel 0.7.0's
FakeBalancedGate and Megatron's fused permute), with the tolerance stated."""

import math

import pytest

from cost_models import expert_parallel, step_parts
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig, Routing, SpecError, TrainingSpec
from planner.api import estimate_config
from planner.hardware import make_cluster
from planner.models import load_preset

QWEN = load_preset("qwen3-30b-a3b")  # 128 experts, top-8, hidden 2048, expert width 768
H100 = make_cluster(8, "h100-80gb")
ROUND_ROBIN = TrainingSpec(seq_len=4096, routing="round-robin")


def row(dispatch: str, grad_accum: int = 1):
    """The Automodel row's configuration (tests/golden/test_automodel_rows.py) with either dispatch, priced by the
    cost model directly (a trainer runs one of them)."""
    config = FsdpConfig(sharding="SHARD_GRAD_OP", precision="bf16-pure", reduce_dtype="fp32", ac_every=1,
                        micro_batch=4, grad_accum=grad_accum, ep=8, moe_dispatch=dispatch)
    return estimate_config(QWEN, H100, ROUND_ROBIN, config)


@pytest.mark.parametrize("experts, k, ep, routing, ranks", [
    (128, 8, 8, Routing.ROUND_ROBIN, 1.0),   # Qwen3-30B-A3B: 8 consecutive experts inside one rank's 16
    (32, 4, 8, Routing.ROUND_ROBIN, 1.0),    # GPT-OSS 20B: 4 consecutive inside one rank's 4
    (64, 6, 8, Routing.ROUND_ROBIN, 1.5),    # starts 0, 6, 12, ... mod 64: start mod 8 in {0, 2} one rank, {4, 6} two
    # learned: 8 (1 - C(112, 8) / C(128, 8)) = 8 (1 - prod_i (112 - i) / (128 - i)) = 8 (1 - 0.3325804)
    (128, 8, 8, Routing.LEARNED, 5.339357),
])
def test_ranks_per_token(experts, k, ep, routing, ranks):
    assert expert_parallel.ranks_per_token(experts, k, ep, routing) == pytest.approx(ranks, rel=1e-6)


def test_deepep_dispatch_seconds_by_hand():
    """Qwen row, one micro-batch of 4 x 4,096 tokens: one row of 2,048 bf16 per token to one rank, 7/8 of it off
    the rank, at (153 + 158) / 2 / 200 of H100's 450 GB/s NVLink per direction, plus one 5 us latency."""
    cluster = make_cluster(8, "h100-80gb")
    training = TrainingSpec(seq_len=4096, routing="round-robin")
    config = FsdpConfig(ep=8, micro_batch=4, moe_dispatch="deepep")
    view = expert_parallel.view(QWEN, config, cluster, training)
    seconds = expert_parallel.all_to_all_seconds(view, cluster, DEFAULT_PROFILE, 16384, 2)
    by_hand = 16384 * 2048 * 2 * 7 / 8 / (450e9 * 155.5 / 200) + 5e-6
    assert seconds == pytest.approx(by_hand, rel=1e-9)  # 172.8 us
    all_to_all = expert_parallel.all_to_all_seconds(
        expert_parallel.view(QWEN, FsdpConfig(ep=8, micro_batch=4), cluster, training), cluster, DEFAULT_PROFILE,
        16384, 2)
    assert all_to_all == pytest.approx(16384 * 8 * 2048 * 2 * 7 / 8 / 370e9 + 5e-6, rel=1e-9)  # 8 rows, NCCL bus


def test_deepep_block_ops_by_hand():
    """Per token of a Qwen block: the fused permute / unpermute moves 2 c h (k + 1) = 73,728 B each way; the
    experts' SwiGLU (8 x 768 wide) its fused 3c / 5c per element = 36,864 / 61,440 B; round-robin drops the
    128 x 2048 router product and its softmax / top-k."""
    training = TrainingSpec(seq_len=4096, routing="round-robin")
    config = FsdpConfig(ep=8, micro_batch=4, moe_dispatch="deepep")
    ops, _ = step_parts.priced_block_ops(QWEN, training, config, 2)
    memory = {o.name: (o.forward_bytes, o.backward_bytes) for o in ops.memory_ops}
    assert memory["DeepEP permute / unpermute"] == (73728, 73728)
    assert memory["MLP activation"] == (36864, 61440)
    assert "router softmax/top-k" not in memory and "expert routing" not in memory
    assert "router" not in {m.name for m in ops.matmuls}
    learned, _ = step_parts.priced_block_ops(QWEN, TrainingSpec(seq_len=4096), FsdpConfig(ep=8), 2)
    assert {o.name: o.forward_bytes for o in learned.memory_ops}["expert routing"] == 8 * 2048 * 6 * 2
    assert "router" in {m.name for m in learned.matmuls}


def test_deepep_buffer_is_reserved_outside_the_allocator():
    """10 channels x 8 NVLink ranks x 256 slots x (4,096 hidden bytes + 2,048 of top-k metadata) = 125,829,120 B
    more reserved, the same allocated."""
    deepep, nccl = row("deepep"), row("all-to-all")
    assert deepep.memory.peak_allocated_bytes == nccl.memory.peak_allocated_bytes
    assert deepep.memory.peak_reserved_bytes - nccl.memory.peak_reserved_bytes == 10 * 8 * 256 * (4096 + 2048)


def test_deepep_step_moves_an_eighth_of_the_rows():
    """The step's EP seconds scale with the rows sent: one per token against eight (bandwidths 349.9 vs 370 GB/s,
    latencies equal): 6 all-to-alls per sparse block and micro-batch either way."""
    deepep, nccl = row("deepep", 16), row("all-to-all", 16)
    calls = 16 * 48 * 6
    rows_1 = (deepep.time.ep_comm_s / calls - 5e-6) * 349.875e9
    rows_8 = (nccl.time.ep_comm_s / calls - 5e-6) * 370e9
    assert rows_8 / rows_1 == pytest.approx(8, rel=1e-9)
    assert deepep.time.ep_comm_s == pytest.approx(calls * (16384 * 4096 * 7 / 8 / 349.875e9 + 5e-6), rel=1e-9)


def test_bad_input_is_one_line():
    assert FsdpConfig(moe_dispatch="deepep") == FsdpConfig()  # nothing dispatched without EP: one spelling
    with pytest.raises(SpecError, match="routing_imbalance: round-robin routing is balanced"):
        TrainingSpec(routing="round-robin", routing_imbalance=1.2)
    with pytest.raises(SpecError, match="moe_dispatch: unknown value 'nvshmem'"):
        FsdpConfig(ep=8, moe_dispatch="nvshmem")
    assert math.isclose(expert_parallel.DEEPEP_DISPATCH_OF_PEAK * 200, 153)


def test_bf16_params_and_bf16_adam_states():
    """Automodel's rows build the model in bf16 (no fp32 master) with an fp32 reduce: precision bf16-pure with
    reduce_dtype fp32 keeps 2 B parameters and two 2 B Adam states per parameter, each rank 1/8 of the 30,532,122,624
    (16 whole experts of 128 and 1/8 of the rest): 7.63 GB of parameters, 15.27 GB of states (explain's ledger)."""
    m = row("deepep").memory.breakdown
    assert m.sharded_params == 30_532_122_624 // 8 * 2
    assert m.optimizer_state == 30_532_122_624 // 8 * 4


def test_deepep_across_nodes_sends_a_token_once_per_remote_node():
    """ep 16 over 2 nodes of 8 H100s, learned routing, 16,384 tokens: a token reaches 2 (1 - C(64, 8) / C(128, 8))
    = 1.99381 nodes, half of them remote on average: 0.99690 rows of 2,048 bf16 over RDMA at the network's 42.5 GB/s
    per GPU (400 GB/s x 0.85 / 8) = 1.5741 ms; NVLink carries 15/16 of its 6.5965 ranks' rows at DeepEP's 349.9 GB/s
    = 1.1862 ms; the slower, + 15 us. NCCL's all-to-all of the same 8 rows a token: 6.331 ms."""
    cluster = make_cluster(16, "h100-80gb")
    config = FsdpConfig(ep=16, micro_batch=4, moe_dispatch="deepep")
    view = expert_parallel.view(QWEN, config, cluster, TrainingSpec(seq_len=4096))
    nodes = 2 * (1 - math.comb(64, 8) / math.comb(128, 8))
    rdma = 16384 * nodes / 2 * 2048 * 2 / 42.5e9
    nvlink = 15 / 16 * 16384 * expert_parallel.ranks_per_token(128, 8, 16) * 2048 * 2 / (450e9 * 155.5 / 200)
    assert rdma > nvlink
    seconds = expert_parallel.all_to_all_seconds(view, cluster, DEFAULT_PROFILE, 16384, 2)
    assert seconds == pytest.approx(rdma + 15e-6, rel=1e-9)
    assert seconds == pytest.approx(1.5891e-3, rel=1e-3)
