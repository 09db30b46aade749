"""TRL 1.16 beyond its colocated defaults (tests/unit/test_rl_trl.py): vllm_mode="server" (cost_models/
rl_trl_server.py), several generations per optimizer step (rl_schedule.trl_cycle) and LoRA's weight sync
(rl_strategy.weight_sync_bytes), each figure worked by hand.

Qwen2.5-7B as in test_rl_trl.py: 7,615,616,512 parameters; the embedding and the untied head 544,997,376 each, the
final norm 3,584; a block 233,057,792: q and o 3,584 x 3,584, k and v 3,584 x 512, gate, up and down 3,584 x 18,944
(233,046,016) and 11,776 more (norms, q / k / v biases). The actor in fp32, FSDP2, on 8 H100s."""

import pytest

from cost_models.rl_trl_server import chunks, packed_receive_peak_bytes, packed_send_peak_bytes
from planner.rl import rl_estimate
from tests.unit.test_rl_trl import ADAM, GRAPHS, H100, PAGE, PROFILE, SHARD, TRL, WEIGHTS, phases

BLOCK = 233_057_792 * 4                     # a block's fp32 bytes: 932,231,168
EMBEDDING = 544_997_376 * 4                 # 2,179,989,504
# a server of its own on another node, TP 1 at 0.9, the profile run of test_rl_trl.py (4,096 tokens, 8 rows)
SERVER = dict(TRL, vllm_mode="server", vllm_server_host="10.0.0.2", gpu_memory_utilization=0.9, max_num_seqs=8,
              max_num_batched_tokens=4096, internode_gbps=3200)


def test_vllms_packed_broadcast_by_hand():
    """vLLM's pack_tensors fills a list until it passes the buffer (the tensor that passes it included), then
    torch.cat beside it; two buffers in flight. Tensors of 4, 4, 4, 12, 1, 3 into a buffer of 10: chunks 12 (4+4+4),
    12, 4. Rank 0's peak: the second chunk's list and buffer (2 x 12) beside the first in flight: 36. A receiver
    allocates the third chunk's buffer while both earlier ones are referenced: 12 + 12 + 4 = 28. One rank (nothing
    gathered): the list holds the parameters themselves, the buffer alone is new: 12 + 12 = 24."""
    tensors = [4, 4, 4, 12, 1, 3]
    assert chunks(tensors, 10) == [12, 12, 4]
    assert packed_send_peak_bytes(tensors, 10) == 36
    assert packed_receive_peak_bytes(tensors, 10) == 28
    assert packed_send_peak_bytes(tensors, 10, gathered=False) == 24


@pytest.fixture(scope="module")
def server():
    return rl_estimate("qwen2.5-7b", 8, **SERVER)


def test_server_mode_holds_no_engine_on_the_trainer(server):
    """The trainer's phases as colocated TRL runs them, with no engine term at any of them; the engine sized by
    vLLM's rule on a GPU of its own at 0.9 (66,665 blocks: 61,165,404,160 B). The sync: every fp32 tensor
    gathered (227 of them, 30,462,466,048 B) and packed by rank 0; the last chunk holds the last block's norms and
    biases (47,104 B), the final norm (14,336 B) and the head (2,179,989,504 B) - 2,180,050,944 B, listed and
    concatenated - beside the chunk before it in flight, a block and one MLP weight (932,231,168 + 271,581,184 =
    1,203,812,352): 5,563,914,240 B."""
    p = phases(server)
    assert list(p) == ["init", "weight_sync", "rollout", "log_prob", "update", "optimizer_step", "checkpoint"]
    assert not any(k.startswith("engine") for phase in p.values() for k in phase.gpu_bytes)
    assert not any(phase.offloaded for phase in p.values())
    kv = (int(H100 * 0.9) - WEIGHTS - PROFILE) // PAGE // 28 * PAGE * 28
    assert server.memory.engine.kv_bytes == kv == 61_165_404_160
    assert p["init"].gpu_bytes == {"actor params": SHARD}
    last = 47_104 + 3_584 * 4 + EMBEDDING
    assert last == 2_180_050_944 and BLOCK + 3_584 * 18_944 * 4 == 1_203_812_352
    assert p["weight_sync"].gpu_bytes == {"actor params": SHARD, "Adam states": ADAM,
                                          "packed broadcast buffers (rank 0)": 1_203_812_352 + 2 * last}
    assert p["rollout"].gpu_bytes == {"actor params": SHARD, "Adam states": ADAM}
    colocated = phases(rl_estimate("qwen2.5-7b", 8, **TRL))
    kv_colocated = colocated["update"].gpu_bytes["engine KV cache"]
    assert p["update"].reserved_bytes == colocated["update"].reserved_bytes - WEIGHTS - kv_colocated - GRAPHS
    assert server.fits and server.engine_settings.max_num_seqs == 8   # vllm serve's, not TRL's


