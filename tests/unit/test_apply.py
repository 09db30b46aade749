"""calibration.apply builds the FSDP objects the plan names; planner.emit writes the same choices as text;
the reference Llama has exactly ModelSpec.n_params parameters."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

import calibration.apply as apply_mod
from calibration.apply import (
    apply_fsdp1,
    apply_fsdp2,
    cast_for_precision,
    fsdp1_kwargs,
    fsdp2_kwargs,
    grad_scaler_for,
    make_mesh,
)
from calibration.build import build_model, load_factory
from calibration.checkpointing import apply_activation_checkpointing
from calibration.model_blocks import block_classes_for
from calibration.reference import Block, build_reference, tiny_llama_spec
from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec, Precision, Sharding, TrainingSpec
from planner.emit import emit_accelerate, emit_fsdp1, emit_fsdp2, emit_torchrun

ROOT = Path(__file__).resolve().parents[2]
GPU = GpuSpec(id="h100-sxm", name="H100 SXM", memory_bytes=80 * 2**30, hbm_bytes_per_s=3.35e12,
              peak_flops={"bf16": 989e12}, intra_node_bus_bytes_per_s=450e9)
ONE_NODE = ClusterSpec(gpu=GPU, n_gpus=8, gpus_per_node=8, internode_bytes_per_s=50e9)
TWO_NODES = ClusterSpec(gpu=GPU, n_gpus=16, gpus_per_node=8, internode_bytes_per_s=50e9)
SPEC = tiny_llama_spec(name="tiny")


# ---------------------------------------------------------------- fsdp1_kwargs

@pytest.mark.parametrize("precision,param,reduce", [
    ("bf16", torch.bfloat16, torch.float32),
    ("fp16", torch.float16, torch.float32),
])
def test_fsdp1_mixed_precision_casts_compute_reduces_fp32(precision, param, reduce):
    mp = fsdp1_kwargs(FsdpConfig(precision=precision), {Block})["mixed_precision"]
    assert isinstance(mp, MixedPrecision)
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (param, reduce, None)  # buffers keep fp32


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_fsdp1_no_mixed_precision_when_storage_dtype_is_compute_dtype(precision):
    assert fsdp1_kwargs(FsdpConfig(precision=precision), {Block})["mixed_precision"] is None


def test_fsdp1_kwargs_objects_and_defaults():
    kwargs = fsdp1_kwargs(FsdpConfig(), {Block}, device_id=torch.device("cpu"))
    assert kwargs["sharding_strategy"] is ShardingStrategy.FULL_SHARD
    assert kwargs["cpu_offload"] is None
    assert kwargs["backward_prefetch"] is BackwardPrefetch.BACKWARD_PRE
    assert kwargs["forward_prefetch"] is False and kwargs["limit_all_gathers"] is True
    assert isinstance(kwargs["auto_wrap_policy"], ModuleWrapPolicy)
    assert kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert kwargs["use_orig_params"] is True and kwargs["sync_module_states"] is False
    assert kwargs["device_id"] == torch.device("cpu")
    assert "device_mesh" not in kwargs and "process_group" not in kwargs


def test_fsdp1_kwargs_knobs():
    config = FsdpConfig(sharding="SHARD_GRAD_OP", offload=True, backward_prefetch=False, forward_prefetch=True,
                        limit_all_gathers=False)
    kwargs = fsdp1_kwargs(config, {Block})
    assert kwargs["sharding_strategy"] is ShardingStrategy.SHARD_GRAD_OP
    assert isinstance(kwargs["cpu_offload"], CPUOffload) and kwargs["cpu_offload"].offload_params is True
    assert kwargs["backward_prefetch"] is None
    assert kwargs["forward_prefetch"] is True and kwargs["limit_all_gathers"] is False
    assert fsdp1_kwargs(FsdpConfig(sharding="NO_SHARD"), {Block})["sharding_strategy"] is ShardingStrategy.NO_SHARD


@pytest.mark.parametrize("sharding,expected", [
    ("HYBRID_SHARD", ShardingStrategy.HYBRID_SHARD),
    ("HYBRID_SHARD_ZERO2", ShardingStrategy._HYBRID_SHARD_ZERO2),
])
def test_fsdp1_hybrid_on_multi_gpu_nodes(sharding, expected):
    with mock.patch.object(apply_mod, "_fsdp1_devices_per_node", return_value=8):
        assert fsdp1_kwargs(FsdpConfig(sharding=sharding), {Block}, gpus_per_node=8)["sharding_strategy"] is expected
        with pytest.raises(ValueError, match="gpus_per_node=4"):
            fsdp1_kwargs(FsdpConfig(sharding=sharding), {Block}, gpus_per_node=4)


def test_fsdp1_hybrid_with_one_device_per_node_is_no_shard():
    # CPU: device_count() == 1. FSDP1 would clamp its 1-rank shard group to NO_SHARD and skip the
    # cross-node all-reduce (tests/distributed shows the replicas diverge); NO_SHARD keeps them in sync.
    kwargs = fsdp1_kwargs(FsdpConfig(sharding="HYBRID_SHARD"), {Block}, gpus_per_node=1, device_id=torch.device("cpu"))
    assert kwargs["sharding_strategy"] is ShardingStrategy.NO_SHARD


def test_fsdp1_lora_policy_separates_trainable_leaves():
    model = build_reference(SPEC)
    model.requires_grad_(False)
    model.layers[0].self_attn.q_proj.requires_grad_(True)  # stands in for a LoRA adapter
    policy = fsdp1_kwargs(FsdpConfig(), {Block}, trainable_mixed=True)["auto_wrap_policy"]
    assert isinstance(policy, CustomPolicy)
    targets = policy._run_policy(model, set(), {})
    assert model.layers[0] in targets and model.layers[1] in targets
    assert model.layers[0].self_attn.q_proj in targets and model.layers[0].self_attn.k_proj not in targets


def test_fsdp1_rejects_empty_block_classes():
    with pytest.raises(ValueError, match="block_classes"):
        fsdp1_kwargs(FsdpConfig(), set())


# ---------------------------------------------------------------- FSDP2 (fake process group, meta model)

@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    yield 8
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding,shape,names", [
    ("FULL_SHARD", (8,), ("dp_shard",)),
    ("SHARD_GRAD_OP", (8,), ("dp_shard",)),
    ("HYBRID_SHARD", (2, 4), ("dp_replicate", "dp_shard")),
    ("HYBRID_SHARD_ZERO2", (2, 4), ("dp_replicate", "dp_shard")),
    ("NO_SHARD", (8, 1), ("dp_replicate", "dp_shard")),
])
def test_make_mesh(fake_world, sharding, shape, names):
    mesh = make_mesh(FsdpConfig(sharding=sharding), fake_world, 4, "cpu")
    assert tuple(mesh.shape) == shape and mesh.mesh_dim_names == names


@pytest.mark.parametrize("sharding,reshard", [
    ("FULL_SHARD", True), ("HYBRID_SHARD", True), ("SHARD_GRAD_OP", False), ("HYBRID_SHARD_ZERO2", False),
    # shard groups of one: "resharding" frees the bf16 compute copies after forward, re-made by a local copy
    ("NO_SHARD", True),
])
def test_fsdp2_reshard_after_forward(fake_world, sharding, reshard):
    config = FsdpConfig(sharding=sharding)
    assert fsdp2_kwargs(config, make_mesh(config, fake_world, 4, "cpu"))["reshard_after_forward"] is reshard


def test_fsdp2_policies(fake_world):
    mesh = make_mesh(FsdpConfig(), fake_world, 8, "cpu")
    kwargs = fsdp2_kwargs(FsdpConfig(precision="bf16", offload=True), mesh)
    assert kwargs["mp_policy"] == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert isinstance(kwargs["offload_policy"], CPUOffloadPolicy)
    plain = fsdp2_kwargs(FsdpConfig(precision="bf16-pure"), mesh)
    assert plain["mp_policy"] == MixedPrecisionPolicy() and "offload_policy" not in plain


def test_apply_fsdp2_shards_each_block_and_root(fake_world):
    config = FsdpConfig(sharding="HYBRID_SHARD", ac_every=2)
    with torch.device("meta"):
        model = build_reference(tiny_llama_spec(n_layers=4))
    apply_fsdp2(model, config, {Block}, make_mesh(config, fake_world, 4, "cpu"))
    assert isinstance(model, FSDPModule)
    assert all(isinstance(layer, FSDPModule) for layer in model.layers)
    # The checkpoint wrapper (blocks 0 and 2) is what gets sharded, torchtitan-style.
    assert [isinstance(layer, CheckpointWrapper) for layer in model.layers] == [True, False, True, False]
    weight = model.embed_tokens.weight  # root unit, 2-D mesh: replicated across nodes, sharded in one
    assert weight.to_local().shape == (SPEC.vocab_size // 4, SPEC.hidden_size)


# ---------------------------------------------------------------- helpers

def test_activation_checkpointing_every_k():
    torch.manual_seed(0)
    model = build_reference(tiny_llama_spec(n_layers=5))
    ids = torch.randint(0, 256, (1, 8))
    before = model(ids).logits
    assert apply_activation_checkpointing(model, {Block}, 2) == 3  # blocks 0, 2, 4: ceil(5 / 2)
    assert [isinstance(layer, CheckpointWrapper) for layer in model.layers] == [True, False, True, False, True]
    assert apply_activation_checkpointing(model, {Block}, 2) == 0  # already wrapped
    assert torch.equal(model(ids).logits, before)
    with pytest.raises(ValueError):
        apply_activation_checkpointing(model, {Block}, 0)


def test_block_classes_for():
    assert block_classes_for(build_reference(SPEC)) == {Block}
    hf = build_model(SPEC, _hf_llama(SPEC), device="meta")
    assert {cls.__name__ for cls in block_classes_for(hf)} == {"LlamaDecoderLayer"}
    with pytest.raises(ValueError):
        block_classes_for(nn.Linear(2, 2))


def test_cast_and_scaler():
    model = cast_for_precision(build_reference(SPEC), FsdpConfig(precision="bf16-pure"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model = cast_for_precision(build_reference(SPEC), FsdpConfig(precision="bf16"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert isinstance(grad_scaler_for(FsdpConfig(precision="fp16"), device="cpu"), ShardedGradScaler)
    assert grad_scaler_for(FsdpConfig(precision="bf16")) is None


# ---------------------------------------------------------------- the KV cache (real HF Llama, one gloo rank)

# The 4-block Llama of the CPU calibration run that showed the pitfall (shared/reference/pitfalls.md).
KV_LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_hidden_layers=4, vocab_size=512)


@pytest.fixture
def gloo_rank():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield 1
    dist.destroy_process_group()


def _kv_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**KV_LLAMA))
    assert model.config.use_cache is True  # Hugging Face's default
    return model.train()


def _checkpointed_peak(config: FsdpConfig, seq_len: int, use_cache: bool | None) -> tuple[int, bool, float]:
    """FSDP2 + full checkpointing through calibration.apply, real tensors; use_cache set after the apply
    path unless None. Returns (peak bytes of the second step, use_cache as apply left it, last loss)."""
    from calibration.memtrack import MemoryTracker

    model = _kv_llama()
    apply_fsdp2(model, config, {type(model.model.layers[0])}, make_mesh(config, 1, 1, "cpu"))
    left_by_apply = model.config.use_cache
    if use_cache is not None:
        model.config.use_cache = use_cache
    ids = torch.randint(0, KV_LLAMA["vocab_size"], (config.micro_batch, seq_len),
                        generator=torch.Generator().manual_seed(1))
    tracker = MemoryTracker(model, None, vocab_size=KV_LLAMA["vocab_size"])
    tracker.track_inputs(ids)
    with tracker:
        for step in range(2):
            model.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids).loss
            loss.backward()
            if step == 0:
                tracker.reset()
    return tracker.snapshot().peak_allocated_bytes, left_by_apply, loss.item()


def test_apply_path_turns_the_kv_cache_off_measured(gloo_rank):
    """SHARD_GRAD_OP, fp32, every block checkpointed, micro-batch 4 x 256 tokens (about 5 s): with the
    cache forced back on, each recompute appends its keys and values to a live cache, held to the end
    of backward; the apply path's own peak is the cache-off peak."""
    from planner.doctor.rules_cost import kv_cache_extra_bytes
    from planner.models import from_hf_config

    config, seq_len = FsdpConfig(sharding="SHARD_GRAD_OP", precision="fp32", ac_every=1, micro_batch=4), 256
    default, left_by_apply, default_loss = _checkpointed_peak(config, seq_len, None)
    off, _, off_loss = _checkpointed_peak(config, seq_len, False)
    on, _, on_loss = _checkpointed_peak(config, seq_len, True)
    assert left_by_apply is False
    assert default == pytest.approx(off, rel=1e-3)  # a count of tensors: equal in practice (22,868,616 B)
    # The doctor's lower bound: 4 checkpointed blocks x 2 x 4 x 256 x kv_dim 64 x 4 B = 2 MiB. Measured
    # 3.5x that (7,352,320 B): the peak comes late in backward, where recomputes have grown their layers.
    lower = kv_cache_extra_bytes(from_hf_config(KV_LLAMA), config, seq_len)
    assert lower == 4 * 2 * 4 * 256 * 64 * 4 == 2 * 2**20
    assert 3.0 <= (on - off) / lower <= 4.5, (on, off)
    assert on_loss == pytest.approx(off_loss, rel=1e-6) == pytest.approx(default_loss, rel=1e-6)  # same math


