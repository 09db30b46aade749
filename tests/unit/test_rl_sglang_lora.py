"""SGLang's LoRA pool on mixtures of experts and MLA (cost_models/rollout_lora_sglang.py), and our pool bytes against
the LoRAMemoryPool SGLang 0.5.23 builds itself for the catalog's models on the meta device at each TP degree
(benchmarks/sglang_lora_check.py: SGLang's ModelConfig and model class, LoRAManager.init_lora_shapes,
LoRAMemoryPool.init_buffers). SGLang installs in an environment of its own (the benchmark says how); here those tests
are skipped, the by-hand ones run. With sglang 0.5.23: 11 of 11 dense cases the same (2026-12-07), and 12 of 12 MoE /
MLA cases (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss, DeepSeek-V2-Lite and V3), 6 of 6 of the backend's CUDA-graph
metadata and 4 of 4 adapters refused where SGLang's loader raises (2026-12-08); 7 of 7 Llama 4 pools and 9 of 9
engine starts refused where SGLang raises (2026-12-08).

By hand, from SGLang 0.5.23's python/sglang/srt/lora/: mem_pool.py init_buffer gives gate_up_proj and down_proj, on a
model holding a FusedMoE, a 4D buffer per layer (every layer, the dense ones too) of (slots, experts, rank x stacked,
in) / (slots, experts, out, rank), at moe_intermediate_size / tp, and a 3D one only where the config has shared
experts (the layer's own linear: the shared expert, or a dense block's MLP); utils.py auto_detect_lora_target_modules
normalises DeepSeek's q_a_proj / kv_a_proj_with_mqa to fused_qkv_a_proj_with_mqa (replicated, stacked 2) and V2-Lite's
q_proj to qkv_proj (get_default_hidden_dim at transformers' head_dim, qk_rope_head_dim)."""

import importlib.util

import pytest

from benchmarks.sglang_lora_check import our_model
from cost_models.rollout_lora_sglang import (adapter_refusals, all_targets, csgmv_graph_metadata_bytes,
                                             moe_graph_buffers_bytes, sglang_lora_pool, sglang_target_modules,
                                             start_refusals)
from cost_models.spec_values import SpecError
from planner.models import resolve_model
from planner.rl import rl_estimate

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="SGLang is not importable in this environment: it installs in one of its "
                                         "own (benchmarks/sglang_lora_check.py says how)")


def test_qwen3_30b_a3b_tp1_rank32_by_hand():
    """Qwen3-30B-A3B (h 2,048, 32 heads / 4 KV of 128, 128 experts of 768, 48 layers, vocab 151,936 untied), TP 1, rank
    32, 8 slots, bf16. Per slot and layer: qkv A 96 x 2,048 = 196,608, B (4,096 + 2 x 512) x 32 = 163,840; o A 32 x
    4,096 = 131,072, B 65,536; an expert: gate_up A 64 x 2,048 = 131,072, B 1,536 x 32 = 49,152, down A 32 x 768 =
    24,576, B 65,536 = 270,336, x 128 = 34,603,008 (no router buffer: "gate" is not a LoRA target). 35,160,064 x 48 x 8
    x 2 B = 27,002,929,152 B (25.1 GiB, 8 x vLLM's one slot of experts). Vocabulary (4,861,952 + 65,536 + 65,536 +
    4,861,952) x 8 x 2 B, twice = 315,359,232 B. SGLang's own pool: the same (benchmarks/sglang_lora_check.py)."""
    expert = 131_072 + 49_152 + 24_576 + 65_536
    per_layer = 196_608 + 163_840 + 131_072 + 65_536 + 128 * expert
    b = sglang_lora_pool(resolve_model("qwen3-30b-a3b"), tp=1, max_lora_rank=32)
    assert (b.blocks_bytes, b.vocab_bytes) == (per_layer * 48 * 16, 9_854_976 * 32) == (27_002_929_152, 315_359_232)


