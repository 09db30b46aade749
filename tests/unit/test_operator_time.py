"""The operator-level step time (cost_models/operators.py, kernel_time.py), each term checked by hand."""

import dataclasses

import pytest

from cost_models import activations, comm, operators
from cost_models.kernel_time import Rates, price_block
from cost_models.memory import estimate_memory
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import Attention, ClusterSpec, FsdpConfig, GpuSpec, ModelSpec, TrainingSpec
from cost_models.step_time import estimate_step_time

RATES = Rates(matmul_flops_per_s=500e12, float8_flops_per_s=1000e12, attention_flops_per_s=300e12,
              memory_bytes_per_s=2e12, half_dim=64, attention_half_seq=384)
# A Llama-like block: h 1024, 8 heads of 128 (q 1024), 2 kv heads (kv 256), SwiGLU f 4096, eager RMSNorm.
H, Q, KV, F = 1024, 1024, 256, 4096
LLAMA = ModelSpec(name="llama-ish", family="llama", n_layers=4, hidden_size=H, n_heads=8, n_kv_heads=2, head_dim=128,
                  ffn_hidden_size=F, vocab_size=32000, block_params=H * (Q + 2 * KV) + Q * H + 3 * H * F + 2 * H,
                  embedding_params=32000 * H, head_params=32000 * H, root_other_params=H, block_class="Block",
                  gated_mlp=True, norm="rmsnorm", activation="silu")
GPU = GpuSpec(id="t", name="t", memory_bytes=80 * 2**30, hbm_bytes_per_s=2e12, peak_flops={"bf16": 1000e12, "fp32": 60e12,
              "fp8": 2000e12}, intra_node_bus_bytes_per_s=400e9, matmul_efficiency=0.8, attention_efficiency=0.4)


def test_matmul_time_depends_on_its_shape():
    m = operators.Matmul("up", n=4096, k=1024)
    tokens = 8192
    shape = (8192 / (8192 + 64)) * (4096 / (4096 + 64)) * (1024 / (1024 + 64))
    assert shape == pytest.approx(0.9195, abs=1e-4)
    assert RATES.matmul_forward_s(m, tokens) == pytest.approx(2 * 8192 * 4096 * 1024 / (500e12 * shape))
    assert RATES.matmul_backward_s(m, tokens) == pytest.approx(2 * RATES.matmul_forward_s(m, tokens))
    frozen = dataclasses.replace(m, trainable=False)   # LoRA base weight: the input gradient only
    assert RATES.matmul_backward_s(frozen, tokens) == pytest.approx(RATES.matmul_forward_s(m, tokens))
    assert RATES.matmul_forward_s(m, tokens, float8=True) == pytest.approx(RATES.matmul_forward_s(m, tokens) / 2)
    # a LoRA rank-16 factor runs at 16 / 80 of the large rate (per FLOP): skinny products fall far below peak
    lora = operators.Matmul("lora A", n=16, k=1024)
    per_flop = RATES.matmul_forward_s(lora, tokens) / (2 * 8192 * 16 * 1024)
    assert per_flop * 500e12 == pytest.approx(1 / ((8192 / 8256) * (16 / 80) * (1024 / 1088)))


def test_attention_kernel_time_by_hand():
    ops = operators.block_ops(LLAMA, 2, seq_len=4096)
    # causal: the kernel computes half of 4 q s per token (the MFU convention counts all of it)
    assert ops.attention_flops_per_token == 4 * Q * 2048 and ops.attention_reference_flops == 4 * Q * 4096
    t = price_block(ops, RATES, tokens=8192)
    rate = 300e12 * 4096 / (4096 + 384)   # head dim 128: factor 1
    assert t.attention_forward_s == pytest.approx(4 * Q * 2048 * 8192 / rate)
    assert t.attention_backward_s == pytest.approx(2.5 * t.attention_forward_s)
    # head dim 64 runs at (64 / 88) / (128 / 152) = 0.864 of head dim 128's rate
    assert RATES.attention_rate(4096, 64) / RATES.attention_rate(4096, 128) == pytest.approx(0.8636, abs=1e-4)