def test_server_sync_and_generation_seconds(server):
    """The sync: rank 0's broadcast of 30,462,466,048 B over one GPU's share of the node's network (3,200 Gbit/s
    over 8 GPUs x 0.85: 42.5 GB/s, 15 us) - 0.71678 s, over the trainer's all-gathers (7 x 3,807,808,256 B at
    370 GB/s: 0.072 s); on the trainer's node, over NVLink (370 GB/s, 5 us). The generation: the 64 sequences on
    the server's one replica (colocated: 8 on each GPU)."""
    assert server.time.weight_sync_s == pytest.approx(15e-6 + 30_462_466_048 / 42.5e9, rel=1e-12)
    local = rl_estimate("qwen2.5-7b", 6, **{**SERVER, "vllm_server_host": "127.0.0.1", "train_batch": 6})
    assert local.fits, local.reasons
    assert local.time.weight_sync_s == pytest.approx(5e-6 + 30_462_466_048 / 370e9, rel=1e-12)
    assert server.batch.rollout_seqs_per_replica == 64
    assert rl_estimate("qwen2.5-7b", 8, **TRL).batch.rollout_seqs_per_replica == 8


@pytest.mark.parametrize("knobs, field", [
    (dict(vllm_server_host="0.0.0.0"), "vllm_server_host"),          # 8 trainers + 1 server > the node's 8
    (dict(vllm_server_data_parallel_size=2), "vllm_server_data_parallel_size"),   # DP on a dense model
    (dict(strategy="fsdp"), "strategy"),                              # FSDP1's views freed before the packer
    (dict(gpu_memory_utilization=0.95), "gpu_memory_utilization")])   # + 4.4 GiB of receive buffers
def test_what_stops_a_server_job(knobs, field):
    e = rl_estimate("qwen2.5-7b", 8, **{**SERVER, **knobs})
    assert not e.fits and [r.split(":")[0] for r in e.reasons] == [field]


def test_several_generations_per_optimizer_step():
    """steps_per_generation 1 below gradient_accumulation_steps 4 (train batch 8 prompts, mini-batch 32): TRL
    generates at each micro-step, four times an optimizer step (grpo_trainer.py generate_every = 1), and syncs once
    (global_step moves once) - with the colocated engine asleep, once a generation (generate() pushes the weights
    again after a level-2 sleep). Against one generation of 8 prompts: the generation and the old log-probs 4 x;
    the update as steps_per_generation 4 runs it (4 micro-steps, one optimizer step); TRL's max_num_seqs 8 x 1 x 1
    (32 with steps_per_generation 4). verl refuses the same batch."""
    one = rl_estimate("qwen2.5-7b", 8, **TRL)
    four = rl_estimate("qwen2.5-7b", 8, **{**TRL, "ppo_mini_batch_size": 32})
    once = rl_estimate("qwen2.5-7b", 8, **{**TRL, "train_batch": 32})
    assert four.fits and four.engine_settings.max_num_seqs == 8 and once.engine_settings.max_num_seqs == 32
    assert four.time.generation_s == pytest.approx(4 * one.time.generation_s, rel=1e-12)
    assert four.time.log_prob_s == pytest.approx(4 * one.time.log_prob_s, rel=1e-12)
    assert four.time.update_s == pytest.approx(once.time.update_s, rel=1e-12)
    assert four.time.weight_sync_s == one.time.weight_sync_s
    asleep = {"vllm_enable_sleep_mode": True}
    assert rl_estimate("qwen2.5-7b", 8, **{**TRL, "ppo_mini_batch_size": 32, **asleep}).time.weight_sync_s == \
        pytest.approx(4 * rl_estimate("qwen2.5-7b", 8, **TRL, **asleep).time.weight_sync_s, rel=1e-12)
    verl = rl_estimate("qwen2.5-7b", 8, **{**TRL, "framework": "verl", "ppo_mini_batch_size": 32})
    assert any(r.startswith("ppo_mini_batch_size: 32 > train batch 8") for r in verl.reasons)


