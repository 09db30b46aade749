"""peft's all-linear LoRA on an MoE, priced (cost_models/moe_lora.py): the router and the stacked experts adapted
through ParamWrappers, their merged weights W_eff saved, the routed rows' inputs saved for W_eff's gradients. Truth: the
trace tier (planner.tracing.trace: the FSDP2 step on fake tensors with peft's own all-linear adapters, calibration/
lora.add_lora) and peft measured block by block (benchmarks/peft_moe_lora.py). One trace runs here (~2-5 s); the
other traced figures are quoted from `planner.tracing.trace(arch_config(arch), gpus, finetune="lora", lora_rank=4,
lora_targets="all-linear", sharding=..., **knobs)` at 2026-12-07 (docs/accuracy.md "peft all-linear on an MoE,
priced"); each estimate takes ~0.3 s."""

import dataclasses

import pytest

from benchmarks.memory_accuracy import arch_config
from cost_models import activations, moe_lora
from cost_models.compute import model_flops_per_token
from cost_models.spec_values import SpecError
from cost_models.specs import Attention, TrainingSpec
from cost_models.step_allocations import replays
from planner.api import estimate
from planner.models import from_hf_config
from tests.unit.test_step_allocations import _events_peak, _walk

LORA = dict(finetune="lora", lora_rank=4, lora_targets="all-linear")


@pytest.fixture(scope="module")
def mixtral_traced():
    """Mixtral's small config (4 blocks, E 8, h 256, f 512, k 2), 8 ranks FULL_SHARD fp32, 1 x 32 tokens: block 3's
    backward leads, where W_eff's stack-sized gradients are."""
    pytest.importorskip("peft")
    from planner.tracing import trace

    return trace(arch_config("mixtral"), 8, sharding="FULL_SHARD", precision="fp32", activation_checkpointing="none",
                 micro_batch=1, seq_len=32, **LORA)


def test_the_ledger_meets_the_trace(mixtral_traced):
    """The trace peaks at 111,424,680 B in the backward; the ledger -0.07% at block 3's backward (its moment: down's
    grouped_mm backward, W_eff's gradient 8 x 256 x 512 x 4 = 4,194,304 B beside the rows' gradient). Before: refused
    (lora_targets); with full fine-tuning's expert moments (every stack's gradient accumulated) +3.76%."""
    r = mixtral_traced
    assert r.traced.peak_allocated_bytes == 111_424_680
    assert r.candidate.memory.peak_moment == "backward of block 3"
    assert r.candidate.memory.peak_allocated_bytes == pytest.approx(111_424_680, rel=1e-3)


@pytest.mark.parametrize("arch, gpus, knobs, traced", [
    ("mixtral", 8, dict(precision="fp32", activation_checkpointing="full", seq_len=128), 74_999_640),
    ("mixtral", 8, dict(precision="bf16", activation_checkpointing="full", seq_len=32), 36_556_200),
    ("mixtral", 8, dict(precision="bf16", activation_checkpointing="none", seq_len=32), 56_211_944),
    ("mixtral", 16, dict(precision="bf16", activation_checkpointing="none", seq_len=512, sharding="HYBRID_SHARD"),
     124_798_248),
    ("qwen3-moe", 8, dict(precision="fp32", activation_checkpointing="none", seq_len=1024), 356_917_992),
    ("qwen3-moe", 8, dict(precision="bf16", activation_checkpointing="none", seq_len=1024, micro_batch=2), 520_551_784),
    ("qwen3-moe", 8, dict(precision="bf16", activation_checkpointing="full", seq_len=32), 42_399_072),
    ("qwen3-moe", 2, dict(precision="fp32", activation_checkpointing="full", seq_len=512, sharding="NO_SHARD"),
     188_924_264),
    # Qwen2-MoE: a gated shared expert, its linears lora.Linear
    ("qwen2-moe", 8, dict(precision="fp32", activation_checkpointing="none", seq_len=1024, micro_batch=2), 637_503_336),
    ("qwen2-moe", 8, dict(precision="bf16", activation_checkpointing="full", seq_len=32), 40_647_584),
], ids=["mixtral-fp32-full", "mixtral-bf16-full", "mixtral-bf16-none", "mixtral-hsdp-16", "qwen3-fp32-1024",
        "qwen3-bf16-mb2", "qwen3-bf16-full-32", "qwen3-noshard", "qwen2-fp32-mb2", "qwen2-bf16-full-32"])
