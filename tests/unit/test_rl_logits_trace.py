"""verl's log-prob / entropy arithmetic traced: torch 2.13's eager autograd on fake tensors at Qwen2.5's vocabulary,
its peak counted by torch's MemTracker (torch.distributed._tools.mem_tracker), against what
cost_models/rl_phases.py prices (ENTROPY_TENSORS_*: [tokens, vocab] tensors of the compute dtype). The functions are
verl's (verl/utils/torch_functional.py, 2025), copied: verl is not installed here."""

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402

from cost_models.rl_actor import verl_logits_bytes  # noqa: E402
from cost_models.rl_settings import RlSettings  # noqa: E402
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
