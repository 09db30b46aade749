"""calibration.memtrack: the tensor-storage accountant, checked against numbers computed by hand.

Real CPU tensors for the plain-module path (what a CPU calibration run sees), fake tensors with a fake
process group for the FSDP2 path (what the trace tier sees).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from calibration.memtrack import BREAKDOWN_KEYS, MemorySnapshot, MemoryTracker

F32 = 4


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 10, bias=False))


def _two_steps(tracker, model, opt, x, loss_fn):
    with tracker:
        for i in range(2):
            y = model(x)
            loss = loss_fn(y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                tracker.reset()
    return tracker.snapshot(), y, loss


def test_plain_module_real_tensors_adamw_step_peak_by_hand():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(4, 64)
    tracker = MemoryTracker(model, opt, vocab_size=10)
    tracker.track_inputs(x)
    snap, _, _ = _two_steps(tracker, model, opt, x, lambda y: y.float().pow(2).mean())

    params = (64 * 128 + 128 * 10) * F32                     # 37,888
    b = snap.breakdown
    assert set(b) == set(BREAKDOWN_KEYS)
    assert b["sharded_params"] == params
    assert b["sharded_grads"] == params                       # grads are alive during step()
    assert b["optimizer_state"] == 2 * params + 2 * F32       # exp_avg, exp_avg_sq, one fp32 step per param
    # torch 2.13's for-loop AdamW: denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps) holds two copies of
    # the largest parameter at once (sqrt result and the quotient).
    assert b["optimizer_temporaries"] == 2 * 64 * 128 * F32
    assert b["logits_and_loss"] == 4 * 10 * F32               # y (last dim = vocab 10) is still referenced
    assert b["activations"] == F32                            # the scalar loss
    assert b["other"] == 4 * 64 * F32                         # the input
    assert snap.peak_phase == "optimizer_step"
    assert snap.peak_allocated_bytes == sum(b.values()) == 218_284


def test_without_vocab_logits_stay_in_activations():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    x = torch.randn(4, 64)
    snap, _, _ = _two_steps(MemoryTracker(model, opt), model, opt, x, lambda y: y.pow(2).mean())
    b = snap.breakdown
    assert b["logits_and_loss"] == 0
    assert b["optimizer_state"] == (64 * 128 + 128 * 10) * F32  # one momentum buffer per param
    assert b["optimizer_temporaries"] == 0                      # SGD updates in place
    assert snap.peak_allocated_bytes == sum(b.values())


def test_reset_forgets_the_warm_up_peak():
    model = nn.Linear(8, 8, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 8)
    with MemoryTracker(model, opt) as tracker:
        big = torch.zeros(1_000_000)  # 4 MB, freed before the measured window
        del big
        tracker.reset()
        model(x).sum().backward()
        opt.step()
    snap = tracker.snapshot()
    assert snap.peak_allocated_bytes < 4 * 1_000_000
    # weight 256 B + its grad 256 B + output 64 B + input (untracked: made outside) during backward
    assert snap.breakdown["sharded_params"] == 8 * 8 * F32
    assert snap.peak_allocated_bytes <= 8 * 8 * F32 * 2 + 2 * 8 * F32 * 2 + 64


def test_gradient_accumulation_micro_steps_keep_the_peak():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    x = torch.randn(4, 64)
    with MemoryTracker(model, opt) as tracker:
        for micro in range(2):  # without next_microstep the tracker refuses the second root forward
            model(x).pow(2).mean().backward()
            tracker.next_microstep()
        opt.step()
    snap = tracker.snapshot()
    params = (64 * 128 + 128 * 10) * F32
    # at the first step: params, accumulated grads and the new momentum buffers, nothing else
    assert snap.breakdown["optimizer_state"] == snap.breakdown["sharded_grads"] == params
    assert snap.peak_allocated_bytes == 3 * params and snap.peak_phase == "optimizer_step"


def test_snapshot_to_dict():
    snap = MemorySnapshot(peak_allocated_bytes=10, breakdown={"activations": 10}, peak_phase="backward")
    assert snap.to_dict() == {"peak_allocated_bytes": 10, "peak_phase": "backward", "breakdown": {"activations": 10}}


# ---------------------------------------------------------------- FSDP2 on fake tensors

@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    yield 4
    dist.destroy_process_group()


def test_fsdp2_fake_tensors_model_states_by_hand(fake_world):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from calibration.apply import apply_fsdp2, make_mesh
    from calibration.reference import Block, build_reference, tiny_llama_spec
    from cost_models.specs import FsdpConfig

    spec = tiny_llama_spec()  # every weight's dim 0 (64, 32, 128, 256) divides by 4: no padding
    config = FsdpConfig(precision="fp32")
    mesh = make_mesh(config, fake_world, fake_world, "cpu")
    with FakeTensorMode():
        model = apply_fsdp2(build_reference(spec), config, {Block}, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        ids = torch.randint(0, spec.vocab_size, (2, 32))
        tracker = MemoryTracker(model, opt, vocab_size=spec.vocab_size)
        tracker.track_inputs(ids)
        with tracker:
            for i in range(2):
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                if i == 0:
                    tracker.reset()
        snap = tracker.snapshot()

    b = snap.breakdown
    h, kv, f, v = 64, 32, 128, 256
    block = h * h + 2 * h * kv + h * h + 3 * h * f + 2 * h    # 36,992
    root = 2 * v * h + h                                      # embedding, head, final norm: 32,832
    n_tensors = 2 * 9 + 3
    assert spec.block_params == block and spec.root_params == root
    assert b["sharded_params"] == (2 * block + root) * F32 // 4
    assert b["optimizer_state"] == 2 * (2 * block + root) * F32 // 4 + n_tensors * F32
    # At the backward peak the root (never resharded) and one block are gathered, and one block's
    # all-gather output is in flight.
    assert snap.peak_phase == "backward"
    assert b["unsharded_params"] in ((root + block) * F32, (root + 2 * block) * F32)
    assert b["collective_buffers"] % (block * F32) == 0
    assert b["other"] == 2 * 32 * 8                           # int64 token ids
    assert snap.peak_allocated_bytes == sum(b.values())
