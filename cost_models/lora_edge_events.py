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


class LoraEdgeUnitsWalk:
    """EdgeUnitsWalk's hooks with the edge units frozen (a mixin ahead of LoraWalk, whose loss and root_backward run
    StepWalk's with edge units)."""

    def gathered_elements(self, s: int, u) -> tuple[int, int]:
        """An edge unit's all-gather copies in frozen shards only (LoraWalk.all_gather: cast where stored in another
        dtype than c); a block's as LoraWalk's."""
        if not isinstance(u, str):
            return super().gathered_elements(s, u)
        p = self.edge_params
        return 0, p["emb"] if u == "emb" else p["head"] + p["norm"]

    def edge_grad(self, s: int, part: str) -> None:
        """Frozen: no gradient."""

    def edge_post_backward(self, s: int, part: str) -> None:
        """The head's or the embedding's post-backward: reshard, nothing to reduce (_fsdp_param_group.py post_backward
        returns before foreach_reduce)."""
        self.reshard_unit("emb" if part == "emb" else "head")

    def edge_embedding_backward(self, s: int, grad_in) -> None:
        """Autograd ends at block 0 (its input gradient freed); the final callback's post-backward of the embedding's
        unit then drops block 0's prefetch of it uncopied (ZeRO-2: reshards it, gathered since the forward)."""
        self.free(grad_in)
        if "emb" in self.prefetched:
            self.free(("all_gather", self.stage, "emb"))
            self.prefetched.discard("emb")
        if "emb" in self.gathered_units:
            self.reshard_unit("emb")
