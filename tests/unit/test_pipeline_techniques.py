"""Techniques under pipeline parallelism (issue 18; cost_models/pipeline_techniques.py): MoE experts' backward
moments, selective-op checkpointing and the compiled loss priced per stage, checked against cached peaks of the
pipeline trace; CPU offload refused with pp > 1.

The cached figures are calibration.trace_pipeline.trace_pipeline's peak allocated bytes per pipeline rank (torch 2.13,
transformers 5.24, fake tensors at the real world size; 35-70 s a trace, so the tests read the figures). Each was
recorded through benchmarks/memory_accuracy_pp.run_pp_one on the row below (FULL_SHARD, bf16, 8 GPUs a node), the
MoE architectures being benchmarks/memory_accuracy.py's EP_ARCHS, e.g. for the first row:
    row = dict(arch="mixtral-blocks", pp_schedule="1f1b", pp=2, pp_stages_per_rank=0, microbatches=4, gpus=4,
               gpus_per_node=8, sharding="FULL_SHARD", precision="bf16", ac_every=0, micro_batch=1, seq_len=128)
    benchmarks.memory_accuracy_pp.run_pp_one(row)   # with PP_ARCHS extended by EP_ARCHS
and, for selective-op, the same row with FsdpConfig(selective_op_ac=True).
"""

from __future__ import annotations

import functools

import pytest

from benchmarks.memory_accuracy import EP_ARCHS
from benchmarks.memory_accuracy_pp import PP_ARCHS
from cost_models.memory import estimate_memory
from cost_models.mesh_rules import mesh_refusals
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig
from planner.api import resolve_inputs

ARCHS = {**PP_ARCHS, **EP_ARCHS}


@functools.cache
def specs(arch: str, gpus: int, seq_len: int):
    return resolve_inputs(dict(ARCHS[arch]), gpus, gpus_per_node=min(gpus, 8), seq_len=seq_len)


def estimate(arch, schedule, pp, microbatches, gpus, micro_batch, seq_len, **config):
    spec, cluster, training = specs(arch, gpus, seq_len)
    cfg = FsdpConfig(pp=pp, pp_schedule=schedule, micro_batch=micro_batch, grad_accum=microbatches, **config)
    return estimate_memory(spec, cluster, training, cfg, DEFAULT_PROFILE)


# (arch, schedule, pp, microbatches, gpus, micro-batch, seq), selective-op: traced peaks per pipeline rank.
# Before pipeline_techniques.py (f6fd2f2, db63e2a) the estimate was, per rank: MoE rows 1-2 -0.63/-0.68% and
# -0.84/-0.82% (the stacked experts' weight gradients at their backward moments left out); selective-op rows 6-7
# +50.54/+31.63% and +26.86/+15.03% (priced as no checkpointing).
CACHED = [
    (("mixtral-blocks", "1f1b", 2, 4, 4, 1, 128), False, (187_472_404, 182_456_236)),
    (("qwen3-moe-blocks", "gpipe", 2, 4, 4, 1, 128), False, (202_014_772, 207_534_692)),
    (("mixtral-blocks", "1f1b", 2, 4, 4, 2, 256), False, (235_569_684, 220_321_196)),
    (("mixtral-blocks", "gpipe", 2, 4, 4, 4, 512), False, (650_265_364, 779_356_984)),
    (("qwen3-moe-blocks", "1f1b", 2, 4, 4, 4, 512), False, (509_751_092, 419_453_516)),
    (("llama-8", "gpipe", 2, 4, 4, 2, 256), True, (94_652_820, 208_730_552)),
    (("mixtral-blocks", "1f1b", 2, 4, 4, 2, 256), True, (185_444_660, 191_266_092)),
    # selective-op, 1F1B pp4 m8: -0.44 / -1.35 / -1.49 / -0.18% until Schedule1F1B's held send of the last input
    # gradient (bwd_sends) was priced, -0.44 / -0.73 / -0.80 / -0.02% since
    (("llama-8", "1f1b", 4, 8, 8, 2, 256), True, (69_263_692, 41_982_280, 37_966_152, 165_350_772)),
]


# the compiled loss (compile=True: FsdpConfig.loss_compiled): traced with calibration/fused_loss.py's fused
# cross-entropy standing for the compiled kernel, as the pp = 1 trace does (calibration/trace.py _loss; the pipeline
# trace's loss_fn, calibration.pipeline.causal_lm_loss, replaced by fused_causal_lm_loss for the run, blocks eager).
# Before loss_bytes: +2.64% and +27.97% on the last stage (log_softmax's fp32 output priced as saved).
COMPILED_LOSS = [
    (("llama-8", "1f1b", 2, 4, 4, 2, 256), (114_368_916, 134_280_620)),
    (("llama-8", "gpipe", 2, 4, 4, 2, 256), (142_573_972, 189_102_020)),
]


@pytest.mark.parametrize("row, traced", COMPILED_LOSS)
def test_compiled_loss_stage_peaks_match_the_trace(row, traced):
    ranks = estimate(*row, compile=True).pipeline_ranks
    errors = [r.peak_allocated_bytes / t - 1 for r, t in zip(ranks, traced)]
    assert max(map(abs, errors)) < 0.01, [f"{100 * e:+.2f}%" for e in errors]


@pytest.mark.parametrize("row, selective, traced", CACHED)
def test_stage_peaks_match_the_pipeline_trace(row, selective, traced):
    ranks = estimate(*row, selective_op_ac=selective).pipeline_ranks
    errors = [r.peak_allocated_bytes / t - 1 for r, t in zip(ranks, traced)]
    assert len(ranks) == len(traced)
    assert max(map(abs, errors)) < 0.01, [f"{100 * e:+.2f}%" for e in errors]


def test_moe_block_backward_holds_the_stacked_experts_gradient():
    # mixtral-blocks stage 0: embedding 2000 x 256 + 4 blocks of 3,312,128 parameters (8 experts of gate|up
    # 2 x 512 x 256 and down 256 x 512: 3,145,728 routed) = 13,760,512. At microbatch 1's backward the fp32 sums of
    # microbatch 0's gradients are there (4 B each), and the experts' activation backward holds the stacked down
    # projection's bf16 gradient, 8 x 256 x 512 x 2 B = 2,097,152 (a dense MLP's moment would hold fc2's alone,
    # 256 x 512 x 2 B = 262,144). At one microbatch of 128 tokens that moment sets stage 0's peak.
    ranks = estimate("mixtral-blocks", "1f1b", 2, 4, 4, 1, 128).pipeline_ranks
    assert ranks[0].peak_moment == "backward of microbatch 1 on stage 0"
    assert ranks[0].breakdown.unsharded_grads == (2000 * 256 + 4 * 3_312_128) * 4 + 8 * 256 * 512 * 2


def test_notes_no_longer_say_moe_selective_op_or_the_compiled_loss_are_unpriced():
    notes = estimate("mixtral-blocks", "1f1b", 2, 4, 4, 1, 128, selective_op_ac=True, compile=True).notes
    assert not [n for n in notes if "does not price" in n]


def test_offload_with_pipeline_is_refused_in_one_line():
    spec, cluster, training = specs("llama-8", 4, 256)
    refused = mesh_refusals(spec, cluster, training, FsdpConfig(pp=2, offload=True, grad_accum=4))
    assert [(r.field, r.code) for r in refused] == [("offload", "pipeline-with-offload")]
    assert "\n" not in refused[0].reason + refused[0].fix
    assert not mesh_refusals(spec, cluster, training, FsdpConfig(pp=2, grad_accum=4))
