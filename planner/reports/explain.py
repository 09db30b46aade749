"""`fsdp-plan explain`: the winning config's memory and time budget in plain words, term by term,
with the formula and where it comes from. Memory terms here; the step's budget by operator class in
explain_time.py. The figures are the cost model's own, the formulas' inputs beside them, so a reader can
check the arithmetic.
"""

from __future__ import annotations

import math

from cost_models import activations, moe
from cost_models.memory_types import ParamCounts, traced_block_terms
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.units import DTYPE_BYTES, GiB

from planner.api import Candidate
from planner.reports.explain_time import time_terms
from planner.reports.table import estimate_dict
from planner.reports.table_pipeline import batch_words, pipeline_ranks, schedule_words
from planner.search.words import describe


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def memory_terms(c: Candidate, profile: Profile = DEFAULT_PROFILE) -> list[tuple[str, str, str]]:
    """(term, formula with numbers, source) for each category at the peak moment, then the reserved memory: the
    allocator's (a pipeline's replayed segments) and what lies outside it (`profile`: the one c was costed with)."""
    m, cfg, L = c.model, c.config, c.model.n_layers
    if cfg.pp > 1:  # each rank holds its own stages: the whole-model formulas below do not apply
        return pipeline_memory_terms(c) + _largest_rank_terms(c, profile) + outside_allocator_terms(c)
    b = c.memory.breakdown
    d = cfg.shard_group_size(c.cluster)
    p = DTYPE_BYTES[cfg.precision.param_dtype]
    cb = DTYPE_BYTES[cfg.precision.compute_dtype]
    r = DTYPE_BYTES[cfg.gradient_reduce_dtype]
    dim1 = bool(cfg.expert_shard_dim)
    counts = ParamCounts.of(m, c.training, d, dim1)  # MoE: stacked experts padded to a multiple of d rows
    trainable, frozen = counts.trainable(L), counts.frozen(L)
    real = ParamCounts.of(m, c.training)
    padded = f" (FSDP2 padding included; {real.trainable(L):,} real)" if trainable != real.trainable(L) else ""
    frozen_b = cb if cfg.precision.mixed else p
    opt = c.training.optimizer.state_bytes_per_param(cfg.precision.param_dtype)
    tokens = cfg.micro_batch * c.training.seq_len
    where = "CPU RAM (offloaded)" if cfg.offload else "GPU"
    edges = m.split_edge_units and d > 1  # torchtitan 0.3's embedding and head units (cost_models/edge_units.py)
    terms = [
        ("peak moment", f"{c.memory.peak_moment} ({c.memory.peak_phase.replace('_', ' ')})",
         "the largest of the moments where FSDP2's schedule can peak (cost_models/memory.py)"),
        ("stored parameters", f"{trainable:,} trainable{padded} x {p} B + {frozen:,} frozen x {frozen_b} B / d={d} = "
         f"{_gib(math.ceil((trainable * p + frozen * frozen_b) / d))} on {where}",
         "ZeRO (Rajbhandari et al. 2020) / FSDP (Zhao et al. 2023): each rank keeps 1/d of every unit"
         + (f"; FSDP2 pads each stacked expert tensor to ceil(E / d) rows per rank (x{moe.padding_factor(m, d, dim1):.1f}, "
            "counts include it)" if m.moe is not None and moe.padding_factor(m, d, dim1) > 1 else "")),
        ("optimizer state", f"{trainable:,} x {opt:g} B ({c.training.optimizer.value}) / {d} = "
         f"{_gib(math.ceil(trainable * opt / d))} on {where}",
         "Adam/AdamW keep two states per parameter (m, v); SGD one; 8-bit Adam two 1-byte states"),
        ("optimizer step temporaries", f"{c.training.optimizer.value}, {c.training.optimizer_impl.value} step = "
         f"{_gib(c.memory.phases['optimizer_step'].optimizer_temporaries)} on {where}",
         "torch/optim/adam.py: foreach's _foreach_sqrt(exp_avg_sqs) list, one state's worth; fused kernels in place; "
         "for-loop two copies of one parameter; SGD in place (cost_models/optimizer_step.py)"),
        ("sharded gradients", f"{trainable:,} x {p} B / {d} = {_gib(math.ceil(trainable * p / d))} once complete; "
         f"at the peak {_gib(b.sharded_grads)} (the units already reduced)",
         "FSDP reduce-scatters each unit's gradient after its backward"),
        ("gathered parameters", (f"torchtitan 0.3's edge units: the embedding resharded after forward (gathered again "
                                 f"for its backward), [final norm, head] ({counts.root() - m.embedding_params:,} x {cb} "
                                 "B) from the loss to the norm's backward, and the block in compute "
                                 f"({counts.block():,} x {cb} B)" if edges
                                 else f"the root ({counts.root():,} x {cb} B, kept gathered through backward) and the "
                                 f"block in compute ({counts.block():,} x {cb} B)" if cfg.sharding.reshards_after_forward
                                 else f"the root and every block not yet through backward ({cfg.sharding.value} "
                                      "keeps them gathered from forward") + f" = {_gib(b.unsharded_params)}",
         "FSDP paper: peak parameter memory = sharded + the units in flight"
         + ("; cost_models/edge_units.py (torchtitan distributed/fsdp.py apply_fsdp_to_decoder)"
            if edges else "")),
        ("compute-dtype gradients", ("the current block's gradients before reduce-scatter (edge units: the head unit's reduced after "
                                     "its own backward, the embedding's at the end of backward)" if edges else
                                     "the root's and the current block's gradients before reduce-scatter")
         + f" = {_gib(b.unsharded_grads)}", "autograd writes gradients in the compute dtype"),
        ("collective buffers", f"the next block's all-gather output ({counts.block():,} x {cb} B) and the previous "
                               f"block's reduce-scatter input ({counts.trainable_block:,} x {r} B) = "
                               f"{_gib(b.collective_buffers)}",
         "FSDP2 prefetches the next unit and copies gradients into a flat reduce-scatter buffer"),
    ]
    rank = c.training.adapter_rank
    per_block = activations.block_bytes_per_token(m, cb, cfg.attention, c.training.seq_len, cfg.micro_batch, rank)
    traced = traced_block_terms(m, cfg.precision, cfg.attention) if not rank else None
    if traced is not None:
        per_block = round(traced.saved_bytes_per_token(c.training.seq_len))
    if cfg.ac_every:
        n_ckpt = math.ceil(L / cfg.ac_every)
        act = (f"{n_ckpt} checkpointed blocks keep their input ({m.hidden_size} x {cb} B per token), {L - n_ckpt} "
               f"keep everything ({per_block:,} B per token); x {tokens:,} tokens; at the peak "
               f"{_gib(b.activations)}")
    else:
        act = (f"{L} blocks x {per_block:,} B per token ({per_block / m.hidden_size:.1f} x h) x {tokens:,} tokens "
               f"= {_gib(L * per_block * tokens)} saved; at the peak {_gib(b.activations)}")
    if rank:
        act += "; LoRA: frozen weights keep no tensors for weight gradients, each adapter its r-wide lora_A output"
    source = (f"{m.activation_profile.source} (planner/models/block_profiles.py)" if traced is not None else
              "Korthikanti et al. 2022 (34 s b h per GPT layer), recounted per architecture from what autograd saves "
              "(cost_models/activations.py); verify with fsdp-plan trace")
    terms.append(("activations", act, source))
    compiled = cfg.loss_compiled
    _, loss = activations.logits_bytes_per_token(m, cb, compiled)
    stranded = activations.logits_reserved_extra_bytes_per_token(m, cb, compiled)
    held = ("the compiled loss's saved logits and their gradient" if compiled else
            "the loss's fp32 log-softmax, its gradient and the logits' gradient")
    terms.append(("logits and loss", f"{tokens:,} tokens x vocab {m.vocab_size:,} x {loss // m.vocab_size} B ({held}) "
                  f"= {_gib(tokens * loss)} during the loss backward; at the peak {_gib(b.logits_and_loss)}",
                  "torch.compile of the loss: one fused kernel each way (activations.loss_events)" if compiled else
                  "Hugging Face's causal-LM loss upcasts the logits to fp32"))
    stranded_text = (f" (at least the loss backward's allocation + {_gib(tokens * stranded)} of segments the caching "
                     "allocator cannot reuse)" if stranded else "")
    if replayed := _replay_terms(c, None, profile):  # the shown estimate's step replayed (step_allocations.py)
        return terms + replayed + outside_allocator_terms(c)
    terms.append(("reserved", f"peak allocated {_gib(c.memory.peak_allocated_bytes)}{stranded_text} x (1 + "
                  f"fragmentation) = {_gib(c.memory.allocator_reserved_bytes)} in the caching allocator (what "
                  f"torch.cuda.max_memory_reserved shows) + {_gib(c.memory.outside_allocator_bytes)} outside it = "
                  f"{_gib(c.memory.peak_reserved_bytes)} of {_gib(c.cluster.gpu.memory_bytes)}",
                  "FSDP paper section 7 on allocator fragmentation; cost_models/allocator.py; the terms below"))
    return terms + outside_allocator_terms(c)


