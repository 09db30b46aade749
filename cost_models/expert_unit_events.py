"""The step walk's expert parallelism at pp = 1 (step_allocations' full fine-tuning walk; a mixin ahead of the others):
each sparse block's routed experts an FSDP unit of their own on the efsdp mesh, as transformers' EP path runs them
(calibration/expert_parallel.py: the experts module `fully_shard`ed over efsdp = dp_shard x cp x tp / ep inside the
block's unit on dp_shard x cp; expert_parallel.py prices it).

The rank's model is expert_parallel.rank_view's: its E / ep experts stacked. A sparse block's parameter tensors are
moe_events.moe_block_tensors' with the stacked expert tensors as the ledger's shard counts hold them (the efsdp shard,
its rows padded to efsdp x ceil(E / ep / efsdp), scaled by d), so that the sharded parameters, optimizer states and
the optimizer's foreach temporaries (/ d) are the ledger's (ExpertParallelView.param_counts). The block's unit
gathers and reduces the rest (router padded at d); the experts' unit ("experts", u) gathers E / ep rows padded at
efsdp and reduces them over efsdp. FSDP2's hooks in the trace's order (memory_accuracy.py --mesh --only ep, row 1's
allocation events; torch 2.13 _fsdp_state.py / _fsdp_param_group.py):
- forward: the block's pre-forward gathers it; the experts' pre-forward (inside the MLP, after the router) gathers
  them and frees the block's all-gather output (the deferred free of the previous unit's); their post-forward
  reshards them; the next block's copy-out frees the experts' all-gather output (the last one's: the root's
  post-forward, after the loss: the ledger's "loss in forward");
- backward: prefetch follows the post-forward order reversed (block i, experts i, block i-1, ...): block i's
  pre-backward prefetches its experts, the experts' pre-backward (the MLP's backward starts with them) prefetches
  block i-1. The MLP's moments (the MoE backward_moments before experts_done) with the experts gathered and their
  gradients made; the experts' post-backward reshards them and reduce-scatters their gradients (reduce dtype, input
  kept to the next reduce-scatter, output the efsdp shard); then the block's other moments (the attention's, the
  norm's: experts_done), its gradients, its post-backward. The walk writes a block's forward in one sweep, so the
  experts' forward hooks run at its end (a checkpointed block's no-grad forward before its experts are gathered, less
  its MoE MLP's bytes: made with the experts gathered, cut as the trace's routed rows, routed_tensors; under EP as
  AllToAllEP's dispatch / experts / combine make them, ep_forward_events, whose saved tensors cut its recompute and
  whose working set goes ahead of a non-checkpointed block's MLP saved tensors).
  On an efsdp group of one rank the experts are copied out parameter by parameter (OneRankWalk's unshard).
The saved tensors and moments are the ledger's (memory_shape.ledger_shape with the EP view: the dispatch / combine's
saved bytes per routed row, ExpertParallelView.backward_moments; a traced block profile's moments where the model has
one, with the experts gathered). After the experts' post-backward FSDP2 has freed their gradients (copied into the
reduce-scatter input) and made their new shard: the walk's later moments hold the block's others only, as memory.py
does (expert_unit_terms.py). The MoE MLP's saved tensors (moe.mlp_bytes_per_token) go as the trace frees them
(planner.tracing.trace's allocation events, mixtral-blocks EP 8 on 512, bf16, no AC: test_ep_step_allocations.py;
docs/accuracy.md "2026-12-08: the MLP's saved tensors in the experts' backward"): the routed rows' made inside the
experts' forward (after their all-gather) and freed in their backward, before their reshard and reduce-scatter; the
router's made before the experts' all-gather and freed after that reduce-scatter (the router's backward follows the
experts'), before the post-attention norm's backward - where the ledger's later moments have them freed; a
checkpointed block's beside them too (every-2). Not apart (to the block's end, as before): a checkpointed block's (its
recompute keeps the MLP's whole), a traced block profile's saved bytes, the dispatch / combine's (the ledger keeps them
too). Without EP the experts' forward ends with the un-permute's working set (forward_unpermute).
Experts as units of their own without EP (FsdpConfig.expert_units) are this walk at efsdp = d, the model unsliced.
A dense block (DeepSeek's leading, Llama 4's interleaved) has no experts: MoeWalk's unit, StepWalk's backward.
The FSDP2 hooks are ExpertUnitsHooks, what the trained experts add ExpertUnitsWalk; under LoRA (frozen experts, no
EP) lora_expert_unit_events.LoraExpertUnitsWalk composes the hooks with its own. Not here (step_allocations.replays
keeps the flat rule, moe_events.moe_flat_reason): expert units with CPU offload, EP with LoRA, experts sharded on
dim 1.
"""

