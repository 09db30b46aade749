"""Cost-model figures checked by hand on small, round specs."""

import dataclasses
import math

import pytest

from cost_models import comm
from cost_models.compute import mfu_flops_per_token, model_flops_per_token, recompute_flops_per_token
from cost_models.evaluate import evaluate
from cost_models.memory import estimate_memory
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.specs import (ClusterSpec, FsdpConfig, GpuSpec, ModelSpec, SpecError, TrainingSpec,
                               parse_activation_checkpointing)
from cost_models.step_time import estimate_step_time

GPU = GpuSpec(id="test", name="test", memory_bytes=80 * 2**30, hbm_bytes_per_s=2e12,
              peak_flops={"bf16": 300e12, "fp32": 20e12}, intra_node_bus_bytes_per_s=200e9)
# 4 blocks of 1,000 params and a 200-param root: Psi = 4,200 (too small for activations to matter
# unless asked for; sequences of 1 token keep them out of the model-state checks).
# FSDP2 pads each tensor to d x ceil(rows / d) rows (torch 2.13 _fsdp_param.py padded_sharded_param_size; cost_models/
# dim0_padding.py), so what FSDP shards, gathers and reduces is Psi_d: d = 2: nothing pads, 4,200; d = 4: the root's
# 10-row embedding (100 // 8 = 12 rows, vocabulary 10) and 10-row head pad to 12 rows, 2 x 2 x 8 = 32 more, 4,232
# (the blocks' rows, q 8, k / v 4, o 8, gate / up 16, down 8, norms 8, divide by 4); d = 8: the tables to 16 rows,
# 2 x 6 x 8 = 96, and each block's k and v, 4 rows, to 8, 2 x 4 x 8 = 64 a block: 4,200 + 96 + 4 x 64 = 4,552.
PSI_4, PSI_8 = 4200 + 32, 4200 + 96 + 4 * 64
TOY = ModelSpec(name="toy", family="llama", n_layers=4, hidden_size=8, n_heads=2, n_kv_heads=1, head_dim=4,
                ffn_hidden_size=16, vocab_size=10, block_params=1000, embedding_params=100, head_params=80,
                root_other_params=20, block_class="Block", gated_mlp=True, norm="rmsnorm", activation="silu",
                lora_target_shapes=((8, 8), (8, 4), (8, 4), (8, 8)))


def cluster(n=4, per_node=4):
    return ClusterSpec(gpu=GPU, n_gpus=n, gpus_per_node=per_node, internode_bytes_per_s=100e9)


def mem(config, n=4, per_node=4, **training):
    return estimate_memory(TOY, cluster(n, per_node), TrainingSpec(seq_len=1, **training), config, DEFAULT_PROFILE)


def test_full_shard_model_states_fp32_adam():
    m = estimate_memory(TOY, cluster(4), TrainingSpec(seq_len=1), FsdpConfig(precision="fp32"), DEFAULT_PROFILE)
    # step phase: params 4 B, grads 4 B, Adam 8 B, foreach temporaries 4 B per param, all / 4 ranks, of the padded
    # 4,232 (PSI_4: rank 0 holds 3 of each 10-row table's rows; the sharded grad is the reduce-scatter's padded output)
    b = m.phases["optimizer_step"]
    assert (b.sharded_params, b.sharded_grads, b.optimizer_state, b.optimizer_temporaries) == (4232, 4232, 8464, 4232)
    assert PSI_4 * 4 // 4 == 4232


