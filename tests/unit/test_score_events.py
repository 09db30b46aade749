"""Eager attention's (s, s) tensors in the step walk (cost_models/score_events.py), against the trace tier's replay.

No trace runs here: the traced figures are the trace's own replay of memory_accuracy.py's rows at 0edad1c
(`PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_accuracy.py --families 2026 --arch llama4 --arch deepseek-v3
--finetune lora --jobs 1` and `... --families 2026 --arch gemma2 --jobs 1`; docs/accuracy.md, "2026-12-08: eager
attention's scores in the walk").
"""

import pytest

from benchmarks.memory_accuracy import arch_config
from cost_models.step_allocations import step_replay
from planner.api import estimate
from tests.unit.test_step_allocations import _events_peak, _walk

# row #17 of the LoRA grid: llama4 NO_SHARD fp32, full checkpointing, eager, 2 x 1,024 tokens on 4
LLAMA4_ROW = dict(sharding="NO_SHARD", precision="fp32", activation_checkpointing="full", attention="eager",
                  micro_batch=2, seq_len=1024, gpus_per_node=4, finetune="lora", lora_rank=16)
LLAMA4_TRACE_REPLAY = 553_648_128
# row #5 of gemma2's grid: FULL_SHARD fp32 every-2, eager, 1 x 2,048 tokens on 128
GEMMA2_ROW = dict(sharding="FULL_SHARD", precision="fp32", activation_checkpointing="every-2", attention="eager",
                  micro_batch=1, seq_len=2048, gpus_per_node=8)
GEMMA2_TRACE_REPLAY = 1_612_709_888


@pytest.fixture(scope="module")
def llama4():
    return estimate(arch_config("llama4"), 4, **LLAMA4_ROW)


def test_the_walk_makes_the_traces_score_tensors(llama4):
    """The trace's largest block tensors on this row are 2 x 8 heads x 1,024 x 1,024 fp32 = 64 MiB: the scores, the
    softmax output and its two gradients. The walk cut them into a 91.5 MiB forward and a 100.9 MiB backward remainder
    (no 64 MiB segment held the latter: +26.9% over the trace's replay); now each is a 64 MiB tensor of its own."""
    scores = 2 * 8 * 1024 * 1024 * 4
    sizes = [e[2] for e in _walk(llama4)[0] if e[0] == "alloc" and e[1][0] not in ("logits", "loss")]
    assert max(sizes) == scores
    assert sizes.count(scores) >= 4 * 3   # each block's forward: two scores and the softmax output, at least


def test_llama4s_softmax_keeps_the_scores_dtype():
    """Llama 4's eager_attention_forward takes a plain softmax (transformers modeling_llama4.py:267, no fp32): the
    generic reader reads that off the module, so its bf16 LoRA walk makes bf16 (s, s) tensors and no fp32 one (the
    fp32 softmax gradients were a 512 MiB segment of their own on the LoRA grid's HSDP every-2 row: +16.3% -> -0.6%
    against the trace's replay, docs/accuracy.md "2026-12-08: Llama 4's shared expert and softmax read from the
    module"). Row 1 of that grid: NO_SHARD bf16-pure every-2 eager, 1 x 512 tokens on 2."""
    c = estimate(arch_config("llama4"), 2, sharding="NO_SHARD", precision="bf16-pure", activation_checkpointing="every-2",
                 attention="eager", micro_batch=1, seq_len=512, gpus_per_node=2, finetune="lora", lora_rank=16)
    assert c.model.eager_softmax_fp32 is False
    scores = 8 * 512 * 512   # heads x s x s of the one sequence
    sizes = [e[2] for e in _walk(c)[0] if e[0] == "alloc" and e[1][0] not in ("logits", "loss")]
    assert sizes.count(2 * scores) >= 4 and 4 * scores not in sizes


@pytest.mark.parametrize("arch, gpus, row, traced, tolerance", [
    ("llama4", 4, LLAMA4_ROW, LLAMA4_TRACE_REPLAY, 0.05),   # measured -1.1% (+8.7% before the shared expert was read)
    ("gemma2", 128, GEMMA2_ROW, GEMMA2_TRACE_REPLAY, 0.05)])
