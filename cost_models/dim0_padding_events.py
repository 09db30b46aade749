"""The step walk's dim-0 padding of the parameters (a mixin of both pp = 1 walks, step_allocations.py, and of the
pipeline ranks' walk, pipeline_allocations.py; dim0_padding.py says what FSDP2 pads and why): at shard group d > 1
each block unit's tensors
(pipeline_allocations.param_tensors, LoRA's adapters after them) and the root's are padded to d x ceil(rows / d)
rows, as the ledger's ParamCounts count them: their shards, optimizer states,
all-gather inputs and outputs (the unsharded storage), reduce-scatter inputs and sharded gradients, and the
optimizer's foreach temporaries over the padded shards. The gradients autograd makes stay the real tensors.

A tensor of the walk's block takes the padding of the ledger's tensor of its size (dim0_padding.block_tensors: q, k,
v, o, the MLP's linears, the norms, where the layouts agree); what the walk's layout does not match (a fused qkv, the
ledger's q / k norms) goes to its largest attention tensor, so that a block's padded sum is the ledger's (an MoE's
sparse block: MoeWalk's units with the experts padded already, ExpertUnitsWalk's experts over efsdp). LoRA: the base
tensors and the adapters (dim0_padding.adapter_tensors), the gradients the adapters' real ones. Edge units: the
embedding's padding on its unit, the head's and the final norm's on the head's (edge_units.root_terms). A pipeline
stage's root: its own tables' (dim0_padding.stage_root_padding_elements); a sparse block's stacked experts there are
padded on its "rest" tensor (pipeline_allocations._PaddedRankWalk), as the pipeline ledger pads them (StagePieces).
"""

from __future__ import annotations

import contextlib
import dataclasses

from . import dim0_padding
from .model_spec import dense_block_spec


def _padded(tensors: list[int], ledger_tensors, d: int) -> list[int]:
    """A block's tensors (elements) padded as the ledger pads the block (module docstring)."""
    out, todo = list(tensors), list(ledger_tensors)
    left = dim0_padding.padding_elements(todo, d)
    for i, n in enumerate(tensors):
        match = next(((rows, per_row) for rows, per_row in todo if rows * per_row == n), None)
        if match is not None:
            todo.remove(match)
            pad = dim0_padding.padding_elements([match], d)
            out[i] += pad
            left -= pad
    out[max(range(min(4, len(out))), key=out.__getitem__)] += left
    return out


