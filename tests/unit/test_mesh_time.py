"""The mesh's step-time terms, checked by hand: TP's collectives (cost_models/tensor_parallel.py) and CP's ring
(cost_models/context_parallel.py) for Llama 3 8B (h 4096, 32 heads x 128, 8 KV heads, 32 layers) on H100 SXM
nodes (catalog: NVLink bus 370 GB/s, 5 us per ring hop intra-node; 8 x 400 Gb/s NICs per node, 0.85 of it).
"""

import math

import pytest

from cost_models import comm, context_parallel, tensor_parallel
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig, TrainingSpec
from cost_models.step_time import _shard_tiers, estimate_step_time, mesh_tiers
from planner.hardware import make_cluster
from planner.models import load_preset

MODEL = load_preset("llama3-8b")
NODE = make_cluster(8, "h100-80gb")
NVLINK = 370e9


def _config(**kw):
    return FsdpConfig(sharding="FULL_SHARD", precision="bf16", **kw)


def test_tp_all_gather_bytes_and_seconds_by_hand():
    # micro-batch 1 x 8192 tokens, bf16: the attention input b x s x h = 8192 x 4096 x 2 B = 64 MiB, gathered
    # over 8 ranks of one node: 7 hops x 5 us + 7/8 x 67,108,864 B / 370 GB/s = 35 us + 158.7 us = 193.7 us
    config = _config(tp=8, ac_every="selective-op")
    block = tensor_parallel.block_collectives(MODEL, config, 8192, 2)
    gather = block[0]
    assert (gather.kind, gather.phase, gather.message_bytes) == ("all-gather", "forward", 67_108_864)
    tier, _ = mesh_tiers(config, NODE, DEFAULT_PROFILE)
    assert tier.bus_bytes_per_s == NVLINK and tier.latency_s == 5e-6
    assert tensor_parallel.collective_s(gather, 8, tier) == pytest.approx(35e-6 + 7 / 8 * 67_108_864 / NVLINK)
    assert tensor_parallel.collective_s(gather, 8, tier) == pytest.approx(193.7e-6, rel=1e-3)


@pytest.mark.parametrize("ac,sp,expected", [
    ("none", True, {"all-gather": 4, "reduce-scatter": 4}),           # forward 2 + 2, backward 2 + 2
    ("selective-op", True, {"all-gather": 6, "reduce-scatter": 4}),   # + the two all-gathers k and up re-read
    ("full", True, {"all-gather": 6, "reduce-scatter": 6}),           # + the whole forward again
    ("none", False, {"all-reduce": 4}),                               # o and down forward, two input gradients
    ("selective-op", False, {"all-reduce": 5}),                       # + o's, which the recomputed up needs
    ("full", False, {"all-reduce": 6}),
])
def test_tp_collectives_per_block(ac, sp, expected):
    config = _config(tp=8, ac_every=ac, sequence_parallel=sp)
    kinds = {}
    for x in tensor_parallel.block_collectives(MODEL, config, 8192, 2):
        kinds[x.kind] = kinds.get(x.kind, 0) + 1
        assert x.message_bytes == 8192 * 4096 * 2
    assert kinds == expected


def test_float8_tp_gathers_one_byte():
    # Float8ColwiseParallel casts the inputs (and Float8RowwiseParallel the output gradients) before gathering
    config = _config(tp=8, compile=True, float8=True)
    for x in tensor_parallel.block_collectives(MODEL, config, 8192, 2):
        assert x.message_bytes == 8192 * 4096 * (1 if x.kind == "all-gather" else 2)


def test_tp_step_terms_add_up_by_hand():
    # 32 blocks x 10 collectives (selective-op) of 64 MiB + the root's: embedding reduce-scatter, head all-gather
    # and their gradients (64 MiB each), the loss-parallel statistics (3 x 8192 x 4 B all-reduced)
    config = _config(tp=8, ac_every="selective-op", compile=True)
    t = estimate_step_time(MODEL, NODE, TrainingSpec(seq_len=8192), config, DEFAULT_PROFILE)
    tier = comm.Tier(NVLINK, 5e-6)
    one = comm.all_gather_s(67_108_864, 8, tier)
    stats = comm.all_reduce_s(3 * 8192 * 4, 8, tier)
    assert t.tp_comm_s == pytest.approx(32 * 10 * one + 4 * one + stats)
    assert t.tp_exposed_comm_s == pytest.approx(t.tp_comm_s)  # vanilla TP: on the critical path
    assert t.cp_comm_s == t.cp_exposed_comm_s == 0.0
    assert t.exposed_comm_s >= t.tp_exposed_comm_s and t.total_comm_s >= t.tp_comm_s