def test_a_window_as_long_as_the_sequence_masks_the_kernel():
    # transformers skips the sliding-window mask only while kv_length < the window (masking_utils), so at a window
    # equal to the sequence SDPA gets an explicit mask and computes all s keys. Traced 2026-12-02 (a gemma3_text block
    # as test_block_ops' at 128 tokens, calibration.block_profile.profile_block): attention_flops_per_token 131,072 =
    # 4 x 256 x 128 at window 128, 65,536 (the causal half) at window 129. The formula read window < s before.
    for window, executed in ((4096, 4 * Q * 4096), (4097, 4 * Q * 2048), (2048, 4 * Q * 4096)):
        ops = operators.block_ops(dataclasses.replace(LLAMA, sliding_window=window), 2, seq_len=4096)
        assert ops.attention_flops_per_token == executed and ops.attention_reference_flops == 4 * Q * 4096


def test_block_memory_bound_bytes_eager_and_compiled():
    ops = operators.block_ops(LLAMA, 2, seq_len=4096)
    c = 2
    eager = sum(op.forward_bytes for op in ops.memory_ops)
    fused = sum(op.fused_forward_bytes for op in ops.memory_ops)
    # eager: two fp32-upcast RMSNorms (28 + 4c per element), rotary on q + kv (12c), the attention output
    # copy (2c q), two residual adds (3c h), SwiGLU (5c f); compiled: 2c, 2c, 2c, 2c each, 3c f
    assert eager == 2 * (28 + 4 * c) * H + 12 * c * (Q + KV) + 2 * c * Q + 2 * 3 * c * H + 5 * c * F == 161_792
    assert fused == 2 * 2 * c * H + 2 * c * (Q + KV) + 2 * c * Q + 2 * 2 * c * H + 3 * c * F == 50_176
    t_eager = price_block(ops, RATES, 8192)
    t_fused = price_block(ops, RATES, 8192, compiled=True)
    assert t_eager.memory_forward_s == pytest.approx(8192 * 161_792 / 2e12)
    assert t_fused.memory_forward_s == pytest.approx(8192 * 50_176 / 2e12)
    assert t_fused.matmul_forward_s == t_eager.matmul_forward_s   # compile fuses pointwise work only


def test_selective_op_policy_recomputes_every_second_mm():
    ops = operators.block_ops(LLAMA, 2, seq_len=4096)
    assert [m.name for m in ops.matmuls] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert [m.name for m in ops.selective_op_recomputed()] == ["k", "o", "up"]
    # Qwen2's biased q/k/v run as aten.addmm, counted as matmuls as calibration.apply's policy counts them
    qwen = dataclasses.replace(LLAMA, family="qwen2", block_params=LLAMA.block_params + Q + 2 * KV)
    assert [m.bias for m in operators.block_ops(qwen, 2, 4096).matmuls[:3]] == [True] * 3
    assert [m.name for m in operators.block_ops(qwen, 2, 4096).selective_op_recomputed()] == ["k", "o", "up"]
    # a routed expert's grouped product is not on the save list: recomputed whatever its position
    assert operators.Matmul("experts", 8, 8, 0.25, 8) in operators.BlockOps(
        (operators.Matmul("router", 8, 8), operators.Matmul("experts", 8, 8, 0.25, 8)), 0, 0, (), 128, 1
    ).selective_op_recomputed()
    # recompute: those matmuls' forward and every memory-bound op's forward; the attention output is saved
    t = price_block(ops, RATES, 8192, recompute="selective-op")
    assert t.recompute_attention_s == 0.0
    assert t.recompute_memory_s == pytest.approx(t.memory_forward_s)
    k, o, up = (operators.Matmul("k", KV, H), operators.Matmul("o", H, Q), operators.Matmul("up", F, H))
    assert t.recompute_matmul_s == pytest.approx(sum(RATES.matmul_forward_s(m, 8192) for m in (k, o, up)))


def test_selective_op_memory_holds_input_and_saved_outputs():
    c = 2
    held = activations.selective_op_held_bytes_per_token(LLAMA, c, Attention.SDPA, 4096)
    # block input, the outputs of q, v, gate, down (the 1st, 3rd, 5th, 7th mm), SDPA output + fp32 logsumexp
    assert held == c * H + c * (Q + KV + F + H) + c * Q + 4 * 8 == 16_928
    t = TrainingSpec(seq_len=4096)
    cl = ClusterSpec(gpu=GPU, n_gpus=8, gpus_per_node=8, internode_bytes_per_s=50e9)
    full, sel, none = (estimate_memory(LLAMA, cl, t, FsdpConfig(ac_every=ac), DEFAULT_PROFILE)
                       for ac in ("full", "selective-op", "none"))
    assert full.peak_allocated_bytes < sel.peak_allocated_bytes < none.peak_allocated_bytes


