"""Planner search speed: gpt-175b on 1,024 GPUs over the full candidate space, the device mesh included (tp and
cp as planner/search/ enumerates them), llama3.1-405b with tp, and with pipelines; target: < 1 s on 2 cores.

    python benchmarks/search_speed.py
Prints the search time (best of 5), configurations costed, and candidates costed per second.

The pipelines line (llama3.1-405b on 512 H100-96, global batch 256: 794 costed, 248 of them pipelines, 124 on the
fastest scouted tp 8 x pp 16 interleaved V 2 with 64 microbatches), CPU time (time.process_time) on 2 busy cores,
first search of a process / best of 3: 4.9-5.3 s / 4.5-5.3 s at e5f5702; 2.1-3.1 s / 1.9-2.3 s after the walk's
dependencies were precomputed per shape (pipeline_time._walk_plan: 6.2 -> 1.1 ms a pp 16 x V 2 x m 64 walk), the
unrecorded walk cached on its stage seconds, and each configuration's evaluation and a pipeline's memory priced
once per search across Float8 and async TP (planner/search/memo.py: 248 -> 182 pipeline memory estimates). What
is left is that memory: each rank's replay (cost_models/pipeline_rank_memory.rank_memory, ~85% of the line).

Issue 27 item 6, at c6d1449 (results byte-identical: every fitting candidate and miss of the three searches dumped to
JSON and compared): the replay keeps what the state holds as running sums instead of summing the rank's stages at
each of its ~400 moments, skips a pass that runs again on the same state (1F1B's steady state), and caches the stage
layout and the active stages per schedule shape; the 297 pipeline estimates of the three searches 4.04 -> 1.32 s.
CPU best of 5 (time.process_time around search(), 2 cores shared with other jobs, load 3-4), before / after: gpt-175b
1.91 / 1.09 s, llama3.1-405b over the TP meshes 4.36 / 2.77 s, the pipelines line 1.62 / 1.14 s. This script's own
figures in the same hour (wall, best of 5 / 3 / 3): 2,790 / 4,653 / 1,758 ms before, 1,457 / 3,556 / 1,645 ms after.
Still above 1 s: of the TP line (2.8 s) the data-parallel candidates' memory ledger (3,091 calls, ~0.7 s) and step
time (~0.9 s) take as much as the 116 pipeline candidates' memory (~0.9 s; stage_pieces and the per-action replay).

Issue 27 item 6 again (25856b6 -> this session's commits): what reads only part of a candidate is priced once per
search - the memory across FSDP1's backward prefetch, the step time across its rate limiter, the host RAM on what it
reads (planner/search/memo.py), the ledger without PP across Float8 and async TP (no EP), the step's blocks / head /
mesh seconds across FSDP's own knobs (step_time._compute_parts), NCCL's outside terms per mesh, a pipeline's stage
pieces per stage shape - and the rank replay's F inlined. Results byte-identical (every candidate and miss of the
three searches against pricing each configuration whole; fsdp-plan --format json of four plans). CPU best of 3,
25856b6 / now, run alternately on the same 2 busy cores (load 2-3): gpt-175b 1.44-1.66 / 0.72-0.77 s, llama3.1-405b
TP meshes 2.5-3.2 / 1.58-1.7 s, the pipelines line 0.90-1.03 / 0.57-0.65 s. Left above 1 s: the TP line, whose 4
flat meshes' 4,400 candidates take ~1.1 s (~1,700 ledgers at ~0.15 ms, ~1,700 step times at ~0.1 ms, evaluate's
checks and the configurations' construction ~0.1 ms each) and its pp 16 / 32 interleaved scouts ~0.4 s (15 estimates
of 16-32 ranks x 256-512 actions each).

Issue 27 item 6, third pass (fe33d6e -> this session's commits): the ledger's shape (cost_models/memory_shape.py: the
activations per token, the working sets, the loss's bytes, the blocks whose moments can peak) priced once per shape
(392 shapes for the TP line's 2,548 ledgers), its moments weighed as tuples; the outside terms once per
outside_allocator.outside_key; FSDP's collectives in the step time once per what they read (step_time._fsdp_collectives);
one memory verdict per estimate (evaluate.memory_verdict: FSDP1's prefetch pairs share it); the search's refusal check
not made twice. Results byte-identical (every candidate and miss of the three searches; fsdp-plan --format json of 9
plans). CPU best of 3, fe33d6e / now, alternate runs on the same 2 cores (load 1.2-1.4): gpt-175b 687-741 / 506-522 ms,
llama3.1-405b TP meshes 1,469-1,605 / 1,179-1,215 ms (its flat meshes alone 958-1,002 / 676-684 ms), the pipelines
line 593-646 / 523-556 ms. Still above 1 s: the TP line. Of its ~1.2 s the pipeline scouts' rank replays
(cost_models/pipeline_rank_memory.rank_memory: 119 estimates, 1,092 ranks) take ~0.45 s, the flat meshes' 4,483
evaluations ~0.6 s: ledgers ~0.15 s, step times ~0.17 s (their compute parts, 561 shapes, ~0.07 s), the search's own
work ~0.27 s (~4,500 FsdpConfigs built at ~11 us each, the memo's keys and verdicts, refusals, the final sorts).

Issue 27 item 6, fourth pass (4e37c03, 510fcb2): a pipeline rank's order replayed once per schedule shape over counts
of its stages' pieces (cost_models/pipeline_rank_replay.py), each moment a row of coefficients; a configuration weighs
the rows with its bytes (one int64 matrix product) and takes the first largest, as the in-order replay did. The TP
line's 1,092 rank replays are 68 shapes; its 119 pipeline estimates 0.52-0.64 s -> 0.145-0.16 s (0.23-0.29 s in a
process's first search, which builds the replays). Results byte-identical (every candidate and miss of the three
searches, fsdp-plan --format json of 9 plans; every rank of 700 random pipeline configurations, 5 schedules, against
the previous replay). CPU, before (4e37c03~1) / after, alternate runs on the same 2 cores, which ran slower
than in the third pass (the before figures' TP line 1.34-1.72 s against 1.18-1.21 then): this script (load 0.9,
best of 5 / 3 / 3) gpt-175b 598-641 / 435-437 ms, llama3.1-405b TP meshes 1,338-1,380 / 982-1,000 ms, the
pipelines line 608-613 / 464-473 ms; the TP line alone, 6 searches a process, 3 processes each (load 1.0): first
search 1,702-1,747 / 1,279-1,847 ms, best 1,350-1,584 / 952-988 ms. The TP line's flat meshes alone take 713-731 ms
of it now, its pipeline scouts ~230 ms (their memory ~150 ms: the 340 stage shapes' pieces ~45 ms, ~90 us a rank).

Issue 27 item 6, fifth pass (8a308aa -> a9c88f6, f205606). Construction: the frozen dataclasses a search makes by the
ten thousand (FsdpConfig, MemoryEstimate, MemoryBreakdown, TimeBreakdown, Evaluation, ...) get
cost_models/quick_init.py's __init__ (the fields stored in the instance dict, not one object.__setattr__ each:
FsdpConfig 26 -> 8 us) and replaced() for replace() where nothing is derived again; FsdpConfig.with_batch varies the
micro-batch, accumulation and shard group of a knob combination. Memos by what they read: the compute parts by the
compute dtype and without the pipeline's fields (680 -> 410 on the TP line), FSDP's copies and the optimizer seconds
once per collectives key, feasibility once a knob combination and group; a stage's pieces with running sums, a rank's
moments by np.einsum. Results byte-identical: every evaluation (config, memory, time) of the three searches and of 7
more (Mixtral, DeepSeek-V2-Lite, QLoRA, LoRA 70B, CP 64k, Gemma 2, gpt-oss) dumped to JSON, fsdp-plan --format json of
13 plans. Instructions of one warm search (valgrind --tool=callgrind, instrumented around search(): what the load on
the 2 cores does not change), 8a308aa / now: gpt-175b 2,628 / 1,866 M (-29%), llama3.1-405b TP meshes 5,530 / 3,992 M
(-28%), the pipelines line 2,862 / 2,201 M (-23%). CPU, this script (best of 5 / 3 / 3), three alternate runs each on
the same 2 cores at load ~1.8: 8a308aa 419-665 / 899-1,405 / 478-810 ms, now 347-567 / 766-813 / 382-393 ms; the TP
line alone (5 searches a process, 3 processes each, alternate) best 886, 938, 899 / 790, 747, 714 ms. Time falls less
than the instructions (-15 to -20% against -28%) on these shared cores. Left on the TP line (py-spy): the flat ledgers
~20% (2,490 at ~40 us), the pipeline scouts' memory ~22% (1,092 rank replays; stage pieces ~6%), the step times ~24%
(their compute parts ~8%), evaluate's verdicts and the configurations ~10%.

Issue 27 item 6, sixth pass (c096ad2 -> f550632): the DeepSeek-V2-Lite line (9,382 costed over 6 EP meshes and their
pipelines) at 1.5 s. What its ~4,800 ledgers and ~5,000 step times derived again, priced once per what it reads
(cost_models/identity_memo.IdentityMemo): the MoE MLP's backward moments (moe.backward_moments, and the EP view's,
which built its E / ep model at every ledger shape), ParamCounts.of, edge_units.root_terms,
operators.selective_op_saved_elements, step_parts.priced_block_ops (so price_block's cache matches its key by
identity), EP's all-to-all seconds; the search memo shares EP meshes' ledgers across Float8 as the others' (no DeepEP
buffer under the all-to-all). And the cyclic garbage collector is paused while search() runs (planner/search/
gc_pause.py): the search makes no cycles, but its passes over the live memo took ~250 ms of the 1.6 s. Results
byte-identical (every candidate and miss of the four searches and of 8 plans, config, memory and time reprs:
/tmp/fp_search/fp.py; 3 QLoRA / all-linear LoRA plans). CPU, this script, best of 5 / 3 / 3 / 3, three alternate runs
each on the same 2 cores (load ~4.7): 7eede2d 258-281 / 576-600 / 302-304 / 1,501-1,558 ms, f550632 235-240 /
465-486 / 293-311 / 931-934 ms. Left on the DeepSeek line (sampled): the ledger (memory.py) ~50%, its MoE moments
~6%; the step times ~19%; the pipeline scouts' memory ~7%.

Issue 27 item 6, seventh pass (3056741 -> d381790): what the DeepSeek-V2-Lite line's ledgers derived again. A ledger
with CPU offload is the same configuration's without it less the sharded states (cost_models/offload_moments.py: 1,120
of its 1,196 offload ledgers), and one without a backward prefetch the same with or without the rate limiter (70
more); the ledger's shape leaves out the FP8 all-gather (its saving applied in memory.py) and the experts' sharding
(expert units, dim 1), which it never read; a sparse block's moment (expert_unit_terms.sparse_block_moment), the EP
view and its parameter counts (expert_parallel_counts.py), a block's priced time (step_parts._timed: price_block's
lru_cache hashed every operator of its key) and a pipeline stage's MoE MLP moments once per what they read. Results
byte-identical: /tmp/fp_search/fp.py (every candidate and miss of the four searches and of 8 plans) 25853058... and
fpq.py (3 QLoRA / LoRA plans) 2b975afc... at 2554fd7 and after each commit. CPU, this script (best of 5 / 3 / 3 / 3),
three alternate runs on the same 2 cores (load 1.9-2.2): 2554fd7 219-232 / 449-458 / 273-279 / 856-872 ms, d381790
200-210 / 430-439 / 260-279 / 686-705 ms (DeepSeek -19 to -21%). Left on the DeepSeek line (sampled): the ~3,000
ledgers priced whole ~40% (~70 us each; their peak_estimate ~6%), the step times ~18%, the pipeline scouts' memory
~8% (their stage pieces ~5.5%, no two configurations' alike).
"""

