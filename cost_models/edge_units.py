"""Where a step holds the embedding, final norm and head, by how the trainer wraps them (memory.py's ledger).

- One root unit (the planner's FSDP2 code, accelerate, torchtitan 0.2): FSDP2 keeps the root gathered from its
  forward to its post-backward at the end of backward, its pre-backward (on the model's output, before the loss's
  backward) prefetches the last block, and the head's and final norm's gradients wait for the root's reduce-scatter.
- Edge units (ModelSpec.split_edge_units: torchtitan 0.3's distributed/fsdp.py apply_fsdp_to_decoder): the
  embedding a unit resharded after forward (as the root would be under FULL_SHARD), [final norm, head] a unit kept
  gathered to its backward (reshard_after_forward=False), the root with no parameters; the loss computed on the
  returned logits (after the root's post-forward has freed the head's all-gather output). The head unit's
  pre-backward hook sits on the logits, so no block is prefetched during the loss's backward. FSDP2 runs a
  module group's post-backward once per module: after the head's backward it reshards the unit and
  reduce-scatters the head's gradient, then the final norm's pre-backward gathers the whole unit again (the head
  with it: its all-gather output and parameters beside that reduce-scatter input), and its post-backward reduces
  the norm's gradient (whose small input stays to the last block's post-backward). Block 0's pre-backward
  prefetches the embedding, whose post-backward ends the step: its one gradient outlives the reduce-scatter's output
  (torch 2.13 _fsdp_collectives.py foreach_reduce: its first loop's variable `unsharded_grad` keeps a unit's last
  gradient after unsharded_grads.clear(); a root's last, the head's, is no larger than the rest freed). Traced
  (calibration/apply.py edge_units, the loss outside the model): Llama 3 8B on 8 ranks at 8,192 tokens, selective-op,
  eager loss, the loss backward's peak 1,486,897,152 B below the root layout's (the embedding's 1,050,673,152 and
  the last block's 436,224,000 prefetch); at 2,048 tokens without checkpointing (4 blocks) the norm's regather
  leads, 9,164,191,908 B.
With one rank in the shard group the root layout's figures stand (no unit split: edge_unit_events.init_edges), FSDP2's
post-backward still reshards the root and runs foreach_reduce at world size 1 (torch 2.13 _fsdp_collectives.py: the
input in the reduce dtype, then `reduce_output.copy_(reduce_scatter_input)`, a full-size output that becomes the
sharded gradient); FSDP1's NO_SHARD keeps its flat parameters and all-reduces the gradient in place (fsdp1: no
buffers, the root kept).
"""

from __future__ import annotations

from typing import NamedTuple

from . import dim0_padding
from .identity_memo import IdentityMemo
from .specs import ModelSpec


class RootTerms(NamedTuple):
    """Bytes a ledger moment holds for the root's parameters (gathered, in the compute dtype c), gradients (c, or
    the reduce dtype r for a reduce-scatter input) and the sharded gradients already reduced."""

    at_blocks: int          # gathered at the blocks' backward moments
    head_grad: int          # unsharded gradients held at the blocks' backward moments
    done_grads: int         # sharded gradients reduced before the blocks' backward (the head unit's)
    rs_at_last_block: int   # a reduce-scatter input alive at the last block's backward (the head unit's)
    prefetch_at_first: int  # an all-gather output prefetched at block 0's backward (the embedding unit's)
    at_loss: int            # gathered at the loss's backward
    prefetch_at_loss: bool  # the last block's prefetch issued before the loss's backward
    regather: int           # the head unit's all-gather output again at the final norm's backward (0: no such moment)
    rs_at_regather: int     # the head's reduce-scatter input then
    done_at_regather: int   # and its sharded gradient
    end_grads: int          # unsharded gradients at the end of backward (the last unit's post-backward)
    end_rs: int             # its reduce-scatter input (and output; at d = 1 memory.py adds its full-size output)
    end_params: int         # gathered then


