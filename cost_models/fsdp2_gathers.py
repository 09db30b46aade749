"""FSDP2's all-gather transients beside the unsharded parameters, in bytes per rank (torch 2.13,
torch/distributed/fsdp/_fully_shard/), for the ledger's moments around a block's all-gather (memory.py):

- the copy-in source: foreach_all_gather's _get_param_all_gather_inputs casts every shard stored in another dtype
  than param_dtype into one new flat tensor (torch.empty of their numel in param_dtype, then _foreach_copy_), whose
  views the local all_gather_inputs list keeps until foreach_all_gather returns - after the all-gather output is
  allocated beside it (all_gather_copy_in then copies it into the output's rank slice). Shards already stored in
  param_dtype go in as they are (FSDPParam.init_dtype_attrs: param_dtype None). In the backward the pre-backward of
  block i first copies its own prefetched all-gather output out (wait_for_unshard: output and unsharded parameters
  alive at once, the output freed as it returns; the last block stays gathered from its forward), then issues block
  i-1's prefetch (FSDPParamGroup.pre_backward -> _backward_prefetch) with block i gathered;
- the forward's deferred free: with implicit forward prefetching (not async_op, d > 1) wait_for_unshard keeps the
  copied-out all-gather result in comm_ctx.all_gather_state and drops it at the next unit's wait_for_unshard - but
  through the walrus local `prev_all_gather_state`, which holds it until that function returns, after the next
  unit's copy-out: block i-1's all-gather output, block i's and block i's unsharded parameters at once.

Measured on verl 0.9.1's FSDP2 LoRA update on 2 gloo ranks (tests/distributed/test_torchrun_verl_actor.py: the
fp32-stored base cast at every all-gather, the backward's prefetch the peak from 256 tokens a rank; the forward's
copy-out below) and against the trace tier (docs/accuracy.md: a full fine-tune's backward copy-out). Ignored: the
FP8 all-gather's own inputs (fsdp_pre_all_gather), a second prefetch without the rate limiter.
"""

from __future__ import annotations


def copy_in_bytes(trainable_elements: int, frozen_elements: int, p: int, frozen_p: int, c: int, d: int) -> int:
    """The copy-in source of one unit's all-gather: its shards stored in p (trainable) or frozen_p (frozen) bytes,
    cast to the compute dtype's c where they differ from it."""
    cast = trainable_elements * (p != c) + frozen_elements * (frozen_p != c)
    return -(-cast * c // d)
