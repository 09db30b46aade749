"""The step walk's unshard under a shard group of one rank (d = 1: a single GPU, FSDP2's NO_SHARD - HSDP over
[replicas, 1] - or HYBRID with a shard group of 1), for step_allocations' walks (a mixin ahead of theirs).

FSDP2 (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) skips the collective there:
- unshard (the pre-forward's, and the backward's prefetch) issues nothing: `if world_size == 1` it records an
  AllGatherResult around the empty `_all_gather_output` and returns; no copy-in source, no all-gather output, and so
  no forward deferral of its free (`world_size > 1` in wait_for_unshard) and no prefetched bytes;
- wait_for_unshard copies each parameter on its own: `all_gather_input = fsdp_param.all_gather_inputs[0]` (the shard
  cast to param_dtype where it is stored in another dtype - _fsdp_param.py all_gather_inputs,
  _to_dtype_if_needed - else the shard itself), then alloc_storage of the parameter's all_gather_outputs[0] (its
  unsharded data, which init_unsharded_param views) and the copy. The local is rebound at the next parameter, after
  that one's cast is made: two casts alive at once, the last freed as the function returns;
- reshard frees each parameter's storage (free_storage), as for d > 1;
- foreach_reduce still runs (_fsdp_collectives.py): the reduce-scatter input (reduce dtype, the unit's gradients
  copied in, kept to the next post-backward) and a full-size output copied from it (`reduce_output.copy_(...)`),
  which is the sharded gradient - the walk's reduce_scatter at d = 1 as it stands.
The root's embedding, final norm and head are parameters of their own here (each cast and copied apart).
Traced: calibration/trace.py at world 1 writes this order (tests/unit/test_one_rank_offload_allocations.py).
Not written: the Float8 all-gather's own pre-all-gather cast (fsdp_pre_all_gather) where the storage is bf16.
"""

from __future__ import annotations

import math


class OneRankWalk:
    """StepWalk's all_gather / unshard / unsharded at d = 1 (d > 1: theirs)."""

    def all_gather(self, u) -> None:
        if self.d > 1:
            return super().all_gather(u)
        self.prefetched.add(u)  # unshard at world size 1 allocates nothing (its wait_for_unshard does)

    def unsharded(self, s: int, u) -> list[int]:
        """At d = 1 the root's tensors each its own allocation: embedding, final norm (and the rest), head."""
        sizes = super().unsharded(s, u)
        if self.d > 1 or isinstance(u, str) or u >= self.root_units(s):
            return sizes
        m, root = self.model, self.units[s][u][0]
        emb = min(m.embedding_params, root)
        other = min(m.root_other_params, root - emb)
        parts = [n for n in (emb, other, root - emb - other) if n]
        return [sizes[0] * n // root for n in parts[:-1]] + [sizes[0] - sum(sizes[0] * n // root for n in parts[:-1])]

    def param_input(self, s: int, u, i: int, size: int, stream=0):
        """One parameter's all-gather input (size: its unsharded bytes): its shard cast to the compute dtype where
        stored in another (the key of that tensor), else the shard itself (None). stored_width: the walk's (the step
        walk's for full fine-tuning, LoraWalk's)."""
        width = self.stored_width(s, u, i)
        if width is None or width == self.c:
            return None
        self.alloc(("cast", s, u, i), math.ceil(size / self.d), stream)
        return ("cast", s, u, i)

    def unshard(self, u, backward: bool = False) -> None:
        """wait_for_unshard at world size 1: per parameter its input (param_input), the previous parameter's freed,
        its unsharded storage; the last input freed at the end."""
        if self.d > 1:
            return super().unshard(u, backward)
        if u in self.gathered_units:
            return
        s = self.stage
        self.prefetched.discard(u)
        previous = None
        for i, size in enumerate(self.unsharded(s, u)):
            current = self.param_input(s, u, i, size)
            if previous:
                self.free(previous)
            previous = current
            self.alloc(("unsharded", s, u, i), size)
        if previous:
            self.free(previous)
        self.gathered_units.add(u)