def root_terms(model: ModelSpec, trainable_root: int, root_params: int, c: int, r: int, p: int, d: int,
               keeps_gathered: bool, fsdp1: bool = False) -> RootTerms:
    """The root's terms for a rank of `model` (its local widths under TP) sharded over d: trainable_root /
    root_params its root's trainable / all parameters, c / r / p the compute, reduce and stored bytes per element;
    keeps_gathered: the ZeRO-2 forms (nothing resharded after forward); fsdp1: FSDP1's adapter units
    (fsdp1_adapters.py). Once per model and these (a search's ledgers share them across most knobs)."""
    return _ROOT_TERMS.get(model, (trainable_root, root_params, c, r, p, d, keeps_gathered, fsdp1),
                           lambda: _root_terms(model, trainable_root, root_params, c, r, p, d, keeps_gathered, fsdp1))


_ROOT_TERMS = IdentityMemo(limit=1024)


def _root_terms(model: ModelSpec, trainable_root: int, root_params: int, c: int, r: int, p: int, d: int,
                keeps_gathered: bool, fsdp1: bool) -> RootTerms:
    root_c = root_params * c
    # the counts pad the tables to d x ceil(rows / d) rows (dim0_padding.py); their gradients are the real tables
    embedding_pad, rest_pad = dim0_padding.root_padding_elements(model, d)
    if not model.split_edge_units or d == 1:
        head = (model.head_params or (model.embedding_params if model.tied_embeddings else 0)) + model.root_other_params
        return RootTerms(at_blocks=root_c, head_grad=min(head, trainable_root) * c, done_grads=0, rs_at_last_block=0,
                         prefetch_at_first=0, at_loss=root_c, prefetch_at_loss=True, regather=0, rs_at_regather=0,
                         done_at_regather=0, end_grads=max(0, trainable_root - embedding_pad - rest_pad) * c,
                         end_rs=0 if fsdp1 and d == 1 else trainable_root * r,
                         end_params=root_c if fsdp1 and d == 1 else 0)
    embedding_c = (model.embedding_params + embedding_pad) * c
    head_unit = root_params - model.embedding_params - embedding_pad
    trainable_head = min(head_unit, trainable_root)
    trainable_norm = min(model.root_other_params, trainable_head)
    trainable_embedding = trainable_root - trainable_head
    kept = embedding_c if keeps_gathered else 0
    return RootTerms(at_blocks=kept, head_grad=0, done_grads=-(-trainable_head * p // d),
                     rs_at_last_block=trainable_norm * r, prefetch_at_first=0 if keeps_gathered else embedding_c,
                     at_loss=head_unit * c + kept, prefetch_at_loss=False, regather=head_unit * c,
                     rs_at_regather=(trainable_head - trainable_norm) * r,
                     done_at_regather=-(-(trainable_head - trainable_norm) * p // d),
                     end_grads=max(0, trainable_embedding - embedding_pad) * c,
                     end_rs=trainable_embedding * r + -(-trainable_embedding * r // d), end_params=0)


def edge_moments(loss_backward, done_states: dict, root: RootTerms, last_gathered: int) -> dict:
    """Edge units' moments beside the ledger's loss backward (memory.py's, a memory_peak.Moment): the final norm's
    backward, its pre-backward having gathered the head's unit again (its all-gather output, the head's reduce-scatter
    input, the head's sharded gradient done: done_states); and with FSDP2's per-block all-gathers (last_gathered, the
    last block's all-gather output) the head's unit copied out in forward beside that output, whose free FSDP2 defers
    past the next unit's copy-out (fsdp2_gathers.py), the blocks' saved tensors held and no logits yet: below the loss
    backward under the eager loss, the step's peak where a loss kernel keeps no logits (Liger under LoRA). Traced
    (planner.tracing's edge-unit step, llama3-gqa LoRA fp32 on 8, 256 tokens: the head's 32,770,048 B all-gather
    output and 32,768,000 B copy-out beside block 7's 13,848,576 B output, 169,803,264 B live; the walk 169,261,312,
    -0.32%, the ledger's offset from the trace at its peak)."""
    moments = {"final norm's backward": loss_backward._replace(
        **done_states, collective_buffers=root.regather + root.rs_at_regather, logits_and_loss=0)}
    if last_gathered:
        moments["forward all-gather copy-out of the head's unit"] = loss_backward._replace(
            collective_buffers=root.regather + last_gathered, logits_and_loss=0)
    return moments
