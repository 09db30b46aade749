"""The optimizer's implementation as a knob (issue 26): what each step allocates on top of params, grads and state
(cost_models/optimizer_step.py, read from torch 2.13's torch/optim/adam.py and sgd.py), through the request and in
the outputs. The figures are by hand from the presets' shapes; tests/distributed/test_torchrun_optimizer.py checks the
same formulas against real CPU steps and the trace, to the byte."""

from __future__ import annotations

import json

import pytest

from cost_models.optimizer_step import GRAD_SCALER_BYTES, step_temporary_bytes
from cost_models.specs import OptimizerImpl, Precision, SpecError, TrainingSpec
from planner import estimate
from planner.models import load_preset
from tests.doctor.cli_run import cli_process

LLAMA3_8B = 8_030_261_248                 # parameters (the preset's count)
EMBEDDING = 128_256 * 4_096               # llama3-8b's embedding table, and its untied head: the largest tensors


def temporaries(impl, precision="bf16", optimizer="adamw", d=8, finetune="full"):
    training = TrainingSpec(optimizer=optimizer, optimizer_impl=impl, finetune=finetune)
    return step_temporary_bytes(load_preset("llama3-8b"), training, Precision(precision), d, LLAMA3_8B)


def test_each_implementation_by_hand_llama3_8b_on_8_ranks():
    # foreach: torch._foreach_sqrt(exp_avg_sqs) holds one fp32 copy of the local shard (mixed bf16: fp32 states)
    assert temporaries("foreach") == LLAMA3_8B * 4 // 8 == 4_015_130_624
    # fused: torch._fused_adamw_ updates in place
    assert temporaries("fused") == 0
    # for-loop: at the head, the final norm's quotient (4,096 / 8 elements) and the head's sqrt and quotient
    assert temporaries("for-loop") == (4_096 // 8 + 2 * EMBEDDING // 8) * 4 == 525_338_624
    # bf16-pure: the states, hence the temporaries, in bf16
    assert temporaries("foreach", "bf16-pure") == 2_007_565_312
    assert temporaries("for-loop", "bf16-pure") == 262_669_312


def test_sgd_and_8bit_update_in_place_whatever_the_implementation():
    for impl in OptimizerImpl:
        assert temporaries(impl, optimizer="sgd") == 0  # sgd.py: momentum buffer mul_ / add_, param add_
        assert temporaries(impl, optimizer="adamw-8bit") == 0  # bitsandbytes' optimizer_update_8bit_blockwise
        assert temporaries(impl, precision="fp16", optimizer="sgd") == GRAD_SCALER_BYTES == 4096
    assert TrainingSpec(optimizer="adamw-8bit", optimizer_impl="foreach").optimizer_impl is OptimizerImpl.FUSED


def test_lora_for_loop_prices_the_largest_adapter():
    # llama3-8b's adapters (rank 16) on q, k, v, o: lora_A 16 x 4,096 each, lora_B 4,096 x 16 (q, o) or 1,024 x 16
    # (k, v), in peft's order (A, then B); the peak: q's (or o's) lora_B beside its lora_A's quotient
    assert temporaries("for-loop", finetune="lora", d=1) == (65_536 + 2 * 65_536) * 4


def test_the_knob_parses_and_refuses_in_one_line():
    assert TrainingSpec(optimizer_impl="FOR_LOOP").optimizer_impl is OptimizerImpl.FOR_LOOP
    with pytest.raises(SpecError, match="optimizer_impl: unknown value 'triton'; choose one of: foreach, fused, "
                                        "for-loop"):
        TrainingSpec(optimizer_impl="triton")
    r = cli_process(["estimate", "--model", "llama3-8b", "--gpus", "8", "--optimizer-impl", "triton"])
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "error: optimizer_impl: unknown value 'triton'; choose one of: foreach, fused, for-loop\n"


def test_where_the_step_is_the_peak_fused_drops_the_copy():
    """The issue's figure: Qwen3-30B-A3B on 8 GPUs, no checkpointing, priced with foreach peaks at the step, 4.8%
    above the fused step's peak (its backward); the step phases differ by one fp32 copy of the local shard."""
    foreach, fused = (estimate("qwen3-30b-a3b", 8, gpu="h100-80gb", optimizer_impl=i).memory for i in ("foreach", "fused"))
    copy = 30_532_122_624 * 4 // 8  # 128 experts over 8 ranks: no padding
    assert foreach.peak_phase == "optimizer_step" and fused.peak_phase == "backward"
    assert foreach.phases["optimizer_step"].total_bytes - fused.phases["optimizer_step"].total_bytes == copy
    assert foreach.peak_allocated_bytes / fused.peak_allocated_bytes == pytest.approx(1.048, abs=0.001)


def test_offloaded_step_prices_host_memory():
    foreach, fused = (estimate("llama3-8b", 8, offload=True, optimizer_impl=i).memory for i in ("foreach", "fused"))
    assert foreach.phases["optimizer_step"].optimizer_temporaries == 0  # on the CPU: nothing on the GPU
    assert foreach.cpu_bytes_per_node - fused.cpu_bytes_per_node == 8 * LLAMA3_8B * 4 // 8  # 8 ranks per node


def test_pipeline_ranks_price_the_implementation():
    fused = estimate("llama3-8b", 8, pp=2, optimizer_impl="fused").memory
    foreach = estimate("llama3-8b", 8, pp=2, optimizer_impl="foreach").memory
    for f, g in zip(fused.pipeline_ranks, foreach.pipeline_ranks):
        assert f.phases["optimizer_step"].optimizer_temporaries == 0
        # foreach: one copy of the rank's stored parameters (fp32, like them)
        assert g.phases["optimizer_step"].optimizer_temporaries == g.phases["optimizer_step"].sharded_params


def test_outputs_name_the_implementation():
    r = cli_process(["estimate", "--model", "llama3-8b", "--gpus", "8", "--optimizer-impl", "for-loop", "--format",
                     "json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["training"] == {"seq_len": 2048, "optimizer": "adamw", "optimizer_impl": "for-loop", "finetune": "full"}
    text = cli_process(["explain", "--model", "llama3-8b", "--gpus", "8", "--optimizer-impl", "fused"]).stdout
    assert "optimizer step temporaries: adamw, fused step = 0.00 GiB on GPU" in text
