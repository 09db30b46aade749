"""The step walk's device allocations under CPU offload (FSDP2's CPUOffloadPolicy: config.offload), for
step_allocations' walks (a mixin ahead of one_rank_events.OneRankWalk and theirs).

What FSDP2 (torch 2.13, torch/distributed/fsdp/_fully_shard/) keeps on the host and puts on the device:
- the sharded parameters live on the host (pinned): no device shard (FSDPParam.reset_sharded_param moves them);
- an all-gather's input: for an offloaded parameter _get_param_all_gather_inputs leaves the foreach copy
  (`not fsdp_param.offload_to_cpu`) for FSDPParam.all_gather_inputs, per parameter: the shard copied to the device
  (`sharded_param_data.to(self.device, non_blocking=True)`, stored bytes), then cast to param_dtype where it
  differs (_to_dtype_if_needed; the device copy dropped as the property returns); all of them kept, under the
  copy-in stream, until the all-gather output is allocated and copied into (foreach_all_gather's `del
  param_all_gather_inputs`). At d = 1 the same per parameter in wait_for_unshard (one_rank_events.py);
- foreach_reduce as without offload (the input kept to the next post-backward), but each new sharded gradient is
  copied to the host (`new_sharded_grad.to(torch.device("cpu"), ...)`): the reduce-scatter output goes as
  foreach_reduce returns; gradient accumulation adds into the host's gradient. (Its cast to the parameters' dtype
  where the reduce dtype differs, _to_dtype_if_needed, is not written, as without offload);
- the optimizer steps on the host: no device state, no device temporaries.
QLoRA's QuantStates stay on the device (lora_events.py, as the ledger's quant_state). The ledger (memory.py) keeps
no device states (gpu_states 0) and prices the copy-in source by fsdp2_gathers.copy_in_bytes (the cast only).
"""

from __future__ import annotations

import math

from .pipeline_allocations import ALL_GATHER_STREAM


class OffloadWalk:
    """StepWalk's model states and collectives under CPU offload (without it: theirs)."""

    def alloc(self, key, size_bytes: int, stream=0) -> None:
        if self.config.offload and key[0] == "param":  # the sharded parameters: on the host
            return
        super().alloc(key, size_bytes, stream)

    def param_input(self, s: int, u, i: int, size: int, stream=0):
        """One offloaded parameter's all-gather input: its shard copied to the device in its stored bytes, cast to
        the compute dtype where stored in another (the copy then freed); the key of the input."""
        if not self.config.offload:
            return super().param_input(s, u, i, size, stream)
        shard, width = math.ceil(size / self.d), self.stored_width(s, u, i)
        self.alloc(("h2d", s, u, i), shard if width is None else shard * width // self.c, stream)
        if width is None or width == self.c:
            return ("h2d", s, u, i)
        self.alloc(("cast", s, u, i), shard, stream)
        self.free(("h2d", s, u, i))
        return ("cast", s, u, i)

    def all_gather(self, u) -> None:
        """d > 1: every parameter's input made (param_input, copy-in stream), the all-gather output, the inputs
        freed."""
        if not self.config.offload or self.d <= 1:
            return super().all_gather(u)
        s = self.stage
        sizes = self.unsharded(s, u)
        inputs = [self.param_input(s, u, i, size, ALL_GATHER_STREAM) for i, size in enumerate(sizes)]
        self.alloc(("all_gather", s, u), sum(sizes), ALL_GATHER_STREAM)
        for key in inputs:
            if key:
                self.free(key)
        self.prefetched.add(u)

    def reduce_scatter(self, s: int, u, n: int, grads, kept: bool = False, shard_unit=None) -> None:
        """foreach_reduce as without offload, its output freed once copied to the host: as a later microbatch's
        output is, once added into the sharded gradient (StepWalk.reduce_scatter's `later`)."""
        if self.config.offload:
            self.has_grad.add(u)
        super().reduce_scatter(s, u, n, grads, kept, shard_unit)

    def optimizer_step(self, first: bool) -> None:
        if not self.config.offload:
            super().optimizer_step(first)
