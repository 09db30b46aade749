"""The LoRA step walk with each sparse block's routed experts an FSDP unit of their own (FsdpConfig.expert_units, no
EP: LoRA with EP is refused, mesh_rules "mesh-with-lora"), and with its router and stacks padded on dim 0 at shard
group d (FSDP2's ceil(rows / d) rows a rank, as the ledger's ParamCounts; without expert units the whole block one
unit, its tensors moe_block_tensors' padded, gathered in the compute dtype: DenseBlocks.unsharded's rule): two mixins in
step_allocations._LoraStepWalk, LoraExpertUnitsWalk (the FSDP2 hooks) ahead of Dim0PaddingWalk, as ExpertUnitsWalk is
in the full walk (its unsharded drops the experts from a block's padded tensors), and LoraSparseBlocksWalk (the units)
after it, ahead of LoraDenseBlocksWalk / LoraWalk (so that Dim0PaddingWalk pads its units).

calibration/apply.py fully_shards the module holding a block's stacked expert tensors (model_blocks.expert_modules:
the 3-D parameters' module) inside the block's unit. So the experts' unit holds frozen tensors only: it is gathered
(the copy-in cast where stored in another dtype than the compute dtype) and resharded, never reduced (FSDP2's
post_backward returns before foreach_reduce without gradients, torch 2.13 _fsdp_param_group.py), and the block
above's reduce-scatter input stays alive through the block's later moments. FSDP2's hook order is
expert_unit_events.ExpertUnitsHooks' (the experts' shard, unsharded / all_gather / unshard / post_forward /
pre_backward; not ExpertUnitsWalk's trained experts), read again off the trace's allocation events (Mixtral of
memory_accuracy.py on 8, LoRA, expert units, 1 x 256 tokens): the block gathered without its experts, the experts
gathered at the block's forward end, their all-gather output the deferred free of the next copy-out (the last through
the loss in forward); in backward block i prefetches its experts, they prefetch block i - 1, their reshard after the
MLP's backward. A sparse block's base tensors are moe_events.moe_block_tensors' (q, k, v, o, router, the stacks, ...;
at shard group d the router and the stacks padded to d x ceil(rows / d) rows, as the ledger's ParamCounts) so that
the stacks are tensors of their own.

A sparse block's backward: the ledger's moments (memory_shape.ledger_shape's mlp_moments under LoRA, moe_lora's
under all-linear) - the largest of the MoE MLP's with the experts gathered, the adapter gradients that fit it made
first; the experts' post-backward (reshard); then the largest of the later ones (the norm's, the attention's) with
the rest of the adapter gradients that fit it. Flat still (moe_events.moe_flat_reason): CPU offload (EP with LoRA and
QLoRA on an MoE are refused). All-linear on an MoE with expert units is refused (moe_lora.refusals: peft's
ParamWrapper merges the experts' weights before their FSDP2 pre-forward gathers them, so the trace's step fails); the
moments above still take moe_lora's where asked (replays, step_events).
"""

from __future__ import annotations

from .expert_unit_events import ExpertUnitsHooks
from .moe import block_gathered_elements
from .moe_events import moe_block_tensors


class LoraExpertUnitsWalk(ExpertUnitsHooks):
    """ExpertUnitsHooks (FSDP2's hooks) around frozen experts: their unit gathered from frozen storage, resharded at
    their post-backward, never reduced; a sparse block's backward the ledger's moments with its adapters' gradients
    (the units, gradients, reduce-scatters and optimizer step LoraWalk's)."""

    def gathered_elements(self, s: int, u) -> tuple[int, int]:
        """The experts' unit: frozen, its copy-in source cast where stored in another dtype (LoraWalk.all_gather)."""
        return (0, sum(self.experts_bytes) // self.c) if isinstance(u, tuple) else super().gathered_elements(s, u)

    def stored_width(self, s: int, u, i: int) -> int | None:
        """The experts' tensors: frozen, stored in frozen_p (OneRankWalk.param_input's cast at d = 1)."""
        return self.frozen_p if isinstance(u, tuple) else super().stored_width(s, u, i)

    def transient(self, key, sizes, stream=0) -> None:
        """A sparse block's backward (module docstring); else LoraWalk's."""
        if key[0] != "backward" or not self.is_block(self.root_units(key[1]) + key[3]):
            return super().transient(key, sizes, stream)
        _, s, mb, j = key
        u = self.root_units(s) + j
        mlp, later = self.backward_moments(s, j, 0)  # (the ledger's: its shape is never a traced profile's under LoRA)
        adapters = self.trainable(s, u)
        with self.without_scores():
            made = self.write_moment(("experts backward", s, mb, j), s, u, mlp, adapters)
        self.reshard_unit(("experts", u))  # their post-backward: frozen, nothing reduced
        grads = self.grad_bytes(s, u)
        left = (later[0], max(0, later[1] - sum(grads[i] for i in made)))  # (the ledger's: every gradient by then)
        rest = [i for i in adapters if i not in made]
        with self.softmax_backward(key):   # the attention's among the later moments (score_events)
            self.made[u] = made | self.write_moment(("block backward", s, mb, j), s, u, left, rest)


class LoraSparseBlocksWalk:
    """A sparse block's unit under LoRA with expert units, or with its router / stacks padded at d (module docstring;
    reads ExpertUnitsHooks' expert_units)."""

    def _units(self, x) -> list[list[int]]:
        """LoraWalk's units, a sparse block's base cut as moe_block_tensors (its router and stacks padded at d)."""
        units = super()._units(x)
        model = self.model
        self.sparse_cut = model.moe is not None and (self.expert_units or self.d > 1 and block_gathered_elements(
            model, self.d) != model.block_params)
        if not self.sparse_cut:
            return units
        root = len(units) - x.stage.n_blocks
        out = list(units)
        self.n_sparse_base = self.n_base
        for j, unit in enumerate(units[root:]):
            if x.stage.first_block + j not in self.dense:
                base = moe_block_tensors(self.model, sum(unit[:self.n_base]), self.d)
                out[root + j] = base + list(unit[self.n_base:])
                self.n_sparse_base = len(base)
        return out

    def gathers_own_tensors(self, s: int, u) -> bool:
        """A sparse block's all-gather output: its moe_block_tensors base (padded) and adapters, in the compute dtype
        (DenseBlocks.unsharded: memory.py's block_c; ExpertUnitsHooks.unsharded drops the experts'), else
        LoraDenseBlocksWalk's."""
        return self.sparse_cut and self.sparse_unit(s, u) or super().gathers_own_tensors(s, u)

    def trainable(self, s: int, u) -> list[int]:
        """A sparse block's adapters: after its moe_block_tensors base."""
        if self.sparse_cut and self.sparse_unit(s, u):  # (before StepWalk's self.stage)
            return list(range(self.n_sparse_base, len(self.units[s][u])))
        return super().trainable(s, u)