def test_eager_rows_reserve_what_the_traces_replay_does(arch, gpus, row, traced, tolerance):
    """Measured at 0edad1c: llama4 512 MiB (-3.0%; 670, +26.9%, before), gemma2 1,550 MiB (+0.8%; 1,788, +16.3%,
    before). Tolerance 5% (the replays' band on traced rows, docs/accuracy.md); the walk stays the ledger's allocated
    peak to the byte (its events' live bytes). llama4's LoRA walk now holds its block profile's checkpoint-held
    inputs (its two eager masks, 8 MiB more than the formulas' one, as the trace: allocated -2.1% -> -0.00%), and
    reserved 574 MiB, +8.7% (docs/accuracy.md "2026-12-08: llama4 LoRA's held mask"); with its shared expert read
    (generic._mlp_widths: its saved tensors freed before the routed experts' backward) 522 MiB, -1.1%."""
    c = estimate(arch_config(arch), gpus, **row)
    walk = step_replay(c.model, c.cluster, c.training, c.config, snapshots=False)
    assert walk.peak_requested_bytes == c.memory.peak_allocated_bytes
    assert c.memory.allocator_reserved_bytes == pytest.approx(traced, rel=tolerance)


# Small rows traced for the softmax's backward (planner.tracing.trace(arch_config(arch), 2, **row), fake tensors,
# 2026-12-08; quoted, not run here): after the loss, the last block's backward frees its forward's bf16 cast back
# of the probabilities, then makes the softmax's first fp32 gradient; no other (s, s) tensor of the forward freed
# between. s 384 / 336 so that no other tensor of these models is an (s, s) tensor's size (Mixtral's routed rows at
# 384 tokens are).
SMALL = dict(sharding="FULL_SHARD", precision="bf16", activation_checkpointing="none", attention="eager",
             micro_batch=1, gpus_per_node=2)
LORA = dict(finetune="lora", lora_rank=16)


def _softmax_backward(events: list, first: int, scores: int, vocab: int, tokens: int) -> list[tuple[str, int]]:
    """From the loss (the logits' allocation: every block's forward done) to the first fp32 (s, s) gradient (scores
    elements x 4 B): the frees of bf16 / fp32 (s, s)-sized tensors made in the forward, then that gradient."""
    events = events[:first]
    logits = {tokens * vocab * w for w in (2, 4)}
    loss = next(i for i, e in enumerate(events) if e[0] == "alloc" and e[2] in logits)
    made, out = {}, []
    for i, e in enumerate(events):
        if e[0] == "alloc":
            if i > loss and e[2] == 4 * scores:
                return out + [("alloc", e[2])]
            made[e[1]] = (e[2], i)
        else:
            size, at = made.pop(e[1], (0, 0))
            if i > loss and at < loss and size in (2 * scores, 4 * scores):
                out.append(("free", size))
    return out


@pytest.mark.parametrize("arch, seq, knobs, traced", [
    ("gemma2", 384, LORA, [("free", 1_179_648), ("alloc", 2_359_296)]),             # 4 heads x 384 x 384
    ("mixtral", 336, dict(expert_units=True), [("free", 1_806_336), ("alloc", 3_612_672)]),   # 8 heads x 336 x 336
    ("mixtral", 336, dict(expert_units=True, **LORA), [("free", 1_806_336), ("alloc", 3_612_672)]),
], ids=["gemma2-lora", "mixtral-expert-units", "mixtral-expert-units-lora"])
def test_the_softmax_backward_frees_the_cast_back_first_as_the_trace_does(arch, seq, knobs, traced):
    """Under LoRA (LoraWalk.transient) and in a sparse block whose experts are a unit of their own ("block backward")
    the walk wrote no softmax backward (score_events.softmax_backward not reached): gemma2 LoRA made its first fp32
    (s, s) tensor with the cast back still alive ([("alloc", 2,359,296)]), and Mixtral's cut an (s, s)-sized tensor
    into its MLP's saved tensors, freed before the cast ([free 1,806,336] x 2 with expert units). The walk stays the
    ledger's allocated peak to the byte. Replays (walk / trace's, B): Mixtral expert units 276,824,064 -> 281,018,368
    (trace 281,018,368); LoRA 161,480,704 -> 163,577,856 (trace 159,383,552); gemma2 LoRA unchanged."""
    c = estimate(arch_config(arch), 2, seq_len=seq, **SMALL, **knobs)
    events, first = _walk(c)
    assert _softmax_backward(events, first, c.model.n_heads * seq * seq, c.model.vocab_size, seq) == traced
    assert _events_peak(events) == c.memory.peak_allocated_bytes