def outside_allocator_terms(c: Candidate) -> list[tuple[str, str, str]]:
    """The memory on the GPU that PyTorch's caching allocator does not hold, term by term with its source
    (cost_models/outside_allocator.py; each overridable with --outside-allocator TERM=GiB), then what is inside."""
    m = c.memory
    rows = [(f"outside the allocator: {t.name}", f"{_gib(t.bytes)}: {t.detail}", t.source) for t in m.outside_allocator]
    return rows + [
        ("outside the allocator, total", f"{_gib(m.outside_allocator_bytes)}, in the reserved figure above (fits "
         "compares allocator + outside with the GPU's memory)", ""),
        ("inside the allocator, not counted again", "cuBLAS / cuBLASLt workspaces (one per handle and stream), "
         "Float8's scaled-matmul workspace and Inductor's buffers are caching-allocator blocks",
         "torch include/ATen/cuda/CUDAContextLight.h (WorkspaceMapWithMutex holds at::DataPtr); "
         "torch/testing/_internal/common_utils.py clears them before reading memory_allocated")]


def pipeline_memory_terms(c: Candidate) -> list[tuple[str, str, str]]:
    """With PP: the schedule and microbatches, then each pipeline rank's stages and peak (the largest is the
    headline the other terms break down)."""
    cfg = c.config
    if cfg.pp == 1:
        return []
    from cost_models.pipeline import rank_stages

    terms = [("pipeline", f"{schedule_words(cfg)}; {batch_words(cfg, c.cluster)}",
              "torch.distributed.pipelining schedules; the even block split, the embedding on the first stage and "
              "norm + head + loss on the last (cost_models/pipeline.py)")]
    ranks = {r.rank: r for r in pipeline_ranks(c.memory)}
    top = max(ranks.values(), key=lambda r: r.peak_reserved_bytes) if ranks else None
    for rank in range(cfg.pp):
        held = ", ".join(f"stage {s.index} ({s.describe()})" for s in rank_stages(c.model, cfg, rank))
        r = ranks.get(rank)
        memory = (f"; peak allocated {_gib(r.peak_allocated_bytes)}, reserved {_gib(r.peak_reserved_bytes)} at "
                  f"{r.peak_moment}" + (" (the largest: the terms below are this rank's)" if r is top else "")
                  if r is not None else "")
        terms.append((f"pipeline rank {rank}", held + memory,
                      "" if rank else "each rank's own stages, the activations in flight as its schedule orders them "
                                      "(cost_models/pipeline_memory.py)"))
    return terms


