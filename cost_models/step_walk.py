"""The pp = 1 step walk: FSDP2's unshard / reshard / reduce-scatter around each unit, microbatch after microbatch
(step_allocations.py composes it with its mixins and replays its events).

A step without a pipeline is a one-stage pipeline whose microbatches (gradient accumulation) run forward then
backward one after another: pipeline_allocations._RankWalk writes the tensors (the same StagePieces, parameters per
tensor, activations cut into the model's widths, the loss's events, the optimizer's foreach temporaries), and this
walk gives it FSDP2's hooks around each unit (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, torch 2.13),
where a pipeline stage stays gathered for the step:
- the root (embedding, final norm, head) unsharded at each microbatch's forward and kept to its post-backward, but
  where its explicit reshard_after_forward reshards it after forward and its pre-backward gathers it again
  (root_regather.py);
- a block's pre-forward all-gathers it (input on the default stream, output on the copy-in stream, copied out into
  its unsharded parameters; the previous unit's all-gather output freed once this unit is copied out) and its
  post-forward reshards it (FULL_SHARD; SHARD_GRAD_OP keeps it gathered to its backward; reshard_after_forward=N
  keeps an N-way shard);
- backward: the root's pre-backward prefetches the last block; a block's pre-backward copies it out (its all-gather
  output freed at once: wait_for_unshard defers the free in forward only) and prefetches the block below; its
  post-backward reshards it, then reduce-scatters its gradients (reduce_scatter: input on the default stream, output
  on the reduce-scatter stream);
- the logits freed in forward (the loop drops the model output before backward: loss_memory.loss_events); the
  head's and final norm's gradients made at the head's backward and kept to the root's post-backward, which runs
  once autograd is done (block 0's input gradient and eager attention's checkpointed mask gone by then).
"""

from __future__ import annotations

import dataclasses
import math

from . import activations, kernels, tensor_parallel
from .edge_unit_events import EdgeUnitsWalk
from .loss_kernel_events import LossKernelWalk, loss_kernel_events
from .pipeline_allocations import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, _RankWalk
from .specs import FsdpConfig, LossKernel, ModelSpec, Sharding, TrainingSpec