def test_fsdp1_apply_and_api_kwargs_turn_the_kv_cache_off(gloo_rank):
    from planner import estimate

    model = _kv_llama()
    wrapped = apply_fsdp1(model, FsdpConfig(ac_every=2), {type(model.model.layers[0])},
                          device_id=torch.device("cpu"))
    assert wrapped.config.use_cache is False
    model = _kv_llama()
    assert model.config._attn_implementation == "sdpa"  # what transformers picks for a llama
    estimate(KV_LLAMA, 1, activation_checkpointing="full", attention="eager").fsdp_kwargs(model)
    assert model.config.use_cache is False
    assert model.config._attn_implementation == "eager"  # the attention priced, as the emitted snippets set it
    model = _kv_llama()
    estimate(KV_LLAMA, 1, attention="eager").apply_fully_shard(model)
    assert model.config._attn_implementation == "eager"
    plain = build_reference(SPEC)  # no config: left alone
    apply_mod.disable_kv_cache(plain)
    assert not hasattr(plain, "config")


@pytest.mark.parametrize("emit", [emit_fsdp1, emit_fsdp2])
def test_emitted_snippets_turn_the_kv_cache_off(gloo_rank, emit):
    from planner.models import from_hf_config

    code = emit(FsdpConfig(ac_every=1), from_hf_config(KV_LLAMA), ClusterSpec(gpu=GPU, n_gpus=1, gpus_per_node=1,
                                                                             internode_bytes_per_s=50e9))
    assert "    model.config.use_cache = False" in code and "No KV cache in training" in code
    namespace: dict = {}
    exec(compile(code, emit.__name__, "exec"), namespace)
    model = _kv_llama()
    wrapped = namespace["apply_fsdp"](model, device=torch.device("cpu"))
    assert wrapped.config.use_cache is False
    assert sum(isinstance(m, CheckpointWrapper) for m in wrapped.modules()) == 4


