"""Live tensor storages by bytes, as a dispatch mode sees the ops make them (benchmarks/float8_memory.py,
benchmarks/peft_moe_lora.py). Each storage is counted once, as the op that makes it returns, and freed when its last
reference goes (a weakref per storage); the peak, and what was live at it. Imports torch alone: float8_memory.py
runs in a venv of its own without the project on its path and imports this module from its own folder.

    mode = LiveBytes(ignored=[*model.parameters(), x])   # real tensors (TorchDispatchMode)
    mode = FakeLiveBytes(on=False)                       # fake tensors (FakeTensorMode); mode.on = True to count
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Counter:
    """live: storage id -> (bytes, made by, shape, dtype); made: (made by, shape, bytes) in order; current, peak
    bytes; peak_live: live's values at the peak. Storages of `ignored` (parameters, inputs) are never counted."""

    def __init__(self, ignored=(), on: bool = True):
        super().__init__()
        self.ignored = {id(t.untyped_storage()) for t in ignored}
        self.live, self._refs, self.on = {}, {}, on
        self.current = self.peak = 0
        self.peak_live: list = []
        self.made: list[tuple[str, tuple, int]] = []

    def count(self, out, made_by: str) -> None:
        """Every tensor among an op's outputs that this mode counts (counts())."""
        for t in tree_flatten(out)[0]:
            if self.counts(t):
                self.track(t, made_by)

    def track(self, t: torch.Tensor, made_by: str) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live or key in self.ignored:
            return
        nbytes = storage.nbytes()
        self.live[key] = (nbytes, made_by, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self.made.append((made_by, tuple(t.shape), nbytes))
        self.current += nbytes
        if self.current > self.peak:
            self.peak, self.peak_live = self.current, list(self.live.values())

    def _free(self, key) -> None:
        self.current -= self.live.pop(key)[0]


class LiveBytes(_Counter, TorchDispatchMode):
    """Real tensors: every tensor an op returns."""

    @staticmethod
    def counts(t) -> bool:
        return isinstance(t, torch.Tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on:
            self.count(out, func.overloadpacket.__name__)
        return out


class FakeLiveBytes(_Counter, FakeTensorMode):
    """Fake tensors (FakeTensorMode): the plain FakeTensors an op returns, those made inside a tensor subclass's
    ops (torchao's Float8TrainingTensor) included, not the subclass wrappers themselves."""

    @staticmethod
    def counts(t) -> bool:
        return type(t).__name__ == "FakeTensor"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.on and out is not NotImplemented:
            self.count(out, func.overloadpacket.__name__)
        return out
