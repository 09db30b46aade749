"""QLoRA for real: a tiny transformers Llama loaded with bitsandbytes' 4-bit base (BitsAndBytesConfig,
bnb_4bit_quant_storage bf16), peft adapters of rank 8 on q, k, v, o, one measured step under FSDP2 and FSDP1
(use_orig_params) on 2 gloo ranks (worker_qlora.py), against the ledger (cost_models/memory.py with
cost_models/qlora.py).

bitsandbytes 0.50.2 runs on CPU (`pip install --no-deps bitsandbytes==0.50.2`: its wheel needs no CUDA torch):
gemm_4bit's default kernel dequantizes each weight and runs a compute-dtype matmul, as on GPUs where the
dequantize path wins. Measured when written (2 layers, vocabulary 512, micro-batch 2, per rank):
- the packed parameters' nbytes: 589,824 B (h 256) and 9,437,184 B (h 1024), the formula's to the byte;
- the QuantStates, the same on both ranks before and after wrapping (FSDP leaves them whole): 34,008 B (h 256,
  double quantization) and 1,180,544 B (h 1024, fp4 without), the formula's to the byte;
- the tracker's sharded parameters at the peak (packed shards, norms, embeddings, head, fp32 adapters) and the
  prefetched block's all-gather (the packed bytes in bf16): the formula's to the byte under FSDP2;
- the peak plus the QuantStates: FSDP2 12,259,616 B against 12,251,096 (h 256, 256 tokens: the loss backward),
  32,414,660 against 32,345,984 (h 1024, 64 tokens: the last block's down_proj forward, its weight dequantized
  beside the block's saved tensors, -0.21%; 32,083,840, -1.02%, before the ledger held transformers' inputs_embeds
  there, 2026-12-07: activations.output_projection_forward_held_bytes_per_token; calibration.memtrack sees
  gemm_4bit's own allocations since 2026-12-06, before which it read 31,300,040 in the backward); FSDP1 with its
  units of one adapter each (cost_models/fsdp1_adapters.py: each adapter's input copy, the blocks' all-gathers
  without adapters, no all-gather output beside the unsharded block, the previous block prefetched in the attention's
  backward) 7,696,672 against 7,690,200 (h 256, 128 tokens, the loss backward, -0.08%; 6,932,440 before, -9.9%) and
  29,035,460 against 28,966,784 (h 1024 fp4, 64 tokens, the last down_proj's forward, -0.24%; 28,704,640 without
  inputs_embeds, -1.14%), measured 2026-12-06;
- LoRA on every linear (lora_targets all-linear, 2026-12-07; the loss backward): FSDP2 14,139,728 B against
  14,131,160 (h 256, 256 tokens, -0.06%), FSDP1 8,991,056 against 8,984,536 (h 256, 128 tokens, -0.07%: the MLP's
  adapters' input copies, fsdp1_adapters.saved_copies_bytes_per_token).
Avoided, not investigated: a vocabulary equal to h (h 512, V 512: the real loss moment 5% above the ledger, V
1024: 0.02%; the tracker then files h-wide tensors as logits) and h 384 (head_dim 96: 4% above at the loss).
Six cases of the shared 2-rank torchrun launch (cases.shared): ~14 CPU s of it for the first four, both ranks (the
fourth ~4 s; measured 2026-12-06), the two all-linear ones and test_torchrun_autocast_lora.py's two ~6 s of wall
time more (the shared launch of both files: 29.3 s, then 34.9 s; 2026-12-07).
"""

from __future__ import annotations

import functools
import math

import pytest

from cost_models import qlora
from cost_models.memory import estimate_memory
from cost_models.profile import Profile
from cost_models.specs import ClusterSpec, FsdpConfig, GpuSpec, TrainingSpec
from tests.distributed.cases import shared
from tests.distributed.worker_qlora import LORA_RANK, MICRO_BATCH, spec_of

pytestmark = pytest.mark.distributed
bnb = pytest.importorskip("bitsandbytes", reason="QLoRA runs need bitsandbytes: pip install --no-deps "
                                                  "bitsandbytes==0.50.2")

CASES = ({"fsdp_version": 2, "hidden": 256, "layers": 2, "seq": 256, "double_quant": True},
         {"fsdp_version": 2, "hidden": 1024, "layers": 2, "seq": 64, "double_quant": False, "quant": "fp4"},
         {"fsdp_version": 1, "hidden": 256, "layers": 2, "seq": 128, "double_quant": True},
         {"fsdp_version": 1, "hidden": 1024, "layers": 2, "seq": 64, "double_quant": False, "quant": "fp4"},
         {"fsdp_version": 2, "hidden": 256, "layers": 2, "seq": 256, "double_quant": True, "targets": "all-linear"},
         {"fsdp_version": 1, "hidden": 256, "layers": 2, "seq": 128, "double_quant": True, "targets": "all-linear"})
FSDP2_TOLERANCE = 0.015  # measured -0.07% and -0.21%; a dequantized weight missed or added at h 1024 moves it 13%
# measured -0.08% and -0.24%; without the adapters' input copies -9.9% at h 256, with FSDP2's all-gather output in the
# forward +15% at h 1024 (cost_models/fsdp1_adapters.py)
FSDP1_TOLERANCE = 0.015
ALL_LINEAR_TOLERANCE = 0.005  # measured -0.06% (FSDP2) and -0.07% (FSDP1)


def tolerance(case: dict) -> float:
    if case.get("targets") == "all-linear":
        return ALL_LINEAR_TOLERANCE
    return FSDP2_TOLERANCE if case["fsdp_version"] == 2 else FSDP1_TOLERANCE


