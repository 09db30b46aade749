"""calibration.apply for selective op-level checkpointing, per-block torch.compile, an int
reshard_after_forward and Float8 (whose real path is GPU-only: tests/gpu/test_float8.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from calibration.apply import apply_fsdp1, apply_fsdp2, fsdp2_kwargs, make_mesh
from calibration.checkpointing import apply_activation_checkpointing, selective_op_context
from calibration.float8 import precompute_float8_scales
from calibration.reference import Block, build_reference, tiny_llama_spec
from cost_models.specs import FsdpConfig
from tests.unit.test_apply import fake_world  # noqa: F401 (the fixture: a fake 8-rank process group)

SDPA_CPU = "_scaled_dot_product_flash_attention_for_cpu"


class OpCounter(TorchDispatchMode):
    """Counts aten ops by phase. Under a selective checkpoint a saved op's recompute is answered from its
    cache inside the checkpoint's own mode, so only the ops that really rerun reach this outer one."""

    def __init__(self):
        super().__init__()
        self.phase, self.counts = "forward", Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.phase, func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _one_block_step(mode: str):
    """Forward + backward of a 1-block reference Llama (q, k, v, o, gate, up, down: 7 bias-free linears,
    SDPA, RMSNorm, SiLU); checkpoint: none, full, or the selective-op policy."""
    torch.manual_seed(0)
    model = build_reference(tiny_llama_spec(n_layers=1))
    if mode != "none":
        apply_activation_checkpointing(model, {Block}, 1, context_fn=selective_op_context if mode == "sac" else None)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    counter = OpCounter()
    with counter:
        loss = model(ids, labels=ids).loss
        counter.phase = "backward"
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return {op: n for (phase, op), n in counter.counts.items() if phase == "backward"}, loss.item(), grads


def test_selective_op_saves_matmul_and_sdpa_outputs_and_recomputes_every_second_matmul():
    plain, loss, grads = _one_block_step("none")
    full, full_loss, full_grads = _one_block_step("full")
    sac, sac_loss, sac_grads = _one_block_step("sac")
    # No checkpoint: backward runs 2 matmuls per linear (input and weight gradients), 8 linears with the head.
    assert plain["mm"] == 16 and SDPA_CPU not in plain
    # Full: the block's forward reruns up to the last tensor backward needs (q k v o gate up: 6 matmuls; the
    # down projection's output is not needed) and SDPA with it.
    assert full["mm"] - plain["mm"] == 6 and full[SDPA_CPU] == 1
    # Selective op: matmuls 1, 3, 5, 7 of the forward (q, v, gate, down) and SDPA are saved; 2, 4, 6 (k, o,
    # up) rerun; the norms and SiLU rerun as under full checkpointing.
    assert sac["mm"] - plain["mm"] == 3
    assert SDPA_CPU not in sac
    assert sac["silu"] == full["silu"] == 1 and sac["rsqrt"] == full["rsqrt"] == 2
    # Same math: only what is kept for backward changes.
    assert sac_loss == full_loss == loss
    for a, b, c in zip(grads, full_grads, sac_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7) and torch.allclose(a, c, rtol=1e-5, atol=1e-7)


def test_selective_op_wraps_every_block_before_fully_shard(fake_world):
    config = FsdpConfig(ac_every="selective-op")
    with torch.device("meta"):
        model = build_reference(tiny_llama_spec(n_layers=4))
    apply_fsdp2(model, config, {Block}, make_mesh(config, fake_world, 8, "cpu"))
    assert all(isinstance(layer, CheckpointWrapper) for layer in model.layers)
    assert {layer.checkpoint_fn.keywords["context_fn"] for layer in model.layers} == {selective_op_context}
    assert model.layers[0].checkpoint_fn.keywords["use_reentrant"] is False


def test_block_checkpointing_has_no_policy(fake_world):
    config = FsdpConfig(ac_every=2)
    with torch.device("meta"):
        model = build_reference(tiny_llama_spec(n_layers=4))
    apply_fsdp2(model, config, {Block}, make_mesh(config, fake_world, 8, "cpu"))
    assert "context_fn" not in model.layers[0].checkpoint_fn.keywords