class Dim0PaddingWalk:
    """StepWalk's units with FSDP2's dim-0 padding (module docstring): padding_added, the elements it added to each
    tensor of a unit, keyed (stage, unit); the walk's own reads of a unit's gradients and unsharded bytes see the
    tensors without it, the padding added after."""

    def _units(self, x) -> list[list[int]]:
        units = super()._units(x)
        model, d = self.model, self.d
        if d <= 1:
            return units
        root = len(units) - x.stage.n_blocks
        dense = getattr(self, "dense", ())  # MoeWalk's dense blocks (MoE models): moe.dense_block_spec's tensors
        training = self.training
        specs = {False: model, True: dense_block_spec(model) if dense else None}
        # (ParamCounts.of's: QLoRA's packed linears unpadded; LoRA's adapters after the base tensors)
        ledger = {k: (() if training.quantized else dim0_padding.block_tensors(spec)) + (
            dim0_padding.adapter_tensors(spec, training.lora_rank) if training.finetune.adapters else ())
            for k, spec in specs.items() if spec is not None}
        self.padding_added = getattr(self, "padding_added", {})
        out = [list(unit) for unit in units]
        for j, unit in enumerate(units[root:]):
            out[root + j] = _padded(unit, ledger.get(x.stage.first_block + j in dense, ()), d)
        if root:
            out[0][0] += dim0_padding.stage_root_padding_elements(model, d, x.stage.embedding, x.stage.head)
        for u, (padded, real) in enumerate(zip(out, units)):
            if padded != list(real):
                self.padding_added[x.stage.index, u] = [p - r for p, r in zip(padded, real)]
        return out

    def __init__(self, model, training, config, d: int, rank: int):
        super().__init__(model, training, config, d, rank)
        self.edge_padding = {}
        if getattr(self, "edges", False):  # edge units (edge_unit_events.init_edges read unit 0 padded): the
            # embedding's unit and the head's gathered and reduce-scattered padded, their gradients real
            emb, rest = dim0_padding.root_padding_elements(model, d)
            self.edge_padding = {"emb": emb, "head": rest}
            self.edge_bytes = {"emb": self.edge_bytes["emb"] + emb * self.c,
                               "head": self.edge_bytes["head"] + rest * self.c}
            self.edge_params = dict(self.edge_params, head=self.edge_params["head"] - emb - rest)
        for s in self.pieces:  # (a pipeline rank: each of its stages)
            total = sum(sum(unit) for unit in self.units[s])
            if any(k[0] == s for k in getattr(self, "padding_added", {})) and total != self.pieces[s].params:
                # the optimizer step's temporaries over the padded shards (the ledger's trainable elements)
                self.pieces[s] = dataclasses.replace(self.pieces[s], params=total)

    def _added(self, s: int, u) -> list[int] | None:
        """The elements the padding added to unit u's tensors, None where it added none."""
        return self.padding_added.get((s, u)) if isinstance(u, int) and hasattr(self, "padding_added") else None

    @contextlib.contextmanager
    def _unpadded(self, s: int, u):
        """Unit u's tensors without the padding, for the walk's reads of it (nested: once)."""
        swapped = self.__dict__.setdefault("_swapped", set())
        if (s, u) in swapped:
            yield
            return
        padded = self.units[s][u]
        self.units[s][u] = [n - a for n, a in zip(padded, self.padding_added[s, u])]
        swapped.add((s, u))
        try:
            yield
        finally:
            self.units[s][u] = padded
            swapped.discard((s, u))

    def transient(self, key, sizes, stream=0) -> None:
        """A block's backward working set beside its real gradients (LoraWalk reads them off the units)."""
        u = self.root_units(key[1]) + key[3] if key[0] == "backward" else None
        if u is None or self._added(key[1], u) is None:
            return super().transient(key, sizes, stream)
        with self._unpadded(key[1], u):
            super().transient(key, sizes, stream)

    def weight_grads(self, s: int, u, made: bool = False) -> None:
        """The unit's real gradients, then its reduce-scatter of the padded ones (reduce_scatter adds the padding of
        the trained tensors: LoraWalk's adapters, else all)."""
        added = self._added(s, u)
        if added is None:
            return super().weight_grads(s, u, made)
        trained = self.trainable(s, u) if hasattr(self, "trainable") else range(len(added))
        self._rs_added = (u, sum(added[i] for i in trained))
        with self._unpadded(s, u):
            super().weight_grads(s, u, made)
        self._rs_added = None

    def reduce_scatter(self, s: int, u, n: int, grads, kept: bool = False, shard_unit=None) -> None:
        extra = getattr(self, "_rs_added", None)
        n += extra[1] if extra is not None and extra[0] == u else self.edge_padding.get(u, 0)
        super().reduce_scatter(s, u, n, grads, kept, shard_unit)

    def grad_bytes(self, s: int, u) -> list[int]:
        if self._added(s, u) is None:
            return super().grad_bytes(s, u)
        with self._unpadded(s, u):
            return super().grad_bytes(s, u)

    def root_grads(self, s: int) -> list[int]:
        if self._added(s, 0) is None:
            return super().root_grads(s)
        with self._unpadded(s, 0):
            return super().root_grads(s)

    def unsharded(self, s: int, u) -> list[int]:
        """The unit's all-gather output without the padding (StagePieces' gathered bytes over its tensors), each
        tensor's padding added in the compute dtype."""
        added = self._added(s, u)
        if added is None:
            return super().unsharded(s, u)
        with self._unpadded(s, u):
            sizes = super().unsharded(s, u)
        return [n + a * self.c for n, a in zip(sizes, added)]


__all__ = ["Dim0PaddingWalk"]