def test_bf16_gathers_two_blocks_and_root_in_compute_dtype():
    m = mem(FsdpConfig(precision="bf16"))
    # FSDP2's schedule (checked against the trace tier): in a block's backward the block and the root are
    # gathered, the next block's all-gather output is in flight (a collective buffer until copied out), and
    # so is the fp32 reduce-scatter input of the block before. With one-token sequences activations are
    # negligible and the states decide: block 0's pre-backward, as its prefetched all-gather output is copied out
    # into its unsharded parameters (both alive), beside block 1's reduce-scatter input and the sharded gradients
    # of blocks 3, 2 and 1 - above block 1's pre-backward issuing that prefetch (its copy-in source, block 0's shard
    # cast to bf16, 500 B; one sharded gradient fewer: 500 B less in all) and block 1's backward.
    b = m.phases["backward"]
    assert m.peak_moment == "backward of block 0 (its all-gather copied out)"
    assert b.unsharded_params == 1000 * 2 + 232 * 2           # current block + root (its tables' all-gather output
    #                                                          padded to 12 rows: 200 + 32), bf16
    assert b.collective_buffers == 1000 * 2 + 1000 * 4        # block 0's all-gather output (bf16), block 1's RS (fp32)
    assert b.sharded_grads == 3 * 1000 * 4 // 4               # blocks 3, 2 and 1's fp32 grads, sharded over 4
    # SHARD_GRAD_OP keeps every block gathered until backward
    sgo = mem(FsdpConfig(sharding="SHARD_GRAD_OP", precision="bf16", micro_batch=64), n=4)
    assert sgo.peak_phase == "backward"
    assert sgo.breakdown.unsharded_params == 4 * 1000 * 2 + 232 * 2  # the root padded, as above


def test_no_shard_holds_full_states():
    m = mem(FsdpConfig(sharding="NO_SHARD", precision="fp32"))
    b = m.phases["optimizer_step"]
    assert b.sharded_params == 4200 * 4 and b.optimizer_state == 4200 * 8 and b.sharded_grads == 4200 * 4


def test_hybrid_shards_within_node_only():
    # 8 GPUs, 4 per node: HYBRID shards over d=4, FULL_SHARD over d=8
    hy = mem(FsdpConfig(sharding="HYBRID_SHARD", precision="fp32"), n=8, per_node=4)
    fs = mem(FsdpConfig(sharding="FULL_SHARD", precision="fp32"), n=8, per_node=4)
    assert hy.phases["optimizer_step"].optimizer_state == PSI_4 * 8 / 4 == 8464
    assert fs.phases["optimizer_step"].optimizer_state == math.ceil(PSI_8 * 8 / 8) == 4552


def test_hsdp_shard_group_of_gpus_shards_as_fsdp_at_that_size():
    """shard_group_gpus: HSDP's model states are FSDP's at a world of the shard group, whatever the node (a
    group of two 4-GPU nodes on 16 GPUs shards like FULL_SHARD on 8; a group of 2 on one node like FULL_SHARD
    on 2), the default (0) a node's. The trace tier agrees: tests/unit/test_trace.py (HSDP 2 x 4 traced)."""
    two_nodes = mem(FsdpConfig(sharding="HYBRID_SHARD", precision="fp32", shard_group_gpus=8), n=16, per_node=4)
    assert two_nodes.phases["optimizer_step"] == mem(FsdpConfig(precision="fp32"), n=8, per_node=4).phases[
        "optimizer_step"]
    assert two_nodes.phases["optimizer_step"].optimizer_state == PSI_8 * 8 // 8
    part = mem(FsdpConfig(sharding="HYBRID_SHARD", precision="fp32", shard_group_gpus=2), n=4, per_node=4)
    assert part.phases["optimizer_step"].optimizer_state == 4200 * 8 // 2  # d = 2 pads nothing
    node = mem(FsdpConfig(sharding="HYBRID_SHARD", precision="fp32"), n=16, per_node=4)
    assert node.phases["optimizer_step"].optimizer_state == PSI_4 * 8 // 4


