"""cost_models/outside_step.py by hand: each way's host RAM per rank and node and its GPU transient, on sizes small
enough to add up in one's head, and the first optimizer step's reserved bytes through the allocator model."""

from __future__ import annotations

import pytest

from calibration.reference import tiny_llama_spec
from cost_models.outside_step import (DCP_COPY_AHEAD_BYTES, LoadWay, OutsideBytes, SaveWay, StateSizes,
                                      first_step_reserved_bytes, load_bytes, save_bytes)
from cost_models.specs import TrainingSpec
from cost_models.units import GiB, MiB

# A 1 GiB model (fp32 params), Adam's 2 GiB of state, 8 ranks: 384 MiB of state per rank. Largest tensor 64 MiB
# (the embedding), largest unit 128 MiB (the root: embedding + head).
SIZES = StateSizes(params_bytes=GiB, optimizer_bytes=2 * GiB, largest_tensor_bytes=64 * MiB,
                   largest_unit_bytes=128 * MiB, ranks=8)


def test_state_sizes_of_a_model_count_params_adam_and_the_largest_tensor():
    # tiny llama (hidden 64, 4 heads of 16, ffn 128, vocab 256, 2 blocks, untied): 16,384 embedding elements
    model = tiny_llama_spec()
    sizes = StateSizes.of(model, TrainingSpec(), "fp32", ranks=2)
    assert sizes.params_bytes == 4 * model.n_params
    assert sizes.optimizer_bytes == 8 * model.n_params          # AdamW: exp_avg + exp_avg_sq in fp32
    assert sizes.largest_tensor_bytes == 4 * 256 * 64           # the embedding (= the head) 16,384 x 4 B
    # a block (36,992 elements: q, k, v, o, gate, up, down, 2 norms) outweighs the root (32,832: embedding, head, norm)
    assert (model.block_params, model.root_params) == (36_992, 32_832)
    assert sizes.largest_unit_bytes == 4 * 36_992
    lora = StateSizes.of(model, TrainingSpec(finetune="lora", lora_rank=4), "fp32", 2, frozen_dtype="bf16")
    adapters = model.n_layers * model.lora_params_per_block(4)
    assert lora.params_bytes == 2 * model.n_params + 4 * adapters and lora.optimizer_bytes == 8 * adapters


@pytest.mark.parametrize("way, fsdp2, expected", [
    # every rank reads 1 GiB; FSDP2 keeps new local shards (128 MiB) and one full tensor (64 MiB) on the GPU
    (LoadWay.EVERY_RANK, True, OutsideBytes(GiB, GiB, 128 * MiB + 64 * MiB)),
    # FSDP1: a unit and its flattened copy
    (LoadWay.EVERY_RANK, False, OutsideBytes(GiB, GiB, 256 * MiB)),
    (LoadWay.RANK0_BROADCAST, True, OutsideBytes(GiB, 0, 64 * MiB)),
    (LoadWay.RANK0_BROADCAST, False, OutsideBytes(GiB, 0, 256 * MiB)),
    (LoadWay.META_DCP, True, OutsideBytes(8 * MiB, 8 * MiB, 0)),  # one item: a rank's 1/8 of the embedding
])
def test_load_ways(way, fsdp2, expected):
    assert load_bytes(way, SIZES, fsdp2) == expected


def test_every_rank_loading_costs_a_node_eight_models_and_rank0_loading_one():
    assert load_bytes(LoadWay.EVERY_RANK, SIZES).node_bytes(8) == 8 * GiB
    assert load_bytes(LoadWay.RANK0_BROADCAST, SIZES).node_bytes(8) == GiB


def test_resume_reads_the_optimizer_state_too():
    assert load_bytes(LoadWay.RANK0_BROADCAST, SIZES, optimizer=True).rank0_host_bytes == 3 * GiB
    # DCP reads the optimizer state two items at a time (measured): 2 x 8 MiB
    assert load_bytes(LoadWay.META_DCP, SIZES, optimizer=True) == OutsideBytes(16 * MiB, 16 * MiB, 0)


@pytest.mark.parametrize("way, fsdp2, expected", [
    # the writer copies 10 MB ahead plus the item it is on (8 MiB)
    (SaveWay.DCP, True, OutsideBytes(DCP_COPY_AHEAD_BYTES + 8 * MiB, DCP_COPY_AHEAD_BYTES + 8 * MiB, 0)),
    (SaveWay.DCP_ASYNC, True, OutsideBytes(384 * MiB, 384 * MiB, 0)),        # 3 GiB / 8 staged on every rank
    (SaveWay.FULL_RANK0, True, OutsideBytes(3 * GiB, 0, 64 * MiB)),          # params + Adam on rank 0
    (SaveWay.FULL_RANK0, False, OutsideBytes(3 * GiB + 128 * MiB, 0, 128 * MiB)),  # + offload_to_cpu's unit copy
    (SaveWay.SAVE_PRETRAINED, True, OutsideBytes(GiB, 0, 64 * MiB)),
])
def test_save_ways(way, fsdp2, expected):
    assert save_bytes(way, SIZES, fsdp2) == expected


