"""The RL actor's LoRA targets (verl's model.target_modules, `rl` / `rl estimate --lora-targets`;
cost_models/rl_lora_targets.py): attention-only LoRA priced on the trainer (the actor's adapters) and in SGLang's
pool (verl hands it the list), vLLM's buffers unchanged (verl passes vLLM no targets); Llama 4 and gpt-oss, whose
all-linear is refused, planned with attention; a list that is not the attention projections refused, naming the
field."""

import pytest

from benchmarks.sglang_lora_check import our_model
from cost_models.rl_lora_targets import attention_modules, lora_targets, module_names
from cost_models.spec_values import LoraTargets, SpecError
from planner.models import resolve_model
from planner.rl import rl_estimate
from planner.rl.evaluate import evaluate_rl
from planner.rl.request import rl_request

H100 = dict(gpu="h100-80gb", finetune="lora")


def test_attention_lora_on_a_dense_model_by_hand():
    """Qwen2.5-7B (h 3,584, 28 heads / 4 KV of 128, FFN 18,944, 28 layers), rank 32, 8 GPUs, FSDP1, the fp32 actor.
    Adapters per layer, r x (in + out): q 32 x 7,168 = 229,376, k and v 32 x 4,096 = 131,072 each, o 229,376:
    720,896; the MLP's (all-linear only) gate, up, down 32 x 22,528 = 720,896 each. The actor's shard: (7,615,616,512
    + 28 x 720,896) x 4 B / 8 = 3,817,900,800 B, all-linear 30,277,632 B more (28 x 2,162,688 x 4 / 8). SGLang's
    pool (TP 2, 8 slots, bf16) for verl's list: qkv_proj A 3 x 32 x 3,584 = 344,064, B (1,792 + 2 x 256) x 32 = 73,728;
    o_proj A 32 x 1,792 = 57,344, B 3,584 x 32 = 114,688: 589,824 x 28 x 8 x 2 B = 264,241,152, and csgmv's graph rows
    4 x (6 x 256 + 2 + 16) = 6,216: 264,247,368 B - no embedding or head buffers (not targets; all-linear's "all"
    has them: 1,066,670,152 B). vLLM wraps every linear whatever the adapter targets: its buffers the same."""
    att = rl_estimate("qwen2.5-7b", 8, **H100, lora_targets="attention")
    full = rl_estimate("qwen2.5-7b", 8, **H100)
    assert att.settings.lora_targets is LoraTargets.ATTENTION and att.model.lora_targets is LoraTargets.ATTENTION
    assert att.memory.actor.params_bytes == (7_615_616_512 + 28 * 720_896) * 4 // 8 == 3_817_900_800
    assert full.memory.actor.params_bytes - att.memory.actor.params_bytes == 28 * 3 * 720_896 * 4 // 8 == 30_277_632
    assert att.memory.engine.lora_bytes == full.memory.engine.lora_bytes   # vLLM: every linear wrapped
    sglang = rl_estimate("qwen2.5-7b", 8, **H100, engine="sglang", lora_targets="q_proj,k_proj,v_proj,o_proj")
    assert sglang.memory.engine.lora_bytes == 589_824 * 28 * 16 + 6_216 == 264_247_368
    assert rl_estimate("qwen2.5-7b", 8, **H100, engine="sglang").memory.engine.lora_bytes == 1_066_670_152
    assert att.fits and sglang.fits and att.memory.peak.reserved_bytes < full.memory.peak.reserved_bytes


def test_attention_lora_on_an_moe_is_the_single_run_planners():
    """Qwen3-30B-A3B (h 2,048, 32 heads / 4 KV of 128, 48 layers), FSDP2, rank 32: attention adapters q 32 x 6,144,
    k and v 32 x 2,560, o 32 x 6,144 = 557,056 a layer; the fp32 shard (30,532,122,624 + 48 x 557,056) x 4 / 8 =
    15,279,430,656 B; all-linear adds the router's and the stacked experts' adapters (983,138,304 B more). The actor
    is the single-run planner's model under lora_targets attention: no merged expert stacks in the log-prob pass."""
    from planner.request.resolve import with_lora_targets
    from planner.request.groups import TrainingRequest

    att = rl_estimate("qwen3-30b-a3b", 8, **H100, strategy="fsdp2", lora_targets="attention")
    full = rl_estimate("qwen3-30b-a3b", 8, **H100, strategy="fsdp2")
    assert att.memory.actor.params_bytes == (30_532_122_624 + 48 * 557_056) * 4 // 8 == 15_279_430_656
    assert full.memory.actor.params_bytes - att.memory.actor.params_bytes == 983_138_304
    single = with_lora_targets(resolve_model("qwen3-30b-a3b"), TrainingRequest(finetune="lora",
                                                                              lora_targets="attention"))
    assert single.lora_params_per_block(32) == 557_056 == att.model.lora_params_per_block(32)
    log_prob = next(p for p in att.memory.phases if p.name == "log_prob").gpu_bytes
    assert "merged expert stacks (peft)" not in log_prob
    assert "merged expert stacks (peft)" in next(p for p in full.memory.phases if p.name == "log_prob").gpu_bytes