def test_hsdp_shard_group_collectives_by_hand():
    """Each step's collectives of HYBRID_SHARD in fp32 (4 B gathered and reduced per param, 4,200 params; two
    gathers per block, forward and backward, the root's one; one reduce-scatter, then the replicas' all-reduce of
    the shard), no
    latency: on 16 GPUs of 4 per node (NVLink 200 GB/s, 100 GB/s of network per node), a shard group of 8 spans two
    nodes: its ring runs on the network at the node's 100 GB/s; the 2 replicas' all-reduce of 1/8 of the bytes
    crosses nodes in 4 rings at once (one per GPU of a node), 25 GB/s each. A node's group (4) gathers on NVLink
    and all-reduces 1/4 over 4 replicas; a group of 2 inside a 4-GPU node all-reduces on NVLink too."""
    prof = Profile(intra_node_comm_efficiency=1.0, inter_node_comm_efficiency=1.0, intra_node_latency_s=0.0,
                   inter_node_latency_s=0.0)
    # the root gathered once: FSDP2 keeps it for backward. Padded at the group's d (PSI_4 / PSI_8 above): a block
    # 1,000 + 64 and the root 200 + 96 at 8; the root 200 + 32 at 4; nothing at 2
    m, gathered = 4200 * 4, (2 * 4000 + 200) * 4
    m8, gathered8 = PSI_8 * 4, (2 * 4 * 1064 + 296) * 4
    m4, gathered4 = PSI_4 * 4, (2 * 4000 + 232) * 4

    def total_comm_s(n, per_node, group):
        config = FsdpConfig(sharding="HYBRID_SHARD", precision="fp32", shard_group_gpus=group)
        return estimate_step_time(TOY, cluster(n, per_node), TrainingSpec(seq_len=1), config, prof).total_comm_s

    ring = lambda n, message, bw: (n - 1) / n * message / bw  # noqa: E731 - all-gather / reduce-scatter
    assert total_comm_s(16, 4, 8) == pytest.approx(ring(8, gathered8 + m8, 100e9) + 2 * ring(2, m8 / 8, 25e9))
    assert total_comm_s(16, 4, 0) == pytest.approx(ring(4, gathered4 + m4, 200e9) + 2 * ring(4, m4 / 4, 25e9))
    assert total_comm_s(4, 4, 2) == pytest.approx(ring(2, gathered + m, 200e9) + 2 * ring(2, m / 2, 200e9))


