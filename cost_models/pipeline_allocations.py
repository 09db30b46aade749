"""A pipeline rank's ordered allocations and frees over two training steps, for the caching allocator replay.

    result = replay_rank(model, training, config, d, rank)        # caching_allocator.ReplayResult
    result.peak_reserved_bytes                                     # + the CUDA context = the rank's reserved peak
    replayed_reserved(memory, model, cluster, training, config, profile)   # a pipeline MemoryEstimate, replayed

Elsewhere the estimate's reserved is allocated x (1 + fragmentation). Under PP the trace's replay reserves 1.29-1.42
x its allocated peak (docs/accuracy.md, "At full size, pipelines"): microbatches' saved inputs and each backward's
recompute working set are freed in another order than they were made, and the large pool keeps segments later
requests do not fit. The walk follows torch's order of actions (pipeline_orders, as pipeline_memory.rank_memory
does) and writes, at the granularity the trace's events show (calibration/alloc_sequence.py, Llama shapes):
- one tensor per parameter (q, k, v, o, gate, up, down, two norms; what a block has beyond them as one more): the
  sharded parameters and the optimizer's states (kept), the unsharded parameters (FSDP2's copy-out, from a
  stage's first forward to its reduce; reshard_after_forward=False under PP) beside the all-gather output on the
  copy-in stream, each backward's compute-dtype weight gradients and the reduce-dtype sums they are added into;
- per microbatch and block, what its forward keeps (a checkpointed block: its input, its other tensors made and
  freed), in backward its recompute, its largest working set and the gradient passed down; the stage output in
  fwd_cache to its backward's end; the receive buffers (made at the first step, kept; a backward's output gradient
  is one); on the last stage the logits (to the step's end, then merged) and the loss's tensors (loss_memory.events:
  loss parallel's under TP);
- the reduce-scatter input (default stream) and output (the reduce-scatter stream, the sharded gradient until the
  optimizer step), unit by unit; the optimizer's foreach temporaries, one per parameter shard;
- FSDP2's dim-0 padding of each tensor in its shard, states, all-gather and reduce-scatter (dim0_padding_events.py);
  each unit unsharded at its pre-forward, the head's weight gradient made at its backward (pipeline_stage_events.py);
  a checkpointed Llama block (tp_block_events.py) and the final norm (final_norm_events.py) op by op.
Sizes are the ledger's (StagePieces), activations cut into tensors of the model's widths (f, q, kv, h in the compute
dtype). Coarser variants against the traces (docs/accuracy.md): parameters as one tensor per FSDP unit miss by 9%.

Not modelled: the split backward's I / W passes (priced as one backward at W), prefetching across stages, the CUDA
context (added by the caller); elsewhere a block's tensors are made in one sweep and freed in one.
"""

from __future__ import annotations

import dataclasses
import math

from . import loss_memory, moe, optimizer_step, pipeline_memory, tensor_parallel
from .caching_allocator import AllocatorSettings, ReplayResult, replay
from .dim0_padding_events import Dim0PaddingWalk
from .final_norm_events import FinalNormWalk
from .memory_types import MemoryEstimate
from .pipeline import rank_stages
from .pipeline_orders import active_stages, orders
from .pipeline_stage_events import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, StageUnitsWalk  # (streams: step_walk.py)
from .pipeline_stage_pieces import stage_pieces
from .replay_notes import replay_notes
from .specs import FsdpConfig, ModelSpec, TrainingSpec
from .tensor_cut import cut
from .tp_block_events import BlockWidths, applies, backward_events, forward_events, keyed
from .units import DTYPE_BYTES


