"""A block's operator inventory, counted op by op in a traced forward and backward (fake tensors).

For families without a formula (cost_models/operators.py prices the others from their structure), the
block memory profile's model (calibration/block_profile.py) runs one more forward and backward with a
TorchDispatchMode per counted block, switched on inside that block only (its forward pre/post hooks, its
backward pre/post hooks): a steady-state block and an MoE's leading dense one in the same run. Each aten op
the block dispatches is filed as
- a matmul (aten.mm, addmm, bmm, baddbmm, _grouped_mm), forward only: (n, k, rows per token, count) -
  the backward's input- and weight-gradient products are priced from these, as for the formula families;
- the attention kernel (the SDPA flash / efficient / cuDNN / CPU-flash forward): 2 B H S S_k (D + D_v)
  FLOPs (D_v of calibration.sdpa_kernels' unequal-head-dims calls, whose own pads and copies are skipped), half
  of it with is_causal (the kernel skips the masked blocks); its backward is priced from the forward; the
  reference (the MFU convention, from which cost_models/operators.py reads S_k) stays 4 B H S S_k D;
- memory-bound: any other op that is not a view: the bytes of its tensor inputs (at most their storage:
  a broadcast table is read once) and outputs, in forward and in backward apart.
Everything per token of the traced micro-batch. What inductor would fuse is not known from an eager trace:
the compiled bytes stay the formula's (operators.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cost_models.specs import TracedOperators

from .sdpa_kernels import emulated_value_head_dim

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_ATTENTION = {_aten._scaled_dot_product_flash_attention.default,
              _aten._scaled_dot_product_efficient_attention.default,
              _aten._scaled_dot_product_cudnn_attention.default,
              _aten._scaled_dot_product_flash_attention_for_cpu.default}
_ATTENTION_BACKWARD_PREFIX = "_scaled_dot_product_"
# no HBM traffic: allocations, aliases (_unsafe_view shares its input's storage without saying so)
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
         "_local_scalar_dense", "set_", "resize_", "_unsafe_view"}


def _nbytes(t: torch.Tensor, read: bool) -> int:
    n = t.numel() * t.element_size()
    return min(n, t.untyped_storage().nbytes()) if read else n


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _arguments(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.recording = None          # None, "forward" or "backward"
        self.matmuls: list[tuple[int, int, int, int]] = []   # (n, k, rows, count) in forward
        self.attention_flops = 0.0
        self.attention_reference = 0.0
        self.memory = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recording is not None:
            self._file(func, args, kwargs, out)
        return out

    def _file(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        value_head_dim = emulated_value_head_dim()  # DeepSeek's MLA: CUDA's kernel on CPU (sdpa_kernels.py)
        if value_head_dim is not None and func not in _ATTENTION:
            return  # the emulation's pads and copies: no GPU kernel's
        if func in _MATMULS or func is _aten._grouped_mm.default:
            if self.recording == "forward":
                self.matmuls.append(_matmul_shape(func, args))
            return
        if func in _ATTENTION:
            a = _arguments(func, args, kwargs)
            q, k = a["query"], a["key"]
            b, h, s, d = q.shape
            full = 2.0 * b * h * s * k.shape[-2] * (d + (value_head_dim or d))  # q k^T, then p v
            self.attention_flops += full / 2 if a.get("is_causal") else full
            self.attention_reference += 4.0 * b * h * s * k.shape[-2] * d  # the MFU convention: 4 q_dim s_k
            return
        if name.startswith(_ATTENTION_BACKWARD_PREFIX) or name in _FREE or _is_view(func):
            return
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:   # a query of metadata (device, sizes): nothing moves
            return
        ins = sum(_nbytes(t, read=True) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        self.memory[self.recording] += ins + sum(_nbytes(t, read=False) for t in outputs)


def _matmul_shape(func, args) -> tuple[int, int, int, int]:
    """(n, k, rows, count) of a forward product."""
    if func is _aten.addmm.default:
        a, b = args[1], args[2]
    elif func is _aten.baddbmm.default:
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    if func is _aten._grouped_mm.default:       # (rows of all experts, k) x (E, k, n)
        experts = b.shape[0]
        return int(b.shape[-1]), int(b.shape[-2]), int(a.shape[0]) // experts, experts
    if a.dim() == 3:                            # bmm: (B, m, k) x (B, k, n)
        return int(b.shape[-1]), int(b.shape[-2]), int(a.shape[1]), int(a.shape[0])
    return int(b.shape[-1]), int(b.shape[0]), int(a.shape[0]), 1


def count_block_operators(model, blocks: list, vocab_size: int, micro_batch: int,
                          seq_len: int) -> list[TracedOperators]:
    """Run one forward + backward of `model` (already under FakeTensorMode and the trace tier's kernel
    choices) and count each of `blocks`' operators per token (module docstring): a counter per block, stacked
    (each sees every op; it files those its block dispatches)."""
    tokens = micro_batch * seq_len
    counters = [_Counter() for _ in blocks]

    def start(counter, mode):
        def hook(*_):
            counter.recording = mode
        return hook

    def stopper(counter):
        def stop(*_):
            counter.recording = None
        return stop

    handles = []
    for block, counter in zip(blocks, counters):
        handles += [block.register_forward_pre_hook(start(counter, "forward")),
                    block.register_forward_hook(stopper(counter)),
                    block.register_full_backward_pre_hook(start(counter, "backward")),
                    block.register_full_backward_hook(stopper(counter))]
    ids = torch.randint(0, vocab_size, (micro_batch, seq_len))
    try:
        with contextlib.ExitStack() as modes:
            for counter in counters:
                modes.enter_context(counter)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            del out
    finally:
        for handle in handles:
            handle.remove()
        for p in model.parameters():
            p.grad = None
    return [TracedOperators(
        matmuls=tuple((n, k, rows / tokens, count) for n, k, rows, count in counter.matmuls),
        attention_flops_per_token=counter.attention_flops / tokens,
        attention_reference_flops=counter.attention_reference / tokens,
        memory_forward_bytes_per_token=counter.memory["forward"] / tokens,
        memory_backward_bytes_per_token=counter.memory["backward"] / tokens) for counter in counters]