def test_deepseek_v2_lite_tp2_rank32_by_hand():
    """DeepSeek-V2-Lite (h 2,048, 16 heads, MLA without q_lora_rank: kv_lora_rank 512, qk 128 + 64, v 128; 64 experts
    of 1,408, 2 shared (2,816); block 0 dense, FFN 10,944; 27 layers, vocab 102,400), TP 2, rank 32, 8 slots. Per slot
    and layer: qkv_proj (q_proj's, never read) A 96 x 2,048 = 196,608, B 64 x (16 + 32) / 2 x 32 = 49,152;
    fused_qkv_a A 64 x 2,048 = 131,072, B 576 x 32 = 18,432; kv_b A 32 x 512 = 16,384, B 8 x 256 x 32 = 65,536; o A 32
    x 1,024 = 32,768, B 65,536: 575,488. 3D MLP: block 0 (5,472 a rank) 131,072 + 350,208 + 175,104 + 65,536 =
    721,920, the others' shared experts (1,408 a rank) 131,072 + 90,112 + 45,056 + 65,536 = 331,776; 4D on all 27: an
    expert (704 a rank) 131,072 + 45,056 + 22,528 + 65,536 = 264,192 x 64. (27 x 575,488 + 721,920 + 26 x 331,776 + 27
    x 16,908,288) x 8 x 2 B = 7,702,560,768 B; vocabulary (3,276,800 + 65,536 + 65,536 + 51,200 x 32) x 32 =
    161,480,704 B; both SGLang's own. vLLM's one slot (tests/unit/test_rollout_lora.py) 921,901,056 B."""
    per_slot = 27 * 575_488 + 721_920 + 26 * 331_776 + 27 * 64 * 264_192
    b = sglang_lora_pool(resolve_model("deepseek-v2-lite"), tp=2, max_lora_rank=32)
    assert (b.blocks_bytes, b.vocab_bytes) == (per_slot * 16, 5_046_272 * 32) == (7_702_560_768, 161_480_704)


def test_llama4_pool_by_hand_and_refused_at_start():
    """Llama 4 Maverick's text config (benchmarks/sglang_lora_check.py LLAMA4_CONFIGS: h 5,120, 40 heads / 8 KV of 128,
    48 blocks, 128 experts of 8,192 on every other one, dense MLPs of 16,384 between, vocab 202,048 untied), TP 8, rank
    32, 8 slots. Per slot and layer: qkv A 96 x 5,120 = 491,520, B (640 + 2 x 128) x 32 = 28,672; o A 32 x 640 =
    20,480, B 163,840; an expert (1,024 a rank): gate_up A 64 x 5,120 = 327,680, B 2,048 x 32 = 65,536, down A 32 x
    1,024 = 32,768, B 163,840 = 589,824, x 128 on all 48 layers (the dense ones too); no 3D buffer (the config names no
    shared expert). (704,512 + 75,497,472) x 48 x 8 x 2 B = 58,523,123,712 B; vocabulary (6,465,536 + 163,840 + 163,840
    + 25,256 x 32) x 8 x 2 B, twice = 243,245,056 B: SGLang's own Llama4ForCausalLM pool. Its start then raises
    (update_lora_info: KeyError 'gate_up_proj', the dense and shared-expert MLPs wrapped without a buffer), as on a
    list with down_proj: refused, lora_merge; the attention alone starts (654,311,424 B at TP 2, no refusal); an MoE
    whose config names its shared experts (Qwen2-MoE), or has none and no dense MLP (Qwen3-MoE), starts."""
    maverick = our_model("llama4-maverick")
    b = sglang_lora_pool(maverick, tp=8, max_lora_rank=32)
    per_layer = 491_520 + 28_672 + 20_480 + 163_840 + 128 * (327_680 + 65_536 + 32_768 + 163_840)
    assert (b.blocks_bytes, b.vocab_bytes) == (per_layer * 48 * 16, 7_601_408 * 32) == (58_523_123_712, 243_245_056)
    assert [(r.field, r.code) for r in adapter_refusals(maverick)] == [("lora_merge", "engine-lora-start")]
    attention = sglang_target_modules(["q_proj", "k_proj", "v_proj", "o_proj"], maverick)
    assert sglang_lora_pool(maverick, 2, 32, targets=attention).total_bytes == 654_311_424
    assert not adapter_refusals(maverick, attention)
    assert start_refusals(maverick, sglang_target_modules(["q_proj", "v_proj", "down_proj"], maverick))
    assert not any(start_refusals(resolve_model(n)) for n in ("qwen2-moe-a2.7b", "qwen3-30b-a3b", "qwen2.5-7b"))