def test_compile_each_block_in_place_not_the_root(fake_world):
    config = FsdpConfig(compile=True, ac_every="selective-op")
    with torch.device("meta"):
        model = build_reference(tiny_llama_spec(n_layers=3))
    apply_fsdp2(model, config, {Block}, make_mesh(config, fake_world, 8, "cpu"))
    # nn.Module.compile(): the checkpoint wrapper each unit shards is compiled, names stay (no _orig_mod)
    assert all(layer._compiled_call_impl is not None for layer in model.layers)
    assert model._compiled_call_impl is None and model.embed_tokens._compiled_call_impl is None
    assert "layers.0.self_attn.q_proj.weight" in model.state_dict()


def test_compile_without_the_flag_compiles_nothing(fake_world):
    with torch.device("meta"):
        model = build_reference(tiny_llama_spec(n_layers=2))
    apply_fsdp2(model, FsdpConfig(), {Block}, make_mesh(FsdpConfig(), fake_world, 8, "cpu"))
    assert all(m._compiled_call_impl is None for m in model.modules())


def test_fsdp1_compiles_inside_each_unit():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = apply_fsdp1(build_reference(tiny_llama_spec(n_layers=2)), FsdpConfig(compile=True, ac_every=1),
                            {Block}, device_id=torch.device("cpu"))
        inner = [layer._fsdp_wrapped_module for layer in model.module.layers]
        assert all(isinstance(m, CheckpointWrapper) and m._compiled_call_impl is not None for m in inner)
        assert model._compiled_call_impl is None
    finally:
        dist.destroy_process_group()


def test_int_reshard_after_forward_reaches_the_blocks_not_the_root(fake_world):
    config = FsdpConfig(reshard_after_forward=4)
    mesh = make_mesh(config, fake_world, 8, "cpu")
    assert fsdp2_kwargs(config, mesh)["reshard_after_forward"] is True
    assert fsdp2_kwargs(config, mesh, block=True)["reshard_after_forward"] == 4
    assert fsdp2_kwargs(FsdpConfig(), mesh, block=True)["reshard_after_forward"] is True  # 0: the strategy's
    with torch.device("meta"):
        model = build_reference(tiny_llama_spec(n_layers=2))
    apply_fsdp2(model, config, {Block}, mesh)
    # After forward a block's params stay sharded over groups of 4 of the 8 ranks: mesh (2, 4)
    block = model.layers[0]._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info
    root = model._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info
    assert block.shard_mesh_size == 4 and tuple(block.mesh.shape) == (2, 4)
    assert root.shard_mesh_size == 8


def test_int_reshard_after_forward_must_divide_the_shard_group(fake_world):
    config = FsdpConfig(reshard_after_forward=3)
    with torch.device("meta"):
        model = build_reference(tiny_llama_spec(n_layers=1))
    with pytest.raises(ValueError, match="factor of 8"):  # FSDP2's own check
        apply_fsdp2(model, config, {Block}, make_mesh(config, fake_world, 8, "cpu"))


def test_float8_on_cpu_is_a_clear_error(fake_world):
    config = FsdpConfig(float8=True, fp8_all_gather=True)
    with torch.device("meta"):
        model = build_reference(tiny_llama_spec(n_layers=1))
    with pytest.raises(ValueError, match=r"^float8: .*CUDA GPUs with FP8 tensor cores.*cpu"):
        apply_fsdp2(model, config, {Block}, make_mesh(config, fake_world, 8, "cpu"))
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())


@pytest.mark.parametrize("config,field", [
    (FsdpConfig(float8=True, fp8_all_gather=True), "fp8_all_gather"),
    (FsdpConfig(reshard_after_forward=2), "reshard_after_forward"),
])
def test_fsdp2_only_options_refused_by_fsdp1(config, field):
    with pytest.raises(ValueError, match=f"^{field}: FSDP2 only"):
        apply_fsdp1(build_reference(tiny_llama_spec(n_layers=1)), config, {Block})


def test_precompute_float8_scales_is_a_no_op_without_the_fp8_all_gather():
    precompute_float8_scales(torch.nn.Linear(2, 2), FsdpConfig())  # would import torchao (absent here) otherwise
