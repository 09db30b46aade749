"""Each doctor finding: a config that triggers it and one that does not."""

import pytest

from planner.doctor import check
from planner.doctor.readers import UserSetup, from_accelerate, from_kwargs

GOOD = {"auto_wrap_policy": "ModuleWrapPolicy", "mixed_precision": {"param_dtype": "bfloat16",
                                                                     "reduce_dtype": "float32"},
        "use_orig_params": True}


def codes(kwargs, model="llama2-7b", gpus=8, **kw):
    return {f.code: f.severity for f in check(from_kwargs(kwargs), model, gpus, **kw).findings}


def test_good_config_has_no_errors_or_warnings():
    # the planner's own pick, written as kwargs, has nothing to fix. Since FSDP1's copies around its collectives are
    # priced (cost_models/fsdp_copies.py: FULL_SHARD pays the shard casts of two gathers and the flat gradient's
    # cat, cast and divides), that pick is SHARD_GRAD_OP at micro-batch 4: FULL_SHARD at 2 reads 3,183 tokens/s
    # against its 3,510 (+10.3%, a warning)
    found = codes({**GOOD, "sharding_strategy": "SHARD_GRAD_OP", "activation_checkpointing": "none", "micro_batch": 4},
                  seq_len=2048)
    assert not {c: s for c, s in found.items() if s != "advice"}, found
    slower = codes({**GOOD, "activation_checkpointing": "none", "micro_batch": 2}, seq_len=2048)
    assert slower["planner-pick-is-faster"] == "warning"


def test_compile_and_float8_are_advice_not_a_warning():
    # the planner's pick on H100 adds torch.compile and Float8 linears (code changes, not FSDP settings): the
    # same FSDP settings without them get advice naming them, not "planner-pick-is-faster"
    found = {f.code: f for f in check(from_kwargs({**GOOD, "activation_checkpointing": "none", "micro_batch": 2}),
                                      "llama2-7b", 8, gpu="h100-80gb", seq_len=2048).findings}
    pick = found.get("planner-pick-is-faster")   # FSDP settings only (here: a larger micro-batch)
    assert pick is None or ("compile" not in pick.message and "Float8" not in pick.message)
    advice = found["techniques-would-help"]
    assert advice.severity == "advice" and "torch.compile per block" in advice.message


@pytest.mark.parametrize("scaler,severity", [("null", "error"), ("GradScaler", "error"), ("unstated", "warning")])
def test_fp16_without_sharded_scaler(scaler, severity):
    kw = {**GOOD, "mixed_precision": {"param_dtype": "float16", "reduce_dtype": "float32"}}
    if scaler != "unstated":
        kw["grad_scaler"] = None if scaler == "null" else scaler
    assert codes(kw)["fp16-without-sharded-scaler"] == severity
    assert "fp16-without-sharded-scaler" not in codes({**kw, "grad_scaler": "ShardedGradScaler"})
    assert "fp16-without-sharded-scaler" not in codes(GOOD)


def test_lora_without_use_orig_params():
    assert codes({**GOOD, "use_orig_params": False}, finetune="lora")["lora-without-use-orig-params"] == "error"
    assert "lora-without-use-orig-params" not in codes(GOOD, finetune="lora")
    assert "lora-without-use-orig-params" not in codes({**GOOD, "use_orig_params": False})  # full fine-tune
    fsdp2 = {"reshard_after_forward": True, "mp_policy": GOOD["mixed_precision"]}
    assert "lora-without-use-orig-params" not in codes(fsdp2, finetune="lora")  # FSDP2 keeps original params


