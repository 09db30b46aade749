"""Context parallelism on CPU: torch's ring attention given the CPU SDPA kernel.

torch.distributed.tensor.experimental.context_parallel patches F.scaled_dot_product_attention so that q, k, v
become sequence-sharded DTensors, and registers DTensor handlers that turn the CUDA SDPA kernels (flash,
memory-efficient, cuDNN) into ring attention (_templated_ring_attention: the K/V chunks travel the ring, the
partial outputs are merged by their logsumexp). On CPU, SDPA dispatches `aten._scaled_dot_product_flash_attention_
for_cpu`, which has no handler and no sharding strategy (pitfalls.md): context_parallel fails at the first
attention call. `cpu_ring_attention()` registers the missing handlers for the CPU kernel and its backward,
running the same ring (_templated_ring_attention / _templated_ring_attention_backward) with the CPU kernel per
chunk. The kernels' signatures differ from the CUDA flash kernel's only in what the ring does not read (no
cum_seq / philox outputs, an attn_mask keyword): the per-chunk call passes query, key, value, is_causal,
dropout_p and scale, and reads (out, logsumexp) forward, (grad_q, grad_k, grad_v) backward.

The handlers wrap their local results as DTensors with the query's placements (the output; the logsumexp of
shape (b, heads, s) on the same sequence dim), which is what the CUDA path's sharding rule gives.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

aten = torch.ops.aten
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # (batch, heads, seq, head_dim), as the CUDA ring handlers hard-code it


def _spec_like(dtensor, local: torch.Tensor, global_shape: tuple[int, ...]):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = torch.empty(global_shape, device="meta").stride()
    return DTensorSpec(dtensor._spec.mesh, dtensor._spec.placements,
                       tensor_meta=TensorMeta(torch.Size(global_shape), stride, local.dtype))


def _wrap(dtensor, local: torch.Tensor, global_shape: tuple[int, ...]):
    from torch.distributed.tensor import DTensor

    return DTensor(local, _spec_like(dtensor, local, global_shape), requires_grad=False)


def _cpu_ring_handler(op_call, args, kwargs):
    """The DTensor handler of the CPU flash kernel and its backward: ring attention over the mesh of q."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )

    kwargs = dict(kwargs or {})
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("CPU ring attention: an explicit attn_mask is not supported (causal or none)")
    kwargs.pop("attn_mask", None)
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    if op_call is CPU_FLASH:
        names = ("query", "key", "value", "dropout_p", "is_causal")
        bound = {**dict(zip(names, args)), **kwargs}
        query = bound["query"]
        group = query._spec.mesh.get_group()
        out, lse = _templated_ring_attention(
            group, SEQ_DIM, CPU_FLASH, query=local(query), key=local(bound["key"]), value=local(bound["value"]),
            is_causal=bound.get("is_causal", False), dropout_p=bound.get("dropout_p", 0.0), scale=bound.get("scale"))[:2]
        b, h, s, _ = query.shape
        return _wrap(query, out, tuple(query.shape[:3]) + (out.shape[-1],)), _wrap(query, lse, (b, h, s))
    names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
    bound = {**dict(zip(names, args)), **kwargs}
    query, key, value = bound["query"], bound["key"], bound["value"]
    group = query._spec.mesh.get_group()
    grads = _templated_ring_attention_backward(
        group, SEQ_DIM, CPU_FLASH_BACKWARD, grad_out=local(bound["grad_out"]), grad_out_name="grad_out",
        query=local(query), key=local(key), value=local(value), out=local(bound["out"]),
        logsumexp=local(bound["logsumexp"]), is_causal=bound.get("is_causal", False),
        dropout_p=bound.get("dropout_p", 0.0), scale=bound.get("scale"))[:3]
    return tuple(_wrap(t, g, tuple(t.shape)) for t, g in zip((query, key, value), grads))


@contextmanager
def cpu_ring_attention():
    """Inside torch's context_parallel(...): let the CPU SDPA kernel reach ring attention (module docstring).
    Enter it inside context_parallel, which installs its own handlers on entry and restores the originals
    on exit."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    before = dispatcher._custom_op_handlers
    dispatcher._custom_op_handlers = {**before, CPU_FLASH: _cpu_ring_handler, CPU_FLASH_BACKWARD: _cpu_ring_handler}
    try:
        yield
    finally:
        dispatcher._custom_op_handlers = before


@contextmanager
def sequence_sharded(cp_mesh, buffers: list[torch.Tensor]):
    """torch's context_parallel on `cp_mesh` with `buffers` (token ids, labels, position ids: their dim 1 the
    sequence) sharded in place with its load balancing (rank r keeps chunks r and 2 cp - 1 - r of 2 cp) and not
    restored, and ring attention reaching the CPU SDPA kernel (cpu_ring_attention)."""
    from torch.distributed.tensor.experimental import context_parallel

    with context_parallel(cp_mesh, buffers=list(buffers), buffer_seq_dims=[1] * len(buffers),
                          no_restore_buffers=set(buffers)), cpu_ring_attention():
        yield