def test_offload_moves_states_to_cpu_ram_per_node():
    m = mem(FsdpConfig(precision="bf16", offload=True))
    assert m.breakdown.sharded_params == m.breakdown.optimizer_state == 0
    # per rank: params 4 + grads 4 + Adam 8 + temporaries 4 = 20 B/param of PSI_4 (4,232) / 4 ranks (rank 0's
    # shard: the busiest), 4 ranks per node
    assert m.cpu_bytes_per_node == 4 * (PSI_4 * 20 // 4) == 84640


def test_lora_frozen_weights_have_no_grads_or_optimizer_state():
    m = mem(FsdpConfig(precision="fp32"), finetune="lora", lora_rank=2)
    lora_per_block = 2 * (16 + 12 + 12 + 16)  # r * (in + out) summed over q, k, v, o = 112
    trainable = 4 * lora_per_block
    # FSDP2 pads each lora_A (r = 2 rows, in = 8) to 4 rows at d = 4: + 2 x 8 for each of q, k, v, o; the lora_B
    # (out = 8, 4, 4, 8 rows) divide by 4: 112 + 64 = 176 a block, 704 sharded (rank 0 holds one row of each lora_A)
    padded = 4 * (lora_per_block + 4 * 2 * 8)
    assert m.phases["optimizer_step"].optimizer_state == math.ceil(padded * 8 / 4) == 1408
    assert m.phases["optimizer_step"].sharded_grads == math.ceil(padded * 4 / 4) == 704
    assert TOY.lora_params_per_block(2) == lora_per_block


def test_activation_bytes_llama_block_by_hand():
    from cost_models.activations import block_bytes_per_token
    from cost_models.specs import Attention

    h, f, kv, q, c, a = 8, 16, 4, 8, 2, 2
    norms = 2 * ((4 * h + c * h) + c * h)          # fp32 upcast + normalised product + linear input
    # rotated q and k, v; the kernel's output, which is also the o-projection's input (HF transposes it
    # back to (b, s, heads*d) without a copy: the kernel writes it in that layout); fp32 logsumexp.
    # Earlier versions counted a separate o-projection input copy: saved_tensors_hooks on LlamaAttention
    # show none (the copy exists only for cat-built rotary, GPT-NeoX/Phi-3).
    attn = c * (q + 2 * kv) + c * q + 4 * a
    mlp = 4 * c * f                                # gate, act, up, product
    assert block_bytes_per_token(TOY, c, Attention.SDPA, 128) == norms + attn + mlp
    # eager: q and the per-head repeated k and v (3 c q), the copy of P @ V for the o-projection (c q),
    # the fp32 softmax and its bf16 cast (a * s * (4 + c))
    eager = block_bytes_per_token(TOY, c, Attention.EAGER, 128)
    assert eager == norms + 4 * c * q + a * 128 * (4 + c) + mlp


def test_lora_activation_bytes_llama_block_by_hand():
    """LoRA on q, k, v, o: frozen weights need no gradient, so autograd keeps only what input gradients
    and the adapters need (listed with saved_tensors_hooks on a peft-wrapped LlamaDecoderLayer; the trace
    tier agrees within 0.1% over benchmarks/memory_accuracy.py --finetune lora)."""
    from cost_models.activations import block_bytes_per_token, first_block_lora_savings, root_bytes_per_token
    from cost_models.specs import Attention

    h, f, kv, q, c, a, r = 8, 16, 4, 8, 2, 2, 4
    norms = 2 * (4 * h) + c * h      # each frozen RMSNorm keeps its fp32 input; the attention norm's output
                                     # is kept by the q/k/v adapters' lora_A (the MLP's norm output by no one)
    attn = c * (q + 2 * kv) + c * q + 4 * a     # as in full fine-tuning (o's lora_A keeps the kernel output)
    mlp = 3 * c * f                  # gate, act(gate), up; the frozen down_proj keeps no input
    adapters = 4 * r * c             # each lora_A output, kept for lora_B
    assert block_bytes_per_token(TOY, c, Attention.SDPA, 128, lora_rank=r) == norms + attn + mlp + adapters
    assert block_bytes_per_token(TOY, c, Attention.SDPA, 128) - (norms + attn + mlp + adapters) == \
        3 * c * h + c * f - adapters  # full: both norms' normalised tensors, the MLP input, down_proj's input
    # root: the final norm's fp32 input and the labels; no LM-head input. Block 0's input needs no grad.
    assert root_bytes_per_token(TOY, c, lora=True) == 4 * h + 8
    assert first_block_lora_savings(TOY, c) == 4 * h


def test_all_linear_lora_by_hand():
    """LoRA on every linear (lora_targets all-linear): the MLP's adapters keep its norm's output (gate / up lora_A)
    and down_proj's input (its lora_A), as a full fine-tune's linears do; each adds its lora_A output; the MLP's
    backward frees down_proj's input again; the adapters' parameters, optimizer state and FLOPs cover 7 linears."""
    from cost_models.activations import block_bytes_per_token
    from cost_models.activations_backward import (attention_freed_before_backward_bytes_per_token,
                                                  mlp_backward_working_bytes_per_token)
    from cost_models.compute import attention_flops_per_token_per_layer, model_flops_per_token
    from cost_models.specs import Attention

    every = dataclasses.replace(TOY, lora_targets="all-linear")
    h, f, c, r = 8, 16, 2, 4
    attention_only = block_bytes_per_token(TOY, c, Attention.SDPA, 128, lora_rank=r)
    assert block_bytes_per_token(every, c, Attention.SDPA, 128, lora_rank=r) - attention_only == \
        c * h + c * f + 3 * r * c
    assert mlp_backward_working_bytes_per_token(every, c, lora=True) == c * h + 3 * c * f - c * f
    assert mlp_backward_working_bytes_per_token(TOY, c, lora=True) == c * h + 3 * c * f
    assert attention_freed_before_backward_bytes_per_token(every, c, lora=True) - \
        attention_freed_before_backward_bytes_per_token(TOY, c, lora=True) == c * f + c * h
    lora_per_block = 2 * ((8 + 8) + 2 * (8 + 4) + (8 + 8) + 2 * (8 + 16) + (16 + 8))  # q, k, v, o, gate, up, down
    assert every.lora_params_per_block(2) == lora_per_block == 256
    trainable = 4 * lora_per_block
    m = estimate_memory(every, cluster(4), TrainingSpec(seq_len=1, finetune="lora", lora_rank=2),
                        FsdpConfig(precision="fp32"), DEFAULT_PROFILE)
    # lora_A padded to 4 rows at d = 4 (2 x in more): q, k, v, o, gate, up (in 8): 6 x 16, down (in 16): 32
    padded = 4 * (lora_per_block + 6 * 2 * 8 + 2 * 16)
    assert m.phases["optimizer_step"].optimizer_state == math.ceil(padded * 8 / 4) == 3072
    flops = model_flops_per_token(every, TrainingSpec(seq_len=16, finetune="lora", lora_rank=2))
    assert flops == 4 * 4100 + 6 * trainable + 4 * attention_flops_per_token_per_layer(TOY, 16)


def test_eager_attention_backward_peaks_after_v_and_the_o_input_are_freed():
    """At the softmax backward (eager attention's peak) the o-projection's input copy and v are gone:
    Llama-style separate projections free c*q + c*q (v repeated per head, or as wide under MHA); a fused
    rotary projection with one sequence and MHA frees the copy and the fused output v is a view of."""
    from cost_models.activations_backward import attention_freed_before_backward_bytes_per_token as freed
    from cost_models.specs import Attention

    c, q = 2, TOY.q_dim
    assert freed(TOY, c, attention=Attention.EAGER) - freed(TOY, c) == c * q + c * q
    neox = ModelSpec(name="neox", family="gpt_neox", n_layers=2, hidden_size=8, n_heads=2, n_kv_heads=2, head_dim=4,
                     ffn_hidden_size=32, vocab_size=10, block_params=1, embedding_params=1, head_params=1,
                     root_other_params=1, block_class="B", parallel_block=True)
    assert freed(neox, c, attention=Attention.EAGER) - freed(neox, c) == c * 8 + c * (8 + 2 * 8)
    # two sequences: P @ V reads a contiguous copy of v (the fused output is not kept): that copy goes
    assert freed(neox, c, attention=Attention.EAGER, micro_batch=2) - freed(neox, c) == 2 * c * 8


def test_checkpointing_never_raises_activation_memory():
    acts = [estimate_memory(TOY, cluster(), TrainingSpec(seq_len=512), FsdpConfig(ac_every=k, micro_batch=4),
                            DEFAULT_PROFILE) for k in (0, 4, 2, 1)]
    activation_bytes = [a.phases["backward"].activations for a in acts]
    assert activation_bytes == sorted(activation_bytes, reverse=True)
    assert activation_bytes[0] > activation_bytes[-1]


def test_ring_collective_times():
    tier = comm.Tier(bus_bytes_per_s=100e9, latency_s=0.0)
    assert comm.all_gather_s(1e9, 8, tier) == pytest.approx(7 / 8 * 1e9 / 100e9)
    assert comm.all_reduce_s(1e9, 8, tier) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9)
    assert comm.all_gather_s(1e9, 1, tier) == 0.0
    with_latency = comm.Tier(bus_bytes_per_s=100e9, latency_s=1e-5)
    assert comm.reduce_scatter_s(0, 8, with_latency) == pytest.approx(7e-5)


