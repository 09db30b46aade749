"""verl's log-prob / entropy arithmetic traced: torch 2.13's eager autograd on fake tensors at Qwen2.5's vocabulary,
its peak counted by torch's MemTracker (torch.distributed._tools.mem_tracker), against what
cost_models/rl_phases.py prices (ENTROPY_TENSORS_*: [tokens, vocab] tensors of the compute dtype). The functions are
verl's (verl/utils/torch_functional.py, 2025), copied: verl is not installed here. TRL 1.16's fused head is traced
with TRL's own installed function against cost_models/rl_trl_head.py."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402

from cost_models.rl_actor import verl_logits_bytes  # noqa: E402
from cost_models.rl_settings import RlSettings  # noqa: E402
from cost_models.rl_trl_head import VOCAB_TILE, trl_head_bytes  # noqa: E402
from planner.models import resolve_model  # noqa: E402

TOKENS, HIDDEN = 512, 64   # a narrow head: the [tokens, vocab] tensors dominate what is traced


def entropy_from_logits(logits):
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def traced_peak_bytes(vocab: int, grad: bool, log_softmax: bool = False) -> int:
    """Peak bytes of the head's logits and the entropy (and a log-softmax gather) under no_grad, or through the
    backward; the inputs (hidden states, head weight) are left out of the count."""
    with FakeTensorMode():
        hidden = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=grad)
        weight = torch.randn(vocab, HIDDEN, dtype=torch.bfloat16, requires_grad=grad)
        labels = torch.randint(0, vocab, (TOKENS,))
        tracker = MemTracker()
        tracker.track_external(hidden, weight)
        with tracker, torch.set_grad_enabled(grad):
            logits = hidden @ weight.t()
            loss = entropy_from_logits(logits).sum()
            if log_softmax:
                loss = loss + torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).sum()
            if grad:
                loss.backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return peak["Total"] - (TOKENS + vocab) * HIDDEN * 2   # the inputs (their gradients come after the peak)


@pytest.fixture(scope="module")
def qwen():
    return resolve_model("qwen2.5-7b")


def test_log_prob_forward_matches_the_trace(qwen):
    priced = verl_logits_bytes(qwen, TOKENS, 2, RlSettings(), grad=False)   # 3 x 512 x 152,064 x 2 B
    assert priced == 467_140_608
    assert traced_peak_bytes(qwen.vocab_size, grad=False) == pytest.approx(priced, rel=0.01)


def test_eager_update_matches_the_trace(qwen):
    priced = verl_logits_bytes(qwen, TOKENS, 2, RlSettings(entropy_compile=False))   # 7 x 155,713,536 B
    assert priced == 1_089_994_752
    assert traced_peak_bytes(qwen.vocab_size, grad=True) == pytest.approx(priced, rel=0.01)
    # the log-prob's log-softmax beside the entropy leaves the peak where it was
    assert traced_peak_bytes(qwen.vocab_size, grad=True, log_softmax=True) == pytest.approx(priced, rel=0.01)


def trl_traced_peak_bytes(monkeypatch, tokens: int, vocab: int, grad: bool, head_trains: bool = True) -> int:
    """TRL 1.16's own ChunkedLogProbFunction (trl/kernels/chunked_logprob.py) on fake tensors, as it runs on a GPU:
    its Triton kernels (they only load and store through the pointers they are given) as launches that allocate
    nothing, and _addmm_fp32's CUDA branch (addmm into the fp32 accumulator); the update asks for the entropy too.
    The inputs (the compact hidden states, the head weight, the labels) are left out of the count."""
    ck = pytest.importorskip("trl.kernels.chunked_logprob")

    class Launch:   # kernel[grid](...): a Triton launch
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(ck, "_use_triton", lambda device: True)
    monkeypatch.setattr(ck, "_forward_kernel", Launch())
    monkeypatch.setattr(ck, "_backward_kernel", Launch())
    monkeypatch.setattr(ck, "triton", type("triton", (), {"cdiv": staticmethod(lambda a, b: -(-a // b))}),
                        raising=False)
    monkeypatch.setattr(ck, "_addmm_fp32", lambda acc, a, b: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc))
    with FakeTensorMode():
        hidden = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=grad)
        weight = torch.randn(vocab, HIDDEN, dtype=torch.bfloat16, requires_grad=grad and head_trains)
        labels = torch.randint(0, vocab, (tokens,))
        tracker = MemTracker()
        tracker.track_external(hidden, weight, labels)
        with tracker, torch.set_grad_enabled(grad):
            log_probs, entropy, *_ = ck.ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, VOCAB_TILE,
                                                                      None, 1.0, ("log_probs", "entropy"))
            if grad:
                (log_probs.sum() + entropy.sum()).backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return peak["Total"] - (tokens + vocab) * HIDDEN * 2 - tokens * 8


@pytest.mark.parametrize("grad, head_trains", [(False, True), (True, True), (True, False)],
                         ids=["log-prob pass", "update", "update-lora"])
def test_trls_fused_head_matches_the_trace(monkeypatch, qwen, grad, head_trains):
    """TRL's log-prob head on 8,192 scored tokens (two 4,096-token tiles) at Qwen2.5's vocabulary against
    rl_trl_head.trl_head_bytes less the compact hidden states (the trace's input): forward only, one 4,096 x 32,768
    bf16 tile and 11 fp32 values a token, 268,795,904 B exactly; through the backward, the tile, the hidden states'
    gradient in fp32 and bf16, the head's when it trains and 5 fp32 values a token (within 0.1%: a few scalars). No
    [tokens, vocab] tensor: verl's path holds 3 of them (2.49 GB here) under no_grad."""
    model = dataclasses.replace(qwen, hidden_size=HIDDEN)
    priced = trl_head_bytes(model, 8192, 2, grad, head_trains) - 8192 * HIDDEN * 2
    traced = trl_traced_peak_bytes(monkeypatch, 8192, qwen.vocab_size, grad, head_trains)
    if not grad:
        assert traced == priced == 4096 * VOCAB_TILE * 2 + 11 * 8192 * 4 == 268_795_904
    assert traced == pytest.approx(priced, rel=0.001)
