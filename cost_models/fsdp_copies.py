"""The memory traffic FSDP adds around its collectives, by API, in bytes read + written (torch 2.13), for
step_time.py's memory-bound seconds. Widths: s the stored (sharded) parameters', c the compute dtype's (the
unsharded parameters and their gradients), r the reduction's; d the shard group, W the data-parallel ranks.

FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), per all-gather of a unit:
- copy-in (foreach_all_gather): under mixed precision _get_param_all_gather_inputs casts the trainable shards to
  param_dtype in one _foreach_copy_ (read s, write c per shard element; frozen weights kept in c have param_dtype
  None and skip it: FSDPParam.init_dtype_attrs), then all_gather_copy_in copies every shard into the all-gather
  input (read + write, per shard element, what the collective sends);
- copy-out (foreach_all_gather_copy_out): split_with_sizes_copy of the whole output into each unsharded parameter
  (read + write per gathered element).
Per reduce-scatter (foreach_reduce): foreach_reduce_scatter_copy_in's _chunk_cat packs the unsharded gradients into
the reduce-scatter input in reduce_dtype (read c, write r per element), always a copy; no division for fp32 / bf16
(_get_gradient_divide_factors: NCCL's AVG); the output shard cast to the parameters' dtype when r differs
(_to_dtype_if_needed: read r, write s per shard element).

FSDP1 (torch/distributed/fsdp/_flat_param.py, _runtime_utils.py), per all-gather of a unit: straight into the
padded unsharded flat parameter (FlatParamHandle._all_gather_flat_param), the original parameters views of it
(_use_unsharded_views): no copy-in, no copy-out; under mixed precision the shard's cast (_use_low_precision_shard:
read s, write c per shard element of the trainable units; frozen ones are stored in c: no cast). Per backward: the
views' gradients joined into the flat gradient by autograd's backward of their torch.split (_get_unflat_views_*:
a cat, read + write c per element). Per reduce-scatter (_post_backward_hook, _reduce_grad): the flat gradient cast
to the reduce dtype when it differs (read c, write r), divided in place before the collective and its shard after
(_div_if_needed with DefaultState._get_gradient_predivide_factor(W) and W over it, each where above 1: read + write
r), the shard cast to the parameters' dtype when r differs (_cast_grad_to_param_dtype: read r, write s).

Both, every micro-step after the first of a step: the new gradient shard added to the kept one (FSDP2 `+=` on the
sharded grad in foreach_reduce, FSDP1 _accumulate_sharded_grad: read 2 s, write s per shard element).

Ignored: FSDP1's F.pad of a flat gradient whose length is not a multiple of d (_get_reduce_scatter_tensors; never
with use_orig_params, whose flat parameter is padded to a multiple of d at flatten_tensors), FSDP2's chunk / cat
copies of parameters sharded on dim 1 (MoE's expert_shard_dim 1) and its reshard_after_forward=N post-forward shard
copies, NO_SHARD's (d = 1: priced 0).
"""

from __future__ import annotations

from .spec_values import Precision
from .units import DTYPE_BYTES


def predivide_factor(world: int) -> int:
    """FSDP1's gradient pre-divide factor for W data-parallel ranks (torch/distributed/algorithms/_comm_hooks/
    default_hooks.py DefaultState._get_gradient_predivide_factor); the post-divide is W over it."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return factor


def gather_copy_bytes(fsdp2: bool, precision: Precision, gathered_bytes: float, trainable_elements: float,
                      trainable_bytes: float, d: int) -> float:
    """Bytes moved around one all-gather of units that gather `gathered_bytes` (what the collective moves), of which
    `trainable_elements` stored in s and gathered as `trainable_bytes` (c each; FP8 all-gather: 1)."""
    cast = (trainable_elements * DTYPE_BYTES[precision.param_dtype] + trainable_bytes) / d if precision.mixed else 0.0
    if not fsdp2:
        return cast
    return cast + 2 * gathered_bytes / d + 2 * gathered_bytes


def reduce_copy_bytes(fsdp2: bool, precision: Precision, reduce_dtype: str, elements: float, d: int,
                      world: int) -> float:
    """Bytes moved around one gradient reduce-scatter of `elements` trainable parameters over d ranks, W
    data-parallel ranks in all (FSDP1's divisions)."""
    c, r = DTYPE_BYTES[precision.compute_dtype], DTYPE_BYTES[reduce_dtype]
    s = DTYPE_BYTES[precision.param_dtype]
    shard_cast = elements / d * (r + s) if r != s else 0.0
    if fsdp2:
        return elements * (c + r) + shard_cast
    pre = predivide_factor(world)
    return (2 * elements * c                                  # the split's backward: the flat gradient's cat
            + (elements * (c + r) if c != r else 0.0)         # cast to the reduce dtype
            + (2 * elements * r if pre > 1 else 0.0)          # pre-divide, the whole flat gradient
            + (2 * elements / d * r if world / pre > 1 else 0.0)  # post-divide, the shard
            + shard_cast)


def accumulate_bytes(precision: Precision, elements: float, d: int) -> float:
    """Bytes of adding one micro-step's gradient shard to the kept one (either API)."""
    return 3 * elements / d * DTYPE_BYTES[precision.param_dtype]