def test_traced_rows(arch, gpus, knobs, traced):
    """The ledger within 0.3% of the trace (-0.26 .. -0.003%; the attention-only rows' own gaps -0.005 .. -0.12%)."""
    knobs = {"sharding": "FULL_SHARD", "micro_batch": 1, **knobs}
    c = estimate(arch_config(arch), gpus, gpus_per_node=min(gpus, 8), **knobs, **LORA)
    assert c.memory.peak_allocated_bytes == pytest.approx(traced, rel=3e-3)


@pytest.mark.parametrize("arch, c, adapters, measured", [
    ("qwen3-moe", 4, 4, 13_647_872), ("qwen3-moe", 2, 4, 7_004_160),
    ("mixtral", 4, 4, 19_931_136), ("mixtral", 2, 4, 10_178_560), ("qwen2-moe", 4, 4, 9_510_912),
    ("deepseek-v3", 4, 4, 7_921_664)])
def test_a_blocks_excess_is_pefts(arch, c, adapters, measured):
    """What one MoE block saves beyond attention-only LoRA at 1,024 tokens, as benchmarks/peft_moe_lora.py measured it
    on peft itself (saved_tensors_hooks, rank 4; bf16 base with fp32 adapters cast at the merge): p [3 E f h + T k (h +
    f) + T h + E h] (+ p r E (5f + 3h)), and a shared expert's lora.Linears p T (fs + n r) (n 4 with Qwen2-MoE's gate, 3
    on DeepSeek-V3), to the byte."""
    spec = from_hf_config(arch_config(arch))
    wide = dataclasses.replace(spec, lora_targets="all-linear")
    per_token = (activations.block_bytes_per_token(wide, c, Attention.SDPA, 1024, 1, 4)
                 - activations.block_bytes_per_token(spec, c, Attention.SDPA, 1024, 1, 4))
    assert 1024 * per_token + moe_lora.merged_weight_bytes(wide, c, adapters, 4) == measured


def test_flops_count_each_tokens_experts_and_the_merges():
    """Qwen3-30B-A3B (48 blocks, E 128, k 8, h 2,048, f 768), rank 16, 4,096 tokens: per block and token the weight
    gradients of the router (262,144) and 8 experts (4,718,592 each), 2 x 38,010,880 = 76,021,760, and the merges
    (gate_up 2 x 1,536 x 32 x 2,048 x 128, down 2 x 2,048 x 16 x 768 x 128, router 2 x 128 x 16 x 2,048 =
    32,220,643,328) x 3 / 4,096 = 23,599,104: 48 x 99,620,864 = 4,781,801,472 FLOPs a token over attention-only LoRA."""
    spec = estimate("qwen3-30b-a3b", 8, gpu="h100-80gb", finetune="lora", lora_rank=16).model
    training = TrainingSpec(seq_len=4096, finetune="lora", lora_rank=16)
    wide = dataclasses.replace(spec, lora_targets="all-linear")
    assert model_flops_per_token(wide, training) - model_flops_per_token(spec, training) == 4_781_801_472


