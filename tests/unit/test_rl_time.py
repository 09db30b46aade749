"""The RL step time's parts (cost_models/rl_time.py) that are plain arithmetic, worked by hand: the decode roofline
and the bytes offload moves. H100 SXM from planner/catalog/gpus.json: 3.35 TB/s HBM, 989 TFLOP/s bf16 at a
measured matmul efficiency of 0.8, 50 GB/s host copies."""

import pytest

from cost_models.rollout_engine import EngineMemory, EngineSettings
from cost_models.rl_time import generation_s
from planner.hardware import make_cluster
from planner.models import resolve_model
from planner.rl import rl_estimate

P7 = 7_615_616_512


def test_decode_roofline_by_hand():
    model, cluster = resolve_model("qwen2.5-7b"), make_cluster(8, gpu="h100-80gb")
    s = EngineSettings(tp=2, max_model_len=2048)
    e = EngineMemory(weights_bytes=P7, activation_peak_bytes=0, cuda_graph_bytes=0, kv_bytes=0, kv_blocks=0,
                     page_bytes=0, kv_tokens=0, max_concurrent_seqs=256)
    # 100 sequences in one wave, 1000 decode steps each reading the weights (7,615,616,512 B) and 100 x 1500
    # tokens of context x 28,672 B (2 x 2 heads x 128 x 2 B x 28 layers): 1000 x 11,916,416,512 / 3.35e12 s;
    # prefill 2 x P / 2 x 100 x 1000 tokens at 989e12 x 0.8
    decode = 1000 * (P7 + 100 * 1500 * 28_672) / 3.35e12
    prefill = P7 * 100 * 1000 / (989e12 * 0.8)
    assert generation_s(model, cluster, s, e, 100, 1000, 1000) == pytest.approx(decode + prefill, rel=1e-9)
    assert decode + prefill == pytest.approx(3.5572 + 0.9625, abs=1e-3)


def test_offload_bytes_by_hand():
    e = rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb", param_offload=True, optimizer_offload=True)
    # actor fp32 shard 3,807,808,256 B in and out 3 times; Adam 7,615,616,512 in and out; the bf16 reference
    # shard 1,903,904,128 streamed in; level-1 backup of 7,615,616,512 B of TP-2 weights out and back: 50 GB/s
    moved = 6 * 3_807_808_256 + 2 * 7_615_616_512 + 1_903_904_128 + 2 * P7
    assert moved == 55_213_219_712
    assert e.time.offload_s == pytest.approx(moved / 50e9, rel=1e-12)


def test_critic_offload_bytes_by_hand():
    on = rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb", algorithm="ppo", critic_param_offload=True,
                     critic_optimizer_offload=True)
    off = rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb", algorithm="ppo")
    # the critic's fp32 shard (3,535,311,361 B) in and out for its values and its update; Adam (7,070,622,721 B)
    # in and out: 4 x 3,535,311,361 + 2 x 7,070,622,721 = 28,282,490,886 B at 50 GB/s
    assert on.time.offload_s - off.time.offload_s == pytest.approx(28_282_490_886 / 50e9, rel=1e-9)
    assert off.time.critic_s > 0 and rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb").time.critic_s == 0
