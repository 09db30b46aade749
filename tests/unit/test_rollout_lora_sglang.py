"""SGLang's LoRA memory pool (cost_models/rollout_lora_sglang.py), worked by hand from the shapes SGLang 0.5.23 reads:

- python/sglang/srt/lora/mem_pool.py LoRAMemoryPool.get_lora_A_shape: (max_loras_per_batch, max_lora_rank x
  get_stacked_multiply(name), in), in the row-parallel o_proj / down_proj's input_size_per_partition
  (_dense_local_dim); get_lora_B_shape: (max_loras_per_batch, out, max_lora_rank), out the sum of the column
  layer's output_partition_sizes (q / tp + the rank's K and V heads, max(1, kv // tp):
  _column_parallel_lora_b_per_rank_dim; gate and up / tp each); init_buffers: one A and one B per target per layer.
- lora/utils.py get_stacked_multiply: qkv_proj 3, gate_up_proj 2; get_normalized_target_modules (q/k/v ->
  qkv_proj, gate/up -> gate_up_proj); lora_manager.py init_lora_shapes: "all" (verl's all-linear,
  sglang_rollout/utils.py sglang_lora_target_modules) adds EMBEDDING_NAMES.
- mem_pool.py get_embedding_lora_A_shape (S, rank, vocab) for both, get_embedding_lora_B_shape (S, hidden, rank)
  for embed_tokens and (S, the ParallelLMHead's rank rows, rank) for lm_head (utils.py
  get_lm_head_lora_b_shard_size; the whole vocabulary where the head is tied: no ParallelLMHead); init_buffers
  fills embedding_A/B_buffer and again lm_head_A/B_buffer with every embedding name targeted: under "all" each
  vocabulary buffer twice (as the pool SGLang builds holds them: benchmarks/sglang_lora_check.py, 11 of 11).
- the pool is built before the KV cache is sized (model_runner.py initialize -> maybe_init_lora_manager, then
  kv_cache_configurator.py _profile_available_bytes): the KV pool shrinks by exactly its bytes.
verl 0.9.1 (async_sglang_server.py launch_server): max_lora_rank = the rank, max_loras_per_batch SGLang's 8."""

import dataclasses

import pytest

from cost_models.rollout_engine import Engine, EngineSettings, engine_memory
from cost_models.rollout_lora_sglang import head_rows_per_rank, sglang_lora_pool, sglang_target_modules
from cost_models.spec_values import SpecError
from cost_models.units import GiB
from planner.models import resolve_model
from planner.rl import rl_estimate

QWEN7 = resolve_model("qwen2.5-7b")
QWEN3 = resolve_model("qwen3-8b")
LLAMA1 = resolve_model("llama3.2-1b")
QWEN7_TP2_R32 = 825_753_600 + 240_910_336   # the first test's pool
# the csgmv backend's decode-graph rows at 256 requests (max_num_seqs; tests/unit/test_rl_sglang_lora.py):
# 4 x (6 x 256 + 2 + 2 x slots) B
META_8, META_1 = 6_216, 6_160


def test_qwen25_7b_tp2_rank32_by_hand():
    """Qwen2.5-7B (h 3,584, 28 heads / 4 KV heads of 128, f 18,944, 28 layers, vocab 152,064 untied), TP 2, rank
    32, 8 slots, bf16. Per slot and layer on rank 0: qkv A 96 x 3,584 = 344,064, B (1,792 + 2 x 256) x 32 = 73,728;
    o A 32 x 1,792 = 57,344, B 3,584 x 32 = 114,688; gate_up A 64 x 3,584 = 229,376, B 18,944 x 32 = 606,208; down
    A 32 x 9,472 = 303,104, B 114,688: 1,843,200 x 28 x 8 x 2 B = 825,753,600 B. Embedding A 32 x 152,064 =
    4,866,048, B 114,688; head A 114,688, B 76,032 rows (152,064 / 2) x 32 = 2,433,024: 7,528,448 x 8 x 2 B, twice
    = 240,910,336 B. 1,066,663,936 B in all (0.99 GiB), 10.3 x vLLM's one slot (103,618,616 B)."""
    per_layer = 344_064 + 73_728 + 57_344 + 114_688 + 229_376 + 606_208 + 303_104 + 114_688
    assert per_layer == 1_843_200 and 4_866_048 + 2 * 114_688 + 2_433_024 == 7_528_448
    b = sglang_lora_pool(QWEN7, tp=2, max_lora_rank=32)
    assert (b.blocks_bytes, b.vocab_bytes, b.metadata_bytes) == (per_layer * 28 * 8 * 2, 7_528_448 * 8 * 2 * 2, 0)
    assert b.total_bytes == QWEN7_TP2_R32 == 1_066_663_936