from __future__ import annotations

import contextlib

from . import context_parallel, moe
from .ep_forward_events import ep_no_grad_forward_plan, ep_saved_widths, plan_peak
from .expert_parallel import rank_view
from .memory_shape import ledger_shape
from .moe_events import expert_indices, moe_block_tensors
from .spec_values import MoeDispatch
from .tensor_cut import cut


class ExpertUnitsHooks:
    """FSDP2's hooks for each sparse block's experts as a unit of their own over efsdp (ep > 1 or expert_units): their
    shard, all-gathers, reshard and prefetch order around the block's, and the block's backward moments. What the
    experts' training adds: ExpertUnitsWalk (trained), lora_expert_unit_events.LoraExpertUnitsWalk (frozen)."""

    mlp_apart_blocks: frozenset = frozenset()   # blocks whose MLP saved tensors go apart (ExpertUnitsWalk's)

    def __init__(self, model, training, config, d: int, rank: int):
        self.expert_units = model.moe is not None and (config.ep > 1 or config.expert_units
                                                       and not config.expert_shard_dim)
        self.ep_view = rank_view(model, config, d, training) if self.expert_units and config.ep > 1 else None
        if self.expert_units:
            model = self.ep_view.model if self.ep_view is not None else model
            self.expert_index = expert_indices(model)
            self.efsdp = self.ep_view.efsdp if self.ep_view is not None else d  # (without EP: over d, padded)
        super().__init__(model, training, config, d, rank)
        if not self.expert_units:
            return
        gathered = moe_block_tensors(model, model.block_params, self.efsdp)
        self.experts_bytes = [gathered[i] * self.c for i in self.expert_index]
        self.experts_forward: list[int] = []   # a checkpointed block's no-grad MLP tensors (at its experts' forward)

    def _units(self, x) -> list[list[int]]:
        units = super()._units(x)
        if not self.expert_units:
            return units
        efsdp = self.efsdp
        gathered = moe_block_tensors(self.model, x.block_params, efsdp)
        blocks = []
        for j, unit in enumerate(units[len(units) - x.stage.n_blocks:]):
            unit = list(unit)
            for i in self.expert_index if x.stage.first_block + j not in self.dense else ():
                unit[i] = gathered[i] // efsdp * self.d  # the efsdp shard scaled by d: / d it is the rank's shard
            blocks.append(unit)
        return units[:len(units) - x.stage.n_blocks] + blocks

    def is_block(self, u) -> bool:
        """Whether unit u is a sparse block's (its experts a unit of their own; MoeWalk's dense blocks are not)."""
        return self.expert_units and self.sparse_unit(self.stage, u)

    @contextlib.contextmanager
    def _experts_group(self):
        """The experts' collectives: over efsdp ranks in place of d."""
        d, self.d = self.d, self.efsdp
        try:
            yield
        finally:
            self.d = d

    def unsharded(self, s: int, u) -> list[int]:
        if isinstance(u, tuple):  # ("experts", block unit)
            return self.experts_bytes
        sizes = super().unsharded(s, u)
        return [n for i, n in enumerate(sizes) if i not in self.expert_index] if self.is_block(u) else sizes

    def all_gather(self, u) -> None:
        if not isinstance(u, tuple):
            return super().all_gather(u)
        with self._experts_group():
            super().all_gather(u)

    def unshard(self, u, backward: bool = False) -> None:
        """The experts' wait_for_unshard over efsdp; on an efsdp group of one rank (OneRankWalk's copies, no
        all-gather output) the forward's deferred all-gather output (the block's) freed first (_fsdp_param_group.py
        wait_for_unshard: the previous all_gather_state dropped before the copy-out, no new one at world size 1)."""
        if not isinstance(u, tuple) or u in self.gathered_units:
            return super().unshard(u, backward)
        with self._experts_group():
            if self.d == 1 and self.pending is not None:
                self.free(self.pending)
                self.pending = None
            super().unshard(u, backward)

    def post_forward(self, s: int, u) -> None:
        """The experts' pre-forward and post-forward at the block's end (the walk writes a block's forward in one
        sweep: a checkpointed block's forward but its MoE MLP's before its experts are gathered), then the block's
        post-forward."""
        if self.is_block(u):
            self.mlp_saved_tensors(s, u, "router")
            self.unshard(("experts", u))
            self.mlp_saved_tensors(s, u, "experts")
            self.forward_unpermute(s, u)
            if not self.keeps_gathered:
                self.reshard_unit(("experts", u))
        super().post_forward(s, u)

    def transient(self, key, sizes, stream=0) -> None:
        """A checkpointed sparse block's no-grad forward (("forward", s, mb, j); no EP): its MoE MLP's bytes made at
        the experts' forward (forward_unpermute), the rest here."""
        if key[0] != "forward" or not self.is_block(self.root_units(key[1]) + key[3]):
            return super().transient(key, sizes, stream)
        x = self.pieces[key[1]]
        mlp = min(x.block_full, self.no_grad_mlp_bytes())
        if self.ep_view is not None:
            self.experts_forward = self.ep_forward_plan(mlp) if self.ep_planned() else []
            if not self.experts_forward:
                return super().transient(key, sizes, stream)
        else:
            self.experts_forward = self.routed_tensors(mlp)
        super().transient(key, self.tensors(x.block_full - mlp), stream)

    def no_grad_mlp_bytes(self) -> int:
        """Per token, the MoE MLP's bytes of a block's saved ones but the router's (none from a traced profile)."""
        if self.shape.traced is not None:
            return 0
        lora = self.training.finetune.adapters
        return moe.mlp_bytes_per_token(self.model, self.c, lora) - moe.router_bytes_per_token(self.model.moe, self.c)

    def routed_tensors(self, per_token_bytes: int) -> list[int]:
        """A no-grad MoE MLP's bytes as the trace's experts make them (transformers 5.24 integrations/moe.py:455-528):
        the k routed rows' gate|up product (2f), activation (f) and its product with up (f), their gathered input and
        output (h each), in the compute dtype; the rest (routing, shared experts) in one."""
        k, f, h = self.model.moe.experts_per_token, self.model.moe.expert_ffn_size, self.model.hidden_size
        widths = [k * w * self.c for w in (2 * f, f, f, h, h)]
        return [self.tokens * w for w in cut(per_token_bytes, widths)] if per_token_bytes > 0 else []

    def ep_planned(self) -> bool:
        """EP through transformers' AllToAllEP (the trace's, ep_forward_events); DeepEP's tensors not read (lumps)."""
        return self.ep_view is not None and self.ep_view.dispatch is MoeDispatch.ALL_TO_ALL

    def ep_args(self) -> tuple:
        """ep_forward_events' rows (sent, received per token), widths and dtype for this rank."""
        m = self.model.moe
        return (m.experts_per_token, self.ep_view.expert_rows_per_token(), self.model.hidden_size, m.expert_ffn_size,
                self.c)

    def ep_forward_plan(self, per_token_bytes: int) -> list[tuple]:
        """Under EP, a no-grad MoE MLP's bytes as the trace's dispatch, experts and combine make them
        (ep_forward_events), the rest (routing, shared experts) held across in one; none where they do not fit."""
        plan = ep_no_grad_forward_plan(*self.ep_args())
        rest = per_token_bytes - plan_peak(plan)
        if per_token_bytes <= 0 or rest < 0:
            return []
        return [("alloc", "rest", rest)] * (rest > 0) + plan + [("free", "rest")] * (rest > 0)

    def recomputed(self, x, j: int) -> list[int]:
        """Under EP, a checkpointed sparse block's recompute: its MoE MLP's bytes cut as the trace's saved tensors
        (ep_forward_events.ep_saved_widths, after the attention's), the rest of the block's first."""
        if not self.ep_planned() or not self.is_block(self.root_units(x.stage.index) + j):
            return super().recomputed(x, j)
        mlp = min(x.block_full, self.no_grad_mlp_bytes())
        if mlp <= 0:
            return super().recomputed(x, j)
        return self.tensors(x.block_full - mlp) + [self.tokens * w for w in cut(mlp, ep_saved_widths(*self.ep_args()))]

    def write_plan(self, key, plan: list[tuple]) -> None:
        """An ep_forward_events plan's allocations and frees, named (key + (name,))."""
        for step in plan:
            if step[0] == "alloc":
                self.alloc(key + (step[1],), round(self.tokens * step[2]))
            else:
                self.free(key + (step[1],))

    def ep_forward(self, s: int, u) -> None:
        """A checkpointed sparse block's no-grad MoE MLP under EP (transient's plan), with the experts gathered."""
        plan, self.experts_forward = self.experts_forward, []
        self.write_plan(("experts forward", s, u), plan)

    def forward_unpermute(self, s: int, u) -> None:
        """The MoE MLP's un-permute with the experts gathered (no EP), before their post-forward reshards them: the
        weighted rows (transformers 5.24 integrations/moe.py:524) and their un-permuted copy (:528), k x h each in the
        product's dtype, the routing's small tensors (router logits, top-k weights, sorted ids, histc's input, :440-448;
        under LoRA the router's input and gathered rows) in one; made and freed (moe.forward_unpermute_bytes_per_token,
        the ledger's forward copy-out moment, expert_unit_terms.copy_out_moment)."""
        if self.ep_view is not None:
            return self.ep_forward(s, u)
        routed, self.experts_forward = self.experts_forward, []   # a checkpointed block's (transient's), made first
        for t, size in enumerate(routed):
            self.alloc(("experts forward", s, u, t), size)
        model, key = self.model, ("unpermute", s, u)
        rows = self.tokens * model.moe.experts_per_token * model.hidden_size * moe.weighted_output_bytes(model.moe,
                                                                                                      self.c)
        total = self.tokens * moe.forward_unpermute_bytes_per_token(model, self.c, self.training.finetune.adapters)
        sizes = [rows, rows, total - 2 * rows] if total > 2 * rows else [total]
        for t, size in enumerate(sizes):
            self.alloc(key + (t,), size)
        for t in range(len(sizes)):
            self.free(key + (t,))
        for t in range(len(routed)):
            self.free(("experts forward", s, u, t))

    def mlp_saved_tensors(self, s: int, u, part: str, free: bool = False) -> None:
        """Block unit u's MLP saved tensors of `part` made apart, or freed: none here (the block's whole; full
        fine-tuning's apart: ExpertUnitsWalk.mlp_saved_apart)."""

    def pre_backward(self, s: int, u) -> None:
        """Block u's pre-backward prefetching its experts, then theirs: gathered, block u - 1 prefetched."""
        if not self.is_block(u):
            return super().pre_backward(s, u)
        self.unshard(u, backward=True)
        self.unshard(("experts", u), backward=True)  # (its all-gather issued there: StepWalk.unshard)
        super().pre_backward(s, u)  # block u gathered already: block u - 1 prefetched

    def backward_moments(self, s: int, j: int, experts_grads: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Block j's largest MoE MLP moment (the experts gathered) and largest later one (the norm's, the attention's),
        each (working bytes, gradient bytes that fit it), the later ones' gradients less the experts'
        (experts_grads, reduced at their post-backward): a traced block profile's moments (memory.py takes their
        largest, CP's ring transients on top) where the model has one, else the ledger's (LoRA's too:
        lora_expert_unit_events.py)."""
        x, shape = self.pieces[s], self.shape
        traced = shape.traced
        moments = traced.backward_moments if traced is not None else shape.mlp_moments[x.checkpointed[j]]
        ring = self.tokens * context_parallel.ring_working_bytes_per_token(self.model, self.config.cp, self.c)
        cap = shape.real.trainable_block * self.c
        seq = self.training.seq_len

        def best(candidates):
            return max(candidates, key=sum, default=(0, 0))

        mlp = best((round(m.activation_bytes(self.tokens, seq)) + (ring if traced else 0), min(m.grad_bytes, cap))
                   for m in moments if not m.experts_done)
        # the ledger's later moments are above the block's whole saved tensors, the MLP's freed by then: here above
        # what the block holds once they are freed (mlp_saved_apart)
        mlp_freed = self.tokens * sum(self.mlp_saved_bytes_per_token.values()) if j in self.mlp_apart_blocks else 0
        later = best([(round(m.activation_bytes(self.tokens, seq)) + mlp_freed,
                       max(0, min(m.grad_bytes, cap) - experts_grads)) for m in moments if m.experts_done]
                     + ([] if traced else [(self.tokens * (shape.w_attn - shape.freed_attn) + mlp_freed,
                                            max(0, shape.attn_grad - experts_grads))]))
        return mlp, later

    def write_moment(self, key, s: int, u, moment: tuple[int, int], among) -> set:
        """One backward moment: the gradients among `among` that fit its gradient bytes (StepWalk.early_grads),
        then its working set above the incoming gradient (alive already) made and freed; the gradients' indices."""
        acts, left = moment
        early = self.early_grads(s, u, left, among)
        per_token, rest = divmod(max(0, acts - self.tokens * self.hs), self.tokens)
        super().transient(key, self.tensors(per_token) + ([rest] if rest else []))
        return early


class ExpertUnitsWalk(ExpertUnitsHooks):
    """StepWalk with each sparse block's experts a unit of their own over efsdp, trained (full fine-tuning): their
    gradients made in the MLP's backward and reduce-scattered over efsdp at their post-backward, their sharded
    gradients, the MLP's saved tensors apart (module docstring)."""

    def ledger_saved(self, model, training, config) -> None:
        """The saved tensors as the ledger holds them with the EP view (MoeWalk's hook; a dense block's own too)."""
        if not self.expert_units:
            return super().ledger_saved(model, training, config)
        self.shape = ledger_shape(model, training, config, self.ep_view, False)
        self.pieces[self.stage] = self.pieces[self.stage].with_ledger_saved(self.shape, self.tokens)
        self.dense_saved(self.shape)
        self.mlp_saved_apart()

    def mlp_saved_apart(self) -> None:
        """Without activation checkpointing a sparse block keeps its MoE MLP's saved tensors (moe.mlp_bytes_per_token,
        as the ledger's moments after the experts' backward free them) apart from its others: the routed rows'
        (`experts`) made in the experts' forward and freed in their backward, the router's (`router`) made before them
        and freed after their post-backward (module docstring). A traced block profile's saved bytes stay whole."""
        x = self.pieces[self.stage]
        mlp = moe.mlp_bytes_per_token(self.model, self.c) if self.shape.traced is None else 0
        router = moe.router_bytes_per_token(self.model.moe, self.c)
        self.mlp_saved_bytes_per_token = {"router": router, "experts": mlp - router}
        # (not a checkpointed block's: its recompute keeps the MLP's whole; beside checkpointed blocks the others' go
        # apart too, as autograd frees them: docs/accuracy.md "2026-12-08: the experts' forward un-permute ...")
        self.mlp_apart_blocks = {j for j in range(x.stage.n_blocks) if mlp and not x.checkpointed[j]
                                 and x.stage.first_block + j not in self.dense}
        self.saved_less([mlp * (j in self.mlp_apart_blocks) for j in range(x.stage.n_blocks)])  # (DenseBlocks')

    def mlp_saved_tensors(self, s: int, u, part: str, free: bool = False) -> None:
        """Block unit u's MLP saved tensors of `part` (mlp_saved_apart) made, or freed."""
        if u - self.root_units(s) not in self.mlp_apart_blocks:
            return
        if self.ep_planned() and part == "experts" and not free:
            # EP: the dispatch / experts / combine's working set, in the trace's order with its saved tensors, made
            # and freed first (ep_forward_events' plan; their saved bytes stay the ledger's, cut below)
            self.write_plan(("experts working", s, u), ep_no_grad_forward_plan(*self.ep_args()))
        with self.without_scores():
            sizes = self.tensors(self.mlp_saved_bytes_per_token[part])
        for t, size in enumerate(sizes):
            if free:
                self.free(("mlp saved", s, u, part, t))
            else:
                self.alloc(("mlp saved", s, u, part, t), size)

    def grad_bytes(self, s: int, u) -> list[int]:
        """A block's gradients: its real tensors (the rank's E / ep experts unpadded), whatever its shards."""
        return [n * self.c for n in self.real_block] if self.is_block(u) else super().grad_bytes(s, u)

    def transient(self, key, sizes, stream=0) -> None:
        """A block's backward (key ("backward", s, mb, j)): the MLP's largest moment with the experts' gradients,
        the experts' post-backward, then the block's other moments (module docstring)."""
        if key[0] != "backward" or not self.is_block(self.root_units(key[1]) + key[3]):
            return super().transient(key, sizes, stream)
        _, s, mb, j = key
        u = self.root_units(s) + j
        grads = self.grad_bytes(s, u)
        traced = self.shape.traced
        mlp, later = self.backward_moments(s, j, sum(grads[i] for i in self.expert_index))
        # a traced profile's moment is the whole block's, its attention's softmax backward in it (score_events)
        with self.softmax_backward(key) if traced else self.without_scores():
            made = self.write_moment(("experts backward", s, mb, j), s, u, mlp,
                                     range(len(grads)) if traced else self.expert_index)
        self.mlp_saved_tensors(s, u, "experts", free=True)
        for i in self.expert_index:  # the rest of the experts' gradients, then their post-backward
            if i not in made:
                self.alloc(("wgrad", s, u, i), grads[i])
        experts = ("experts", u)
        self.reshard_unit(experts)
        with self._experts_group():
            self.reduce_scatter(s, experts, sum(self.experts_bytes) // self.c,
                                [("wgrad", s, u, i) for i in self.expert_index])
        self.mlp_saved_tensors(s, u, "router", free=True)
        others = [i for i in range(len(grads)) if i not in made and i not in self.expert_index]
        with self.softmax_backward(key):   # the attention's among the later moments (score_events)
            later_made = self.write_moment(("block backward", s, mb, j), s, u, later, others)
        self.made[u] = made | set(self.expert_index) | later_made

    def reduce_scatter(self, s: int, u, n: int, grads, kept: bool = False, shard_unit=None) -> None:
        if self.is_block(u):  # the block's unit without its experts (theirs reduced at their post-backward)
            n -= sum(self.units[s][u][i] for i in self.expert_index)
            grads = [g for g in grads if g[3] not in self.expert_index]
        super().reduce_scatter(s, u, n, grads, kept, shard_unit)

    def optimizer_step(self, first: bool) -> None:
        super().optimizer_step(first)
        if self.expert_units:
            s = self.stage
            for u in range(self.root_units(s), len(self.units[s])):
                if self.is_block(u):
                    self.free(("sharded_grad", s, ("experts", u)))


