"""Kernel knobs priced from the kernels' code (cost_models/kernels.py), checked against real CPU runs.

Liger and Transformer Engine run only on GPUs: their autograd functions are re-implemented in
calibration/kernel_functions.py with the same save_for_backward sets, in-place writes and chunking, and run
here on real CPU tensors; torchtitan's ChunkedLossWrapper runs for real. Saved tensors are counted by storage
with saved_tensors_hooks, peaks by the project's memory tracker (calibration/memtrack.py); each figure is
compared with the estimate's bytes at an explicit tolerance, the difference said where there is one."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from calibration.kernel_functions import LigerFusedLinearCrossEntropy, LigerRMSNorm, LigerSiLUMul, TESwiGLU
from calibration.memtrack import MemoryTracker
from cost_models import activations, activations_backward, kernels, operators
from cost_models.kernels import Kernels
from cost_models.specs import Kernel, LossKernel
from planner.models import resolve_model

BF16 = torch.bfloat16
T, H, F, V = 256, 512, 1024, 4096  # tokens, hidden, FFN width, vocabulary
ROWS = 128                           # the losses' tokens


def saved_bytes(fn, params=()):
    """Bytes of the distinct storages autograd saves while fn() runs (parameters left out), and fn()'s result."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_liger_rmsnorm_saves_its_input_where_the_eager_norm_keeps_an_fp32_copy():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    model = SimpleNamespace(norm="rmsnorm", hidden_size=H)
    x = torch.randn(T, H, dtype=BF16, requires_grad=True) * 1
    eager = LlamaRMSNorm(H).to(BF16)
    liger, out = saved_bytes(lambda: LigerRMSNorm.apply(x, eager.weight, eager.variance_epsilon), [eager.weight])
    plain, ref = saved_bytes(lambda: eager(x), [eager.weight])
    assert torch.equal(out, ref)
    # X (c*h) and RSTD (one fp32 per row, which the estimate leaves out: 4 / (2 * 512) = 0.39%)
    assert liger == T * (2 * H + 4)
    assert liger / T == pytest.approx(activations._norm_bytes(model, 2, fused=True), rel=0.004)
    assert plain / T == pytest.approx(activations._norm_bytes(model, 2), rel=0.002)  # 4h + c*h (+ rsqrt per row)


@pytest.mark.parametrize("kind", ["eager", "liger", "te"])
def test_swiglu_mlp_saves_what_the_estimate_counts(kind):
    torch.manual_seed(0)
    gate, up, down = nn.Linear(H, F, bias=False), nn.Linear(H, F, bias=False), nn.Linear(F, H, bias=False)
    fc1 = nn.Linear(H, 2 * F, bias=False)  # TE's SwiGLU reads [gate | up] from one projection
    params = [p for m in (gate, up, down, fc1) for p in m.to(BF16).parameters()]
    x = torch.randn(T, H, dtype=BF16, requires_grad=True) * 1
    run = {"eager": lambda: down(nn.functional.silu(gate(x)) * up(x)),
           "liger": lambda: down(LigerSiLUMul.apply(gate(x), up(x))),
           "te": lambda: down(TESwiGLU.apply(fc1(x)))}[kind]
    saved, _ = saved_bytes(run, params)
    model = SimpleNamespace(moe=None, ffn_hidden_size=F, gated_mlp=True)
    # the projections' input (the norm's output, counted with the norms) + the MLP's own
    assert saved == T * (2 * H + activations._mlp_bytes(model, 2, fused_swiglu=kind != "eager"))


def test_liger_swiglu_backward_writes_its_gradients_into_the_saved_gate_and_up():
    a = torch.randn(T, F, dtype=BF16, requires_grad=True) * 1
    b = torch.randn(T, F, dtype=BF16, requires_grad=True) * 1
    grads = {}
    a.register_hook(lambda g: grads.update(a=g.untyped_storage().data_ptr()))
    b.register_hook(lambda g: grads.update(b=g.untyped_storage().data_ptr()))
    where = (a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr())
    out = LigerSiLUMul.apply(a, b)
    ref_a, ref_b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (nn.functional.silu(ref_a.float()) * ref_b.float()).to(BF16).sum().backward()
    out.sum().backward()
    # no new tensor in the MLP's backward beyond fc2's input gradient (activations: c*h + c*f)
    assert (grads["a"], grads["b"]) == where


def _run_loss(module, x, target):
    with MemoryTracker(module) as tracker:
        before = tracker.current_bytes()
        loss = module(x, target)
        after = tracker.current_bytes()
        peak = tracker.snapshot().peak_allocated_bytes
        loss.backward()
    inputs = x.untyped_storage().nbytes() + target.untyped_storage().nbytes()  # the tracker counts them at the call
    return loss, peak - before - inputs, after - before - inputs


class _Head(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, H, dtype=BF16) * 0.02)
        self.loss = loss

    def forward(self, x, target):
        return self.loss(self, x, target)


