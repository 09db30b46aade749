"""A pipeline stage's FSDP2 unshard and its head's weight gradient in the rank's walk (a mixin of
pipeline_allocations._RankWalk's composed walk; torch 2.13 torch/distributed/fsdp/_fully_shard):
- reshard_after_forward=False under PP: a stage is unsharded in its first forward of the step and stays so to its
  reduce. A one-stage rank unshards each unit at its own pre-forward (FSDPParamGroup.pre_forward, _fsdp_param_group.py:
  540-556: unshard, then wait_for_unshard's copy-out), between the units' forwards; in forward the previous unit's
  all-gather output is freed once this unit is copied out (wait_for_unshard, :429-432 and :476-487), the last one at
  the stage root's post-forward (_fsdp_state.py:333-343), after the stage's output (the last stage: its logits,
  before the schedule's loss). A multi-stage rank unshards the stages ahead at once (pipeline_orders.active_stages),
  their outputs held until used.
- the last stage's head: autograd makes its weight gradient at the head's backward, right after the loss's, and it
  stays in the compute dtype (the unsharded parameter's .grad) until the stage root's post-backward adds it into the
  reduce-dtype sum (_fsdp_param_group.py:588 post_backward; _RankWalk.weight_grads), after every block's backward
  (StagePieces.head_grad, which the pipeline ledger holds at each block's moment).
"""

from __future__ import annotations

import math

ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = "all_gather_copy_in", "reduce_scatter"  # alloc_sequence.py's names


class StageUnitsWalk:
    """_RankWalk's gather (its step calls it before each action) and the head's gradient (module docstring)."""

    def __init__(self, *args) -> None:
        self.lazy: list = []            # (stage, unit) left to unshard at their pre-forwards, in order
        self.last_gather = None         # the last all-gather output, freed after the next copy-out or post-forward
        self.head_grad_made = None      # the stage whose head's gradient the loss's backward made
        super().__init__(*args)

    def gather(self, stages) -> None:
        todo = [(s, u) for s in sorted(stages) if s not in self.gathered for u in range(len(self.units[s]))]
        self.gathered.update(stages)
        if len(stages) == 1:  # one stage: each unit at its pre-forward (pre_forward, forward_pass, loss)
            self.lazy += todo
            return
        for s, u in todo:
            self.all_gather_unit(s, u)
        for s, u in todo:
            self.copy_out(s, u)
            self.free(("all_gather", s, u))

    def all_gather_unit(self, s: int, u: int) -> None:
        """The all-gather input (default stream) and output (copy-in stream)."""
        size = sum(self.unsharded(s, u))
        self.alloc(("all_gather_in", s, u), math.ceil(size / self.d))
        self.alloc(("all_gather", s, u), size, ALL_GATHER_STREAM)
        self.free(("all_gather_in", s, u))

    def copy_out(self, s: int, u: int) -> None:
        for i, size in enumerate(self.unsharded(s, u)):
            self.alloc(("unsharded", s, u, i), size)

    def unshard_through(self, s: int, u: int) -> None:
        """Stage s's units up to u not unsharded yet (the root's before the first block's), each at its pre-forward:
        its all-gather and copy-out, then the previous unit's output freed."""
        while self.lazy and self.lazy[0][0] == s and self.lazy[0][1] <= u:
            unit = self.lazy.pop(0)
            self.all_gather_unit(*unit)
            self.copy_out(*unit)
            self.free_last_gather()
            self.last_gather = ("all_gather", *unit)

    def pre_forward(self, s: int, u: int) -> None:
        """The first stage's root runs its embedding before the first block's pre-forward: its output (which
        forward_pass writes as block 0's input after this hook) made before that block's all-gather."""
        held = bool(self.lazy) and self.lazy[0] == (s, 0) and u == self.root_units(s) and self.pieces[s].stage.embedding
        self.unshard_through(s, u - 1 if held else u)
        if held:
            self.alloc(("held", s), self.tokens * self.hs)
            self.unshard_through(s, u)
            self.free(("held", s))
        super().pre_forward(s, u)

    def free_last_gather(self) -> None:
        if self.last_gather is not None:
            self.free(self.last_gather)
            self.last_gather = None

    def forward_pass(self, x, mb: int) -> None:
        if not x.stage.n_blocks:  # a stage of its root alone: unsharded at the root's pre-forward
            self.unshard_through(x.stage.index, 0)
        super().forward_pass(x, mb)
        self.free_last_gather()  # the stage root's post-forward (a last stage's: at its logits, loss below)

    def loss(self, events, s: int, mb: int) -> None:
        """The root's post-forward after the logits (the loss's first event), the head's weight gradient after the
        loss's backward made the logits' gradient (its last event frees it)."""
        if events is self.loss_events[0] and events:
            super().loss(events[:1], s, mb)
            self.free_last_gather()
            super().loss(events[1:], s, mb)
            return
        if events is not self.loss_events[1] or not events or not self.root_units(s):
            super().loss(events, s, mb)
            return
        super().loss(events[:-1], s, mb)
        self.head_grad_made = s  # the root unit is one tensor (_RankWalk._units): the head's and final norm's
        self.alloc(("wgrad", s, 0, 0), self.pieces[s].head_grad)
        super().loss(events[-1:], s, mb)

    def root_backward(self, s: int, grad_in) -> None:
        """The root's post-backward: the head's gradient made already (loss)."""
        if self.head_grad_made != s:
            return super().root_backward(s, grad_in)
        self.head_grad_made = None
        self.weight_grads(s, 0, made=True)
        self.free(grad_in)


__all__ = ["StageUnitsWalk"]