def test_accelerate_and_lightning_say_to_turn_the_kv_cache_off():
    from planner.emit import emit_lightning

    for emit in (emit_accelerate, emit_lightning):
        assert "model.config.use_cache = False" in emit(FsdpConfig(ac_every=2), SPEC, ONE_NODE)
        assert "use_cache" not in emit(FsdpConfig(), SPEC, ONE_NODE)  # nothing to grow without recompute
    assert "HF Trainer does" in emit_accelerate(FsdpConfig(ac_every=1), SPEC, ONE_NODE)


# ---------------------------------------------------------------- reference model and build

def _hf_llama(spec) -> dict:
    return dict(model_type="llama", hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
                num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim,
                num_hidden_layers=spec.n_layers, vocab_size=spec.vocab_size,
                tie_word_embeddings=spec.tied_embeddings, torch_dtype="bfloat16")


@pytest.mark.parametrize("overrides", [
    {},                                                          # GQA 4:2, untied
    {"tied_embeddings": True},                                   # tied head
    {"n_heads": 8, "n_kv_heads": 8, "head_dim": 8},              # multi-head
    {"n_heads": 8, "n_kv_heads": 1, "head_dim": 16, "n_layers": 3, "ffn_hidden_size": 172},  # MQA, q_dim != hidden
])
def test_reference_param_count_is_exact(overrides):
    spec = tiny_llama_spec(**overrides)
    model = build_reference(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    assert sum(p.numel() for p in model.layers[0].parameters()) == spec.block_params
    # The same formula counts Hugging Face's LlamaForCausalLM (built on meta, no memory).
    hf = build_model(spec, _hf_llama(spec), device="meta")
    assert sum(p.numel() for p in hf.parameters()) == spec.n_params


def test_tiny_spec_hand_count():
    # GQA: q 64x64, k/v 64x32 each, o 64x64, MLP 3x64x128, two norms of 64.
    assert SPEC.block_params == 4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128 == 36_992
    assert (SPEC.embedding_params, SPEC.head_params, SPEC.root_other_params) == (16_384, 16_384, 64)
    assert tiny_llama_spec(tied_embeddings=True).head_params == 0
    with pytest.raises(ValueError):
        tiny_llama_spec(block_params=1)


def test_reference_forward_like_hugging_face():
    torch.manual_seed(0)
    model = build_reference(SPEC)
    ids = torch.randint(0, SPEC.vocab_size, (2, 16))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 16, SPEC.vocab_size) and out.loss.dtype == torch.float32
    expected = nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, SPEC.vocab_size), ids[:, 1:].reshape(-1))
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert out.loss.item() == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)  # near-uniform at init
    assert model(ids).loss is None
    eager = build_reference(SPEC, attention="eager")
    eager.load_state_dict(model.state_dict())
    torch.testing.assert_close(eager(ids).logits, out.logits, atol=1e-5, rtol=1e-5)


