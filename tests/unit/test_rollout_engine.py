"""The rollout engine's memory rules (cost_models/rollout_engine.py), each number worked by hand in the comment
beside it from Qwen2.5-7B's config (28 layers, 4 KV heads of 128, hidden 3584, FFN 18944, vocab 152064,
7,615,616,512 parameters: planner/catalog/models.json)."""

import pytest

from cost_models.rollout_engine import (Engine, EngineSettings, KvShape, engine_memory, kv_page_bytes,
                                        num_kv_blocks, sglang_rule, vllm_rule_current, vllm_rule_v08)
from cost_models.specs import SpecError
from cost_models.units import GiB
from planner.models import resolve_model

QWEN_PARAMS = 7_615_616_512
CONTEXT = 3 * GiB // 4   # the CUDA context the caller passes as memory outside torch


@pytest.fixture(scope="module")
def qwen():
    return resolve_model("qwen2.5-7b")


def test_page_bytes_gqa_and_mla():
    # 16 tokens x 2 (K, V) x 4/2 heads x 128 x 2 B = 16,384 B per layer
    assert kv_page_bytes(KvShape(28, 4, 128), 16, 2, 2) == 16_384
    # TP 8 > 4 KV heads: vLLM keeps one head per rank (max(1, 4 // 8)): 16 x 2 x 1 x 128 x 2 = 8,192
    assert kv_page_bytes(KvShape(28, 4, 128), 16, 8, 2) == 8_192
    # DeepSeek-V3 MLA: 16 x (512 latent + 64 rope) x 2 B = 18,432, whatever the TP
    assert kv_page_bytes(KvShape(61, 128, 192, 512, 64), 16, 8, 2) == 18_432


def test_num_blocks_floors_per_layer():
    # 1 GiB // 16,384 = 65,536 pages; // 28 layers = 2,340 blocks (28 x 2,340 = 65,520)
    assert num_kv_blocks(GiB, 16_384, 28) == 2_340
    assert num_kv_blocks(-5, 16_384, 28) == 0


def test_vllm_08_counts_the_trainer_in_its_budget():
    s = EngineSettings(version="0.8", gpu_memory_utilization=0.6)
    # 80 GiB x 0.6 = 48 GiB; minus 20 GiB of torch peak (trainer + weights + profile) and 1 GiB outside torch
    assert vllm_rule_v08(80 * GiB, s, 20 * GiB, GiB) == 27 * GiB


def test_vllm_current_refuses_start_below_utilization():
    s = EngineSettings(version="current", gpu_memory_utilization=0.6)
    kv, refused = vllm_rule_current(80 * GiB, 60 * GiB, s, 8 * GiB, 2 * GiB, 0)
    assert (kv, refused) == (48 * GiB - 10 * GiB, None)   # 48 GiB requested - weights 8 - profile 2
    kv, refused = vllm_rule_current(80 * GiB, 47 * GiB, s, 8 * GiB, 2 * GiB, 0)
    assert kv == 0 and refused.field == "gpu_memory_utilization" and "on startup is less than" in refused.reason


def test_sglang_fraction_is_of_free_memory():
    # free 60 GiB before load, 45 after 15 GiB of weights, fraction 0.5: 45 - 60 x 0.5 = 15 GiB of KV
    assert sglang_rule(60 * GiB, 45 * GiB, 0.5) == 15 * GiB


def test_engine_memory_vllm_08_qwen_tp2(qwen):
    s = EngineSettings(version="0.8", gpu_memory_utilization=0.6, tp=2, max_model_len=2048, max_num_seqs=256,
                       max_num_batched_tokens=8192)
    e = engine_memory(qwen, s, 80 * GiB, resident_bytes=0, non_torch_bytes=CONTEXT)
    assert e.weights_bytes == QWEN_PARAMS  # 2 B x params / TP 2
    # profile run: 8192 tokens x (2 x 3584 + (3584 + 2 x 512) / 2 + 3 x 18944 / 2 = 37,888) x 2 B = 620,756,992;
    # sampler 2 x 256 rows x 152,064 x 4 B (the vocabulary gathered) = 311,427,072
    assert e.activation_peak_bytes == 620_756_992 + 311_427_072
    # available = 51,539,607,552 (0.6 x 80 GiB) - 7,615,616,512 - 932,184,064 - 805,306,368 = 42,186,500,608;
    # // 16,384 = 2,574,859 pages; // 28 = 91,959 blocks
    assert e.kv_blocks == 91_959 and e.kv_bytes == 91_959 * 16_384 * 28
    # 2048 tokens = 128 blocks: 91,959 // 128 = 718 sequences, capped by max_num_seqs 256
    assert e.max_concurrent_seqs == 256 and e.refusals == ()