launch = shared(__file__, "worker_qlora", CASES, timeout_s=600)


@pytest.fixture(scope="module")
def runs() -> tuple[dict, ...]:
    return launch()


@functools.cache
def predicted(i: int):
    case = CASES[i]
    gpu = GpuSpec(id="cpu", name="CPU", memory_bytes=2 ** 30, hbm_bytes_per_s=1e11, intra_node_bus_bytes_per_s=1e10)
    cluster = ClusterSpec(gpu=gpu, n_gpus=2, gpus_per_node=2, internode_bytes_per_s=1e9)
    training = TrainingSpec(seq_len=case["seq"], finetune="qlora", lora_rank=LORA_RANK, quant=case["quant"]
                            if "quant" in case else "nf4", double_quant=case["double_quant"])
    return estimate_memory(spec_of(case), cluster, training, FsdpConfig(micro_batch=MICRO_BATCH), Profile(),
                           fsdp1_adapter_units=case["fsdp_version"] == 1)  # calibration.apply's trainable_mixed


@pytest.mark.parametrize("i", range(len(CASES)))
def test_packed_weights_and_quant_states_are_the_formulas(runs, i):
    spec, run = spec_of(CASES[i]), runs[i]
    assert run["packed_param_bytes"] == spec.n_layers * qlora.packed_bytes(qlora.quantized_per_block(spec))
    state = qlora.replicated_bytes(spec, CASES[i]["double_quant"])
    assert run["quant_state_bytes_before"] == state
    assert [r["quant_state_bytes"] for r in run["ranks"]] == [state, state]  # every rank holds all of it
    assert all(math.isfinite(loss) and 4 < loss < 8 for r in run["ranks"] for loss in r["losses"])


@pytest.mark.parametrize("i", [0, 1])
def test_fsdp2_shards_and_gathers_the_packed_bytes(runs, i):
    memory, snap = predicted(i), runs[i]["ranks"][0]["snapshot"]
    state = qlora.replicated_bytes(spec_of(CASES[i]), CASES[i]["double_quant"])
    assert snap["breakdown"]["sharded_params"] + state == memory.breakdown.sharded_params
    assert snap["breakdown"]["collective_buffers"] == memory.breakdown.collective_buffers


@pytest.mark.parametrize("i", range(len(CASES)))
def test_peak_per_rank_matches_the_ledger(runs, i):
    spec = spec_of(CASES[i])
    for rank in runs[i]["ranks"]:
        real = rank["snapshot"]["peak_allocated_bytes"] + qlora.replicated_bytes(spec, CASES[i]["double_quant"])
        print(f"case {CASES[i]}: real {real} B, formula {predicted(i).peak_allocated_bytes} B")
        assert abs(predicted(i).peak_allocated_bytes - real) / real < tolerance(CASES[i])
        assert rank["snapshot"]["peak_phase"] == predicted(i).peak_phase  # h 256: the loss backward; h 1024: forward


@pytest.mark.parametrize("i", range(len(CASES)))
def test_first_step_peaks_without_the_adapters_optimizer_state(runs, i):
    """The warm-up step, measured before the tracker's reset: AdamW makes exp_avg / exp_avg_sq in its first step(), so
    the first step's forward / backward peak lacks them (MemoryEstimate.first_step_allocated_bytes). Measured
    2026-12-06 (FSDP2): 12,110,856 B first against 12,225,608 steady (h 256: 114,752 apart, the fp32 states of the
    adapters' shards and AdamW's 16 step counters), 30,775,296 against 31,234,116 (h 1024)."""
    memory, state = predicted(i), qlora.replicated_bytes(spec_of(CASES[i]), CASES[i]["double_quant"])
    adam = memory.phases["optimizer_step"].optimizer_state
    for rank in runs[i]["ranks"]:
        first, steady = rank["first"]["peak_allocated_bytes"], rank["snapshot"]["peak_allocated_bytes"]
        print(f"case {CASES[i]}: first step real {first + state} B, formula {memory.first_step_allocated_bytes} B")
        assert abs(memory.first_step_allocated_bytes - (first + state)) / (first + state) < tolerance(CASES[i])
        assert abs((steady - first) - adam) / adam < 0.001  # the states (and 4-byte step counters) alone


def test_forward_peak_is_the_last_blocks_dequantized_output_projection(runs):
    """h 1024 (64 tokens a sequence): the step's peak is the forward of the last block's down_proj, its 2048 x 1024
    weight dequantized (4 MiB in bf16; fp4 without double quantization: no absmax) beside every saved tensor and the
    block's all-gather output, above its backward (calibration.memtrack counts gemm_4bit's own allocations): the
    ledger's forward moment (memory.py, qlora.forward_in_flight_bytes), its peak too. Measured 32,414,660 B on each
    rank, formula 32,345,984 (-0.21%)."""
    spec, memory = spec_of(CASES[1]), predicted(1)
    state = qlora.replicated_bytes(spec, CASES[1]["double_quant"])
    for rank in runs[1]["ranks"]:
        real = rank["forward"]["peak_allocated_bytes"] + state
        print(f"forward: real {real} B, formula {memory.phases['forward'].total_bytes} B")
        assert abs(memory.phases["forward"].total_bytes - real) / real < FSDP2_TOLERANCE
        assert rank["snapshot"]["peak_phase"] == "forward" and memory.peak_phase == "forward"
        assert rank["forward"]["breakdown"]["collective_buffers"] == memory.phases["forward"].collective_buffers