@pytest.mark.parametrize("model, knobs", [
    ("mixtral-8x7b", dict(micro_batch=1, activation_checkpointing="none")),
    ("mixtral-8x7b", dict(micro_batch=2, activation_checkpointing="full", precision="fp32")),
    ("qwen3-30b-a3b", dict(micro_batch=1, activation_checkpointing="full", precision="fp32")),
], ids=["mixtral-none", "mixtral-fp32-full", "qwen3-fp32-full"])
def test_the_walk_allocates_the_ledgers_peak_and_gpt_oss_is_refused(model, knobs):
    """8 x h100-80gb, 2,048 tokens: the allocator walk (LoraWalk with the ledger's largest moe_lora moment, W_eff's
    gradient a tensor) peaks at the ledger's allocated peak to the byte, at a block's backward (24 / 24 of Mixtral 8x7B
    / Qwen3-30B-A3B x mb 1 / 2 x none / full / every-2 x bf16 / fp32; before, with LoRA's frozen MoE block, 7 / 24,
    -0.25 .. -6.0%), and the estimate reports the replay's reserved. gpt-oss (no conversion: peft adapts its attention
    alone) is refused in one line naming lora_targets."""
    from tests.unit.test_step_allocations import _events_peak, _walk

    c = estimate(model, 8, gpu="h100-80gb", seq_len=2048, **knobs, **LORA)
    assert replays(c.model, c.training, c.config, 8) is None
    events, _ = _walk(c)
    assert _events_peak(events) == c.memory.peak_allocated_bytes
    assert c.memory.peak_moment.startswith("backward of block")
    assert any("replayed through the caching allocator" in n for n in c.memory.notes)
    with pytest.raises(SpecError, match="lora_targets.*attention alone"):
        estimate("gpt-oss-20b", 8, gpu="h100-80gb", **LORA)


def test_what_peft_cannot_run_is_refused():
    """peft's ParamWrapper raises for lora_dropout > 0 (tuners/lora/layer.py), and torch's selective checkpoint raises
    in the backward of an adapted Mixtral block under torchtitan's op-level policy (real CPU tensors, 32 tokens;
    attention-only LoRA runs): both refused in one line naming the field, and the search leaves selective-op out."""
    peft = pytest.importorskip("peft")
    import torch
    from torch.utils.checkpoint import checkpoint

    from benchmarks.peft_moe_lora import build
    from calibration.build import build_model
    from calibration.checkpointing import selective_op_context
    from planner.api import plan

    model = build_model(None, arch_config("qwen3-moe"), device="meta")
    with pytest.raises(ValueError, match="lora_dropout"):
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.05))
    with pytest.raises(SpecError, match="^lora_dropout: .*ParamWrapper"):
        estimate("qwen3-30b-a3b", 8, lora_dropout=0.05, **LORA)
    for targets, raises in (("attention", False), ("all-linear", True)):
        block = build("mixtral", targets, "cpu", torch.float32).base_model.model.model.layers[1].mlp
        x = torch.randn(1, 32, 256, requires_grad=True)
        try:
            checkpoint(block, x, use_reentrant=False, context_fn=selective_op_context)[0].sum().backward()
            raised = False
        except RuntimeError as exc:
            raised = "selective activation checkpoint has been mutated" in str(exc)
        assert raised == raises
    with pytest.raises(SpecError, match="^activation_checkpointing: selective-op"):
        estimate("qwen3-30b-a3b", 8, activation_checkpointing="selective-op", **LORA)
    ranked = plan("qwen3-30b-a3b", 8, gpu="h100-80gb", seq_len=4096, **LORA).candidates
    assert ranked and not any(c.config.selective_op_ac for c in ranked)


def test_the_rl_actor_prices_them():
    """verl's actor (rank 32, cost_models/rl_actor.py) on Qwen3-30B-A3B (h 2,048, q 4,096, kv 512, E 128, f 768): 32 x
    (6,144 + 2,560 + 2,560 + 6,144) = 557,056 attention elements a block, router 32 x 2,176 = 69,632, gate_up 2 x 32 x
    128 x 3,584 = 29,360,128, down 32 x 128 x 2,816 = 11,534,336: 41,521,152. The old log-prob pass (adapters on) holds
    the merged stacks and router weight, (3 x 128 x 768 x 2,048 + 128 x 2,048) x 2 = 1,208,483,840 B in bf16 (both
    stacks cached through the experts' forward); the reference's pass (adapter disabled) does not."""
    from cost_models.rl_actor import all_linear_lora, forward_only_bytes
    from cost_models.rl_settings import RlSettings
    from planner.models import resolve_model

    model = resolve_model("qwen3-30b-a3b")
    assert all_linear_lora(model).lora_params_per_block(32) == 41_521_152
    old, ref = forward_only_bytes(model, 4096, 2, RlSettings(finetune="lora"))
    assert old["merged expert stacks (peft)"] == 1_208_483_840 and "merged expert stacks (peft)" not in ref


