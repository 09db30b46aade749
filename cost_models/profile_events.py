"""The step walk's activations for a model priced by a traced block profile (ModelSpec.activation_profile: generic
families, planner/models/block_profiles.py) at pp = 1: step_allocations._FullStepWalk runs ProfileWalk ahead of
StepWalk, which otherwise writes the formulas' widths (pipeline_stage_pieces.stage_pieces).

What memory.py prices from the profile (memory_shape.ledger_shape's traced terms), the walk now writes:
- a block's saved tensors: the profile's saved bytes per token (a checkpointed block its input, and in its recompute
  the profile's saved bytes again; ledger_shape's ckpt_input_extra where the first norm does not save the input);
- the blocks' inputs that checkpointing keeps (the profile's checkpoint-held masks and rotary tables) in place of the
  formula's rotary tables and eager attention's mask;
- a block's backward moment: the profile's largest (ActivationTerms.backward_peak: its activations above the block's
  saved tensors, a token-independent part among them, and the weight gradients made by then, no more than the
  block's), CP's ring transients on top, as memory.py adds them.
LoRA keeps the formulas (ledger_shape prices no profile under adapters: lora_events.py walks them); a profiled MoE
model keeps the flat rule (step_allocations.replays).
"""

from __future__ import annotations

import dataclasses

from . import context_parallel
from .memory_shape import ledger_shape


class ProfileWalk:
    """The pieces of StepWalk that a traced block profile replaces (a mixin ahead of it)."""

    def __init__(self, model, training, config, d: int, rank: int):
        super().__init__(model, training, config, d, rank)
        self.profile_rest = None  # per block: the working set's bytes below a whole tensor per token
        if model.activation_profile is None:  # (the formulas' widths: StepWalk's own)
            return
        shape = ledger_shape(model, training, config, None, False)
        if shape.traced is None:
            return
        x, tokens, n = self.pieces[self.stage], self.tokens, self.pieces[self.stage].stage.n_blocks
        acts, grads = shape.traced.backward_peak(tokens, training.seq_len)
        grads = min(grads, shape.real.trainable_block * self.c)
        # the moment's activations above the block's saved tensors (the incoming gradient among them, as the
        # formulas' working sets hold it), CP's ring transients on top
        working = round(acts) + tokens * context_parallel.ring_working_bytes_per_token(model, config.cp, self.c)
        self.profile_rest = working % tokens
        self.pieces[self.stage] = dataclasses.replace(
            x.with_ledger_saved(shape, tokens), working=(working - self.profile_rest,) * n,
            blocks=tuple(((0, grads), *b[1:]) for b in x.blocks))
        # the checkpoint-held inputs (masks, rotary tables: the profile's), or without checkpointing the formula's
        # rotary tables: memory_shape.py's shared bytes, held from the forward to block 0's backward
        self.shared, self.mask = shape.shared, 0

    def transient(self, key, sizes, stream=0) -> None:
        """A block's backward working set (StepWalk's) beside the bytes of it that are no whole tensor per token."""
        if key[0] != "backward" or not self.profile_rest:
            return super().transient(key, sizes, stream)
        self.alloc(("profile rest", key), self.profile_rest)
        super().transient(key, sizes, stream)
        self.free(("profile rest", key))