class StepWalk(LossKernelWalk, EdgeUnitsWalk, _RankWalk):
    """A pp = 1 rank: microbatch after microbatch, FSDP2's unshard / reshard / reduce-scatter around each unit."""

    keeps_logits = False
    late_post_backward = True  # the post-backward hook runs once autograd is done with the block (its grad_in made)

    def __init__(self, model: ModelSpec, training: TrainingSpec, config: FsdpConfig, d: int, rank: int):
        super().__init__(model, training, config, d, rank)
        self.m = config.grad_accum
        self.stage = next(iter(self.pieces))
        # as memory.py holds them: a checkpointed block's input once (its first norm's saved input, where it is that
        # tensor) and the rotary tables to block 0's backward (freed with the mask, not with the root's saved tensors)
        x = self.pieces[self.stage]
        self.pieces[self.stage] = dataclasses.replace(x, block_full=x.recomputed, saved=x.saved - x.shared)
        self.shared = x.shared
        self.keeps_gathered = config.sharding in (Sharding.SHARD_GRAD_OP, Sharding.HYBRID_SHARD_ZERO2)
        self.partial = 0 if self.keeps_gathered else config.reshard_after_forward  # an N-way shard kept
        self.pending: tuple | None = None   # the last all-gather output, freed once the next unit is copied out
        self.prefetched: set[int] = set()   # units whose all-gather was issued ahead (backward prefetch)
        self.rs_in: tuple | None = None     # the last reduce-scatter input, freed at the next post-backward
        self.has_grad: set[int] = set()     # units holding their sharded gradient this step
        self.made: dict[int, set] = {}      # a block's gradients made at its backward's moment (transient)
        self.gathered_units: set[int] = set()
        self.partials: set[int] = set()     # units keeping an N-way shard from forward to backward
        self.gathers_logits = config.tp > 1 and not tensor_parallel.sequence_parallel(config)
        # eager attention's causal mask, kept by checkpointing for the recompute (memory_shape.py's shared bytes)
        k = 1 if config.selective_op_ac else config.ac_every
        self.mask = k and activations.eager_mask_bytes(model, self.c, training.seq_len, config.micro_batch,
                                                       config.attention)
        # a loss kernel (Liger, the chunked loss): its own tensors in whole bytes, the head's weight gradient among them
        self.loss_kernel = kernels.memory_kernels(config).loss is not LossKernel.EAGER
        if self.loss_kernel:
            self.loss_events = loss_kernel_events(model, self.c, config, self.tokens)
        self.init_edges(model, x, d)
        # the root's post-forward reshards it, its pre-backward gathers it again (root_regather.py)
        self.root_regathers = not self.keeps_gathered and d > 1 and not self.edges

    def stored_width(self, s: int, u, i: int) -> int | None:
        return self.p  # full fine-tuning: every parameter trained, stored in the param dtype (LoraWalk: its own)

    def unsharded(self, s: int, u) -> list[int]:
        return [self.edge_bytes[u]] if isinstance(u, str) else super().unsharded(s, u)

    def grad_bytes(self, s: int, u) -> list[int]:
        """Unit u's compute-dtype gradients in bytes, one per tensor (MoeWalk: unpadded where its shards are padded)."""
        return [n * self.c for n in self.units[s][u]]

    def all_gather(self, u) -> None:
        s = self.stage
        size = sum(self.unsharded(s, u))
        self.alloc(("all_gather_in", s, u), math.ceil(size / self.d))
        self.alloc(("all_gather", s, u), size, ALL_GATHER_STREAM)
        self.free(("all_gather_in", s, u))
        self.prefetched.add(u)

    def unshard(self, u, backward: bool = False) -> None:
        """Wait for the unit's all-gather (issued now unless prefetched), copy it out; in forward free the previous
        unit's output (its free deferred past this copy-out), in backward this one's at once (wait_for_unshard)."""
        if u in self.gathered_units:
            return
        s = self.stage
        if u not in self.prefetched:
            self.all_gather(u)
        self.prefetched.discard(u)
        if u in self.partials:
            self.free(("partial", s, u))
            self.partials.discard(u)
        for i, size in enumerate(self.unsharded(s, u)):
            self.alloc(("unsharded", s, u, i), size)
        self.gathered_units.add(u)
        if self.pending is not None:
            self.free(self.pending)
        self.pending = ("all_gather", s, u)
        if backward:
            self.free(self.pending)
            self.pending = None

    def reshard_unit(self, u) -> None:
        s = self.stage
        for i in range(len(self.unsharded(s, u))):
            self.free(("unsharded", s, u, i))
        self.gathered_units.discard(u)

    def pre_forward(self, s: int, u: int) -> None:
        # a block's copy-out beside what the forward holds (memory.py's "forward all-gather copy-out" moments): block 0
        # the embedding's output (forward_pass writes it as block 0's input after this hook), a later block its input
        # and the embedding's output (transformers' inputs_embeds, held apart; d > 1 without SP, as the ledger's)
        root = self.root_units(s)
        sp = tensor_parallel.sequence_parallel(self.config)
        held = 1 if u == root > 0 else 2 * (u > root and self.d > 1 and not sp)
        for i in range(held):
            self.alloc(("held", s, i), self.tokens * self.hs)
        self.unshard(u)
        self.events += [("free", ("held", s, i)) for i in range(held)]

    def post_forward(self, s: int, u: int) -> None:
        if self.keeps_gathered:
            return
        self.reshard_unit(u)
        if self.partial:
            self.alloc(("partial", s, u), math.ceil(sum(self.unsharded(s, u)) / self.partial))
            self.partials.add(u)

    def pre_backward(self, s: int, u: int) -> None:
        self.unshard(u, backward=True)
        below = u - 1
        if below >= self.root_units(s) and below not in self.gathered_units:
            self.all_gather(below)
        elif below == 0 and self.edges and "emb" not in self.gathered_units:  # block 0 prefetches the embedding
            self.all_gather("emb")

    def transient(self, key, sizes, stream=0) -> None:
        """A block's backward working set (key ("backward", s, mb, j)) amid its compute-dtype gradients: those alive
        at its largest moment (StagePieces.blocks: fc2's at the MLP's, the MLP's and o's at the attention's, the
        MLP's at the norm's; taken in backward order, down first) before it, the rest at its post-backward (once its
        recomputed tensors and input are freed, as autograd frees them on the way)."""
        if key[0] != "backward":
            return super().transient(key, sizes, stream)
        _, s, _, j = key
        x, u = self.pieces[s], self.root_units(s) + j
        left = x.blocks[x.stage.n_blocks - 1 - j][0][1]  # bytes of gradients at the moment
        early = self.early_grads(s, u, left, range(len(self.grad_bytes(s, u))))
        # the working set's incoming gradient (activations_backward's c*h) is the walk's grad_in, alive already
        super().transient(key, self.tensors(max(0, x.working[j] // self.tokens - self.hs)), stream)
        self.made[u] = early

    def early_grads(self, s: int, u, left: int, among) -> set[int]:
        """Unit u's gradients (indices among `among`) made before a backward moment of `left` gradient bytes: taken
        in backward order (down, up, gate, o, v, k, q, then the norms), each that fits, allocated now."""
        grads = self.grad_bytes(s, u)
        early = []
        for i in sorted(among, key=lambda i: (i >= 7, -i)):
            if grads[i] <= left:
                early.append(i)
                left -= grads[i]
        for i in early:
            self.alloc(("wgrad", s, u, i), grads[i])
        return set(early)

    def weight_grads(self, s: int, u: int, made: bool = False) -> None:
        """The unit's compute-dtype gradients (made: already, by tp_block_events' products or, the root's, by
        head_backward and root_backward; a block's made at its backward's moment by transient, the rest now), then its
        post-backward: reshard, then reduce-scatter."""
        unit = self.root_grads(s) if u == 0 and self.root_units(s) else self.grad_bytes(s, u)
        early = self.made.pop(u, ())
        for i, n in enumerate(unit if not made else ()):
            if i not in early:
                self.alloc(("wgrad", s, u, i), n)
        self.reshard_unit(u)  # post_backward reshards before foreach_reduce (_fsdp_param_group.py:637-638)
        grads = self.root_keys if u == 0 and self.root_units(s) else [("wgrad", s, u, i) for i in range(len(unit))]
        self.reduce_scatter(s, u, sum(self.units[s][u]), grads)

    def reduce_scatter(self, s: int, u, n: int, grads, kept: bool = False, shard_unit=None) -> None:
        """foreach_reduce of unit u's n gradient elements: the previous input freed (FSDP2 keeps it to the next), this
        one's (reduce dtype), the gradients `grads` (keys) freed (kept: after the output, edge_units.py), the output the
        sharded gradient (keyed by shard_unit, default u) or, at a later microbatch, added into it and freed."""
        if self.rs_in is not None:
            self.free(self.rs_in)
        self.rs_in = ("rs_in", s, u)
        self.alloc(self.rs_in, n * self.r)
        for key in () if kept else grads:
            self.free(key)
        later = u in self.has_grad
        output = ("new_grad", s, u) if later else ("sharded_grad", s, u if shard_unit is None else shard_unit)
        if self.r != self.p:  # the output cast to the parameters' dtype, the reduce-dtype one freed (torch 2.13
            # _fsdp_collectives.py:696 _to_dtype_if_needed(reduce_output, orig_dtype)): the sharded gradient's bytes
            self.alloc(("rs_out", s, u), math.ceil(n * self.r / self.d), REDUCE_SCATTER_STREAM)
        self.alloc(output, math.ceil(n * self.p / self.d), REDUCE_SCATTER_STREAM)
        if self.r != self.p:
            self.free(("rs_out", s, u))
        for key in grads if kept else ():
            self.free(key)
        if later:
            self.free(output)
        self.has_grad.add(u)

    def root_grads(self, s: int) -> list[int]:
        """The root's gradients in bytes (compute dtype): wgrad 0 the head's and the final norm's (tied: the norm's),
        wgrad 1 the embedding's rows (tied: the head's, the one table)."""
        emb = min(self.model.embedding_params, self.units[s][0][0])
        return [(self.units[s][0][0] - emb) * self.c, emb * self.c]

    def loss(self, events, s: int, mb: int) -> None:
        """The loss's tensors; after its backward the head's: its gradients (and the final norm's, the table's rows
        when tied) kept to the root's post-backward (memory.py's head_grad at every block's moment)."""
        if events is self.loss_events[0] and self.edges:  # the head's unit gathered, then the root's post-forward
            self.unshard("head")
            self.free(self.pending)
            self.pending = None
        if events is self.loss_events[0] and self.gathers_logits:
            self.gathered_logits(events, s, mb)
            return
        if self.loss_kernel:
            self.kernel_loss(events, s, mb)
        else:
            self.model_loss(events, s, mb)
        if self.edges:
            self.edge_head_backward(events, s)
            return
        if events is not self.loss_events[1] or not self.root_units(s):
            return
        head, emb = self.root_grads(s)
        if self.loss_kernel and not self.model.tied_embeddings:  # the rest of the root's (the final norm's)
            head -= self.model.vocab_size * self.model.hidden_size * self.c
        self.alloc(("wgrad", s, 0, 0), head)
        if self.model.tied_embeddings and not self.loss_kernel:
            self.alloc(("wgrad", s, 0, 1), emb)

    def model_loss(self, events, s: int, mb: int) -> None:
        """The model's own loss (loss_memory.events); a compiled loss's backward runs before the root's pre-backward
        hook on the logits, which fires beside their gradient (its last free)."""
        if events is self.loss_events[1] and self.root_units(s) and self.root_regathers and self.config.loss_compiled:
            _RankWalk.loss(self, events[:-1], s, mb)
            self.root_pre_backward(s)
            events = events[-1:]
        _RankWalk.loss(self, events, s, mb)

    def gathered_logits(self, events, s: int, mb: int) -> None:
        """TP without sequence parallel (transformers' tp_plan, the head column-wise with its output gathered): the
        rank's vocab / tp logits, all_gather_into_tensor's output and the cat of its chunks along the vocabulary (the
        logits), then the loss's other tensors; the trace's order (benchmarks/memory_accuracy.py's qwen2-tp tp 4 no-SP
        row: 39.06, 156.25, 156.25 MiB before the fp32 copy)."""
        c, v = self.c, self.model.vocab_size
        self.alloc(("head shard", s, mb), self.tokens * -(-v // self.config.tp) * c)
        self.alloc(("head gathered", s, mb), self.tokens * v * c)
        super().loss(events[:1], s, mb)
        self.free(("head gathered", s, mb))
        self.free(("head shard", s, mb))
        super().loss(events[1:], s, mb)

    def root_backward(self, s: int, grad_in) -> None:
        """The embedding's backward from block 0's input gradient (grad_in), then the root's post-backward. Block 0's
        all-gather output is gone by then (freed at its copy-out in backward: _fsdp_param_group.py
        wait_for_unshard), and so is eager attention's mask, block 0's recompute input; grad_in goes as autograd ends, before the post-backward (the final callback). The
        embedding's gradient: its rows (untied; tied, added into the head's in place: its transient not written, as
        memory.py's "end of backward"), or under TP with sequence parallel the whole table first
        (embedding_table_grad)."""
        if self.pending is not None:
            self.free(self.pending)
            self.pending = None
        self.free(("mask", grad_in[2]))  # grad_in: ("grad_in", s, mb, 0)
        if self.edges:
            self.edge_embedding_backward(s, grad_in)
            return
        self.root_keys = [("wgrad", s, 0, 0), ("wgrad", s, 0, 1)]  # the root's gradients' keys (wgrad 1: its last)
        if self.loss_kernel and not self.model.tied_embeddings:  # the head's weight gradient, made by the loss kernel
            self.root_keys.insert(1, ("wgrad", s, 0, 2))
        if not self.root_units(s):
            self.free(grad_in)
            return
        if self.pieces[s].grad_extra:
            self.embedding_table_grad(s, grad_in)
        else:
            if not self.model.tied_embeddings:
                self.alloc(("wgrad", s, 0, 1), self.root_grads(s)[1])
            self.free(grad_in)
        self.weight_grads(s, 0, made=True)

    def embedding_table_grad(self, s: int, grad_in, rows_key=None) -> None:
        """TP with sequence parallel: the embedding's gradient as memory.py's "embedding backward" moments hold it
        (tensor_parallel.embedding_grad_extra_params): its output gradient (grad_in) all-gathered over the sequence,
        the whole V x h table it makes, grad_in freed, the rank's rows copied out of the table (untied: at the
        post-backward's redistribute to Shard(0), wgrad 1; tied: AccumulateGrad's copy of them and its sum with the
        head's rows, which replaces them), then the table freed. rows_key: the rows' key (an edge unit's gradient)."""
        c, (_, rows), tied = self.c, self.root_grads(s), self.model.tied_embeddings
        self.alloc(("embedding grad gathered", s), self.tokens * self.model.hidden_size * c)
        self.alloc(("embedding table grad", s), rows + self.pieces[s].grad_extra * c)
        self.free(("embedding grad gathered", s))
        self.free(grad_in)
        self.alloc(rows_key or ("embedding rows", s), rows)
        if rows_key is None:
            self.root_keys[1] = ("embedding rows", s)
        if tied:
            self.alloc(("embedding rows sum", s), rows)
            self.free(("embedding rows", s))
            self.free(("wgrad", s, 0, 1))
            self.root_keys[1] = ("embedding rows sum", s)
        self.free(("embedding table grad", s))

    def root_pre_backward(self, s: int) -> None:
        """The root's pre-backward: the root gathered again (root_regathers), then the last block prefetched."""
        root, last = self.root_units(s), len(self.units[s]) - 1
        if root and self.root_regathers:
            self.unshard(0, backward=True)
        if last >= root and last not in self.gathered_units and not self.edges:
            self.all_gather(last)

    def step(self, first: bool) -> None:
        s, x = self.stage, self.pieces[self.stage]
        root = self.root_units(s)
        for mb in range(self.m):
            if root and self.edges:
                self.edge_embedding_forward()
            elif root:
                self.unshard(0)
            self.alloc(("mask", mb), self.mask + self.shared)  # freed with block 0's saved inputs (root_backward)
            self.forward_pass(x, mb)
            if self.pending is not None:  # the root's post-forward frees the last all-gather output
                self.free(self.pending)
                self.pending = None
            if root and self.root_regathers:
                self.reshard_unit(0)
            if not (root and self.root_regathers and self.config.loss_compiled):  # a compiled loss's: after its backward
                self.root_pre_backward(s)
            self.backward_pass(x, mb)
            if self.pending is not None:
                self.free(self.pending)
                self.pending = None
            if self.rs_in is not None:  # the final callback waits for the last reduce-scatter
                self.free(self.rs_in)
                self.rs_in = None
        self.has_grad.clear()
        self.optimizer_step(first)
