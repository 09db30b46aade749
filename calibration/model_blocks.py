"""A model's repeated blocks, as FSDP units, checkpointing, Float8 and tensor parallelism find them: their
classes (by name, else the class repeated most), their slots in the module tree (through checkpoint and FSDP1
wrappers) and a block's expert modules."""

from __future__ import annotations

from collections import Counter

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FullyShardedDataParallel


def block_classes(model: nn.Module, name: str | None) -> set[type]:
    """The classes named `name` among the model's modules, else block_classes_for's guess."""
    classes = {type(m) for m in model.modules() if name and type(m).__name__ == name}
    return classes or block_classes_for(model)


def block_classes_for(model: nn.Module) -> set[type]:
    """Fallback detector of the repeated block: the class repeated most inside ModuleLists, weighted by
    parameters (so a list of tiny modules loses to the list of decoder layers)."""
    weight: Counter = Counter()
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                weight[type(child)] += sum(p.numel() for p in child.parameters())
    weight = Counter({cls: w for cls, w in weight.items() if w > 0})
    if not weight:
        raise ValueError(f"no nn.ModuleList of parameterised modules in {type(model).__name__}; "
                         "name the block class explicitly")
    return {weight.most_common(1)[0][0]}


def _block_slots(model: nn.Module, block_classes: set[type]) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of each block in module order, looking through checkpoint wrappers and FSDP1
    wrappers; blocks nested inside a block are not separate slots."""
    classes = tuple(block_classes)
    slots: list[tuple[nn.Module, str]] = []

    def unwrap(module):
        while isinstance(module, (CheckpointWrapper, FullyShardedDataParallel)):
            module = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) \
                else module._fsdp_wrapped_module
        return module

    def visit(parent):
        for name, child in parent.named_children():
            if isinstance(unwrap(child), classes):
                slots.append((parent, name))
            else:
                visit(child)

    visit(model)
    return slots


def expert_modules(block: nn.Module) -> list[nn.Module]:
    """The modules holding a block's stacked expert tensors (fsdp_options.IS_EXPERTS_MODULE)."""
    return [m for m in block.modules() if any(p.ndim == 3 for p in m.parameters(recurse=False))]