def test_targets_of_all_and_refusals():
    """"all" resolves by the model (V3: q_b_proj; V2-Lite: its q_proj as qkv_proj); q_b_proj named on a model without
    q_lora_rank is refused as SGLang's get_default_hidden_dim fails on it; an MoE family whose SGLang class is not
    read, or a non-gated MLP, is refused: one line naming the field."""
    v3, lite = resolve_model("deepseek-v3"), resolve_model("deepseek-v2-lite")
    assert all_targets(v3) - all_targets(lite) == {"q_b_proj"} and all_targets(lite) - all_targets(v3) == {"qkv_proj"}
    assert sglang_target_modules("all-linear", v3) == all_targets(v3)
    assert sglang_target_modules(["q_a_proj", "kv_a_proj_with_mqa"]) == {"fused_qkv_a_proj_with_mqa"}
    with pytest.raises(SpecError, match="target_modules: q_b_proj"):
        sglang_lora_pool(lite, 2, 32, targets=frozenset({"q_b_proj"}))
    with pytest.raises(SpecError, match="finetune.*phi"):
        sglang_lora_pool(resolve_model("phi-2"), 1, 32)


def test_backend_graph_metadata_by_hand():
    """csgmv's decode-graph rows (chunked_backend.py init_decode_cuda_graph_batch_info, one token a request): 6 int32
    rows of the batch (+ 1 on the two indptrs) and 2 of the slots: 4 x (6 x 256 + 2 + 16) = 6,216 B. DeepSeek-V2-Lite's
    MoE routing buffers (base_backend.py init_cuda_graph_moe_buffers, 64 experts, top-6, 256 requests, 8 slots): 1,536
    tokens, padded (1,536 + 64 x 63 = 5,568, a multiple of 64) 5,568 and 87 blocks: 4 x (8 x (5,568 + 87 + 3 + 65 +
    1,536) + 256) = 233,312 B. A dense model, or an MoE whose experts are not both targets: csgmv's rows alone; no CUDA
    graphs (max_bs 0): none. SGLang's own code allocates the same (benchmarks/sglang_lora_check.py, 6 of 6)."""
    lite = resolve_model("deepseek-v2-lite")
    assert (csgmv_graph_metadata_bytes(8, 256), moe_graph_buffers_bytes(lite, 8, 256)) == (6_216, 233_312)
    assert sglang_lora_pool(lite, 2, 32, max_bs=256).metadata_bytes == 239_528
    listed = sglang_target_modules(["q_proj", "down_proj"])
    assert sglang_lora_pool(lite, 2, 32, targets=listed, max_bs=256).metadata_bytes == 6_216
    assert sglang_lora_pool(lite, 2, 32).metadata_bytes == 0


def test_verl_sglang_moe_lora_priced_in_every_phase():
    """verl with SGLang serving DeepSeek-V2-Lite's adapter (rollout TP 2, rank 32, max_num_seqs 256): the pool and
    the backend's graph metadata, never released, in every phase - priced, no longer an error. SGLang's loader
    raises on the adapter all the same (its q_proj has no v_proj to stack with: lora/lora.py normalize_qkv_proj), so
    the estimate does not fit and names lora_merge; merged, no adapter, no refusal. DeepSeek-V3 (q_a_proj / q_b_proj)
    and GQA models load."""
    e = rl_estimate("deepseek-v2-lite", 8, gpu="h100-80gb", engine="sglang", finetune="lora")
    assert (e.engine_settings.tp, e.engine_settings.max_lora_rank, e.engine_settings.max_num_seqs) == (2, 32, 256)
    assert e.memory.engine.lora_bytes == 7_702_560_768 + 161_480_704 + 239_528 == 7_864_281_000
    assert all(p.gpu_bytes.get("engine LoRA buffers") == 7_864_281_000 for p in e.memory.phases)
    assert not e.fits and [(r.field, r.code) for r in e.memory.engine.refusals] == [("lora_merge",
                                                                                      "engine-lora-adapter")]
    merged = rl_estimate("deepseek-v2-lite", 8, gpu="h100-80gb", engine="sglang", finetune="lora", lora_merge=True)
    assert merged.memory.engine.lora_bytes == 0 and not merged.memory.engine.refusals
    assert [bool(adapter_refusals(resolve_model(n))) for n in ("deepseek-v3", "qwen3-30b-a3b")] == [False, False]