def _largest_rank_terms(c: Candidate, profile: Profile) -> list[tuple[str, str, str]]:
    """The headline rank's categories at its peak, and its reserved figure (the per-stage sums are
    cost_models/pipeline_memory.py's: each stage's parameters, gradients and optimizer state over d, the
    microbatches its schedule holds in flight)."""
    m = c.memory
    top = max(pipeline_ranks(m), key=lambda r: r.peak_reserved_bytes, default=None)
    who = f"pipeline rank {top.rank}" if top is not None else "the largest pipeline rank"
    source = "cost_models/pipeline_memory.py: the rank's stages replayed in torch's schedule order"
    where = "" if who in m.peak_moment else f" on {who}"
    terms = [("peak moment", f"{m.peak_moment} ({m.peak_phase.replace('_', ' ')}){where}", source)]
    terms += [(name.replace("_", " "), f"{_gib(value)} on {who} at its peak", "") for name, value in
              m.breakdown.to_dict().items() if value]
    replayed = _replay_terms(c, top, profile) if top is not None else []
    return terms + (replayed or [
        ("reserved", f"peak allocated {_gib(m.peak_allocated_bytes)} x (1 + fragmentation) + outside the allocator = "
         f"{_gib(m.peak_reserved_bytes)} of {_gib(c.cluster.gpu.memory_bytes)} (the largest rank's, as "
         "torchtitan reports the maximum across ranks)", "cost_models/allocator.py")])


