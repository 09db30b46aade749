"""FlexAttention (cost_models/attention_flex.py, calibration/flex_kernel.py) and gpt-oss priced with it.

The truth, on CPU: (1) the compiled kernel's saved tensors, from the forward graph AOTAutograd's min-cut partitioner
(torch.compile's) keeps for the flex_attention HOP's backward - q, k, v at their own heads, out, the fp32 logsumexp,
the block mask, not max_scores; (2) real BlockMasks (sizes, visited blocks); (3) a real CPU training step of a
small transformers GptOssForCausalLM with calibration.flex_kernel's implementation - transformers' flex path with
the kernel runnable on CPU - against eager (loss and gradients) and its attention's saved bytes against the formula.
"""

from __future__ import annotations

import math

import pytest

from cost_models import attention_flex
from cost_models.activations_sinks import sink_attention_bytes
from cost_models.specs import Attention

torch = pytest.importorskip("torch")

B, H, KV, S, D = 2, 8, 2, 256, 64


def _qkv(dtype=torch.bfloat16, seq=S):
    torch.manual_seed(0)
    return [torch.randn(B, heads, seq, D, dtype=dtype, requires_grad=True) for heads in (H, KV, KV)]


def _sliding(window):
    return lambda b, h, q, k: (q >= k) & (q - k < window)


def _causal(b, h, q, k):
    return q >= k


def test_compiled_kernel_saves_q_k_v_out_and_logsumexp():
    """The partitioned forward graph's saved outputs: exactly the bytes attention_flex prices (no tolerance)."""
    from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop
    from torch.nn.attention.flex_attention import _apply_kernel_options, _identity, create_block_mask

    q, k, v = _qkv()
    mask = create_block_mask(_sliding(128), B, None, S, S, device="cpu")
    as_tuple = mask.as_tuple()
    slots = [i for i, t in enumerate(as_tuple) if isinstance(t, torch.Tensor)]
    options = _apply_kernel_options(q, k, v, True, None, None)

    def attend(q, k, v, *mask_tensors):
        parts = list(as_tuple)
        for slot, tensor in zip(slots, mask_tensors):
            parts[slot] = tensor
        out, lse, _ = flex_hop(q, k, v, _identity, tuple(parts), 1 / math.sqrt(D), options, (), ())
        return out, lse

    graphs = {}

    def keep(name):
        def compiler(gm, _inputs):
            graphs[name] = gm
            return make_boxed_func(gm)
        return compiler

    compiled = aot_function(attend, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            partition_fn=min_cut_rematerialization_partition)
    out, lse = compiled(q, k, v, *[as_tuple[i] for i in slots])
    (out.float().sum() + lse.sum()).backward()
    output = next(n for n in graphs["forward"].graph.nodes if n.op == "output")
    saved = [n.meta["val"] for n in output.args[0][2:]]  # after the two user outputs
    shapes = sorted((tuple(t.shape), t.dtype) for t in saved if t.dtype != torch.int32)
    assert shapes == sorted([((B, H, S, D), torch.bfloat16), ((B, KV, S, D), torch.bfloat16),
                             ((B, KV, S, D), torch.bfloat16), ((B, H, S, D), torch.bfloat16),
                             ((B, H, S), torch.float32)])  # q, k, v, out, logsumexp: no max_scores
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    per_token = attention_flex.kernel_saved_bytes_per_token(2, H * D, KV * D, H)
    assert saved_bytes == B * S * per_token + attention_flex.block_mask_bytes(S, B)


