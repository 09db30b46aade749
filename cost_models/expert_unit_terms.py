"""The memory ledger's terms for a sparse block whose routed experts are an FSDP unit of their own (memory.py): EP's
experts on the efsdp mesh (expert_parallel.py), or FsdpConfig.expert_units over d without EP.

FSDP2 runs the experts' post-backward once their backward is done, inside the block's (torch 2.13
_fsdp_param_group.py post_backward -> foreach_reduce, _fsdp_collectives.py): it reshards their parameters, allocates
the reduce-scatter input (reduce dtype, every padded row) and copies their gradients into it, frees them (the
compute-dtype gradients, the rank's real experts: autograd's), and makes the reduce-scatter output, the experts' new
sharded gradient (ceil(rows / efsdp) of the padded rows, cast to the parameters' dtype where the reduce dtype is not
theirs: _fsdp_collectives.py:696). So the block's later moments (the router's, the norm's, the attention's) hold the
reduce-scatter input in place of the block above's, the experts' new shard, and none of the experts' gradients.
Traced: docs/accuracy.md "2026-12-07 night: the experts' reduce-scatter in the ledger". The experts' unit gathered
again at the last block's backward, its all-gather output beside the copy-out, and in forward: copy_out_moment."""

from __future__ import annotations

import math
from typing import NamedTuple

from . import moe
from .identity_memo import IdentityMemo
from .memory_peak import Moment


class ExpertUnitTerms(NamedTuple):
    """Bytes of one sparse block's experts unit on this rank (0 where the experts are not a unit of their own)."""

    gathered: int       # their all-gather output (compute dtype, padded rows)
    reduce_input: int   # their reduce-scatter input (reduce dtype, padded rows), kept to the next reduce-scatter
    new_shard: int      # their reduce-scatter output: the new sharded gradient (parameter dtype)
    grads: int          # their compute-dtype gradients before the post-backward (the real experts, unpadded)

    def at_moment(self, grads: int, reduce_above: int, accumulated: bool, after: bool) -> tuple[int, int, int, int]:
        """A block backward moment's (unsharded grads, and the adjustments of its unsharded params, collective buffers
        and sharded grads) from its gradient bytes `grads`: after the experts' post-backward (`after`: the moments
        with experts_done) resharded, their reduce-scatter input in place of the block above's (reduce_above), their
        gradients freed, their new shard made (under accumulation added into the whole shard, counted already)."""
        if not after or not self.gathered:
            return grads, 0, 0, 0
        return (max(0, grads - self.grads), -self.gathered, self.reduce_input - reduce_above,
                0 if accumulated else self.new_shard)


NONE = ExpertUnitTerms(0, 0, 0, 0)


def expert_unit_terms(model, config, ep_view, d: int, c: int, r: int, p: int, frozen: bool) -> ExpertUnitTerms:
    """model: the rank's (EP: ep_view.model, E / ep experts); d: the dense shard group; c / r / p: the compute,
    reduce and parameter dtypes' bytes; frozen: the block's weights frozen (LoRA: nothing reduced)."""
    if ep_view is not None:  # with EP the experts are always a unit of their own, on the efsdp mesh
        group, gathered = ep_view.efsdp, ep_view.experts_gathered_elements()
        reduced = group > 1
    elif config.expert_units:
        group, gathered = d, moe.experts_gathered_elements(model, d, bool(config.expert_shard_dim))
        reduced = not frozen  # (d = 1: as memory.py's reduce_scatter_above)
    else:
        return NONE
    if not reduced:
        return ExpertUnitTerms(gathered * c, 0, 0, 0)
    return ExpertUnitTerms(gathered * c, gathered * r, math.ceil(gathered * p / max(1, group)),
                           moe.experts_gathered_elements(model, 1) * c)


def copy_out_moment(s, model, experts: ExpertUnitTerms, states, grads_done: int, params: int, reduce_above: int,
                    head_grad: int, lora: bool) -> dict:
    """The last block's experts gathered again at their pre-backward (their unit resharded after its forward), the
    all-gather output copied out into their unsharded parameters, both alive (torch 2.13 _fsdp_param_group.py:463
    wait_for_unshard -> _fsdp_collectives.py:431 foreach_all_gather_copy_out; the output freed after it), beside the
    block gathered (`params`, the experts in it), the block above's reduce-scatter input, the saved tensors and the
    incoming gradient, before the block below is prefetched. s: memory_shape.LedgerShape (its blocks top first);
    states: memory.py's states(sharded grad bytes). Padded experts (16 x the rank's rows on 128 ranks) make it the
    peak: docs/accuracy.md "2026-12-08: the padded experts' all-gather copied out at the last block's backward".
    And the same in forward: the experts' all-gather output kept after their copy-out (FSDP2 frees a forward
    all-gather's output at the next unit's copy-out: _fsdp_param_group.py wait_for_unshard keeps it in
    comm_ctx.all_gather_state; the block's own freed at this one), beside the saved tensors of the blocks below and
    the last block's own, at the experts' un-permute (moe.forward_unpermute_bytes_per_token); formulas' families
    only (a traced profile's forward working set is not known), the last block not checkpointed (its forward
    saves nothing, its recompute is the backward moment's)."""
    i, _, recomputed, below, this = s.blocks[0]
    if not experts.gathered or i != s.n_layers - 1:
        return {}
    tokens, h_c = s.tokens, s.c * model.hidden_size
    out = {f"backward of block {i}'s experts (their all-gather copied out)": Moment(
        **states(grads_done), unsharded_params=params, collective_buffers=experts.gathered + reduce_above,
        unsharded_grads=head_grad, activations=tokens * (below + (s.ckpt if recomputed else this) + h_c) + s.shared)}
    if not recomputed and model.activation_profile is None:
        out[f"forward of block {i}'s experts (their all-gather copied out)"] = Moment(
            **states(0), unsharded_params=params, collective_buffers=experts.gathered,
            activations=tokens * (below + this + moe.forward_unpermute_bytes_per_token(model, s.c, lora)) + s.shared)
    return out


_CHOSEN = IdentityMemo(limit=4096)  # a sparse block's moment by its MLP's moments and what else it reads


def sparse_block_moment(mlp_moments: tuple, tokens: int, seq_len: int, base: int, at_attn: int, attn_grad: int,
                        grad_cap: int, experts: ExpertUnitTerms, reduce_above: int, accumulated: bool) -> tuple:
    """memory.py's MoE block backward: the largest of its MLP's moments (moe.backward_moments; base: the saved bytes
    alive, grad_cap: the block's trainable gradient bytes) and the attention's (at_attn, attn_grad), the first
    largest by total, as (activations, unsharded grads, and ExpertUnitTerms.at_moment's adjustments). Once per
    what it reads: a search's ledgers ask again across the FSDP knobs that leave the block's terms alone."""
    return _CHOSEN.get(mlp_moments, (tokens, seq_len, base, at_attn, attn_grad, grad_cap, experts, reduce_above,
                                     accumulated), lambda: max(
        [(base + m.activation_bytes(tokens, seq_len),
          *experts.at_moment(min(m.grad_bytes, grad_cap), reduce_above, accumulated, m.experts_done))
         for m in mlp_moments] + [(at_attn, *experts.at_moment(attn_grad, reduce_above, accumulated, True))], key=sum))
