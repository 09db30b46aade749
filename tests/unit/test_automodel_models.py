"""NeMo Automodel's own models as the step prices them (issue 26): planner/trainers/table.py's own_models run their
RoPE in one kernel each way and are priced from their structure, not from a traced transformers block; Transformer
Engine's attention writes no output layout copy; gpt-oss' compiled swiglu_oai_deepep runs at its fused bytes.
Every figure is worked by hand per token (c = 2 bytes, bf16) from cost_models/operators.py's coefficients."""

import pytest

from benchmarks.throughput_accuracy import predict_automodel
from cost_models import operators, step_parts
from planner.request.resolve import resolve_inputs


@pytest.fixture(scope="module")
def rows():
    """The two golden rows' candidates (tests/golden/test_automodel_rows.py states their setting)."""
    return {"qwen3-30b-a3b": predict_automodel("qwen3-30b-a3b", 4, "sdpa"),
            "gpt-oss-20b": predict_automodel("gpt-oss-20b", 2, "flex")}


def memory_ops(candidate) -> dict[str, tuple[float, float]]:
    ops, _ = step_parts.priced_block_ops(candidate.model, candidate.training, candidate.config, 2)
    return {o.name: (o.forward_bytes, o.backward_bytes) for o in ops.memory_ops}


def test_own_models_rotate_in_one_kernel():
    """Qwen3-30B-A3B's q and k are 4,096 + 512 wide: eager rotary 12c / 15c per element = 110,592 / 138,240 B and
    the gradients' copy back 2c = 18,432 B; one kernel each way 2c = 18,432 B and no copy. A model Automodel runs
    through transformers (Llama 3 8B is not among own_models) keeps transformers' eager ops."""
    own, _, _ = resolve_inputs("qwen3-30b-a3b", 8, trainer="automodel")
    plain, _, _ = resolve_inputs("qwen3-30b-a3b", 8)
    assert (own.rope, plain.rope) == ("fused", "eager")
    bytes_of = lambda spec: {o.name: (o.forward_bytes, o.backward_bytes)  # noqa: E731
                             for o in operators.block_ops(spec, 2, 4096).memory_ops}
    assert bytes_of(own)["rotary"] == (18432, 18432) and bytes_of(own)["q/k gradient copies"] == (0, 0)
    assert bytes_of(plain)["rotary"] == (110592, 138240) and bytes_of(plain)["q/k gradient copies"] == (0, 18432)
    assert resolve_inputs("llama3-8b", 8, trainer="automodel")[0].rope == "eager"


def test_gpt_oss_is_priced_from_its_structure_with_the_traced_memory(rows):
    """gpt-oss 20B under Automodel: the shipped profile's memory terms stay, its traced operators go (transformers'
    GptOssExperts loop, gathers and eager clamped SwiGLU: 867,946 B a token forward after TE's norms, which
    Automodel does not run). The block's memory-bound bytes per token, forward / backward (h 2,880, q 4,096, kv 512,
    expert width f 2,880, top-4, one EP rank per token under round-robin):
    TE RMSNorm x 2: 2c h = 11,520 / 4c h = 23,040 each; rotary (fused) 2c (q + kv) = 18,432 each way; FlexAttention's
    output copy 2c q = 16,384 each way; residual adds 3c 2h = 34,560 each way; the q / k / v input gradients' sum
    3c 2h = 34,560 backward; swiglu_oai_deepep (compiled) 3c f k = 69,120 / 5c f k = 115,200; DeepEP's permute /
    unpermute 2c h (k + 1) = 57,600 each way; the sinks' renormalisation 2c q = 16,384 / 4c q = 32,768.
    Sums: 235,520 forward, 355,584 backward."""
    c = rows["gpt-oss-20b"]
    default, _, _ = resolve_inputs("gpt-oss-20b", 8, seq_len=4096)
    assert default.activation_profile.get("bf16", "flex").operators is not None
    assert c.model.activation_profile.get("bf16", "flex").operators is None
    assert c.model.activation_profile.get("bf16", "flex").saved_per_token == \
        default.activation_profile.get("bf16", "flex").saved_per_token
    ops = memory_ops(c)
    assert ops["norm 1"] == ops["norm 2"] == (11520, 23040)
    assert ops["rotary"] == (18432, 18432) and ops["attention output copy"] == (16384, 16384)
    assert ops["residual adds"] == (34560, 34560) and ops["gradient sums"] == (0, 34560)
    assert ops["MLP activation"] == (69120, 115200)
    assert ops["DeepEP permute / unpermute"] == (57600, 57600)
    assert ops["sink renormalisation"] == (16384, 32768)
    assert sum(f for f, _ in ops.values()) == 235520 and sum(b for _, b in ops.values()) == 355584


def test_transformer_engine_attention_writes_no_layout_copy(rows):
    """TE's DotProductAttention (attention_kernel cudnn) reads and writes bshd: no output copy; PyTorch SDPA's flash2
    returns (b, heads, s, d), copied back at 2c q = 16,384 B a token each way (Qwen's q 4,096)."""
    c = rows["qwen3-30b-a3b"]
    assert c.config.attention_kernel.value == "cudnn" and "attention output copy" not in memory_ops(c)
    from dataclasses import replace

    flash2 = replace(c, evaluation=replace(c.evaluation, config=replace(c.config, attention_kernel="flash2")))
    assert memory_ops(flash2)["attention output copy"] == (16384, 16384)
