"""cost_models/fsdp1_adapters.py: FSDP1's units of one adapter each (the planner's FSDP1 code: CAST), by hand on the
tiny QLoRA Llama of tests/distributed/test_torchrun_qlora.py (h 256, 4 heads of 64, 2 kv heads, ffn 512, V 512, 2 blocks,
rank 8 on q, k, v, o; 2 ranks, micro-batch 2 x 128 tokens). At its loss backward a traced real FSDP1 step held six
(2, 128, 256) bf16 tensors more than FSDP2's (each adapter's own input copy: 4 a block where FSDP2 keeps 1 shared by
q / k / v and o's input shared with SDPA's output) and the last block's all-gather 28,672 B smaller (its adapters,
8 x (512 + 384 + 384 + 512) values in bf16, in units of their own)."""

from __future__ import annotations

import dataclasses

from calibration.reference import tiny_llama_spec
from cost_models import fsdp1_adapters
from cost_models.fsdp1_adapters import AdapterUnits
from cost_models.memory import estimate_memory
from cost_models.profile import Profile
from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec, TrainingSpec
from planner.trainers.table import TRAINERS

SPEC = tiny_llama_spec(hidden_size=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_hidden_size=512, vocab_size=512,
                       n_layers=2)
TOKENS = 2 * 128


def test_each_adapter_saves_its_input_copy():
    # q, k, v read the normed input (256 wide), o the attention output (256): 4 copies where FSDP2 holds the normed
    # input once (SDPA keeps the attention output anyway; eager's P @ V copy is o's adapter's alone)
    assert fsdp1_adapters.saved_copies_bytes_per_token(SPEC, 2, mixed=True, s2_attention=False) == 2 * 3 * 256
    assert fsdp1_adapters.saved_copies_bytes_per_token(SPEC, 2, mixed=True, s2_attention=True) == 2 * 2 * 256
    assert fsdp1_adapters.saved_copies_bytes_per_token(SPEC, 2, mixed=False, s2_attention=False) == 0  # no cast
    assert fsdp1_adapters.block_adapter_bytes(SPEC, 8, 2) == 28_672


def test_ledger_adds_the_copies_and_leaves_the_adapters_out_of_the_prefetch():
    gpu = GpuSpec(id="cpu", name="CPU", memory_bytes=2 ** 30, hbm_bytes_per_s=1e11, intra_node_bus_bytes_per_s=1e10)
    cluster = ClusterSpec(gpu=gpu, n_gpus=2, gpus_per_node=2, internode_bytes_per_s=1e9)
    training = TrainingSpec(seq_len=128, finetune="qlora", lora_rank=8)
    config = FsdpConfig(micro_batch=2)
    fsdp2, fsdp1 = (estimate_memory(SPEC, cluster, training, config, Profile(), fsdp1_adapter_units=units)
                    for units in (False, True))
    assert fsdp2.peak_moment == fsdp1.peak_moment == "loss backward"
    assert fsdp1.peak_allocated_bytes - fsdp2.peak_allocated_bytes == 6 * TOKENS * 256 * 2 - 28_672
    pure = dataclasses.replace(config, precision="bf16-pure")  # adapters in bf16: peft casts nothing
    assert (estimate_memory(SPEC, cluster, training, pure, Profile(), fsdp1_adapter_units=True).breakdown.activations
            == estimate_memory(SPEC, cluster, training, pure, Profile()).breakdown.activations)


def test_the_fsdp1_trainers_run_adapter_units_their_way():
    """The planner's FSDP1 code casts in its units; HF Trainer's and accelerate's FSDP1 wrap a PEFT model's adapters
    as units too (peft's fsdp_auto_wrap_policy) under autocast; Lightning's {Block} policy keeps them in the block."""
    units = {t: TRAINERS[t].host_ways().fsdp1_adapter_units for t in ("fsdp1", "hf-fsdp1", "accelerate", "lightning",
                                                                     "fsdp2", "hf")}
    assert units == {"fsdp1": AdapterUnits.CAST, "hf-fsdp1": AdapterUnits.AUTOCAST,
                     "accelerate": AdapterUnits.AUTOCAST, "lightning": None, "fsdp2": None, "hf": None}


def test_bitsandbytes_layers_cast_nothing_under_autocast():
    # peft's LoRA layer casts its input to the adapters' dtype always; its Linear4bit only where autocast is off
    assert fsdp1_adapters.casts_inputs(AdapterUnits.AUTOCAST, quantized=False)
    assert not fsdp1_adapters.casts_inputs(AdapterUnits.AUTOCAST, quantized=True)
    assert fsdp1_adapters.casts_inputs(AdapterUnits.CAST, quantized=True)
    assert fsdp1_adapters.casts_inputs(True, quantized=True)  # True: the planner's FSDP1 code, CAST