def test_async_tp_hides_behind_the_fused_products():
    # the attention input's all-gather hides behind q, k, v: 2 x 8192 x 4096 x (512 + 128 + 128) FLOPs on a TP
    # rank; exposed = max(0, all-gather - products) for each collective
    kw = dict(tp=8, ac_every="selective-op", compile=True)
    vanilla = estimate_step_time(MODEL, NODE, TrainingSpec(seq_len=8192), _config(**kw), DEFAULT_PROFILE)
    overlapped = estimate_step_time(MODEL, NODE, TrainingSpec(seq_len=8192), _config(async_tp=True, **kw),
                                    DEFAULT_PROFILE)
    assert overlapped.tp_comm_s == pytest.approx(vanilla.tp_comm_s)
    assert 0 < overlapped.tp_exposed_comm_s < 0.6 * vanilla.tp_exposed_comm_s
    assert overlapped.step_s < vanilla.step_s
    tier = comm.Tier(NVLINK, 5e-6)
    gather = tensor_parallel.block_collectives(MODEL, _config(**kw), 8192, 2)[0]
    products = {"q": 0.5e-4, "k": 0.2e-4, "v": 0.2e-4}
    t = tensor_parallel.step_seconds(MODEL, _config(async_tp=True, **kw), 8192, 2, tier, _Rates(), products, 1.0)
    assert gather.fused_with[:3] == ("q", "k", "v")
    # forward: 2 all-gathers (attention: hidden by 90 us of products; MLP: no products given) and 2 reduce-scatters
    one = comm.all_gather_s(67_108_864, 8, tier)
    assert t.block_forward_exposed_s == pytest.approx((one - 0.9e-4) + 3 * one)


class _Rates:
    """memory_s at 1 TB/s, for the reorder copies."""

    @staticmethod
    def memory_s(n_bytes):
        return n_bytes / 1e12


def test_sequence_parallel_reorder_copies():
    # DTensor cats a reduce-scatter's input to dim 0 always and an all-gather's output unless b = 1 (a view):
    # a read and a write of the 64 MiB message each
    kw = dict(tp=8, ac_every="none")
    tier = comm.Tier(NVLINK, 5e-6)
    t1 = tensor_parallel.step_seconds(MODEL, _config(micro_batch=1, **kw), 8192, 2, tier, _Rates(), {}, 0.0)
    assert t1.block_copy_forward_s == pytest.approx(2 * 2 * 67_108_864 / 1e12)       # the two reduce-scatters
    t2 = tensor_parallel.step_seconds(MODEL, _config(micro_batch=2, **kw), 16384, 2, tier, _Rates(), {}, 0.0)
    assert t2.block_copy_forward_s == pytest.approx(4 * 2 * 2 * 67_108_864 / 1e12)   # all four, twice the tokens


def test_sequence_parallel_shards_norms_and_residuals():
    from cost_models.step_time import priced_block_ops

    training = TrainingSpec(seq_len=8192)
    local = tensor_parallel.local_model(MODEL, _config(tp=8))
    sp, _ = priced_block_ops(local, training, _config(tp=8), 2)
    no_sp, _ = priced_block_ops(local, training, _config(tp=8, sequence_parallel=False), 2)
    by_name = {a.name: (a.forward_bytes, b.forward_bytes) for a, b in zip(sp.memory_ops, no_sp.memory_ops)}
    assert by_name["norm 1"][0] * 8 == by_name["norm 1"][1]
    assert by_name["residual adds"][0] * 8 == by_name["residual adds"][1]
    assert by_name["MLP activation"][0] == by_name["MLP activation"][1]  # on the rank's ffn / tp already


def test_fsdp_group_with_tp_spans_nodes_and_shares_nics():
    # FSDP 8 x TP 8 on 64 GPUs: the 8 FSDP ranks are 8 apart (one per node); the 8 FSDP groups of a node cross
    # the network at once: 3,200 Gb/s x 0.85 / 8 = 42.5 GB/s each (inter-node hops 15 us)
    cluster = make_cluster(64, "h100-80gb")
    shard, _ = _shard_tiers(_config(tp=8), cluster, DEFAULT_PROFILE)
    assert shard.bus_bytes_per_s == pytest.approx(3200e9 / 8 * 0.85 / 8)
    assert shard.latency_s == 15e-6
    plain, _ = _shard_tiers(_config(), make_cluster(8, "h100-80gb"), DEFAULT_PROFILE)
    assert plain.bus_bytes_per_s == NVLINK  # without TP, 8 ranks of one node stay on NVLink


def test_cp_ring_bytes_and_seconds_by_hand():
    # CP 2 at 65,536 tokens, micro-batch 1: each rank's K and V are 32,768 x 1,024 x 2 x 2 B = 128 MiB; the
    # ring's all-gather moves the other rank's half: 5 us + 1/2 x 256 MiB / 370 GB/s = 367.8 us; backward the
    # all-gather again and 2 permutes of the fp32 dK/dV (256 MiB each: 5 us + 725.5 us)
    config = _config(cp=2, ac_every="full")
    assert context_parallel.local_kv_bytes(MODEL, 32768, 2) == 134_217_728
    _, tier = mesh_tiers(config, NODE, DEFAULT_PROFILE)
    gather = 5e-6 + 0.5 * 268_435_456 / NVLINK
    permute = 5e-6 + 268_435_456 / NVLINK
    t = context_parallel.ring_seconds(MODEL, config, 32768, 2, tier, attention_forward_s=0.05,
                                      attention_backward_s=0.125, recompute_share=1.0)
    assert t.forward_s == pytest.approx(gather) and gather == pytest.approx(367.8e-6, rel=1e-3)
    assert t.backward_s == pytest.approx(gather + 2 * permute + gather)   # + full AC's recomputed ring
    assert t.forward_exposed_s == 0.0                                     # behind 0.05 / 2 s of attention
    assert t.backward_exposed_s == pytest.approx(permute)                 # the last permute waits