def test_engine_memory_names_vllms_max_len_error(qwen):
    # 0.8 GiB of KV budget: 0.3 x 80 = 24 GiB - 7.09 GiB weights - 0.87 profile - 0.75 context leaves ~15 GiB;
    # with 15 GiB of trainer tensors already resident it leaves ~0.3 GiB, below one 32k sequence (32768 / 16 =
    # 2048 blocks x 16,384 B x 28 layers = 0.875 GiB)
    s = EngineSettings(version="0.8", gpu_memory_utilization=0.3, tp=2, max_model_len=32768, max_num_seqs=256)
    e = engine_memory(qwen, s, 80 * GiB, resident_bytes=15 * GiB, non_torch_bytes=CONTEXT)
    assert 0 < e.kv_bytes < 0.875 * GiB
    assert [r.code for r in e.refusals] == ["engine-max-len"]
    assert "max seq len (32768), (0.88 GiB KV cache is needed" in e.refusals[0].reason


def test_max_num_batched_tokens_buys_kv_and_must_cover_max_num_seqs(qwen):
    """The profile run's tokens come out of the KV budget (vLLM current: total x utilization - weights - profile
    peak): 2,048 instead of 8,192 frees 6,144 x 37,888 x 2 B = 465,567,744 B, 1,014 more blocks of 16,384 B x 28
    layers (465,567,744 // 458,752, to one block's rounding). Below max_num_seqs vLLM's SchedulerConfig refuses."""
    def settings(b, seqs=256):
        return EngineSettings(gpu_memory_utilization=0.6, tp=2, max_model_len=2048, max_num_seqs=seqs,
                              max_num_batched_tokens=b)
    small, large = (engine_memory(qwen, settings(b), 80 * GiB, 0, CONTEXT) for b in (2048, 8192))
    assert large.activation_peak_bytes - small.activation_peak_bytes == 465_567_744
    assert small.kv_blocks - large.kv_blocks in (1_014, 1_015)
    refused = engine_memory(qwen, settings(128), 80 * GiB, 0, CONTEXT).refusals
    assert [(r.field, r.code) for r in refused] == [("max_num_batched_tokens", "engine-config")]
    assert "max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256)" in refused[0].reason
    sglang = EngineSettings(engine="sglang", max_num_seqs=256, max_num_batched_tokens=128)
    assert engine_memory(qwen, sglang, 80 * GiB, 0, CONTEXT).refusals == ()


def test_engine_memory_sglang(qwen):
    s = EngineSettings(engine="sglang", gpu_memory_utilization=0.5, tp=2, max_model_len=2048)
    e = engine_memory(qwen, s, 80 * GiB, resident_bytes=0, non_torch_bytes=CONTEXT)
    # free before load 79.25 GiB; pool = 79.25 GiB x 0.5 - weights = 42,547,019,776 - 7,615,616,512 B;
    # SGLang pages one token: // (2 x 2 x 128 x 2 = 1,024 B per layer) // 28 layers
    assert e.kv_tokens == (42_547_019_776 - QWEN_PARAMS) // 1_024 // 28
    assert e.kv_tokens == 1_218_310


def test_bad_engine_settings_name_the_field():
    with pytest.raises(SpecError, match="engine_version: '0.9' for vllm; choose one of: 0.8, current"):
        EngineSettings(engine=Engine.VLLM, version="0.9")
    with pytest.raises(SpecError, match="engine: unknown value 'tgi'; choose one of: vllm, sglang"):
        EngineSettings(engine="tgi")
    with pytest.raises(SpecError, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
        EngineSettings(gpu_memory_utilization=1.5)
