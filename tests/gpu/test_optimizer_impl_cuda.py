"""The CUDA optimizer step of each implementation against cost_models/optimizer_step.py: the same reference Llama as
tests/distributed/test_torchrun_optimizer.py (there: torch's CPU kernels, measured on gloo ranks), here whole on one
GPU (d = 1), stepping torch.optim.AdamW foreach=True, fused=True (the CUDA kernel torch._fused_adamw_,
multi_tensor_apply) and foreach=False; what the step allocates above what was allocated before it
(torch.cuda.max_memory_allocated) is its temporaries.

Skipped without CUDA (this machine has none). The caching allocator rounds every allocation up to 512 B: the
foreach list allocates one tensor per parameter, so the tolerance is 512 B per parameter tensor.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")]

ROUNDING_BYTES = 512


@pytest.mark.parametrize("impl", ["foreach", "fused", "for-loop"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_cuda_step_temporaries(impl, precision):
    from calibration.reference import build_reference
    from calibration.trace_optimizer import make_optimizer, runs
    from cost_models.optimizer_step import step_temporary_bytes
    from cost_models.specs import Precision, TrainingSpec
    from tests.distributed.worker_optimizer import SHAPE, spec

    model = build_reference(spec()).cuda()
    if precision == "bf16-pure":
        model.to(torch.bfloat16)
    optimizer = make_optimizer(model.parameters(), "adamw", impl)
    assert runs(optimizer).value == impl
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 32), device="cuda")
    for step in range(2):  # the first step creates the state
        model(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        optimizer.zero_grad(set_to_none=True)
    n_tensors = sum(1 for _ in model.parameters())
    priced = step_temporary_bytes(spec(), TrainingSpec(optimizer_impl=impl), Precision(precision), 1, spec().n_params)
    assert abs(measured - priced) <= ROUNDING_BYTES * n_tensors, (measured, priced)