def test_async_save_stages_the_whole_state_of_a_node():
    assert save_bytes(SaveWay.DCP_ASYNC, SIZES).node_bytes(8) == 3 * GiB


def test_on_a_cpu_run_the_gather_is_host_memory_twice_over_gloo():
    assert save_bytes(SaveWay.FULL_RANK0, SIZES, on_gpu=False) == OutsideBytes(3 * GiB + 64 * MiB, 128 * MiB, 0)
    assert save_bytes(SaveWay.DCP, SIZES, on_gpu=False) == OutsideBytes(0, 0, 0)
    assert load_bytes(LoadWay.EVERY_RANK, SIZES, on_gpu=False) == OutsideBytes(GiB + 128 * MiB, GiB + 128 * MiB, 0)


def test_first_step_states_take_the_forwards_segments_and_the_second_forward_needs_new_ones():
    # forward: two 100 MiB activations (segments of 100 MiB each, kRoundLarge); step 1 creates two 100 MiB states,
    # which take those cached segments whole; the 100 MiB temporary needs a third segment: 300 MiB after step 1.
    # Step 2's forward finds the temporary's segment only: one more 100 MiB segment, 400 MiB. A steady step
    # (states first) would reserve 300 MiB.
    step1, step2 = first_step_reserved_bytes([100 * MiB, 100 * MiB], [100 * MiB, 100 * MiB], [100 * MiB])
    assert (step1, step2) == (300 * MiB, 400 * MiB)


def test_first_step_states_too_large_for_the_forwards_segments_grow_step_one():
    # 40 MiB activations cannot hold a 60 MiB state: both states get new segments (120 MiB) beside the 80 MiB
    # cached, and the 60 MiB temporary a third; step 2's activations reuse the forward's segments.
    step1, step2 = first_step_reserved_bytes([40 * MiB, 40 * MiB], [60 * MiB, 60 * MiB], [60 * MiB])
    assert (step1, step2) == (260 * MiB, 260 * MiB)


def test_qlora_sizes_pack_the_block_linears():
    # tiny llama, 2 blocks: 36,864 quantized weights a block (q 4,096, k 2,048, v 2,048, o 4,096, gate / up / down
    # 8,192 each) packed to 18,432 B instead of 73,728 B in bf16; the base 106,816 x 2 B - 2 x 55,296 = 103,040 B.
    # QuantStates with double quantization: 64 / 32 / 32 / 64 / 128 x 3 absmax bytes a block plus 1,096 B of fp32
    # (offset, one nested scale, 16 + 256 code entries) per linear: 8,248 B a block, 16,496 B. Adapters (rank 4 on
    # q, k, v, o: 512 + 384 + 384 + 512 a block) 3,584 in fp32: 14,336 B; Adam 2 x 14,336.
    sizes = StateSizes.of(tiny_llama_spec(), TrainingSpec(finetune="qlora", lora_rank=4), "fp32", 2, "bf16")
    assert sizes.params_bytes == 103_040 + 16_496 + 14_336
    assert sizes.optimizer_bytes == 2 * 14_336
    assert sizes.largest_tensor_bytes == 2 * 256 * 64  # the embedding, left in bf16


def test_host_peak_takes_loading_alone_and_saves_beside_the_offloaded_state():
    from cost_models.host_ram import HostRam, host_ram_reason

    host = HostRam(LoadWay.RANK0_BROADCAST, SaveWay.DCP, LoadWay.META_DCP, "", process_bytes=GiB,
                   offloaded_bytes=10 * GiB, load_bytes=12 * GiB, save_bytes=3 * GiB, resume_bytes=MiB,
                   save_gpu_bytes=0)
    assert host.peak_bytes == GiB + 13 * GiB  # offloaded + save (13) passes loading alone (12)
    assert host_ram_reason(host, 14 * GiB) == ""
    assert host_ram_reason(host, 12 * GiB) == ("needs 14 GiB of host RAM per node > 12 GiB (offloaded state + save "
                                               "13 GiB, processes 1.0 GiB)")


def test_offloaded_state_is_written_in_place_but_a_full_gather_still_runs_on_the_gpu():
    assert save_bytes(SaveWay.DCP, SIZES, offloaded=True) == OutsideBytes(0, 0, 0)
    assert save_bytes(SaveWay.FULL_RANK0, SIZES, offloaded=True) == OutsideBytes(3 * GiB, 0, 64 * MiB)