def test_a_merged_sync_holds_one_stacks_delta():
    """verl's model.lora.merge under FSDP1: PEFT's merge_adapter makes each expert stack's delta whole, one at a time
    (measured on the Mixtral small config: the merge's peak is gate_up's bmm output, 8 x 1,024 x 256 x 4 = 8,388,608 B).
    Mixtral 8x7B in fp32: 8 x 2 x 14,336 x 4,096 x 4 = 3,758,096,384 B, above twice its largest linear's."""
    from cost_models.rl_actor import all_linear_lora
    from cost_models.rl_strategy import merged_sync_bytes
    from planner.models import resolve_model

    model = all_linear_lora(resolve_model("mixtral-8x7b"))
    walk, _ = merged_sync_bytes(model, "fsdp", 0, 4, 8)
    assert walk["LoRA delta"] == 3_758_096_384


def test_fsdp1_is_refused():
    """FSDP1 fails with all-linear on an MoE (benchmarks/peft_moe_fsdp1.py, a 2-rank gloo run of the Mixtral small
    config, 2026-12-07: peft's fsdp_auto_wrap_policy, as verl's is_lora policy, with use_orig_params False and True, and
    the blocks alone as units; attention-only LoRA runs: moe_lora.fsdp1_refusals): verl's actor.strategy fsdp is refused in one line naming the
    field, and the search keeps fsdp2 only."""
    from planner.rl.evaluate import evaluate_rl
    from planner.rl.request import rl_request
    from planner.rl.search import spaces
    from planner.models import resolve_model

    job = dict(gpu="h100-80gb", finetune="lora", prompt_len=1024, response_len=2048, rollout_n=8, train_batch=64)
    refused = evaluate_rl(rl_request("qwen3-30b-a3b", 8, **job))
    assert any(r.startswith("strategy: FSDP1 with all-linear LoRA on an MoE") for r in refused.reasons)
    fsdp2 = evaluate_rl(rl_request("qwen3-30b-a3b", 8, strategy="fsdp2", **job))
    assert not any(r.startswith("strategy:") for r in fsdp2.reasons)
    shared, _, _ = spaces(rl_request("qwen3-30b-a3b", 8, **job), resolve_model("qwen3-30b-a3b"), 8)
    assert {s["strategy"] for s in shared} == {"fsdp2"}
    # the trainers: an FSDP1 one is refused in one line naming the field, an FSDP2 one prices it
    with pytest.raises(SpecError, match="^trainer: the planner's FSDP1 code: FSDP1 with all-linear LoRA on an MoE"):
        estimate("mixtral-8x7b", 8, gpu="h100-80gb", trainer="fsdp1", **LORA)
    assert estimate("mixtral-8x7b", 8, gpu="h100-80gb", trainer="fsdp2", **LORA).trainer == "fsdp2"


# MoE families with dense blocks: DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers / decoder_sparse_step
QWEN3_DENSE_0 = {**arch_config("qwen3-moe"), "mlp_only_layers": [0]}
QWEN2_STEP_2 = {**arch_config("qwen2-moe"), "decoder_sparse_step": 2}
DENSE_BLOCK_CONFIGS = {"deepseek-v3": arch_config("deepseek-v3"), "qwen3-moe-dense-0": QWEN3_DENSE_0,
                       "qwen2-moe-step-2": QWEN2_STEP_2}