def test_hsdp_replica_all_reduce_shares_the_node_nics():
    c = cluster(8, 4)
    alone = comm.Tier.for_group(c, Profile(inter_node_comm_efficiency=1.0), spans_nodes=True)
    shared = comm.Tier.for_group(c, Profile(inter_node_comm_efficiency=1.0), spans_nodes=True, groups_sharing_nics=4)
    assert alone.bus_bytes_per_s == 100e9 and shared.bus_bytes_per_s == 25e9


def test_flops_per_token_llama2_7b_by_hand():
    from planner.models import load_preset

    m = load_preset("llama2-7b")
    t = TrainingSpec(seq_len=4096)
    attention = 12 * 32 * 4096 * 4096
    assert model_flops_per_token(m, t) == 6 * (6_738_415_616 - 32000 * 4096) + attention
    assert mfu_flops_per_token(m, t) == 6 * 6_738_415_616 + attention
    full = recompute_flops_per_token(m, t, FsdpConfig(ac_every=1))
    assert full == 32 * (2 * m.block_params + attention / 32 / 3)


def test_step_time_single_gpu_is_its_operator_classes():
    # One GPU, no collectives: step = matmuls + attention + memory-bound + optimizer + overhead, and
    # nothing overlaps (no slowdown); the classes are the ones tests/unit/test_operator_time.py checks.
    prof = Profile(compute_efficiency={"bf16": 0.5, "fp32": 0.5}, microstep_overhead_s=0.0)
    t = estimate_step_time(TOY, cluster(1, 1), TrainingSpec(seq_len=100), FsdpConfig(micro_batch=2), prof)
    assert t.compute_s == pytest.approx(t.matmul_s + t.attention_s + t.memory_bound_s)
    assert t.matmul_s > 0 and t.attention_s > 0 and t.memory_bound_s > 0
    assert t.exposed_comm_s == 0.0 and t.overlap_slowdown_s == 0.0
    assert t.step_s == pytest.approx(t.compute_s + t.optimizer_s)
    assert t.tokens_per_s_per_gpu == pytest.approx(200 / t.step_s)


