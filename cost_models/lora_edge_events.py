"""The LoRA step walk's events for torchtitan 0.3's edge units (ModelSpec.split_edge_units; edge_units.py says what
FSDP2 does with them, edge_unit_events.py walks them under full fine-tuning): the embedding's unit and [final norm,
head]'s gathered and resharded as there, but frozen, so nothing of theirs is reduced and the embedding's unit runs no
backward hook of its own (its output needs no gradient: torch 2.13 _fsdp_state.py _register_pre_backward_hook and
post-backward registration act on tensors that require grad).

- forward: the embedding's unit gathered (its copy-in the frozen shards cast, fsdp2_gathers.copy_in_bytes) and
  resharded after its forward (FULL_SHARD); the head's unit gathered at the loss, the root's post-forward freeing the
  last all-gather output;
- the loss's backward: the head's post-backward reshards its unit (no gradient: _fsdp_param_group.py post_backward
  returns before foreach_reduce), the final norm's pre-backward gathers it again and prefetches the last block, its
  post-backward reshards it;
- block 0's pre-backward prefetches the embedding's unit (post_forward_order); no pre-backward of its own waits for
  that all-gather, and the final callback's post_backward (_fsdp_state.py _root_post_backward_final_callback, run for
  a group whose inputs needed no gradient) drops it uncopied, after autograd is done.
The trace's order (planner.tracing's edge-unit FSDP2 step: calibration/trace.py apply_fsdp2(edge_units=...)), llama3-gqa
LoRA fp32 on 8, 256 tokens: the embedding's 32,768,000 B all-gather output prefetched at block 0's backward and freed
at the end of backward with no copy-out; the head's unit resharded after the loss's backward and gathered again
(32,770,048 B output, 32,768,000 B head copied out) with the last block's prefetch beside it.
"""

from __future__ import annotations

from .fsdp2_gathers import copy_in_bytes
from .pipeline_allocations import ALL_GATHER_STREAM


class LoraEdgeUnitsWalk:
    """The hooks of LoraWalk that change with edge units (a mixin ahead of it; `edges` from EdgeUnitsWalk)."""

    def all_gather(self, u) -> None:
        """An edge unit's all-gather: the frozen shards' copy-in (cast where stored in another dtype than c), the
        output on the copy-in stream; a block's as LoraWalk's."""
        if not isinstance(u, str):
            return super().all_gather(u)
        s, p = self.stage, self.edge_params
        frozen = p["emb"] if u == "emb" else p["head"] + p["norm"]
        self.alloc(("all_gather_in", s, u), copy_in_bytes(0, frozen, self.p, self.frozen_p, self.c, self.d))
        self.alloc(("all_gather", s, u), sum(self.unsharded(s, u)), ALL_GATHER_STREAM)
        self.free(("all_gather_in", s, u))
        self.prefetched.add(u)

    def loss(self, events, s: int, mb: int) -> None:
        """The head's unit gathered before the loss (then the root's post-forward); after the head's backward (a loss
        kernel's: inside its forward) its post-backward reshards it; at the loss's backward the final norm's
        pre-backward gathers it again and prefetches the last block, its post-backward reshards it."""
        if not self.edges:
            return super().loss(events, s, mb)
        forward = events is self.loss_events[0]
        if forward:
            self.unshard("head")
            self.free(self.pending)
            self.pending = None
        super().loss(events, s, mb)
        if forward == self.loss_kernel:  # the head's post-backward: reshard, nothing to reduce
            self.reshard_unit("head")
        if not forward:
            self.unshard("head", backward=True)
            last = len(self.units[s]) - 1
            if last not in self.gathered_units:
                self.all_gather(last)
            self.reshard_unit("head")

    def root_backward(self, s: int, grad_in) -> None:
        """Autograd ends at block 0 (its input gradient freed); the final callback's post-backward of the embedding's
        unit then drops block 0's prefetch of it uncopied (ZeRO-2: reshards it, gathered since the forward)."""
        if not self.edges:
            return super().root_backward(s, grad_in)
        if self.pending is not None:
            self.free(self.pending)
            self.pending = None
        self.free(("mask", grad_in[2]))
        self.free(grad_in)
        if "emb" in self.prefetched:
            self.free(("all_gather", s, "emb"))
            self.prefetched.discard("emb")
        if "emb" in self.gathered_units:
            self.reshard_unit("emb")