def test_lora_adapters_sharing_block_units():
    found = check(from_kwargs(GOOD), "llama2-7b", 8, finetune="lora").findings
    f = {f.code: f for f in found}["lora-adapters-share-units"]
    assert f.severity == "warning" and "uniform dtype" in f.message and "fsdp_auto_wrap_policy" in f.fix
    # the frozen blocks' fp32 gradients, sharded over 8: 32 x 202,383,360 params x 4 B / 8 = 3.0 GiB
    assert "3.0 GiB per GPU" in f.message
    assert "lora-adapters-share-units" not in codes({**GOOD, "auto_wrap_policy": "lambda_auto_wrap_policy"},
                                                    finetune="lora")  # a custom policy (peft's is a lambda)
    assert "lora-adapters-share-units" not in codes(GOOD)  # full fine-tuning
    fsdp2 = {"reshard_after_forward": True, "mp_policy": GOOD["mixed_precision"]}
    assert "lora-adapters-share-units" not in codes(fsdp2, finetune="lora")  # FSDP2 shards per parameter
    from planner.doctor.readers.trainers import from_hf_trainer

    hf = from_hf_trainer({"fsdp": True, "bf16": True, "fsdp_config": {"version": 1}})  # per block, as accelerate's
    assert hf.wrap == "block" and hf.adapter_units  # but the Trainer swaps in peft's policy for a PEFT model
    assert "lora-adapters-share-units" not in {f.code for f in check(hf, "llama2-7b", 8, finetune="lora").findings}


def test_no_auto_wrap_policy_prices_one_unit():
    no_wrap = {k: v for k, v in GOOD.items() if k != "auto_wrap_policy"}
    r = check(from_kwargs(no_wrap), "llama2-13b", 8)
    f = {f.code: f for f in r.findings}["no-auto-wrap-policy"]
    # the whole 13B model gathered in bf16 (26 GB) is added to the per-block estimate
    wrapped = check(from_kwargs(GOOD), "llama2-13b", 8).candidate
    extra = r.candidate.memory.peak_allocated_bytes - wrapped.memory.peak_allocated_bytes
    assert extra == pytest.approx(13_015_864_320 * 2 - wrapped.memory.phases["backward"].unsharded_params, rel=0.01)
    assert f.severity == ("warning" if r.candidate.fits else "error")
    assert "no-auto-wrap-policy" not in codes(GOOD)


def test_no_auto_wrap_policy_past_the_gpu_is_one_error_at_the_flat_rules_reserved():
    """Llama 2 70B on 16 x 80 GB without a wrap policy: backward gathers the whole model in bf16 (68,976,648,192
    params x 2 B = 137,953,296,384 B, its largest term); the step replay walks per-block units, so the reserved is
    the flat rule's, allocated x 1.05 + the memory outside the allocator, far past the GPU: one error, the wrap
    policy's (no second gpu-memory-does-not-fit for the same peak), and no replay note."""
    r = check(from_kwargs({k: v for k, v in GOOD.items() if k != "auto_wrap_policy"}), "llama2-70b", 16)
    m = r.candidate.memory
    assert (m.peak_phase, m.breakdown.unsharded_params) == ("backward", 68_976_648_192 * 2)
    assert m.peak_reserved_bytes == pytest.approx(m.peak_allocated_bytes * 1.05 + m.outside_allocator_bytes, abs=1)
    assert [(f.code, f.severity) for f in r.findings if f.severity == "error"] == [("no-auto-wrap-policy", "error")]
    assert len(r.candidate.reasons) == 1 and not [n for n in m.notes if "replayed" in n]


def test_size_based_wrap_is_advice():
    assert codes({**GOOD, "auto_wrap_policy": "size_based_auto_wrap_policy"})["size-based-wrap"] == "advice"
    assert "size-based-wrap" not in codes(GOOD)


def test_hybrid_on_one_node():
    assert codes({**GOOD, "sharding_strategy": "HYBRID_SHARD"}, gpus=8)["hybrid-on-one-node"] == "warning"
    assert "hybrid-on-one-node" not in codes({**GOOD, "sharding_strategy": "HYBRID_SHARD"}, gpus=16)


def test_sync_module_states():
    assert codes({**GOOD, "sync_module_states": True})["needless-sync-module-states"] == "advice"
    assert codes({**GOOD, "init": "rank0"})["missing-sync-module-states"] == "error"
    assert codes({**GOOD, "param_init_fn": "reset_parameters"})["missing-sync-module-states"] == "warning"
    ok = codes({**GOOD, "init": "rank0", "sync_module_states": True})
    assert "missing-sync-module-states" not in ok and "needless-sync-module-states" not in ok