def test_iterations_reuse_a_generation_across_an_optimizer_step():
    """num_iterations 2, steps_per_generation 2, gradient_accumulation_steps 4: a generation serves 2 x 2 = 4
    micro-steps, one optimizer step - one generation, not two; the update's 4 micro-steps as
    steps_per_generation 4 with one iteration runs them."""
    knobs = dict(TRL, train_batch=16, ppo_mini_batch_size=32, num_iterations=2)
    two = rl_estimate("qwen2.5-7b", 8, **knobs)
    once = rl_estimate("qwen2.5-7b", 8, **dict(knobs, train_batch=16, ppo_mini_batch_size=16, num_iterations=1))
    assert two.time.generation_s == pytest.approx(once.time.generation_s, rel=1e-12)
    assert two.time.update_s == pytest.approx(rl_estimate("qwen2.5-7b", 8, **dict(
        TRL, train_batch=32, ppo_mini_batch_size=32)).time.update_s, rel=1e-12)


def test_trls_lora_sync_by_strategy():
    """TRL merges the adapters, then walks the parameters as without PEFT (vllm_generation.py
    _iter_named_params): FSDP1 summons one unit at a time in full precision, the root (embedding, head and norm:
    1,089,998,336 parameters x 4 B) - not one tensor; FSDP2 gathers one tensor at a time, the largest the
    embedding, its merge's delta a shard of a weight (below)."""
    lora = dict(TRL, finetune="lora")
    fsdp1 = phases(rl_estimate("qwen2.5-7b", 8, **{**lora, "strategy": "fsdp"}))["weight_sync"].gpu_bytes
    fsdp2 = phases(rl_estimate("qwen2.5-7b", 8, **lora))["weight_sync"].gpu_bytes
    assert fsdp1["gathered units"] == 1_089_998_336 * 4 == 4_359_993_344 and "gathered tensor" not in fsdp1
    assert fsdp2["gathered tensor"] == EMBEDDING


def test_fsdp2_merge_delta_is_a_shard_traced():
    """PEFT's get_delta_weight is lora_B @ lora_A (peft/tuners/lora/layer.py, scaled): on FSDP2's DTensor shards
    (Shard(0) on 4 fake ranks) the product comes out Shard(0), a quarter of the weight on each rank - the merge
    adds it in place, and it is freed before the walk gathers whole tensors (benchmarks/trl_sync_check.py runs
    PEFT's own merge on 2 gloo ranks: the same placement, the merged weight right)."""
    torch = pytest.importorskip("torch")
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    from calibration.apply import make_mesh
    from calibration.fake_world import _FakeWorld, _dtensors_under_fake_mode
    from cost_models.specs import FsdpConfig

    with _FakeWorld(4), _dtensors_under_fake_mode():
        mesh = make_mesh(FsdpConfig(), 4, 4, "cpu")
        with FakeTensorMode():
            b = distribute_tensor(torch.empty(1024, 16), mesh, [Shard(0)])
            a = distribute_tensor(torch.empty(16, 512), mesh, [Shard(0)])
            delta = b @ a
            assert tuple(delta.placements) == (Shard(0),) and tuple(delta.to_local().shape) == (256, 512)
