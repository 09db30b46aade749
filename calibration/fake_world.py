"""The fake world a trace runs in: a fake process group of the real world size (rank 0 is us), DTensor made to
behave under FakeTensorMode as on a real run, and meta parameters made fake (calibration/trace.py)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .trace_result import TraceError


class _FakeWorld:
    """A fake process group of `world_size` ranks for the duration of a trace (rank 0 is us).

    An already initialised fake group of the same size is reused and left alone; any other initialised
    group is an error (the trace would shard over the wrong world)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.owned = False

    def __enter__(self):
        if dist.is_initialized():
            if dist.get_backend() == "fake" and dist.get_world_size() == self.world_size:
                return self
            raise TraceError(f"a {dist.get_backend()} process group of {dist.get_world_size()} ranks is already "
                             f"initialised; the trace needs its own fake group of {self.world_size}")
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=self.world_size, store=FakeStore())
        self.owned = True
        return self

    def __exit__(self, *exc):
        if self.owned:
            dist.destroy_process_group()
            _forget_dtensor_placements()


def _forget_dtensor_placements() -> None:
    """Clear DTensor's sharding-propagation caches once a fake world is gone.

    They are keyed by op schemas whose meshes compare equal across worlds (a tp=2 sub-mesh of 16 ranks
    equals another one of 16 ranks, whatever the other dims), and their
    answers hold the old meshes, whose process groups (by name) died with the world: the next trace of
    the same mesh shape in this process would redistribute over a group that no longer exists ("Could
    not resolve the process group registered under the name ...")."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python caches and the C++ dispatch fast path's
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


@contextmanager
def _dtensors_under_fake_mode():
    """Two things DTensor does differently when the whole step already runs under FakeTensorMode, put back
    as a real run does them (both patches are undone on exit):

    - DeviceMesh creation. A mesh holds real rank tensors; built inside FakeTensorMode it fails
      (pitfalls.md). make_mesh runs outside the mode, but fully_shard on tensor-parallel parameters
      concatenates the data-parallel and the TP meshes into a new one (FSDPParam._init_sharding_spec_tp,
      DeviceMesh._concatenate) while the fake parameters are being sharded: DeviceMesh.__init__ runs under
      unset_fake_temporarily.
    - Shape propagation. For some ops (loss parallel's log-softmax and nll handlers, ops whose output
      metadata is not cached) DTensor runs the op once on *global-shape* fake tensors to learn the output's
      shape (ShardingPropagator._propagate_tensor_meta_non_cached, `detect_fake_mode() or FakeTensorMode()`).
      On a real run that is a private FakeTensorMode the memory tracker never sees; inside the trace it
      finds the trace's own mode and the tracker counts those global tensors as allocations (loss parallel:
      two fp32 b x s x V tensors, +24% over the real run of a tiny Llama, tp 2). It runs with the
      dispatch modes set aside, so it takes a private FakeTensorMode as on a real run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    mesh_init = DeviceMesh.__init__
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def init_outside_fake_mode(self, *args, **kwargs):
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    def propagate_untracked(self, op_schema):
        with _disable_current_modes():
            return propagate(self, op_schema)

    DeviceMesh.__init__ = init_outside_fake_mode
    ShardingPropagator._propagate_tensor_meta_non_cached = propagate_untracked
    try:
        yield
    finally:
        DeviceMesh.__init__ = mesh_init
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate


def _meta_to_fake(model: nn.Module) -> None:
    """Replace every meta parameter and buffer with a fresh (fake, under FakeTensorMode) CPU tensor of the
    same shape and dtype, one per original so tied weights stay tied. Module.to_empty would call
    empty_like on the meta tensors, which FakeTensorMode refuses as non-fake inputs."""
    made: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return made[id(t)]

    for module in model.modules():
        for slots, param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(slots.items()):
                if t is not None and t.device.type == "meta":
                    slots[name] = fresh(t, param)