def test_forward_prefetch_with_dynamic_control_flow():
    kw = {**GOOD, "forward_prefetch": True}
    assert codes(kw, dynamic_control_flow=True)["forward-prefetch-dynamic-graph"] == "error"
    assert "forward-prefetch-dynamic-graph" not in codes(kw)
    assert "forward-prefetch-dynamic-graph" not in codes(GOOD, dynamic_control_flow=True)


def test_limit_all_gathers_explained():
    assert codes({**GOOD, "limit_all_gathers": True})["limit-all-gathers-is-a-rate-limiter"] == "advice"
    assert codes({**GOOD, "limit_all_gathers": False})["limit-all-gathers-is-a-rate-limiter"] == "warning"
    assert "limit-all-gathers-is-a-rate-limiter" not in codes(GOOD)


def test_offload_cpu_ram_does_not_fit():
    kw = {**GOOD, "cpu_offload": {"offload_params": True}}
    assert codes(kw, model="llama2-70b", cpu_ram_per_node="512GiB")["cpu-ram-does-not-fit"] == "error"
    assert "cpu-ram-does-not-fit" not in codes(kw, model="llama2-70b", cpu_ram_per_node="4TiB")


def test_gpu_memory_does_not_fit():
    assert codes(GOOD, model="llama2-70b", gpus=8)["gpu-memory-does-not-fit"] == "error"
    assert "gpu-memory-does-not-fit" not in codes(GOOD, model="llama2-7b", gpus=8)


def test_micro_batch_leaves_memory_unused():
    kw = {**GOOD, "activation_checkpointing": "full"}
    found = codes(kw, model="llama2-7b", gpus=8, seq_len=512)
    assert found["micro-batch-leaves-memory-unused"] == "advice"
    assert "micro-batch-leaves-memory-unused" not in codes({**kw, "micro_batch": 8}, model="llama2-7b", gpus=8,
                                                           seq_len=4096)


def test_strategy_the_planner_ranks_clearly_slower():
    # NO_SHARD on 64 GPUs across 8 nodes all-reduces full fp32 gradients over the network
    slow = {**GOOD, "sharding_strategy": "NO_SHARD"}
    r = check(from_kwargs(slow), "gpt-760m", 64, seq_len=512)
    f = {f.code: f for f in r.findings}.get("planner-pick-is-faster")
    assert f is not None and f.severity == "warning" and "%" in f.message
    # the planner's own pick is, by definition, not clearly slower than itself
    best = UserSetup(config=r.plan.best.config, use_orig_params=True)
    again = check(best, "gpt-760m", 64, seq_len=512)
    assert "planner-pick-is-faster" not in {f.code for f in again.findings}


def test_bf16_on_gpu_without_bf16():
    assert codes(GOOD, gpu="v100-32gb", model="gpt-350m")["dtype-not-supported"] == "error"
    fp16 = {**GOOD, "mixed_precision": {"param_dtype": "float16"}, "grad_scaler": "ShardedGradScaler"}
    assert "dtype-not-supported" not in codes(fp16, gpu="v100-32gb", model="gpt-350m")