from __future__ import annotations

import itertools
import time

from cost_models.evaluate import evaluate
from cost_models.profile import DEFAULT_PROFILE
from cost_models.specs import FsdpConfig, Precision, TrainingSpec
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.search import SearchSpace, mesh_choices, search


def main() -> None:
    model = load_preset("gpt-175b")
    cluster = make_cluster(1024, gpu="a100-80gb")
    training = TrainingSpec(seq_len=2048)
    space = SearchSpace(precisions=tuple(Precision))  # every precision, not just the default one
    timings, cpu = [], []
    for _ in range(5):
        t0, c0 = time.perf_counter(), time.process_time()
        result = search(model, cluster, training, DEFAULT_PROFILE, space)
        timings.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    best = min(timings)
    space_size = (len(space.shardings_for(cluster)) * len(space.precisions_for(cluster)) * len(space.offload)
                  * len(space.ac_every) * len(space.backward_prefetch) * len(space.limit_all_gathers)
                  * len(space.micro_batches))
    meshes = mesh_choices(model, cluster, training, space)
    print(f"meshes searched: {len(meshes)} (tp x cp x ep: "
          f"{', '.join(f'{m.tp}x{m.cp}x{m.ep}' for m in meshes)})")
    print(f"gpt-175b on 1024 x a100-80gb: data-parallel candidate space {space_size:,} configurations; "
          f"{result.n_costed} costed (larger micro-batches skipped once one misses), "
          f"{len(result.fitting)} distinct fitting")
    print(f"search time: {best * 1000:.1f} ms ({min(cpu) * 1000:.1f} ms CPU; best of 5; target < 1000 ms CPU)")
    print(f"candidates costed per second: {result.n_costed / best:,.0f}")
    # Exhaustive: every configuration of the space costed, no pruning.
    configs = [FsdpConfig(sharding=sh, precision=pr, offload=off, ac_every=ac, micro_batch=mb,
                          backward_prefetch=bp, limit_all_gathers=lim)
               for sh, pr, off, ac, bp, lim, mb in itertools.product(
                   space.shardings_for(cluster), space.precisions_for(cluster), space.offload, space.ac_every,
                   space.backward_prefetch, space.limit_all_gathers, space.micro_batches)]
    t0 = time.perf_counter()
    for config in configs:
        evaluate(model, cluster, training, config, DEFAULT_PROFILE)
    exhaustive = time.perf_counter() - t0
    print(f"exhaustive: {len(configs):,} configurations in {exhaustive * 1000:.0f} ms "
          f"({len(configs) / exhaustive:,.0f} per second)")
    # GPT-3's blocks fuse q/k/v (no TP plan: cost_models/mesh_rules.TP_PLAN_FAMILIES), so its space is data
    # parallelism only; a Llama of that scale exercises the mesh (tp 1-8) on the same cluster
    llama = load_preset("llama3.1-405b")
    meshes = mesh_choices(llama, cluster, training, space)
    timings, cpu = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        result = search(llama, cluster, training, DEFAULT_PROFILE, space)
        timings.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    print(f"llama3.1-405b on 1024 x a100-80gb, meshes {', '.join(f'{m.tp}x{m.cp}x{m.ep}' for m in meshes)} "
          f"(tp x cp x ep): {result.n_costed} costed in {min(timings) * 1000:.1f} ms ({min(cpu) * 1000:.1f} ms CPU; "
          "best of 3; target < 1000 ms CPU)")
    # Pipelines: 405B on 512 H100s with a global batch of 256 sequences, where the search picks tp 8 x pp 16
    h100 = make_cluster(512, gpu="h100-96gb")
    piped = TrainingSpec(seq_len=2048, global_batch=256)
    timings, cpu = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        result = search(llama, h100, piped, DEFAULT_PROFILE, SearchSpace())
        timings.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    best = result.fitting[0].config if result.fitting else None
    print(f"llama3.1-405b on 512 x h100-96gb, global batch 256 (pipelines searched): {result.n_costed} costed in "
          f"{min(timings) * 1000:.1f} ms ({min(cpu) * 1000:.1f} ms CPU; best of 3); best: "
          + (f"tp {best.tp} x pp {best.pp} {best.pp_schedule.value}" if best else "none"))
    # An MoE with dense blocks: DeepSeek-V2-Lite on 64 H100s searches its expert-parallel meshes too
    deepseek, h64, long = load_preset("deepseek-v2-lite"), make_cluster(64, gpu="h100-80gb"), TrainingSpec(seq_len=4096)
    cpu = []
    for _ in range(3):
        c0 = time.process_time()
        result = search(deepseek, h64, long, DEFAULT_PROFILE, SearchSpace())
        cpu.append(time.process_time() - c0)
    print(f"deepseek-v2-lite on 64 x h100-80gb, 4,096 tokens (EP meshes searched): {result.n_costed} costed in "
          f"{min(cpu) * 1000:.1f} ms CPU (best of 3; target < 1000 ms CPU)")
    t0 = time.perf_counter()
    from planner.api import plan
    plan("gpt-13b", gpus=8)
    print(f"plan('gpt-13b', gpus=8): {(time.perf_counter() - t0) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