def test_liger_fused_linear_cross_entropy_memory_and_numbers():
    torch.manual_seed(0)
    rows = ROWS
    x = torch.randn(rows, H, dtype=BF16, requires_grad=True)
    target = torch.randint(0, V, (rows,))
    liger = _Head(lambda m, x, t: LigerFusedLinearCrossEntropy.apply(x, m.weight, t))
    loss, peak, kept = _run_loss(liger, x, target)
    ref_x = x.detach().clone().requires_grad_()
    ref = nn.functional.cross_entropy((ref_x @ liger.weight.detach().t()).float(), target)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-3)
    assert torch.allclose(x.grad.float(), ref_x.grad.float(), atol=2e-4)
    model = SimpleNamespace(vocab_size=V, hidden_size=H)
    assert kernels.liger_chunk_rows(rows, model) == 16  # next_power_of_2(128 / (4096 / 512))
    # kept for backward: grad_input and grad_weight (+ the 4-byte loss), exactly
    assert kept - 4 == rows * H * 2 + V * H * 2
    # at its peak: + one chunk's logits, loss_1d, target_mask; the re-implementation's one fp32 row (32,768 B,
    # the Triton program's registers) is the difference: 16,404 B of 4,457,088, 0.37%
    estimate = kernels.liger_loss_bytes(model, 2, rows)
    assert estimate == rows * (2 * H + 5) + V * H * 2 + 16 * V * 2
    assert peak - estimate == 4 * V + 20 and peak == pytest.approx(estimate, rel=0.004)


def test_torchtitan_chunked_loss_memory_runs_for_real():
    from torchtitan.components.loss import ChunkedLossWrapper

    torch.manual_seed(0)
    rows = ROWS
    wrapper = ChunkedLossWrapper.Config(num_chunks=8).build()
    head = _Head(lambda m, x, t: wrapper(x, t)[0])
    wrapper.set_lm_head(lambda h: nn.functional.linear(h, head.weight))  # a module call per chunk: the tracker
    hidden = torch.randn(1, rows, H, dtype=BF16, requires_grad=True)      # counts one root forward
    labels = torch.randint(0, V, (1, rows))
    loss, peak, kept = _run_loss(head, hidden, labels)
    ref = nn.functional.cross_entropy((hidden.detach() @ head.weight.detach().t()).float().flatten(0, 1),
                                      labels.flatten(), reduction="sum")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-4)
    model = SimpleNamespace(vocab_size=V, hidden_size=H)
    # the peak: a chunk's loss backward beside the accumulated head gradient and the fp32 accumulator;
    # measured 12 B above (three loss scalars)
    assert peak - kernels.chunked_loss_bytes(model, 2, rows, compiled=False) == 12
    # kept after the loss call: the accumulated input gradient; here also the head's gradient (V x h x 2:
    # no FSDP2 to reduce-scatter it at the last chunk) and the 4-byte loss
    assert kept - rows * H * 2 - V * H * 2 == 4


def test_llama3_8b_block_with_liger_kernels_by_hand():
    spec = resolve_model("llama3-8b")
    h, f = spec.hidden_size, spec.ffn_hidden_size
    liger = Kernels(Kernel.LIGER, Kernel.LIGER, Kernel.LIGER, LossKernel.LIGER)
    eager_saved = activations.block_bytes_per_token(spec, 2, "sdpa", 8192)
    liger_saved = activations.block_bytes_per_token(spec, 2, "sdpa", 8192, kernels=liger)
    # two norms keep c*h instead of 4h + c*h, SwiGLU keeps gate and up, not act(gate): 2 * 4h + c*f
    assert eager_saved - liger_saved == 2 * 4 * h + 2 * f == 61_440
    assert activations_backward.mlp_backward_working_bytes_per_token(spec, 2, kernels=liger) == 2 * h + 2 * f
    # memory-bound bytes per token: each norm 36 -> 4 forward, 92 -> 8 backward (x h); rotary 24 -> 4 and
    # 30 + 4 -> 4 (x q + kv); SwiGLU 10 -> 6 and 18 -> 10 (x f)
    ops = operators.block_ops(spec, 2, 8192)
    fused = kernels.kernel_block_ops(ops, liger)
    saving = [sum(op.bytes(False, b) for op in ops.memory_ops) - sum(op.bytes(False, b) for op in fused.memory_ops)
              for b in (False, True)]
    qkv = spec.q_dim + spec.kv_dim
    assert saving == [2 * 32 * h + 20 * qkv + 4 * f, 2 * 84 * h + 30 * qkv + 8 * f]


def test_loss_kernels_run_the_head_products_in_chunks_at_their_shape():
    from cost_models.kernel_time import Rates
    from cost_models.specs import FsdpConfig

    spec = resolve_model("llama3-8b")
    head, _ = operators.root_ops(spec, 2)
    rates = Rates(matmul_flops_per_s=1e15, float8_flops_per_s=0.0, attention_flops_per_s=1e15,
                  memory_bytes_per_s=1e12, half_dim=64.0, attention_half_seq=512.0)
    eager = kernels.head_seconds(rates, head, 4096, FsdpConfig(), spec)
    assert eager == pytest.approx(3 * 2 * 4096 * spec.vocab_size * spec.hidden_size / 1e15
                                  / (4096 / 4160 * spec.vocab_size / (spec.vocab_size + 64) * 4096 / 4160))
    # Liger: 128-row chunks (next_power_of_2(4096 / 32)), torchtitan: 512; the same FLOPs, rows / (rows + 64)
    liger = kernels.head_seconds(rates, head, 4096, FsdpConfig(loss_kernel="liger"), spec)
    chunked = kernels.head_seconds(rates, head, 4096, FsdpConfig(loss_kernel="chunked"), spec)
    assert liger / eager == pytest.approx((4096 / 4160) / (128 / 192), rel=1e-12)    # 1.477
    assert chunked / eager == pytest.approx((4096 / 4160) / (512 / 576), rel=1e-12)  # 1.108