def _replay_terms(c: Candidate, top, profile: Profile) -> list[tuple[str, str, str]]:
    """The headline rank's reserved from its allocator replay (top None: a pp = 1 step's), and the replay's segments
    at its reserved peak by stream and pool; [] where the candidate's reserved is not the replay's (the search's
    flat figure)."""
    from cost_models.caching_allocator import pool_words
    from cost_models.pipeline_allocations import rank_replay
    from cost_models.step_allocations import replays, step_replay

    if top is None and replays(c.model, c.training, c.config, c.config.shard_group_size(c.cluster)) is not None:
        return []
    replay = (step_replay(c.model, c.cluster, c.training, c.config) if top is None
              else rank_replay(c.model, c.cluster, c.training, c.config, top.rank))
    outside, held = c.memory.outside_allocator_bytes, top if top is not None else c.memory
    if outside + max(held.peak_allocated_bytes, replay.peak_reserved_bytes) != held.peak_reserved_bytes:
        return []
    conf = f"PYTORCH_CUDA_ALLOC_CONF={c.config.alloc_conf}" if c.config.alloc_conf else "PyTorch's default settings"
    whose = ("the step's" if top is None else "the rank's", "" if top is None
             else " (the largest rank's, as torchtitan reports the maximum)")
    terms = [("reserved", f"{whose[0]} allocations over two steps replayed through the caching allocator under "
              f"{conf}: peak reserved {_gib(replay.peak_reserved_bytes)} (allocated blocks at their peak "
              f"{_gib(replay.peak_allocated_bytes)}) + outside the allocator = {_gib(held.peak_reserved_bytes)} of "
              f"{_gib(c.cluster.gpu.memory_bytes)}{whose[1]}",
              f"cost_models/{'step' if top is None else 'pipeline'}_allocations.py (the walk), caching_allocator.py "
              "(c10's CUDACachingAllocator)")]
    terms += [("segments at the reserved peak", words, "") for words in pool_words(replay.segments_at_peak)]
    return terms


def explain_text(c: Candidate, profile: Profile = DEFAULT_PROFILE) -> str:
    """The memory terms, then the time terms (`profile`: the one c was costed with)."""
    lines = [f"Why {describe(c.config)} for {c.model.name} on {c.cluster.n_gpus} x {c.cluster.gpu.id}:",
             "", "Memory per GPU:"]
    for term, formula, source in memory_terms(c, profile):
        lines += [f"  {term}: {formula}"] + ([f"      source: {source}"] if source else [])
    lines += ["", "Time per optimizer step:"]
    for term, formula, source in time_terms(c, profile):
        lines += [f"  {term}: {formula}", f"      source: {source}"]
    lines += [f"  note: {n}" for n in c.memory.notes]
    return "\n".join(lines)


def explain_json(c: Candidate, chosen_by: str, profile: Profile = DEFAULT_PROFILE) -> str:
    """estimate's JSON of `c` with the same terms as explain_text under "explanation" (planner.schemas'
    ExplainOutput). chosen_by: "plan" (the planner's pick) or "flags" (the configuration given)."""
    import json

    def rows(terms):
        return [{"term": term, "formula": formula, "source": source} for term, formula, source in terms]

    return json.dumps({**estimate_dict(c, chosen_by=chosen_by),
                       "explanation": {"memory": rows(memory_terms(c, profile)), "time": rows(time_terms(c, profile))}},
                      indent=2)