def param_tensors(model: ModelSpec, block_params: int) -> list[int]:
    """A block's parameter tensors (elements): a Llama block's linears and norms, the rest (biases, experts) as one
    more; scaled to the block's count where the shapes overshoot it (TP slices, MoE counted otherwise)."""
    h, f, q, kv = model.hidden_size, model.ffn_hidden_size, model.q_dim, model.kv_dim
    shapes = [q * h, kv * h, kv * h, q * h] + [h * f] * (3 if model.gated_mlp else 2) + [h, h]
    total = sum(shapes)
    if total > block_params:
        shapes = [max(1, x * block_params // total) for x in shapes]
    rest = block_params - sum(shapes)
    return shapes + ([rest] if rest > 0 else [])


def replay_rank(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int, rank: int,
                settings: AllocatorSettings = AllocatorSettings(), snapshots: bool = False) -> ReplayResult:
    """Pipeline rank `rank`'s two training steps (d: the FSDP shard group) replayed under `settings`
    (snapshots: keep the segments at the reserved peak)."""
    return replay(rank_events(model, training, config, d, rank), settings, snapshots=snapshots)


def rank_replay(model: ModelSpec, cluster, training: TrainingSpec, config: FsdpConfig, rank: int,
                settings: AllocatorSettings | None = None, snapshots: bool = True) -> ReplayResult:
    """Pipeline rank `rank`'s replay as replayed_reserved runs it, from the whole model's specs (settings None:
    the config's alloc_conf); with its segments at the reserved peak unless snapshots is False."""
    local, training = pipeline_memory.rank_inputs(model, training, config)
    settings = config.allocator_settings if settings is None else settings
    return replay_rank(local, training, config, config.shard_group_size(cluster), rank, settings, snapshots)


def rank_events(model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int, rank: int,
                steps: int = 2) -> list[tuple]:
    """Pipeline rank `rank`'s allocations and frees over `steps` training steps (d: the FSDP shard group)."""
    walk = _PaddedRankWalk(model, training, config, d, rank)
    for step in range(steps):
        walk.step(first=step == 0)
    return walk.events


class _RankWalk:
    """One pipeline rank's schedule (pipeline_orders.orders), action by action, written as allocations and frees."""

    keeps_logits = True   # the last stage's logits stay in output_chunks to the step's end, then are merged
    late_post_backward = False  # weight_grads after the block's recompute and input go (pp = 1's post-backward)

    def __init__(self, model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int, rank: int):
        self.model, self.training, self.config, self.d, self.rank = model, training, config, d, rank
        self.c, self.p = DTYPE_BYTES[config.precision.compute_dtype], DTYPE_BYTES[config.precision.param_dtype]
        self.r = DTYPE_BYTES[config.gradient_reduce_dtype]
        self.m = config.pp_microbatches
        self.pieces = {st.index: stage_pieces(model, training, config, st) for st in rank_stages(model, config, rank)}
        self.units = {s: self._units(x) for s, x in self.pieces.items()}
        h, f, q, kv, c = model.hidden_size, model.ffn_hidden_size, model.q_dim, model.kv_dim, self.c
        self.tokens = config.micro_batch * training.seq_len
        self.widths = [x * c for x in [f] * (3 if model.gated_mlp else 2) + [q, kv, kv, q, h, h]]
        sp = config.tp if tensor_parallel.sequence_parallel(config) else 1
        self.hs = -(-h * c // sp)  # the residual stream per token (sequence parallel: on s / tp tokens)
        self.loss_events = loss_memory.events(c, config.loss_compiled, tensor_parallel.loss_parallel(config), model)
        # TP with sequence parallel, or no TP: a checkpointed Llama block op by op (tp_block_events), not one sweep
        self.block = BlockWidths.of(model, config, self.tokens) if applies(model, config) else None
        self.events: list[tuple] = []
        self.gathered: set[int] = set()
        self.accumulated: dict[int, set] = {s: set() for s in self.pieces}  # units holding reduce-dtype sums
        for s, units in self.units.items():  # model states, kept: sharded parameters; receive buffers (first step)
            for u, unit in enumerate(units):
                for i, n in enumerate(unit):
                    self.alloc(("param", s, u, i), math.ceil(n * self.p / d))
        for s, x in self.pieces.items():
            for mb in range(self.m):
                for end in (("in",) if not x.stage.embedding else ()) + (("grad_in",) if not x.stage.head else ()):
                    self.alloc(("recv", s, end, mb), self.tokens * self.hs)

    def alloc(self, key, size_bytes: int, stream=0) -> None:
        self.events.append(("alloc", key, int(size_bytes), stream))

    def free(self, key) -> None:
        self.events.append(("free", key))

    def transient(self, key, sizes, stream=0) -> None:
        for i, size in enumerate(sizes):
            self.alloc((key, i), size, stream)
        self.events += [("free", (key, i)) for i in range(len(sizes))]

    def tensors(self, per_token_bytes: int) -> list[int]:
        return [self.tokens * w for w in cut(per_token_bytes, self.widths)]

    def templated(self, x, j: int) -> bool:
        """Whether block j of stage x is written op by op (tp_block_events): checkpointed, keeping its input alone
        (a residual-stream tensor; none where it is the stage's receive buffer)."""
        return self.block is not None and x.checkpointed[j] and x.kept[j] in (0, self.hs)

    def recomputed(self, x, j: int) -> list[int]:  # checkpointed block j's recompute: what its forward saves
        return self.tensors(x.block_full)

    def inputs(self, x, j: int) -> list[int]:  # what block j keeps to its backward (templated: its input, whole)
        return [self.tokens * x.kept[j]] * bool(x.kept[j]) if self.templated(x, j) else self.tensors(x.kept[j])

    def _units(self, x) -> list[list[int]]:
        """The stage's FSDP units' parameter tensors: the root's (embedding, final norm, head) first, then blocks."""
        root = x.params - x.stage.n_blocks * x.block_params
        return ([[root]] if root else []) + [param_tensors(self.model, x.block_params)] * x.stage.n_blocks

    def unsharded(self, s: int, u: int) -> list[int]:
        """A unit's unsharded parameters in bytes: its all-gather output (StagePieces: the compute dtype, Float8
        linears' weights at 1 byte under the FP8 all-gather) over its tensors by their sizes."""
        x, unit = self.pieces[s], self.units[s][u]
        total = x.root_gathered if u == 0 and len(self.units[s]) > x.stage.n_blocks else x.block_gathered
        return [total * n // sum(unit) for n in unit]

    def reshard(self, s: int) -> None:
        if s in self.gathered:
            self.gathered.discard(s)
            for u, unit in enumerate(self.units[s]):
                for i in range(len(unit)):
                    self.free(("unsharded", s, u, i))

    def reduce(self, s: int) -> None:
        """perform_reduce_grad, unit by unit (root first), each unit's post_backward (torch 2.13 _fsdp_param_group.py:
        588-688): its unsharded parameters freed (reshard, :637-638), then foreach_reduce: the reduce-scatter input
        (default stream) takes the summed gradients, kept to the next unit's (reduce_scatter_states), its output (the
        reduce-scatter stream) the sharded gradient until the optimizer step."""
        gathered = s in self.gathered
        self.gathered.discard(s)
        for u, unit in enumerate(self.units[s]):
            self.events += [("free", ("unsharded", s, u, i)) for i in range(len(unit) if gathered else 0)]
            self.events += [("free", ("rs_in", s, u - 1))] * bool(u)
            self.alloc(("rs_in", s, u), sum(unit) * self.r)
            self.events += [("free", ("acc", s, u, i)) for i in range(len(unit))]
            self.alloc(("sharded_grad", s, u), math.ceil(sum(unit) * self.r / self.d) if self.d > 1 else 0,
                       REDUCE_SCATTER_STREAM)
        self.free(("rs_in", s, len(self.units[s]) - 1))
        self.accumulated[s].clear()

    def weight_grads(self, s: int, u: int, made: bool = False) -> None:
        """A unit's backward leaves compute-dtype gradients (made: already, by tp_block_events' products); its
        post-backward adds them into the reduce-dtype sums (made at the stage's first backward: with `made` in the
        trace's order, each sum beside its gradient, which goes at once)."""
        unit = self.units[s][u]
        if u == 0 and self.root_units(s):  # TP with sequence parallel: the embedding's gradient the whole table
            unit = [unit[0] + self.pieces[s].grad_extra] + unit[1:]
        first = u not in self.accumulated[s]
        self.accumulated[s].add(u)
        for i, n in enumerate(unit if not made else ()):
            self.alloc(("wgrad", s, u, i), n * self.c)
        for i, n in enumerate(unit if first else ()):
            self.alloc(("acc", s, u, i), n * self.r)
            self.events += [("free", ("wgrad", s, u, i))] * made
        self.events += [("free", ("wgrad", s, u, i)) for i in range(0 if made and first else len(unit))]

    def root_units(self, s: int) -> int:
        """1 where the stage has a root unit (embedding, final norm, head) before its blocks, else 0."""
        return 1 if len(self.units[s]) > self.pieces[s].stage.n_blocks else 0

    def pre_forward(self, s: int, u: int) -> None:
        """FSDP2's hooks around each unit: none inside a pipeline stage, gathered whole for the step
        (step_allocations.py gives them a plain FSDP step's unshard / reshard)."""

    post_forward = pre_backward = pre_forward

    def loss(self, events, s: int, mb: int) -> None:
        """The loss's tensors (loss_memory.events, V elements per token); the logits stay in output_chunks."""
        for kind, name, size in events:
            if name == "logits" and kind == "free" and self.keeps_logits:
                continue
            key = ("logits", s, mb) if name == "logits" else ("loss", name, s, mb)
            if kind == "alloc":
                self.alloc(key, self.tokens * self.model.vocab_size * size)
            else:
                self.free(key)

    def forward_pass(self, x, mb: int) -> None:
        """A microbatch's forward on a stage: each block's input kept (checkpointed: its other tensors made and freed),
        or all it saves; the stage output in fwd_cache; the root's saved tensors and the loss on the last stage."""
        s = x.stage.index
        root = self.root_units(s)
        out = None  # a templated block's output: the next block's kept input, or ("block_out", ...) until it is made
        for j in range(len(x.kept)):
            self.pre_forward(s, root + j)
            for t, size in enumerate(self.inputs(x, j) if out != ("saved", s, mb, j, 0) else ()):
                self.alloc(("saved", s, mb, j, t), size)
            self.events += [("free", out)] * (out is not None and out[0] == "block_out")
            out = None
            if self.templated(x, j):
                nxt = j + 1 < len(x.kept) and self.templated(x, j + 1) and x.kept[j + 1]
                # the stage's last block's output is the stage output (fwd_cache holds that tensor, no copy)
                last = j + 1 == len(x.kept) and x.output == self.tokens * self.hs
                out = ("saved", s, mb, j + 1, 0) if nxt else ("output", s, mb) if last else ("block_out", s, mb)
                self.events += keyed(forward_events(self.block), {"x": None, "out": out})
            elif x.checkpointed[j]:
                self.transient(("forward", s, mb, j), self.tensors(x.block_full))
            self.post_forward(s, root + j)
        self.stage_end(x, mb, out)

    def stage_end(self, x, mb: int, out) -> None:
        """After the blocks (out: the last one's, templated): the rest saved (rotary tables; final norm, labels)."""
        s = x.stage.index
        self.alloc(("rest", s, mb), x.saved - self.tokens * sum(x.kept) - x.output)
        if out != ("output", s, mb):
            self.alloc(("output", s, mb), x.output)
            self.events += [("free", out)] * (out is not None)
        if x.stage.head:
            self.loss(self.loss_events[0], s, mb)

    def backward_pass(self, x, mb: int) -> None:
        """Its backward: the loss's, then top block first its recompute (checkpointed), its largest working set
        (StagePieces.working), its weight gradients and the gradient passed down; its saved tensors freed as it ends."""
        s = x.stage.index
        if x.stage.head:  # (its output none: the logits are the loss's)
            self.free(("output", s, mb))
            self.loss(self.loss_events[1], s, mb)
        self.free(("rest", s, mb))
        root, grad_in = self.root_units(s), self.output_grad(x, mb)
        for j in reversed(range(x.stage.n_blocks)):
            self.pre_backward(s, root + j)
            if self.templated(x, j):  # its input freed in its first norm's backward, its output gradient before
                names = {"dy": grad_in, "x": ("saved", s, mb, j, 0) if x.kept[j] else None, "dx": ("grad_in", s, mb, j)}
                names |= {f"w{i}": ("wgrad", s, root + j, i) for i in range(9)}
                self.events += keyed(backward_events(self.block), names)
                self.weight_grads(s, root + j, made=True)
                grad_in = ("grad_in", s, mb, j)
                continue
            recomputed = self.recomputed(x, j) if x.checkpointed[j] else ()
            for t, size in enumerate(recomputed):
                self.alloc(("recompute", s, mb, j, t), size)
            self.transient(("backward", s, mb, j), self.tensors(max(0, x.working[j]) // self.tokens))
            if not self.late_post_backward:
                self.weight_grads(s, root + j)
            self.events += [("free", ("recompute", s, mb, j, t)) for t in range(len(recomputed))]
            self.events += [("free", ("saved", s, mb, j, t)) for t in range(len(self.inputs(x, j)))]
            self.alloc(("grad_in", s, mb, j), self.tokens * self.hs)
            self.events += [("free", grad_in)] * (grad_in is not None)
            if self.late_post_backward:
                self.weight_grads(s, root + j)
            grad_in = ("grad_in", s, mb, j)
        self.root_backward(s, grad_in)
        if not x.stage.head:  # the stage output (fwd_cache) goes as backward_one_chunk returns (stage.py:964-966)
            self.free(("output", s, mb))

    def output_grad(self, x, mb: int):
        """The last block's output gradient: the last stage's made here, else the receive buffer (stage.py
        _retrieve_recv_grads, kept: None)."""
        if x.stage.head:
            self.alloc(("grad_in", x.stage.index, mb, x.stage.n_blocks), self.tokens * self.hs)
            return "grad_in", x.stage.index, mb, x.stage.n_blocks

    def root_backward(self, s: int, grad_in) -> None:
        """The stage root's backward (the embedding's) from the gradient `grad_in`: its weight gradient made, grad_in
        freed as autograd ends, then the root's post-backward (the final callback) adds it into the sum."""
        start = len(self.events)
        if self.root_units(s):
            self.weight_grads(s, 0)  # (the root is one tensor: its gradient's allocation the first event)
        self.events.insert(start + bool(self.root_units(s)), ("free", grad_in))

    def step(self, first: bool) -> None:
        """One schedule step (torch's order; a multi-stage rank keeps the stages ahead gathered), the merge of the
        logits, then the optimizer step: its states made at the first, foreach temporaries, gradients dropped."""
        config, m = self.config, self.m
        actions = orders(config.pp_schedule, config.pp, config.pp_stages_per_rank, m)[self.rank]
        kept_ahead = active_stages(config.pp_schedule, config.pp, config.pp_stages_per_rank, m, self.rank) \
            if len(self.pieces) > 1 else ()
        for i, (s, kind, mb) in enumerate(actions):
            if kept_ahead and self.gathered != kept_ahead[i]:
                for other in sorted(self.gathered - kept_ahead[i]):
                    self.reshard(other)
                self.gather(kept_ahead[i])
            if kind == "F":
                self.gather((s,))
                self.forward_pass(self.pieces[s], mb)
            elif kind != "I":  # B, or W (split backward: the whole backward priced at W)
                self.backward_pass(self.pieces[s], mb)
                if mb == m - 1:
                    self.reduce(s)
        for s, x in self.pieces.items():  # the last stage's step returns its logits merged (a copy beside them)
            if x.stage.head:
                self.alloc(("merged", s), m * x.logits)
                for mb in range(m):
                    self.free(("logits", s, mb))
                self.free(("merged", s))
        self.optimizer_step(first)

    def optimizer_step(self, first: bool) -> None:
        """The optimizer step: its states made at the first, foreach temporaries, the sharded gradients dropped."""
        config, pieces, training = self.config, self.pieces.values(), self.training
        total = sum(x.params for x in pieces)
        per_param = training.optimizer.state_bytes_per_param(config.precision.param_dtype)
        n_states = 2 if per_param >= 2 * self.p else 1  # AdamW's exp_avg and exp_avg_sq, each a tensor
        shards = [(s, u, i, n) for s, units in self.units.items() for u, unit in enumerate(units)
                  for i, n in enumerate(unit)]
        if first:
            for s, u, i, n in shards:
                for k in range(n_states):
                    self.alloc(("state", s, u, i, k), math.ceil(n * per_param / n_states / self.d))
        temporaries = optimizer_step.step_temporary_bytes(
            self.model, training, config.precision, self.d, total, embedding=any(x.stage.embedding for x in pieces),
            head=any(x.stage.head for x in pieces))
        # foreach ops make one temporary per parameter shard: the step's temporaries in proportion to the shards
        self.transient(("optimizer", first), [temporaries * n // total for *_, n in shards])
        for s, units in self.units.items():
            for u in range(len(units)):
                self.free(("sharded_grad", s, u))
            self.accumulated[s].clear()


class _PaddedRankWalk(Dim0PaddingWalk, StageUnitsWalk, FinalNormWalk, _RankWalk):
    """The rank's walk: its stages' unshards and head gradient (pipeline_stage_events.py), the final norm
    (final_norm_events.py), FSDP2's dim-0 padding of their tensors (dim0_padding_events.py)."""

    def _units(self, x) -> list[list[int]]:
        """A sparse block's stacked experts padded too (moe.py; StagePieces.block_padding), on param_tensors' rest."""
        units, model = super()._units(x), self.model
        extra = moe.block_gathered_elements(model, self.d, bool(self.config.expert_shard_dim)) - model.block_params
        for u in range(len(units) - x.stage.n_blocks, len(units)) if extra else ():
            units[u] = units[u][:-1] + [units[u][-1] + extra]
            added = self.padding_added.setdefault((x.stage.index, u), [0] * len(units[u]))
            added[-1] += extra
        return units


def replayed_reserved(memory: MemoryEstimate, model: ModelSpec, cluster, training: TrainingSpec, config: FsdpConfig,
                      profile, settings: AllocatorSettings | None = None) -> MemoryEstimate:
    """A pipeline estimate (pipeline_memory.pipeline_estimate) with each rank's reserved peak from its replay, plus
    the memory outside the allocator (memory.outside_allocator), in place of allocated x (1 + fragmentation): never
    below the rank's allocated peak. Run for the candidates reported, not inside the search (a 405B pp 8 estimate
    replays 8 ranks, their TP blocks op by op: ~2.5 s of CPU). settings None: the config's own (its alloc_conf,
    PYTORCH_CUDA_ALLOC_CONF).

    Whether it fits stays the flat rule's (evaluate.py), on purpose: under memory pressure c10's allocator does
    not fail where the replay would map a new segment - malloc first frees cached blocks of the pool
    (release_available_cached_blocks), then every unused segment (release_cached_blocks, as empty_cache), and
    retries cudaMalloc before raising OutOfMemoryError (c10/cuda/CUDACachingAllocator.cpp). So the replay is
    the reserved figure a run shows with room to spare, and above the GPU's memory a warning (slower steps from
    cudaFree / cudaMalloc), not a refusal."""
    if not memory.pipeline_ranks:
        return memory
    settings = config.allocator_settings if settings is None else settings
    ranks = tuple(dataclasses.replace(r, peak_reserved_bytes=memory.outside_allocator_bytes + max(
        r.peak_allocated_bytes, rank_replay(model, cluster, training, config, r.rank, settings, False)
        .peak_reserved_bytes)) for r in memory.pipeline_ranks)
    top = max(ranks, key=lambda r: r.peak_reserved_bytes)
    notes = replay_notes(memory, top.peak_reserved_bytes, f" (pipeline rank {top.rank}): each rank's allocations",
                         settings, profile, cluster.gpu.memory_bytes)
    return dataclasses.replace(memory, peak_reserved_bytes=top.peak_reserved_bytes, pipeline_ranks=ranks,
                               notes=memory.notes + notes)