def test_llama4_and_gpt_oss_are_planned_with_attention_and_refused_with_all_linear():
    """Llama 4 Scout's text config (benchmarks/sglang_lora_check.py) and gpt-oss-20b: all-linear is refused naming
    target_modules (peft: moe_lora_targets.unpriced_reason) with its fix; attention is planned - SGLang starts with
    the attention pool (no engine-lora-start refusal: its gate_up_proj / down_proj are no targets), and gpt-oss on
    vLLM, FSDP1 not refused (attention-only LoRA on an MoE runs under FSDP1: moe_lora.fsdp1_fails) but its LoRA sync
    summons the whole fp32 actor, which does not fit; FSDP2 fits."""
    scout = our_model("llama4-scout")
    knobs = dict(H100, gpus_per_node=8, strategy="fsdp2", engine="sglang", rollout_tp=8)
    with pytest.raises(SpecError, match=r"^lora_targets: all-linear: peft .* Llama 4.*--lora-targets attention"):
        evaluate_rl(rl_request("scout", 16, **knobs), model=scout)
    e = evaluate_rl(rl_request("scout", 16, **knobs, lora_targets="attention"), model=scout)
    assert e.engine_settings.lora_target_modules == {"qkv_proj", "o_proj"}
    # Scout at TP 8 (h 5,120, 40 heads / 8 KV of 128, 48 layers; tests/unit/test_rl_sglang_lora.py's Maverick
    # attention): qkv A 96 x 5,120 = 491,520, B (640 + 2 x 128) x 32 = 28,672, o A 32 x 640 = 20,480, B 163,840:
    # 704,512 x 48 layers x 8 slots x 2 B + csgmv's 6,216
    assert not e.memory.engine.refusals and e.memory.engine.lora_bytes == 704_512 * 48 * 16 + 6_216 == 541_071_432
    assert e.model.lora_targets is LoraTargets.ATTENTION
    with pytest.raises(SpecError, match=r"^lora_targets: all-linear: peft .* gpt-oss"):
        rl_estimate("gpt-oss-20b", 8, **H100)
    assert rl_estimate("gpt-oss-20b", 8, **H100, strategy="fsdp2", lora_targets="attention").fits
    fsdp1 = rl_estimate("gpt-oss-20b", 8, **H100, lora_targets="attention")   # the summoned actor does not fit
    assert [r.split(" (")[0] for r in fsdp1.reasons] == ["needs 113.5 GiB per GPU > 79.6 GiB"]
    # TRL's server sync sends the blocks' linears one by one (rl_actor.sent_tensors): read without an all-linear spec
    trl = rl_estimate("gpt-oss-20b", 4, **H100, framework="trl", vllm_mode="server", strategy="fsdp2",
                      lora_targets="attention")
    assert trl.fits and trl.memory.peak.name == "weight_sync"


def test_target_lists_read_by_the_model():
    """A list is attention where it names exactly the model's attention projections (any order, dotted prefixes as
    PEFT's suffix match); MLA's and Phi-3's own names; anything else is one line naming target_modules."""
    qwen, lite, v3, phi4 = (resolve_model(n) for n in ("qwen2.5-7b", "deepseek-v2-lite", "deepseek-v3", "phi-4"))
    assert module_names("[q_proj, 'k_proj',v_proj,self_attn.o_proj]") == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert lora_targets(["o_proj", "v_proj", "k_proj", "q_proj"], qwen) is LoraTargets.ATTENTION
    assert lora_targets("all-linear", qwen) is LoraTargets.ALL_LINEAR
    assert attention_modules(lite) == ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    assert attention_modules(v3)[:2] == ("q_a_proj", "q_b_proj") and attention_modules(phi4) == ("qkv_proj", "o_proj")
    for bad in (["q_proj", "v_proj"], "q_proj,k_proj,v_proj,o_proj,gate_proj", ".*proj"):
        with pytest.raises(SpecError, match=r"^lora_targets: .* is not priced; choose one of: all-linear, "
                                            r"attention \(the attention projections alone: \[q_proj,k_proj,v_proj,"
                                            r"o_proj\] for qwen2.5-7b\)$"):
            lora_targets(bad, qwen)
