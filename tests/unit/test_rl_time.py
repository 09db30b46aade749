"""The RL step time's parts (cost_models/rl_time.py) that are plain arithmetic, worked by hand: the decode roofline
and the bytes offload moves. H100 SXM from planner/catalog/gpus.json: 3.35 TB/s HBM, 989 TFLOP/s bf16 at a
measured matmul efficiency of 0.8, 50 GB/s host copies."""

import pytest

from cost_models.rollout_engine import EngineMemory, EngineSettings
from cost_models.rl_time import generation_s, prefill_s
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
    # shard 1,903,904,128 streamed in: 50 GB/s (the engine sleeps at verl's level 2 for a full model: no backup)
    moved = 6 * 3_807_808_256 + 2 * 7_615_616_512 + 1_903_904_128
    assert moved == 39_981_986_688
    assert e.time.offload_s == pytest.approx(moved / 50e9, rel=1e-12)


def test_critic_offload_bytes_by_hand():
    on = rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb", algorithm="ppo", critic_param_offload=True,
                     critic_optimizer_offload=True)
    off = rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb", algorithm="ppo")
    # the critic's fp32 shard (3,535,323,905 B: 7,070,622,721 parameters + the 1 x 3,584 head padded to 8 rows,
    # 7 x 3,584, over 8 GPUs; FSDP1's, priced with FSDP2's padding) in and out for its values and its update; Adam
    # (7,070,647,809 B) in and out: 4 x 3,535,323,905 + 2 x 7,070,647,809 = 28,282,591,238 B at 50 GB/s
    assert on.time.offload_s - off.time.offload_s == pytest.approx(28_282_591_238 / 50e9, rel=1e-9)
    assert off.time.critic_s > 0 and rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb").time.critic_s == 0


def test_ulysses_all_to_alls_by_hand():
    """verl's Ulysses attention (monkey_patch._ulysses_flash_attention_forward): q, k, v and the output all-to-all'd
    over sp GPUs, 4 a layer forward, 4 backward, 4 in a checkpointed block's recompute. Qwen2.5-7B (28 layers, q
    3,584 wide, KV 4 heads x 128 = 512), 5,120 tokens a GPU at sp 4, the H100's NVLink tier (370 GB/s, 5 us, the
    catalog and the default profile): per layer and pass 4 x 5 us + 3/4 x 5,120 x (3,584 + 512 + 512 + 3,584) x 2 B
    / 370e9 = 190.04 us; x 28 x 3 passes = 15.963 ms. At sp 8 verl repeats the 4 KV heads to 8 (1,024 wide)."""
    from types import SimpleNamespace

    from cost_models.profile import DEFAULT_PROFILE
    from cost_models.rl_time import ulysses_s

    model, cluster = resolve_model("qwen2.5-7b"), make_cluster(8, gpu="h100-80gb")
    no_attention = SimpleNamespace(attention_s=0.0)
    assert ulysses_s(model, cluster, DEFAULT_PROFILE, no_attention, 5120, 4, True) == pytest.approx(
        28 * 3 * (4 * 5e-6 + 0.75 * 5120 * 8192 * 2 / 370e9), rel=1e-9)
    assert ulysses_s(model, cluster, DEFAULT_PROFILE, no_attention, 5120, 4, True) == pytest.approx(0.015963, rel=1e-4)
    assert ulysses_s(model, cluster, DEFAULT_PROFILE, no_attention, 5120, 8, False, forward_only=True) == \
        pytest.approx(28 * (4 * 5e-6 + 7 / 8 * 5120 * (2 * 3584 + 2 * 1024) * 2 / 370e9), rel=1e-9)
    # the attention: sp - 1 more of it (forward only: flash's forward, 1 / 3.5 of forward + backward), no transfers
    one_second = SimpleNamespace(attention_s=1.0)
    assert ulysses_s(model, cluster, DEFAULT_PROFILE, one_second, 0, 4, False, forward_only=True) == pytest.approx(
        3 / 3.5 + 28 * 4 * 5e-6, rel=1e-9)
    assert ulysses_s(model, cluster, DEFAULT_PROFILE, one_second, 0, 1, True) == 0.0