def test_collectives_on_each_tier_by_hand():
    nvlink, ib = comm.Tier(370e9, 5e-6), comm.Tier(85e9, 15e-6)
    assert comm.all_gather_s(1e9, 8, nvlink) == pytest.approx(7 * 5e-6 + 7 / 8 * 1e9 / 370e9)
    assert comm.reduce_scatter_s(2e9, 64, ib) == pytest.approx(63 * 15e-6 + 63 / 64 * 2e9 / 85e9)
    assert comm.all_reduce_s(1e9, 4, ib) == pytest.approx(2 * 3 * 15e-6 + 2 * 3 / 4 * 1e9 / 85e9)


def _step(config, n_gpus=16, seq=4096, **cluster):
    cl = ClusterSpec(gpu=GPU, n_gpus=n_gpus, gpus_per_node=8, internode_bytes_per_s=cluster.get("inter", 50e9))
    return estimate_step_time(LLAMA, cl, TrainingSpec(seq_len=seq), config, DEFAULT_PROFILE)


def test_fp8_all_gather_moves_one_byte_per_float8_weight():
    f8 = H * (Q + 2 * KV) + Q * H + 3 * H * F    # every block linear converts
    assert operators.float8_weight_elements(LLAMA, 2, 4096) == f8
    base = _step(FsdpConfig(float8=True, micro_batch=2))
    fp8 = _step(FsdpConfig(float8=True, fp8_all_gather=True, micro_batch=2))
    assert fp8.total_comm_s < base.total_comm_s
    cl = ClusterSpec(gpu=GPU, n_gpus=16, gpus_per_node=8, internode_bytes_per_s=50e9)
    t = TrainingSpec(seq_len=4096)
    m8 = estimate_memory(LLAMA, cl, t, FsdpConfig(float8=True, fp8_all_gather=True), DEFAULT_PROFILE)
    m = estimate_memory(LLAMA, cl, t, FsdpConfig(float8=True), DEFAULT_PROFILE)
    # at the peak (the loss backward) the prefetched last block's all-gather output holds 1 byte per Float8
    # weight instead of 2
    assert m.peak_moment == m8.peak_moment == "loss backward"
    assert m.breakdown.collective_buffers - m8.breakdown.collective_buffers == f8


def test_overlap_slowdown_is_a_share_of_the_hidden_communication():
    t = _step(FsdpConfig(micro_batch=1))
    hidden = t.total_comm_s - t.exposed_comm_s
    assert hidden > 0
    assert t.overlap_slowdown_s == pytest.approx(DEFAULT_PROFILE.overlap_slowdown * hidden)


def test_reshard_after_forward_to_the_node():
    # 16 GPUs on two nodes: N = 8 keeps the backward all-gathers on NVLink, and an 8-way shard of each
    # block waits for its backward
    base, partial = _step(FsdpConfig()), _step(FsdpConfig(reshard_after_forward=8))
    assert partial.total_comm_s < base.total_comm_s
    cl = ClusterSpec(gpu=GPU, n_gpus=16, gpus_per_node=8, internode_bytes_per_s=50e9)
    t = TrainingSpec(seq_len=4096)
    m, mp = (estimate_memory(LLAMA, cl, t, cfg, DEFAULT_PROFILE) for cfg in (FsdpConfig(), FsdpConfig(reshard_after_forward=8)))
    assert m.peak_moment == mp.peak_moment == "loss backward"
    assert mp.breakdown.unsharded_params - m.breakdown.unsharded_params == -(-LLAMA.n_layers * LLAMA.block_params * 2 // 8)


def test_compile_and_float8_speed_up_a_step():
    eager = _step(FsdpConfig(micro_batch=2))
    compiled = _step(FsdpConfig(micro_batch=2, compile=True))
    f8 = _step(FsdpConfig(micro_batch=2, compile=True, float8=True))
    assert compiled.memory_bound_s < eager.memory_bound_s and compiled.matmul_s == eager.matmul_s
    assert f8.matmul_s < compiled.matmul_s