def test_the_trace_kernel_saves_what_the_compiled_one_saves():
    """calibration.flex_kernel's CompiledFlexAttention on real CPU tensors: the same saved bytes, and the values
    and gradients of torch's own (eager) flex_attention path to fp32 rounding."""
    from torch.nn.attention.flex_attention import create_block_mask

    from calibration.flex_kernel import flex_attention

    q, k, v = _qkv(torch.float32)
    mask = create_block_mask(_sliding(128), B, None, S, S, device="cpu")
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = flex_attention(q, k, v, block_mask=mask)
    assert sum(saved.values()) == B * S * attention_flex.kernel_saved_bytes_per_token(4, H * D, KV * D, H) \
        + attention_flex.block_mask_bytes(S, B)
    (out.sum() + lse.sum()).backward()
    # reference: dense attention with the same mask, the sink-free softmax, GQA by repetition
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    scores = qr @ kr.repeat_interleave(H // KV, 1).transpose(-1, -2) / math.sqrt(D)
    i = torch.arange(S)
    scores = scores.masked_fill(~((i[:, None] >= i[None]) & (i[:, None] - i[None] < 128)), float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    ref = torch.softmax(scores, -1) @ vr.repeat_interleave(H // KV, 1)
    (ref.sum() + ref_lse.sum()).backward()
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    for mine, theirs in ((q, qr), (k, kr), (v, vr)):
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-4)


@pytest.mark.parametrize("batch,seq", [(1, 1024), (2, 4096)])
def test_block_mask_bytes_and_visited_keys_of_real_masks(batch, seq):
    from torch.nn.attention.flex_attention import create_block_mask

    for window, mask_mod in ((0, _causal), (128, _sliding(128)), (1000, _sliding(1000))):
        mask = create_block_mask(mask_mod, batch, None, seq, seq, device="cpu")
        tensors = [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]
        assert sum(t.numel() * t.element_size() for t in tensors) == attention_flex.block_mask_bytes(seq, batch)
        visited = int((mask.kv_num_blocks + mask.full_kv_num_blocks)[0].sum())  # kv blocks over the query blocks
        assert attention_flex.keys_visited_per_query(seq, window) == 128 * visited / math.ceil(seq / 128)


TINY = dict(model_type="gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=32, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
            use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def test_real_cpu_step_of_a_small_gpt_oss_with_flex(attention_saved_bytes):
    """transformers' GptOssForCausalLM in fp32 with the flex implementation: the loss and gradients of eager to
    fp32 rounding, an AdamW step, and each layer's attention saving what activations_sinks prices for flex
    (q, k, v, out, logsumexp; the sinks' logsumexp, its input and exp; the o-projection's input) plus its mask."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from calibration.flex_kernel import use_flex
    from planner.models import from_hf_config

    fields = {k: v for k, v in TINY.items() if k != "model_type"}
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **fields), attn_implementation="eager")
    flex = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **fields), attn_implementation=use_flex())
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.sinks.normal_()
    flex.load_state_dict(eager.state_dict())
    batch, seq = 2, 96
    ids = torch.randint(0, TINY["vocab_size"], (batch, seq))
    loss, per_layer = attention_saved_bytes(flex, lambda: flex(input_ids=ids, labels=ids).loss)
    reference = eager(input_ids=ids, labels=ids).loss
    loss.backward(), reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    grads = dict(eager.named_parameters())
    for name, p in flex.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6), name
    assert float(flex.model.layers[0].self_attn.sinks.grad.abs().sum()) > 0

    spec = from_hf_config(TINY)
    mask = attention_flex.block_mask_bytes(seq, batch)
    assert per_layer == [batch * seq * sink_attention_bytes(spec, 4, seq, Attention.FLEX) + mask] * 2

    before_step = flex.model.layers[0].self_attn.sinks.detach().clone()
    torch.optim.AdamW(flex.parameters(), lr=1e-2).step()
    assert not torch.equal(before_step, flex.model.layers[0].self_attn.sinks)
    assert flex(input_ids=ids, labels=ids).loss.item() < loss.item()


def test_gpt_oss_prices_flex_by_default_and_sdpa_stays_refused():
    from planner import PlannerError, estimate

    assert estimate("gpt-oss-20b", 8, seq_len=4096).config.attention is Attention.FLEX
    with pytest.raises(PlannerError, match="choose one of: flex, eager"):
        estimate("gpt-oss-20b", 8, attention="sdpa")
    with pytest.raises(PlannerError, match="choose one of: sdpa, eager"):
        estimate("llama3-8b", 8, attention="flex")


def test_sdpa_refusal_is_one_line_and_exit_2():
    from tests.doctor.cli_run import cli_process

    run = cli_process(["estimate", "--model", "gpt-oss-120b", "--gpus", "8", "--attention", "sdpa"])
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().count("\n") == 0 and "flex, eager" in run.stderr


def test_flex_work_counts_the_window():
    """gpt-oss-120b at 4,096 tokens (32 query blocks of 128): a full layer's query block i visits i + 1 kv blocks,
    128 x 33 / 2 = 2,112 keys a query on average; a sliding (128) one 2 blocks (1 for the first), 128 x 63 / 32 =
    252: 4 q_dim x 1,182 per token over the alternating layers, at 0.90 / 0.85 of the flash rate."""
    from planner.models.resolve import load_preset

    from cost_models.operators import block_ops

    spec = load_preset("gpt-oss-120b")
    assert attention_flex.keys_visited_per_query(4096) == 2112
    assert attention_flex.keys_visited_per_query(4096, 128) == 252
    ops = block_ops(spec, 2, 4096, 0, "flex")
    assert ops.attention_flops_per_token == 4 * 4096 * (2112 + 252) / 2
    assert ops.attention_speed == (0.90, 0.85)


# GPT-OSS-120B, micro-batch 4 x 4,096, 8 x H100 80GB, FSDP 8 x EP 8, bf16-pure, fp32 reduction (the published
# Automodel setting of issue 26), full checkpointing and none.
ROW = dict(gpu="h100-80gb", seq_len=4096, precision="bf16-pure", micro_batch=4, ep=8, reduce_dtype="fp32")
GIB = 2 ** 30


def _row(attention: str, checkpointing: str):
    from planner import estimate

    return estimate("gpt-oss-120b", 8, attention=attention, activation_checkpointing=checkpointing, **ROW).memory


def test_gpt_oss_120b_memory_eager_and_flex():
    """Eager (the only choice before): the recomputed block 0's backward the peak (25.26 GiB of activations: its
    s x s scores and their fp32 gradients). Flex: the optimizer step leads (parameters, gradients and AdamW's bf16
    states, the same under either attention). Reserved is the allocator replay's (EP with a traced block profile is
    walked since 1186070; it was the flat rule's 147.44 / 143.83 GiB): eager 190.40 (191.08 before its (s, s + 1)
    tensors were walked as the trace's: docs/accuracy.md "2026-12-08: gpt-oss's sinks' score tensors"), flex 190.95
    GiB, of which the
    reduce-scatter stream's pool caches 27.2 GiB (flex): the sharded gradients FSDP2 makes on that stream, cached once
    zero_grad frees them, where the next forward's default-stream blocks cannot reuse them (explain's
    segments). Without checkpointing
    every layer's saved bytes differ by eager's c H (s + 1) + 4 c q + 8 H less flex's c (3 q + 2 kv) + 4 H + 4 c H
    = 557,696 - 27,392 = 530,304 B a token (the shipped profiles' terms differ by the same), over 36 layers and
    16,384 tokens: 291.30 GiB of the activations."""
    eager, flex = _row("eager", "full"), _row("flex", "full")
    assert eager.peak_reserved_bytes / GIB == pytest.approx(190.40, abs=0.01)
    assert eager.breakdown.activations / GIB == pytest.approx(25.26, abs=0.01)
    assert eager.peak_moment == "backward of block 0 (recomputed)" and flex.peak_moment == "optimizer step"
    assert flex.peak_reserved_bytes / GIB == pytest.approx(190.95, abs=0.01)
    from planner.models.resolve import load_preset

    spec, c, s = load_preset("gpt-oss-120b"), 2, 4096
    per_token = sink_attention_bytes(spec, c, s, Attention.EAGER) - sink_attention_bytes(spec, c, s, Attention.FLEX)
    assert per_token == 557_696 - 27_392 == 530_304
    eager, flex = _row("eager", "none"), _row("flex", "none")
    gone = eager.breakdown.activations - flex.breakdown.activations
    assert gone == pytest.approx(36 * 4 * s * per_token, rel=1e-3)
    reserved = (eager.peak_reserved_bytes / GIB, flex.peak_reserved_bytes / GIB)
    assert reserved == pytest.approx((623.81, 320.81), abs=0.01)   # eager 616.22 before (as above)


def test_small_gpt_oss_flex_estimate_against_the_trace_tier():
    """The trace tier (two FSDP2 steps on fake tensors, 4 ranks, calibration/flex_kernel.py's kernel) of a small
    gpt-oss (4 layers, 128 wide), micro-batch 2 x 128, full checkpointing, bf16, against the formula estimate:
    measured -0.99% (eager on the same row: -0.87%; on TINY, 2 layers 64 wide: flex -2.08%, eager +5.25%); the
    sharded and gathered parameters and buffers exact."""
    pytest.importorskip("transformers")
    from calibration.trace import trace_memory
    from cost_models.specs import FsdpConfig
    from planner import estimate
    from planner.models import from_hf_config

    small = {**TINY, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 4}
    small.pop("layer_types")  # gpt-oss' own alternation, sliding first
    spec = from_hf_config(small)
    config = dict(precision="bf16", attention="flex", micro_batch=2)
    traced = trace_memory(spec, FsdpConfig(ac_every=1, **config), n_gpus=4, gpus_per_node=4, seq_len=128,
                          hf_config=small)
    est = estimate(spec, 4, seq_len=128, activation_checkpointing="full", **config).memory
    assert est.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.015)
    for key in ("sharded_params", "unsharded_params", "collective_buffers"):
        assert est.breakdown.to_dict()[key] == traced.breakdown[key], key


def test_preferred_attention_for_a_trainer():
    """The first of a model's attention choices the trainer runs (planner/models/family_table.py)."""
    from planner.models.family_table import preferred_attention
    from planner.models.resolve import load_preset

    choices = load_preset("gpt-oss-20b").attention_choices
    assert choices == ("flex", "eager")
    assert preferred_attention(choices) == "flex"
    assert preferred_attention(choices, {"sdpa", "eager"}) == "eager"   # a trainer without FlexAttention
    assert preferred_attention(choices, {"sdpa"}) is None
    assert preferred_attention(load_preset("llama3-8b").attention_choices, {"flex", "sdpa"}) == "sdpa"


_WINDOWED = {  # small configs of the sliding-window families that offer flex (family_table.Family.flex_windows)
    "mistral": dict(model_type="mistral", num_attention_heads=8, num_key_value_heads=2, sliding_window=32),
    "mistral-6-heads": dict(model_type="mistral", num_attention_heads=6, num_key_value_heads=2, sliding_window=32),
    "gemma2": dict(model_type="gemma2", num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   sliding_window=32, query_pre_attn_scalar=16),
    "gemma3_text": dict(model_type="gemma3_text", num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                        sliding_window=32, sliding_window_pattern=2, layer_types=["sliding_attention",
                                                                                   "full_attention"]),
}


@pytest.mark.parametrize("name", sorted(_WINDOWED))
def test_real_cpu_step_of_sliding_window_families_with_flex(name, attention_saved_bytes):
    """Each family's transformers model (fp32, 2 layers, b 2 x 96) with the flex implementation: the loss and
    gradients of eager (Gemma 2's soft-capping through the score_mod), and each layer's attention saving what
    activations prices for flex - SDPA's set without the window's (s, s) mask and repeated k / v (its BlockMask
    instead), k / v repeated when the heads are no power of two - exactly."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from calibration.flex_kernel import use_flex
    from cost_models.activations import _attention_bytes
    from planner.models import from_hf_config

    hf = {"vocab_size": 256, "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2,
          "max_position_embeddings": 512, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0,
          "pad_token_id": 0, **_WINDOWED[name]}
    spec = from_hf_config(hf)
    assert spec.attention_choices[-1] == "flex"
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf["model_type"], **fields),
                                             attn_implementation="eager")
    flex = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf["model_type"], **fields),
                                            attn_implementation=use_flex())
    flex.load_state_dict(eager.state_dict())
    batch, seq = 2, 96
    ids = torch.randint(0, 256, (batch, seq))
    loss, per_layer = attention_saved_bytes(flex, lambda: flex(input_ids=ids, labels=ids).loss)
    reference = eager(input_ids=ids, labels=ids).loss
    loss.backward(), reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    grads = dict(eager.named_parameters())
    for key, p in flex.named_parameters():
        assert torch.allclose(p.grad, grads[key].grad, rtol=1e-3, atol=1e-6), key
    expected = batch * seq * _attention_bytes(spec, 4, Attention.FLEX, seq, batch) + \
        attention_flex.block_mask_bytes(seq, batch)
    assert per_layer == [expected] * 2