def test_unsupported_dtype_is_a_reason_not_an_exception():
    v100 = GpuSpec(id="v100", name="v100", memory_bytes=16 * 2**30, hbm_bytes_per_s=9e11,
                   peak_flops={"fp16": 125e12, "fp32": 15.7e12}, intra_node_bus_bytes_per_s=1.2e11)
    c = ClusterSpec(gpu=v100, n_gpus=2, gpus_per_node=2, internode_bytes_per_s=1e10)
    e = evaluate(TOY, c, TrainingSpec(seq_len=8), FsdpConfig(precision="fp16"), DEFAULT_PROFILE)
    assert e.fits
    bf16 = evaluate(TOY, c, TrainingSpec(seq_len=8), FsdpConfig(precision="bf16"), DEFAULT_PROFILE)
    assert not bf16.fits and "no bf16 support" in bf16.reasons[0]
    assert bf16.time.step_s > e.time.step_s  # priced at the fp32 rate


@pytest.mark.parametrize("text,value", [("none", 0), ("full", 1), ("every-3", 3)])
def test_activation_checkpointing_parsing(text, value):
    assert parse_activation_checkpointing(text) == value


def test_bad_spec_values_name_the_field():
    with pytest.raises(SpecError, match="sharding: unknown value 'ZERO3'.*FULL_SHARD"):
        FsdpConfig(sharding="ZERO3")
    with pytest.raises(SpecError, match="micro_batch"):
        FsdpConfig(micro_batch=0)
    with pytest.raises(SpecError, match="activation_checkpointing"):
        FsdpConfig(ac_every="every-0")