@pytest.mark.parametrize("name, elements, tensors, dense_delta", [
    ("deepseek-v3", 200_544, 82, 21_312 - 59_744),
    ("qwen3-moe-dense-0", 312_512, 56, 12_288 - 91_200),
    ("qwen2-moe-step-2", 170_056, 72, 2 * (12_288 - 46_112 - 10_244)),
])
def test_dense_blocks_adapters_are_pefts(name, elements, tensors, dense_delta):
    """peft 0.22's get_peft_model(target_modules="all-linear") on the meta device, rank 4: a dense block's MLP takes
    plain lora.Linear adapters (gate, up, down: 3 r (h + f), f the dense width 768: 12,288), a sparse block the router's
    and stacks' ParamWrappers and its shared expert's lora.Linears. DeepSeek-V3 (block 0 dense): MLA attention 9,024 a
    block; 21,312 dense + 3 x 59,744 sparse (9,024 + 46,112 + shared 4,608) = 200,544 elements, 82 tensors; Qwen3-MoE
    with mlp_only_layers [0]: attention 6,656, 18,944 + 3 x 97,856 = 312,512; Qwen2-MoE with decoder_sparse_step 2
    (blocks 0 and 2 dense): attention 8,192, 2 x 20,480 + 2 x (8,192 + 46,112 + gated shared expert 10,244) = 170,056.
    The ledger's count (ModelSpec.lora_params, the dense blocks' delta in ParamCounts) is peft's, to the element."""
    peft = pytest.importorskip("peft")
    from calibration.build import build_model

    cfg = DENSE_BLOCK_CONFIGS[name]
    spec = dataclasses.replace(from_hf_config(cfg), lora_targets="all-linear")
    model = peft.get_peft_model(build_model(None, cfg, device="meta"),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    adapters = [p.numel() for n, p in model.named_parameters() if "lora_" in n]
    assert (sum(adapters), len(adapters)) == (elements, tensors)
    assert spec.lora_params(4) == elements and spec.lora_dense_delta(4) == dense_delta
    assert spec.n_layers * len(spec.lora_tensor_elements(4)) + spec.lora_dense_delta(4, tensors=True) == tensors


@pytest.mark.parametrize("name, gpus, knobs, traced", [
    ("deepseek-v3", 8, dict(precision="fp32", activation_checkpointing="none", seq_len=32, sharding="NO_SHARD"),
     85_389_520),
    ("deepseek-v3", 8, dict(precision="bf16", activation_checkpointing="full", seq_len=32), 30_676_312),
    ("deepseek-v3", 8, dict(precision="bf16", activation_checkpointing="none", seq_len=1024, micro_batch=2),
     427_342_528),
    ("deepseek-v3", 16, dict(precision="bf16", activation_checkpointing="none", seq_len=512,
                             sharding="HYBRID_SHARD"), 123_495_104),
    ("qwen3-moe-dense-0", 8, dict(precision="fp32", activation_checkpointing="none", seq_len=32), 92_651_604),
    ("qwen3-moe-dense-0", 8, dict(precision="bf16", activation_checkpointing="full", seq_len=128), 46_422_024),
    ("qwen2-moe-step-2", 8, dict(precision="bf16", activation_checkpointing="full", seq_len=128), 45_240_872),
    ("qwen2-moe-step-2", 4, dict(precision="fp32", activation_checkpointing="full", seq_len=512,
                                 sharding="NO_SHARD"), 176_794_888),
], ids=["deepseek-noshard-block-3", "deepseek-bf16-full", "deepseek-mb2-1024", "deepseek-hsdp-16",
        "qwen3-dense-fp32", "qwen3-dense-bf16-full", "qwen2-step2-bf16-full", "qwen2-step2-noshard"])
def test_traced_rows_with_dense_blocks(name, gpus, knobs, traced):
    """The ledger within 0.3% of the trace, `planner.tracing.trace(cfg, gpus, finetune="lora", lora_rank=4,
    lora_targets="all-linear", **knobs)` at 2026-12-07 (peft's own all-linear through calibration/lora.add_lora): -0.275
    .. +0.018%. The first row peaks at DeepSeek's block 3 backward, where the shared experts' backward runs before the
    routed one (moe_lora.backward_moments; before: refused, lora_targets). Dense blocks under LoRA are walked
    (lora_dense_events.py): there the walk's live tensors peak 34,816 B (+0.041%) over the ledger (the block's MoE
    moment); the other seven rows' walks are within 2 B of it, or flat (qwen2-step2 on 8: padded experts)."""
    knobs = {"sharding": "FULL_SHARD", "micro_batch": 1, **knobs}
    c = estimate(DENSE_BLOCK_CONFIGS[name], gpus, gpus_per_node=min(gpus, 8), **knobs, **LORA)
    assert c.memory.peak_allocated_bytes == pytest.approx(traced, rel=3e-3)
    if name == "deepseek-v3" and gpus == 8 and knobs["sharding"] == "NO_SHARD":
        assert c.memory.peak_moment == "backward of block 3"
        assert replays(c.model, c.training, c.config, 1) is None
        assert _events_peak(_walk(c)[0]) == pytest.approx(c.memory.peak_allocated_bytes, rel=5e-4)


def test_llama4_is_refused_where_peft_raises():
    """Llama 4 has no transformers-5 conversion, so peft's all-linear takes its nn.Linears, the router (Llama4Router,
    an nn.Linear returning (scores, logits)) among them: lora.Linear's forward then fails on the tuple (peft
    tuners/lora/layer.py:1192). Refused in one line naming lora_targets."""
    pytest.importorskip("peft")
    import torch

    from benchmarks.peft_moe_lora import build

    model = build("llama4", "all-linear", "cpu", torch.float32)
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'dtype'"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(SpecError, match="^lora_targets: peft 0.22's all-linear fails on Llama 4"):
        estimate(arch_config("llama4"), 8, **LORA)


def test_dense_blocks_adapters_train_in_the_flops():
    """DeepSeek-V3's small config (block 0 dense, f 768), rank 4, 1,024 tokens: the lora.Linear adapters are MLA's and
    the shared expert's in the 3 sparse blocks (9,024 + 4,608 elements each) and MLA's and the MLP's in the dense one
    (9,024 + 12,288): 62,208 elements, 6 FLOPs each a token; the dense block's MLP adapters over a sparse block's
    shared ones, 21,312 - 13,632 = 7,680 elements, add 46,080 FLOPs a token to what n_layers sparse blocks count."""
    spec = dataclasses.replace(from_hf_config(arch_config("deepseek-v3")), lora_targets="all-linear")
    training = TrainingSpec(seq_len=1024, finetune="lora", lora_rank=4)
    as_sparse = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, n_dense_layers=0, dense_layers=(),
                                                                   dense_block_params=0, first_sparse_layer=0))
    sparse_lora = 4 * 4 * sum(map(sum, spec.lora_shapes))
    assert sparse_lora == 4 * 13_632
    dense_flops = model_flops_per_token(spec, training) - model_flops_per_token(as_sparse, training)
    trained = moe_lora.trained_flops_per_token(spec, 4, 1024)  # one sparse block's merges and expert gradients
    params = spec.moe.dense_block_params - spec.block_params + spec.moe.inactive_params  # active params' change
    assert dense_flops == pytest.approx(4 * params + 46_080 - trained)


def test_fsdp1_is_refused_on_deepseek_too():
    """benchmarks/peft_moe_fsdp1.py's run with the DeepSeek-V3 small config (2 gloo ranks, 2026-12-07): attention-only
    LoRA runs (loss 9.4668), all-linear fails under peft's wrap policy with flat ("Output 0 of View is a view ...") and
    original parameters ("inconsistent tensor size"), as Mixtral's: FSDP1 refused in one line naming the field."""
    with pytest.raises(SpecError, match="^trainer: the planner's FSDP1 code: FSDP1 with all-linear LoRA on an MoE"):
        estimate(arch_config("deepseek-v3"), 8, trainer="fsdp1", **LORA)