def test_log_probs_priced_at_their_own_micro_batch():
    """The log-prob micro-batch apart from the update's: 1 / 16 prices the log-probs as 16 / 16 does and the update as
    1 / 1 does; the larger forward is faster per token (FSDP's per-micro-batch costs spread over more tokens)."""
    job = dict(gpu="h100-80gb", prompt_len=1024, response_len=4096, rollout_n=8, train_batch=256, rollout_tp=4)
    split, big, small = (rl_estimate("qwen2.5-7b", 8, ppo_micro_batch_size_per_gpu=u,
                                     log_prob_micro_batch_size_per_gpu=lp, **job)
                         for u, lp in ((1, 16), (16, 16), (1, 1)))
    assert split.time.log_prob_s == big.time.log_prob_s and split.time.update_s == small.time.update_s
    assert split.time.log_prob_s < small.time.log_prob_s


def test_dynamic_batches_run_their_real_tokens():
    """verl packs whole sequences up to the budget (rearrange_micro_batches): at 5,120 tokens a sequence a budget of
    15,359 holds 2 of them, so the step runs what static micro-batches of 2 run, to the second, while the memory is
    priced at the budget (15,359 tokens a GPU, against 10,240). Priced at the budget instead (each of 86 micro-batches
    full), the update would run 86 x 15,359 = 1,320,874 tokens a mini-batch for the 1,310,720 there are."""
    job = dict(gpu="h100-80gb", prompt_len=1024, response_len=4096, rollout_n=8, train_batch=256, actor_dtype="bf16")
    static = rl_estimate("qwen2.5-7b", 8, ppo_micro_batch_size_per_gpu=2, **job)
    dynamic = rl_estimate("qwen2.5-7b", 8, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=15_359, **job)
    assert (dynamic.batch.micro_batches_per_mini, dynamic.batch.update_tokens_per_gpu) == (128, 15_359)
    assert (static.batch.micro_batches_per_mini, static.batch.update_tokens_per_gpu) == (128, 10_240)
    assert dynamic.time.update_s == pytest.approx(static.time.update_s, rel=1e-12)
    assert dynamic.time.log_prob_s == pytest.approx(static.time.log_prob_s, rel=1e-12)
    assert dynamic.memory.phases[5].gpu_bytes["activations"] > static.memory.phases[5].gpu_bytes["activations"]


def test_prefill_chunks_and_the_last_wave_by_hand():
    """vLLM runs at most max_num_batched_tokens a step, each step reading the weights: 100,000 prompt tokens in chunks
    of 64 are 1,563 steps x 7,615,616,512 B / 3.35e12 = 3.5532 s, more than their FLOPs (0.9625 s); in chunks of
    8,192, 13 steps (0.030 s), the FLOPs. Decode: 300 sequences at 256 at once are 2 waves reading the weights, but
    only the 300 sequences' KV (not 2 x 256)."""
    model, cluster = resolve_model("qwen2.5-7b"), make_cluster(8, gpu="h100-80gb")
    e = EngineMemory(weights_bytes=P7, activation_peak_bytes=0, cuda_graph_bytes=0, kv_bytes=0, kv_blocks=0,
                     page_bytes=0, kv_tokens=0, max_concurrent_seqs=256)
    flops_s = P7 * 100_000 / (989e12 * 0.8)
    for chunk, seconds in ((64, 1_563 * P7 / 3.35e12), (8192, flops_s)):
        s = EngineSettings(tp=2, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=chunk)
        assert prefill_s(model, cluster, s, e, 100_000) == pytest.approx(seconds, rel=1e-9)
    assert 1_563 * P7 / 3.35e12 == pytest.approx(3.5532, abs=1e-4)
    s = EngineSettings(tp=2, max_model_len=2048)
    decode = 1000 * (2 * P7 + 300 * 1500 * 28_672) / 3.35e12
    assert generation_s(model, cluster, s, e, 300, 1000, 1000) == pytest.approx(decode + 3 * flops_s, rel=1e-9)