def test_fsdp2_config_with_removed_settings():
    fsdp2 = {"reshard_after_forward": True, "mp_policy": GOOD["mixed_precision"]}
    found = codes({**fsdp2, "backward_prefetch": "BACKWARD_PRE", "use_orig_params": True})
    assert found["fsdp2-removed-backward-prefetch"] == "warning" and found["fsdp2-removed-use-orig-params"] == "warning"
    assert not any(c.startswith("fsdp2-removed") for c in codes(fsdp2))
    acc = from_accelerate({"distributed_type": "FSDP", "mixed_precision": "bf16",
                           "fsdp_config": {"fsdp_version": 2, "fsdp_backward_prefetch": "BACKWARD_PRE",
                                           "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}})
    assert acc.fsdp2_removed == ("backward_prefetch",)


def test_low_precision_reduction():
    kw = {**GOOD, "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}}
    assert codes(kw)["low-precision-reduction"] == "advice"
    assert "low-precision-reduction" not in codes(GOOD)


def test_lora_adapters_sharing_units_is_advice_for_accelerate_configs():
    """An accelerate config is right under HF Trainer (it swaps in peft's policy for PEFT models), so the
    doctor advises instead of warning; the planner's own emitted accelerate config gets the same advice."""
    from cost_models.specs import TrainingSpec
    from planner.api import estimate
    from planner.emit import emit_accelerate
    from planner.doctor.readers import from_accelerate
    import yaml

    c = estimate("llama2-7b", 8, finetune="lora")
    text = emit_accelerate(c.config, c.model, c.cluster, TrainingSpec(finetune="lora"))
    assert "fsdp_auto_wrap_policy(model)" in text  # the header says what plain accelerate needs
    found = {f.code: f for f in check(from_accelerate(yaml.safe_load(text)), "llama2-7b", 8, finetune="lora").findings}
    assert found["lora-adapters-share-units"].severity == "advice"
    assert "HF Trainer" in found["lora-adapters-share-units"].message


def test_checkpointing_with_the_kv_cache_on(tmp_path):
    """Signals: `use_cache: true` in a kwargs file, or a config.json with use_cache: true that the setup
    does not turn off; only with activation checkpointing. Priced at the lower bound, every checkpointed
    block's keys and values: llama2-7b every-2 -> 16 x 2 x 1 x 4096 x 4096 x 2 B (bf16) = 1.00 GiB."""
    import json

    ac = {**GOOD, "activation_checkpointing": "every-2"}
    found = check(from_kwargs({**ac, "use_cache": True}), "llama2-7b", 8, seq_len=4096).findings
    f = {f.code: f for f in found}["checkpointing-with-kv-cache"]
    assert f.severity == "warning" and "at least 1.00 GiB per GPU" in f.message and "use_cache = False" in f.fix
    assert "checkpointing-with-kv-cache" not in codes({**ac, "use_cache": False})
    assert "checkpointing-with-kv-cache" not in codes({**GOOD, "use_cache": True})  # no recompute
    assert "checkpointing-with-kv-cache" not in codes(ac)  # a preset says nothing about the cache

    hf = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
          "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32000}
    (tmp_path / "on").mkdir()
    (tmp_path / "on" / "config.json").write_text(json.dumps({**hf, "use_cache": True}))
    (tmp_path / "off.json").write_text(json.dumps({**hf, "use_cache": False}))
    assert codes(ac, model=str(tmp_path / "on"))["checkpointing-with-kv-cache"] == "warning"
    assert "checkpointing-with-kv-cache" not in codes({**ac, "use_cache": False}, model=str(tmp_path / "on"))
    assert "checkpointing-with-kv-cache" not in codes(ac, model=str(tmp_path / "off.json"))
    assert "checkpointing-with-kv-cache" not in codes(GOOD, model=str(tmp_path / "on"))
    # accelerate under HF Trainer is right (TrainingArguments.use_cache defaults to False): advice only
    acc = from_accelerate({"distributed_type": "FSDP", "mixed_precision": "bf16",
                           "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                           "fsdp_activation_checkpointing": True, "fsdp_use_orig_params": True}})
    f = {f.code: f for f in check(acc, str(tmp_path / "on"), 8).findings}["checkpointing-with-kv-cache"]
    assert f.severity == "advice" and "HF Trainer" in f.message


def test_use_cache_must_be_a_boolean():
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match="use_cache"):
        from_kwargs({**GOOD, "use_cache": "sometimes"})


def test_moe_all_linear_under_fsdp1():
    """All-linear LoRA on an MoE fails under FSDP1 in every wrapping (benchmarks/peft_moe_fsdp1.py: 2 gloo ranks, the
    Mixtral small config); attention-only LoRA and FSDP2 run it."""
    kw = dict(finetune="lora", gpu="h100-80gb")
    assert codes(GOOD, "mixtral-8x7b", 16, lora_targets="all-linear", **kw)["moe-all-linear-fsdp1"] == "error"
    assert "moe-all-linear-fsdp1" not in codes(GOOD, "mixtral-8x7b", 16, lora_targets="attention", **kw)
    fsdp2 = from_accelerate({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}})
    assert "moe-all-linear-fsdp1" not in {f.code for f in check(fsdp2, "mixtral-8x7b", 16, lora_targets="all-linear",
                                                                 **kw).findings}