# gpt-oss's eager attention with sinks (transformers modeling_gpt_oss.py:239-253), row 24 of `memory_accuracy.py --mesh
# --only ep` (EP 8 on 256, bf16, full AC, 1 x 2,048 tokens, 8 heads): the trace's allocations of 32 MiB and more,
# labelled by aten op (planner.tracing.trace at PYTHONHASHSEED=0, calibration's tracker wrapped as docs/accuracy.md
# "2026-12-08: gpt-oss's sinks' score tensors" describes), quoted: block 0's no-grad forward, then block 3's
# recompute and softmax backward (sizes in bytes; ss = 8 x 2,048 x 2,048 x 2, ss1 = 8 x 2,048 x 2,049 x 2).
SS, SS1 = 67_108_864, 67_141_632
TRACED_FORWARD = [("alloc", SS), ("alloc", SS), ("free", SS), ("alloc", SS), ("free", SS), ("alloc", SS1),
                  ("alloc", SS1), ("free", SS1), ("alloc", SS1), ("free", SS), ("free", SS1), ("free", SS1)]
# bmm, mul (bmm's freed), add (mul's), cat, sub (cat's), _softmax, then add's and sub's freed (the recompute keeps
# the softmax's output); backward: bmm, slice_backward, _softmax_backward_data (the softmax output freed), the max's
# new_zeros / scatter, add: at most three s x (s + 1) tensors at once
TRACED_RECOMPUTE = TRACED_FORWARD[:-1]


def _large_events(events: list, lo: int = 32 << 20) -> list[tuple[str, int]]:
    live, out = {}, []
    for e in events:
        if e[0] == "alloc":
            live[e[1]] = e[2]
            out += [("alloc", e[2])] * (e[2] >= lo)
        elif e[0] == "free" and live.get(e[1], 0) >= lo:
            out.append(("free", live.pop(e[1])))
    return out


def test_gpt_oss_sinks_score_tensors_are_the_traces():
    """The walk makes gpt-oss's (s, s) and (s, s + 1) tensors in the trace's order and sizes (TRACED_FORWARD), in
    each no-grad forward and recompute; the ledger's allocated peak and the walk's stay equal (to the shards' ceil).
    Reserved 660 -> 906 MiB against the trace's replay of 926 MiB (970,981,376 B): -28.7% -> -2.2%; tolerance 5%
    (the replays' band on traced rows). ~0.1 s once gpt-oss's block profile is in the session's cache (its trace,
    ~12 s, is shared with test_ep_step_allocations' gpt-oss row)."""
    from benchmarks.memory_accuracy import ep_grid
    row = dict(ep_grid()[23])
    assert (row.pop("arch"), row.pop("gpus"), row["seq_len"]) == ("gpt-oss", 256, 2048)
    c = estimate(arch_config("gpt-oss"), 256, **row)
    events = _walk(c)[0]
    forward = [e for e in events if e[1][0] == "scores" and e[1][1][0][:2] == ("forward", 0) or
               e[1][0] == ("forward", 0, 0, 0)]
    assert _large_events(forward)[:len(TRACED_FORWARD)] == TRACED_FORWARD
    recompute = [e for e in events if e[1][0] == "scores" and e[1][1][:4] == ("recompute", 0, 0, 3) or
                 e[1][:4] == ("recompute", 0, 0, 3)]
    assert _large_events(recompute)[:len(TRACED_RECOMPUTE)] == TRACED_RECOMPUTE
    assert _events_peak(events) == pytest.approx(c.memory.peak_allocated_bytes, abs=16)
    assert c.memory.allocator_reserved_bytes == pytest.approx(970_981_376, rel=0.05)