def test_fsdp1s_dcp_save_copies_the_shard_to_host_and_gathers_a_units_state_on_the_gpu():
    # get_state_dict(cpu_offload=True), as the fsdp1 snippet saves: the copy of the rank's 384 MiB of state in host
    # RAM, each chunk moved as it is made; on the device one Adam state of the 128 MiB unit (NCCL gathers in place)
    assert save_bytes(SaveWay.DCP, SIZES, fsdp2=False) == OutsideBytes(384 * MiB, 384 * MiB, 128 * MiB)
    # CPU offload changes nothing: FSDP1 chunks the unsharded (device) param either way
    assert save_bytes(SaveWay.DCP, SIZES, fsdp2=False, offloaded=True) == OutsideBytes(384 * MiB, 384 * MiB, 128 * MiB)


def test_fsdp1s_dcp_resume_holds_the_copy_and_gathers_root_and_block():
    # get_state_dict's default (a script without cpu_offload), all on the device: the 384 MiB copy, then the model
    # part: the root's params gathered and unsharded (2 x 128 MiB) beside a block's (2 x 128 MiB here: SIZES has one
    # unit size) = 512 MiB, above the optimizer part (256 MiB of new states + the 64 MiB embedding's two states,
    # 128 MiB); host: DCP's two items in flight (2 x 8 MiB)
    assert load_bytes(LoadWay.META_DCP, SIZES, fsdp2=False, optimizer=True, host_state_dict=False) == OutsideBytes(
        16 * MiB, 16 * MiB, 384 * MiB + 512 * MiB)


def test_fsdp1s_dcp_resume_through_a_host_state_dict_keeps_the_copy_and_the_new_states_on_host():
    # cpu_offload=True (--emit fsdp1, accelerate's SHARDED_STATE_DICT): host: the 384 MiB copy beside the new states
    # (256 MiB) and the embedding's two states moved back to host (128 MiB); the GPU: the model part (512 MiB) above
    # the new states copied in (256 MiB) and get_state_dict's gathered unit state (128 MiB)
    assert load_bytes(LoadWay.META_DCP, SIZES, fsdp2=False, optimizer=True) == OutsideBytes(
        768 * MiB, 768 * MiB, 512 * MiB)
    # a save without cpu_offload: the copy on the device beside the gather, DCP's copy-ahead on host
    staged = DCP_COPY_AHEAD_BYTES + 8 * MiB
    assert save_bytes(SaveWay.DCP, SIZES, fsdp2=False, host_state_dict=False) == OutsideBytes(
        staged, staged, 384 * MiB + 128 * MiB)


def test_the_gpu_at_load_save_and_resume_beside_what_is_resident_then():
    """gpu_outside_step_bytes: loading beside the sharded params, a save beside params + grads + optimizer state,
    a resume beside params + optimizer state (no grads); a way without a device transient adds no moment."""
    from cost_models.host_ram import HostRam, gpu_outside_step_bytes
    from cost_models.memory_types import MemoryBreakdown

    step = MemoryBreakdown(sharded_params=GiB, sharded_grads=GiB, optimizer_state=2 * GiB)
    host = HostRam(LoadWay.EVERY_RANK, SaveWay.DCP, LoadWay.META_DCP, "", process_bytes=0, offloaded_bytes=0,
                   load_bytes=0, save_bytes=0, resume_bytes=0, save_gpu_bytes=128 * MiB, load_gpu_bytes=256 * MiB,
                   resume_gpu_bytes=896 * MiB)
    assert gpu_outside_step_bytes(host, step) == {"every-rank load": GiB + 256 * MiB, "dcp save": 4 * GiB + 128 * MiB,
                                                  "meta-dcp resume": 3 * GiB + 896 * MiB}
    assert gpu_outside_step_bytes(HostRam(LoadWay.META_DCP, SaveWay.DCP, LoadWay.META_DCP, "", 0, 0, 0, 0, 0, 0),
                                  step) == {}


def test_the_host_ram_fix_suggests_only_the_ways_not_in_use():
    from cost_models.host_ram import HostRam, host_ram_fix

    def fix(load, save):
        return host_ram_fix(HostRam(load, save, LoadWay.META_DCP, "", 0, 0, 0, 0, 0, 0))

    assert fix(LoadWay.EVERY_RANK, SaveWay.FULL_RANK0) == ("load on rank 0 only (cpu_ram_efficient_loading + "
                                                           "sync_module_states) and save each rank's shard "
                                                           "(state_dict_type SHARDED_STATE_DICT: DCP)")
    assert "DCP" not in fix(LoadWay.EVERY_RANK, SaveWay.DCP) and "rank 0" in fix(LoadWay.EVERY_RANK, SaveWay.DCP)
    assert fix(LoadWay.RANK0_BROADCAST, SaveWay.DCP_ASYNC).startswith("save synchronously")
    assert fix(LoadWay.RANK0_BROADCAST, SaveWay.DCP).startswith("more nodes")
    assert "load on rank 0 only" not in fix(LoadWay.META_DCP, SaveWay.SAVE_PRETRAINED)