def test_qwen3_8b_tp8_rank48_by_hand():
    """Qwen3-8B (h 4,096, 32 heads / 8 KV of 128, f 12,288, 36 layers, vocab 151,936), TP 8, rank 48 (unrounded:
    vLLM's would be 64). Per slot and layer: qkv A 144 x 4,096 = 589,824, B (512 + 2 x 128) x 48 = 36,864; o A 48 x
    512 = 24,576, B 4,096 x 48 = 196,608; gate_up A 96 x 4,096 = 393,216, B 3,072 x 48 = 147,456; down A 48 x
    1,536 = 73,728, B 196,608: 1,658,880 x 36 x 8 x 2 B = 955,514,880 B. Vocabulary: 151,936 is a multiple of 64
    and of 8: 18,992 head rows a rank; 48 x 151,936 + 2 x 196,608 + 18,992 x 48 = 8,597,760 x 16 B, twice =
    275,128,320 B."""
    per_layer = 589_824 + 36_864 + 24_576 + 196_608 + 393_216 + 147_456 + 73_728 + 196_608
    b = sglang_lora_pool(QWEN3, 8, 48)
    assert (b.blocks_bytes, b.vocab_bytes) == (per_layer * 36 * 16, 8_597_760 * 32) == (955_514_880, 275_128_320)


def test_tied_head_and_listed_targets():
    """Llama-3.2-1B (h 2,048, 32 heads / 8 KV of 64, f 8,192, 16 layers, vocab 128,256 tied), TP 2, rank 32: per
    layer qkv 196,608 + 49,152, o 32,768 + 65,536, gate_up 131,072 + 262,144, down 131,072 + 65,536 = 933,888 x 16 x
    16 B = 239,075,328 B; the tied head has no ParallelLMHead, so its B keeps the whole vocabulary: (2 x 32 x 128,256
    + 2 x 65,536) x 16 B, twice = 266,862,592 B. A list of targets ["q_proj", "v_proj"] normalises to qkv_proj
    alone: its 245,760 a layer, no vocabulary buffers."""
    b = sglang_lora_pool(LLAMA1, 2, 32)
    assert (b.blocks_bytes, b.vocab_bytes) == (933_888 * 16 * 16, 8_339_456 * 32) == (239_075_328, 266_862_592)
    targets = sglang_target_modules(["q_proj", "v_proj"])
    assert targets == {"qkv_proj"}
    assert sglang_lora_pool(LLAMA1, 2, 32, targets=targets).total_bytes == 245_760 * 16 * 16
    assert sglang_target_modules("all-linear") == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                                   "embed_tokens", "lm_head"}
    with pytest.raises(SpecError, match="target_modules"):
        sglang_target_modules(".*proj")


def test_head_rows_per_rank():
    """vocab_parallel_embedding.py: padded to 64, or 64 x tp where that does not divide by tp, / tp, capped at the
    vocabulary: 32,000 at TP 3 -> 32,064 / 3 = 10,688; 151,936 at 8 -> 18,992; 100 at 1 -> 100 (not 128)."""
    assert [head_rows_per_rank(v, tp) for v, tp in ((32_000, 3), (151_936, 8), (100, 1))] == [10_688, 18_992, 100]


def test_the_kv_pool_shrinks_by_the_lora_pool():
    """Built after the weights, before the KV cache is sized: rest = free after both - free before x (1 - f), so
    the KV pool loses exactly the LoRA pool's bytes (tokens: its floor), with the backend's graph rows (counted with
    it: under one token's KV); a decode step reads one slot of eight and the rows of one."""
    s = EngineSettings(engine=Engine.SGLANG, tp=2, max_model_len=5120)
    plain = engine_memory(QWEN7, s, 80 * GiB, 2 * GiB, GiB)
    lora = engine_memory(QWEN7, dataclasses.replace(s, max_lora_rank=32), 80 * GiB, 2 * GiB, GiB)
    pool = QWEN7_TP2_R32 + META_8
    assert lora.lora_bytes == pool and plain.available_bytes - lora.available_bytes == pool
    assert plain.kv_tokens - lora.kv_tokens == pytest.approx(pool / lora.page_bytes / 28, abs=1)
    assert lora.decode_read_bytes - lora.weights_bytes == QWEN7_TP2_R32 // 8 + META_1
    one = engine_memory(QWEN7, dataclasses.replace(s, max_lora_rank=32, max_loras_per_batch=1), 80 * GiB, 0, GiB)
    assert one.lora_bytes == QWEN7_TP2_R32 // 8 + META_1 == one.decode_read_bytes - one.weights_bytes
    eager = engine_memory(QWEN7, dataclasses.replace(s, max_lora_rank=32, enforce_eager=True), 80 * GiB, 0, GiB)
    assert eager.lora_bytes == QWEN7_TP2_R32   # no CUDA graphs (disable_cuda_graph): no graph rows


def test_verl_sglang_lora_in_every_phase():
    """verl with SGLang and a LoRA adapter (rollout TP 2, the default): the pool in every phase (sleep level 1 keeps
    the weights; the pool is in no memory-saver region), the rank unrounded; merged or full fine-tuning: none."""
    job = dict(gpu="h100-80gb", engine="sglang", finetune="lora")
    adapter = rl_estimate("qwen2.5-7b", 8, **job)
    assert adapter.memory.engine.lora_bytes == QWEN7_TP2_R32 + META_8
    assert all(p.gpu_bytes.get("engine LoRA buffers") == QWEN7_TP2_R32 + META_8 for p in adapter.memory.phases)
    assert rl_estimate("qwen2.5-7b", 8, **job, lora_rank=48).engine_settings.max_lora_rank == 48
    for other in (dict(job, lora_merge=True), dict(gpu="h100-80gb", engine="sglang")):
        assert rl_estimate("qwen2.5-7b", 8, **other).memory.engine.lora_bytes == 0, other