def test_cp_ring_exposed_when_attention_is_short():
    config = _config(cp=4)
    tier = comm.Tier(10e9, 15e-6)
    kv = context_parallel.local_kv_bytes(MODEL, 1024, 2)
    t = context_parallel.ring_seconds(MODEL, config, 1024, 2, tier, 1e-4, 2.5e-4, 0.0)
    gather = comm.all_gather_s(4 * kv, 4, tier)
    assert t.forward_exposed_s == pytest.approx(gather - 1e-4 / 4)


def test_cp_step_time_prices_the_ring():
    training = TrainingSpec(seq_len=65536)
    cluster = make_cluster(8, "h100-96gb")
    t = estimate_step_time(MODEL, cluster, training, _config(cp=2, ac_every="full", compile=True, float8=True),
                           DEFAULT_PROFILE)
    assert 0 < t.cp_exposed_comm_s < t.cp_comm_s
    # 32 layers x (forward all-gather, recomputed, backward all-gather, 2 permutes)
    gather = 5e-6 + 0.5 * 268_435_456 / NVLINK
    permute = 5e-6 + 268_435_456 / NVLINK
    assert t.cp_comm_s == pytest.approx(32 * (3 * gather + 2 * permute))


def test_cp_ring_kernels_run_at_the_chunk_rate_by_hand():
    # 8,192 tokens, cp 4: a rank's 2,048 queries attend over the causal 8,192 (2 x 4,096 x 8,192 = 67,108,864
    # FLOP per token forward, as executed), but the ring's calls visit chunks of 1,024 keys (forward) or queries
    # (backward) per block: the rate of one causal call of 2,048, 989 TFLOP/s x 0.30 x 2,048 / (2,048 + 384) =
    # 249.85 TFLOP/s (one call of 8,192: x 8,192 / 8,576, 283.4). Per block 2,048 x 67,108,864 / 249.85e12 =
    # 0.5501 ms forward; 32 blocks x 3.5 (forward + 2.5 backward) = 61.61 ms
    assert context_parallel.ring_kernel_seq_len(8192, 4) == 2048
    assert context_parallel.ring_kernel_seq_len(8192, 1) == 8192
    t = estimate_step_time(MODEL, NODE, TrainingSpec(seq_len=8192), _config(cp=4), DEFAULT_PROFILE)
    assert t.attention_s == pytest.approx(61.61e-3, rel=1e-3)


def test_cp_merge_bytes_by_hand():
    # cp 2, per token: E = 4,096 output elements, K = 2,048 K/V elements, c = 2. Forward: upcast the diagonal
    # step (6 E); step 1 on rank 1 merges all rows (6 + 32) E, on rank 0 half the rows and a cat (19 + 8) E:
    # mean 32.5 E; back to bf16 6 E; one torch.cat of K/V before the send (read and write K x 2 B)
    fwd, _ = context_parallel.ring_merge_bytes(MODEL, 1, 2, 2)
    assert fwd == pytest.approx((6 + 32.5 + 6) * 4096 + 2 * 2048 * 2)


def test_cp_ring_working_memory_by_hand():
    # per token of a CP 2 rank: the all-gathered K/V (2 x 2,048 x 2 B) and the send buffer (2,048 x 2 B),
    # then the larger of the forward merge's fp32 tensors (16 x 4,096) and the backward's accumulators
    # (4 x 4,096 + 12 x 2,048): 8,192 + 4,096 + 65,536 = 77,824 B
    assert context_parallel.ring_working_bytes_per_token(MODEL, 2, 2) == 77_824
    assert context_parallel.ring_working_bytes_per_token(MODEL, 1, 2) == 0


def test_no_sequence_parallel_gathers_logits():
    # transformers' tp_plan: the head's logits all-gathered to the full vocabulary (b x s x V x c)
    config = _config(tp=8, sequence_parallel=False)
    root = tensor_parallel.root_collectives(MODEL, config, 8192, 2)
    logits = next(x for x in root if x.name.startswith("logits"))
    assert logits.message_bytes == 8192 * MODEL.vocab_size * 2
    t = estimate_step_time(MODEL, NODE, TrainingSpec(seq_len=8192), config, DEFAULT_PROFILE)
    sp = estimate_step_time(MODEL, NODE, TrainingSpec(seq_len=8192), _config(tp=8), DEFAULT_PROFILE)
    assert t.tp_comm_s > sp.tp_comm_s and math.isfinite(t.step_s)