def test_lora_flops_frozen_weights_skip_their_weight_gradient():
    from cost_models.compute import attention_flops_per_token_per_layer, model_flops_per_token

    full = model_flops_per_token(TOY, TrainingSpec(seq_len=16))
    lora = model_flops_per_token(TOY, TrainingSpec(seq_len=16, finetune="lora", lora_rank=2))
    dense = TOY.n_params - TOY.embedding_params                   # 4 * 1000 + 80 + 20 = 4,100
    attention = TOY.n_layers * attention_flops_per_token_per_layer(TOY, 16)
    adapters = TOY.n_layers * 2 * (16 + 12 + 12 + 16)             # 448, trained: forward 2 + backward 4
    assert full == 6 * dense + attention
    assert lora == 4 * dense + 6 * adapters + attention


def test_a_group_inside_the_scale_up_domain_stays_on_the_fast_tier():
    """GB200 NVL72: 72 GPUs in trays of 4 share one NVLink domain, so a 72-rank shard group's all-gather runs
    at the NVLink bus rate and latency; 72 B200 (9 HGX nodes of 8) cross InfiniBand. By hand: the ring
    all-gather of 1 GiB on 72 ranks is 71 x latency + 71/72 x 1 GiB / bandwidth."""
    from cost_models import comm
    from cost_models.profile import DEFAULT_PROFILE as P
    from cost_models.step_time import _shard_tiers
    from planner.hardware import make_cluster

    gb200, b200 = make_cluster(72, gpu="gb200"), make_cluster(72, gpu="b200")
    assert (gb200.gpus_per_node, gb200.fast_tier_gpus, b200.fast_tier_gpus) == (4, 72, 8)
    config = FsdpConfig(sharding="FULL_SHARD")
    fast, _ = _shard_tiers(config, gb200, P)
    slow, _ = _shard_tiers(config, b200, P)
    nvlink = gb200.gpu.intra_node_bus_bytes_per_s * P.intra_node_comm_efficiency
    assert (fast.bus_bytes_per_s, fast.latency_s) == (nvlink, P.intra_node_latency_s)
    assert slow.latency_s == P.inter_node_latency_s and slow.bus_bytes_per_s < nvlink
    assert comm.all_gather_s(2**30, 72, fast) == pytest.approx(71 * P.intra_node_latency_s + 71 / 72 * 2**30 / nvlink)


def test_reduce_dtype_halves_the_reduce_scatter_buffer_and_its_bytes():
    """--reduce-dtype bf16 under bf16 mixed precision: the reduce-scatter input held at a block's moment
    is the block's gradients in 2 bytes instead of 4 (llama2-7b, 16 ranks: 202,383,360 params per block
    x 2 B less), and the reductions move half the bytes, so the step is no slower."""
    from planner import estimate

    fp32 = estimate("llama2-7b", 16, precision="bf16", micro_batch=1)
    bf16 = estimate("llama2-7b", 16, precision="bf16", micro_batch=1, reduce_dtype="bf16")
    block = fp32.model.block_params
    assert fp32.memory.peak_moment == bf16.memory.peak_moment and "backward of block" in fp32.memory.peak_moment
    assert fp32.memory.breakdown.collective_buffers - bf16.memory.breakdown.collective_buffers == block * 2
    assert bf16.time.step_s <= fp32.time.step_s
    assert bf16.config.to_dict()["reduce_dtype"] == "bf16" and "reduce_dtype" not in fp32.config.to_dict()
    with pytest.raises(SpecError, match="reduce_dtype"):
        FsdpConfig(reduce_dtype="fp8")


def test_emitted_code_sets_the_reduce_dtype():
    from planner import estimate
    from planner.emit import emit_fsdp1, emit_fsdp2

    c = estimate("llama2-7b", 16, precision="fp32", reduce_dtype="bf16")
    assert "MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.bfloat16)" in emit_fsdp2(c.config, c.model, c.cluster)
    assert "MixedPrecision(reduce_dtype=torch.bfloat16)" in emit_fsdp1(c.config, c.model, c.cluster)
