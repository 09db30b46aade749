"""GPU checks of the Float8 path of calibration.apply (torchao Float8 linears, FSDP2's FP8 all-gather,
precomputed scales), with selective-op checkpointing and per-block compile on top, as torchtitan runs them.

Skipped without CUDA, without torchao, or on a GPU without FP8 tensor cores (compute capability < 8.9);
the CPU side (a clear error naming float8) is tests/unit/test_apply_sac_compile_fp8.py. One rank (NCCL,
world size 1): the code path, not the communication, is what is checked here.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)"),
]


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    pytest.importorskip("torchao.float8", reason="needs torchao (pip install torchao)")
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("extra", [{}, {"ac_every": "selective-op", "compile": True}], ids=["float8", "sac-compile"])
def test_float8_linears_with_fp8_all_gather_train(one_rank, extra):
    from torchao.float8.float8_linear import Float8Linear

    from calibration.apply import apply_fsdp2, make_mesh
    from calibration.float8 import precompute_float8_scales
    from calibration.reference import Block, build_reference, tiny_llama_spec
    from cost_models.specs import FsdpConfig

    config = FsdpConfig(precision="bf16", float8=True, fp8_all_gather=True, **extra)
    torch.manual_seed(0)
    spec = tiny_llama_spec(n_layers=2, hidden_size=256, ffn_hidden_size=512, head_dim=64)  # dims of 16
    with torch.device("cuda"):
        model = build_reference(spec)
    apply_fsdp2(model, config, {Block}, make_mesh(config, 1, 1, "cuda"))
    converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 2 * 7  # every block linear; the head stays bf16
    assert not isinstance(model.lm_head, Float8Linear)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, spec.vocab_size, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = []
    for _ in range(6):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        precompute_float8_scales(model, config)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(x == x for x in losses) and losses[-1] < losses[0], losses