def test_build_model_variants():
    model = build_model(SPEC, None, device="meta")
    assert isinstance(model.layers[0], Block) and next(model.parameters()).device.type == "meta"
    assert next(build_model(SPEC, None, device="cpu", dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    hf = build_model(SPEC, _hf_llama(SPEC), device="meta")
    assert next(hf.parameters()).dtype == torch.float32  # not the config's torch_dtype
    bert = build_model(SPEC, dict(model_type="bert", hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  num_hidden_layers=2, vocab_size=100), device="meta")
    assert type(bert).__name__ == "BertForMaskedLM"
    assert load_factory("calibration.reference:tiny_llama_spec") is tiny_llama_spec
    with pytest.raises(ValueError):
        load_factory("calibration.reference")
    with pytest.raises(ValueError, match="llama"):
        build_reference(tiny_llama_spec().__class__(**{**tiny_llama_spec().__dict__, "family": "gpt2"}))


# ---------------------------------------------------------------- emitters

CONFIGS = [FsdpConfig(sharding=s, precision=p, offload=o, ac_every=a)
           for s in Sharding for p, o, a in (("bf16", False, 0), ("fp16", True, 1), ("bf16-pure", False, 2),
                                              ("fp32", True, 3))]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.sharding.value}-{c.precision.value}-ac{c.ac_every}")
def test_emitted_code_compiles(config):
    for cluster in (ONE_NODE, TWO_NODES):
        for emit in (emit_fsdp1, emit_fsdp2):
            code = emit(config, SPEC, cluster)
            compile(code, emit.__name__, "exec")
            assert "BLOCK_CLASS = 'Block'" in code


def test_emit_fsdp1_strings():
    code = emit_fsdp1(FsdpConfig(precision="bf16", ac_every=2), SPEC, ONE_NODE)
    assert "sharding_strategy=ShardingStrategy.FULL_SHARD" in code
    assert "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in code
    assert "auto_wrap_policy=ModuleWrapPolicy({type(blocks[0])})" in code
    assert "limit_all_gathers=True,  # rate limiter" in code and "not message merging" in code
    assert "use_orig_params=True" in code and "sync_module_states=False" in code
    assert "backward_prefetch=BackwardPrefetch.BACKWARD_PRE" in code and "cpu_offload=None" in code
    assert "if i % 2 == 0" in code and "CheckpointImpl.NO_REENTRANT" in code
    assert "ShardedGradScaler" not in code
    fp16 = emit_fsdp1(FsdpConfig(precision="fp16", offload=True), SPEC, TWO_NODES)
    assert "ShardedGradScaler" in fp16 and "CPUOffload(offload_params=True)" in fp16
    assert "MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)" in fp16
    assert "mixed_precision=None" in emit_fsdp1(FsdpConfig(precision="bf16-pure"), SPEC, ONE_NODE)
    assert "model.to(torch.bfloat16)" in emit_fsdp1(FsdpConfig(precision="bf16-pure"), SPEC, ONE_NODE)
    assert "ShardingStrategy._HYBRID_SHARD_ZERO2" in emit_fsdp1(FsdpConfig(sharding="HYBRID_SHARD_ZERO2"), SPEC,
                                                                TWO_NODES)
    one_gpu_nodes = ClusterSpec(gpu=GPU, n_gpus=4, gpus_per_node=1, internode_bytes_per_s=50e9)
    assert "ShardingStrategy.NO_SHARD" in emit_fsdp1(FsdpConfig(sharding="HYBRID_SHARD"), SPEC, one_gpu_nodes)


def test_emit_fsdp2_strings():
    code = emit_fsdp2(FsdpConfig(sharding="HYBRID_SHARD", precision="bf16", ac_every=1), SPEC, TWO_NODES)
    assert ('init_device_mesh(device_type, (dist.get_world_size() // 8, 8), '
            'mesh_dim_names=("dp_replicate", "dp_shard"))') in " ".join(code.split())
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in code
    assert "reshard_after_forward=True" in code and "offload_policy" not in code.split("def apply_fsdp")[1]
    assert "fully_shard(block, **fsdp_kwargs)" in code and "fully_shard(model, **fsdp_kwargs)" in code
    assert code.index("checkpoint_wrapper(block") < code.index("fully_shard(block")  # AC before sharding
    zero2 = emit_fsdp2(FsdpConfig(sharding="SHARD_GRAD_OP", offload=True), SPEC, ONE_NODE)
    assert 'mesh_dim_names=("dp_shard",)' in zero2 and "reshard_after_forward=False" in zero2
    assert "CPUOffloadPolicy(" in zero2 and "checkpoint_wrapper(" not in zero2
    assert "(dist.get_world_size() // 1, 1)" in emit_fsdp2(FsdpConfig(sharding="NO_SHARD"), SPEC, ONE_NODE)


def test_emit_torchrun():
    single = emit_torchrun(FsdpConfig(), SPEC, ONE_NODE)
    assert single.splitlines()[-1] == "torchrun --standalone --nproc_per_node 8 train.py"
    multi = emit_torchrun(FsdpConfig(), SPEC, TWO_NODES, script="pretrain.py")
    assert multi.splitlines()[-1] == ("torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d "
                                      "--rdzv_endpoint $MASTER_ADDR:29500 --rdzv_id fsdp-plan pretrain.py")


def test_emit_accelerate_loads_with_accelerate(tmp_path, load_accelerate):
    from accelerate.utils import DistributedType

    config = FsdpConfig(sharding="SHARD_GRAD_OP", precision="bf16", ac_every=1, offload=True, grad_accum=4)
    text = emit_accelerate(config, SPEC, ONE_NODE, TrainingSpec(finetune="lora"))
    loaded, env, plugin, _ = load_accelerate(tmp_path, text)
    assert loaded.distributed_type is DistributedType.FSDP and loaded.mixed_precision == "bf16"
    assert (loaded.num_machines, loaded.num_processes, loaded.machine_rank) == (1, 8, 0)
    assert loaded.fsdp_config["fsdp_version"] == 1
    assert loaded.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    assert env["FSDP_SYNC_MODULE_STATES"] == "true" and env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    assert plugin.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert plugin.cpu_offload.offload_params is True
    assert plugin.backward_prefetch is BackwardPrefetch.BACKWARD_PRE
    assert plugin.transformer_cls_names_to_wrap == ["Block"]
    assert plugin.use_orig_params is True and plugin.activation_checkpointing is True
    assert plugin.forward_prefetch is False
    assert "gradient_accumulation_steps=4" in text and "LoRA" in text


def test_emit_accelerate_multi_node_and_precisions(tmp_path, load_accelerate):
    from accelerate.utils import DistributedType

    config = FsdpConfig(sharding="HYBRID_SHARD_ZERO2", precision="bf16-pure", backward_prefetch=False)
    text = emit_accelerate(config, SPEC, TWO_NODES)
    loaded, env, plugin, args = load_accelerate(tmp_path, text, ["--main_process_ip", "10.0.0.1"])
    assert loaded.distributed_type is DistributedType.FSDP
    assert loaded.mixed_precision == "no"  # bf16-pure: the model is loaded in bf16 instead
    assert (loaded.num_machines, loaded.num_processes, loaded.main_process_port) == (2, 16, 29500)
    assert plugin.sharding_strategy is ShardingStrategy._HYBRID_SHARD_ZERO2
    assert plugin.backward_prefetch is None and plugin.activation_checkpointing is False
    assert (args.rdzv_endpoint, args.nnodes, args.nproc_per_node) == ("10.0.0.1:29500", "2", "8")  # torchrun flags
    assert "--main_process_ip" in text
    fp16 = emit_accelerate(FsdpConfig(precision="fp16"), SPEC, ONE_NODE)
    assert "mixed_precision: fp16" in fp16
    assert "mixed_precision: 'no'" in emit_accelerate(FsdpConfig(precision="fp32"), SPEC, ONE_NODE)


# ---------------------------------------------------------------- layering

def test_calibration_imports_no_planner():
    for path in (ROOT / "calibration").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "planner" for n in names), path


def test_emit_does_not_import_torch():
    code = "import sys, planner.emit; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_precision_enum_fully_mapped():
    for precision in Precision:
        fsdp1_kwargs(FsdpConfig(precision=precision), {Block})
        emit_accelerate(FsdpConfig(precision=precision), SPEC, ONE_NODE)
