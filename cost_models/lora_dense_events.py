"""An MoE model's dense blocks in the LoRA step walk at pp = 1 (DeepSeek's leading first_k_dense_replace blocks, Llama
4's interleaved ones; a mixin ahead of lora_events.LoraWalk in step_allocations._LoraStepWalk).

A dense block's FSDP unit holds a dense model's base tensors (pipeline_allocations.param_tensors of
model_spec.dense_block_spec, MoeSpec.dense_block_params: the ledger's ParamCounts.frozen_dense_delta) and that spec's
adapters (ModelSpec.lora_tensor_elements: under all-linear its MLP's lora.Linear, not the router's and stacks'
ParamWrappers: the ledger's trainable_dense_delta); not checkpointed, it keeps its own saved bytes
(memory_shape's full_dense: moe_events.DenseBlocks.dense_saved, as for full fine-tuning).
"""

from __future__ import annotations

from .model_spec import dense_block_spec
from .moe_events import DenseBlocks
from .pipeline_allocations import param_tensors


class LoraDenseBlocksWalk(DenseBlocks):
    """LoraWalk's units, trainable tensors and saved bytes with an MoE's dense blocks (no dense block: LoraWalk's)."""

    def _units(self, x) -> list[list[int]]:
        units = super()._units(x)
        self.dense = self.model.dense_block_indices()
        if not self.dense:
            return units
        spec = dense_block_spec(self.model)
        adapters = spec.lora_tensor_elements(self.training.lora_rank)
        base = param_tensors(spec, self.model.moe.dense_block_params)
        self.n_dense_base = len(base)
        root = len(units) - x.stage.n_blocks
        return units[:root] + [base + adapters if x.stage.first_block + j in self.dense else unit
                               for j, unit in enumerate(units[root:])]

    def __init__(self, model, training, config, d: int, rank: int):
        super().__init__(model, training, config, d, rank)
        if self.dense:
            self.dense_saved(self.shape)

    def dense_unit(self, s: int, u) -> bool:
        """Whether unit u is a dense block's."""
        return self.block_unit(s, u) in self.dense

    def trainable(self, s: int, u) -> list[int]:
        """A dense block's adapters (after its base tensors), else LoraWalk's."""
        if self.dense_unit(s, u):
            return list(range(self.n_dense_base, len(self.units[s][u])))
        return super().trainable(s, u)

    def gathers_own_tensors(self, s: int, u) -> bool:
        """A dense block's all-gather output and unsharded storage: its tensors (DenseBlocks.unsharded), not the
        sparse block's StagePieces.block_gathered."""
        return self.dense_unit(s, u)