if importlib.util.find_spec("sglang") is not None:
    from benchmarks.sglang_lora_check import (ADAPTER_CASES, CASES, LLAMA4_CASES, METADATA_CASES, MOE_CASES,
                                              START_CASES, our_metadata_bytes, our_start_refused, ours,
                                              sglang_adapter_load_error, sglang_bytes, sglang_metadata_bytes,
                                              sglang_start_error)
else:
    CASES = MOE_CASES = LLAMA4_CASES = START_CASES = METADATA_CASES = ADAPTER_CASES = ()


@needs_sglang
@pytest.mark.parametrize("name, tp, rank, slots, targets", CASES)
def test_lora_pool_is_sglangs(name, tp, rank, slots, targets):
    """Qwen2.5-7B / 14B, Qwen3-8B, Llama 3 8B (at TP 16 one KV head a rank, replicated), Llama 3.2 1B (the head tied
    to the embedding), verl's all-linear and a list of targets, 8 slots or 1, ranks 16-64: the same bytes."""
    assert ours(name, tp, rank, slots, targets) == sglang_bytes(name, tp, rank, slots, targets)


@needs_sglang
@pytest.mark.parametrize("name, tp, rank, slots, targets", MOE_CASES)
def test_moe_and_mla_lora_pool_is_sglangs(name, tp, rank, slots, targets):
    """Every routed expert's 4D buffers on every layer, the shared experts' and DeepSeek's dense block's 3D ones,
    MLA's projections (V2-Lite's q_proj as a qkv_proj), all-linear and lists, TP 1-16: the same bytes."""
    assert ours(name, tp, rank, slots, targets) == sglang_bytes(name, tp, rank, slots, targets)


@needs_sglang
@pytest.mark.parametrize("name, tp, rank, slots, targets", LLAMA4_CASES)
def test_llama4_lora_pool_is_sglangs(name, tp, rank, slots, targets):
    """Llama 4 Scout (16 experts on every block) and Maverick (128 on every other, dense blocks between; its
    checkpoint's Llama4ForConditionalGeneration too): all-linear (the pool SGLang allocates before its start fails),
    a list with down_proj, the attention alone, TP 1-8, 1 or 8 slots: the same bytes."""
    assert ours(name, tp, rank, slots, targets) == sglang_bytes(name, tp, rank, slots, targets)


@needs_sglang
@pytest.mark.parametrize("name, tp, targets", START_CASES)
def test_refused_where_sglangs_lora_start_raises(name, tp, targets):
    """SGLang's own LoRAManager.init_lora_modules and update_lora_info on the pool: Llama 4 raises (KeyError
    'gate_up_proj' / 'down_proj'; its checkpoint class NotImplementedError in get_hidden_dim) wherever gate_up_proj or
    down_proj is a target, starts on the attention alone; Qwen3-MoE, Qwen2-MoE, Qwen2.5 start: refused exactly there."""
    assert our_start_refused(name, targets) == bool(sglang_start_error(name, tp, targets))


@needs_sglang
@pytest.mark.parametrize("name, tp, slots, max_bs", METADATA_CASES)
def test_backend_graph_metadata_is_sglangs(name, tp, slots, max_bs):
    """csgmv's decode-graph rows and, on an MoE, the routing buffers SGLang allocates for the first wrapped FusedMoE:
    dense and MoE, 1-8 slots, 100-512 requests: the same bytes."""
    assert our_metadata_bytes(name, tp, slots, max_bs) == sglang_metadata_bytes(name, tp, slots, max_bs)


@needs_sglang
@pytest.mark.parametrize("name", ADAPTER_CASES)
def test_adapter_refused_where_sglangs_loader_raises(name):
    """SGLang's own normalize_qkv_proj on verl's all-linear attention adapter: KeyError for DeepSeek-V2-Lite (q_proj,
    no v_proj), loads for DeepSeek-V3, Qwen3-MoE, Qwen2.5: we refuse exactly where it raises."""
    assert bool(adapter_refusals(resolve_model(name))) == bool(sglang_adapter_load_error(name))
