"""What a trace on CPU fake tensors is made to do as a GPU run does (calibration/trace.py's docstring): the CUDA
kernels' choice of saved tensors (dropout, SDPA), transformers' choice of attention mask, and torch._grouped_mm's
meta function for every dtype the real kernels take."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch


@contextmanager
def cuda_kernel_choices():
    """Run the ops whose CPU kernels save different tensors than the CUDA ones a GPU run uses.

    - dropout: the CPU kernel multiplies by a mask kept in the input's dtype; CUDA's fused native_dropout
      keeps a one-byte bool mask. We call native_dropout, which is CUDA's choice on every device.
    - scaled_dot_product_attention with dropout_p > 0: CPU falls back to the math path (fp32 upcast,
      s^2 scores saved); CUDA's flash / memory-efficient kernels take dropout in the kernel and save the
      same q, k, v, output and logsumexp as without dropout (plus an RNG seed). We run it with
      dropout_p=0, which saves exactly those.
    - scaled_dot_product_attention with a v head dim unlike q/k's (DeepSeek MLA): CPU takes the math path
      again, CUDA the memory-efficient kernel; calibration.sdpa_kernels saves what the latter saves.
    Everything else (matmuls, norms, softmax, losses) saves the same tensors on both devices. The two
    functions are swapped on torch.nn.functional for the duration (models look them up at call time), so
    the choice also holds for activation checkpointing's recompute inside backward."""
    import torch.nn.functional as F

    from .sdpa_kernels import sdpa_unequal_head_dims, takes_unequal_head_dims

    sdpa, dropout = F.scaled_dot_product_attention, F.dropout

    def sdpa_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if takes_unequal_head_dims(query, key, value):
            return sdpa_unequal_head_dims(query, key, value, attn_mask, is_causal, scale)
        return sdpa(query, key, value, attn_mask, 0.0, is_causal, scale=scale, **kwargs)

    def dropout_cuda(input, p=0.5, training=True, inplace=False):
        if training and p > 0 and input.is_floating_point() and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    F.scaled_dot_product_attention, F.dropout = sdpa_cuda, dropout_cuda
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout


@contextmanager
def _real_run_masking(is_hf: bool):
    """Make transformers choose the attention mask a real run would.

    Without a KV cache (training), transformers looks for packed sequences in position_ids; on a FakeTensor
    it cannot read the values, takes the tensor for a compile-time trace, and materialises a (b, 1, s, s)
    causal mask that SDPA then converts and saves in every layer (b*s*s*c bytes per layer). On real
    tensors the check finds one sequence per row (our random ids are unpacked) and SDPA runs with
    is_causal and no mask: we give transformers that answer."""
    masking = None
    if is_hf:
        try:
            import transformers.masking_utils as masking
        except ImportError:
            masking = None
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is not None:
        masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original


@contextmanager
def _grouped_mm_shapes_any_dtype():
    """Let torch._grouped_mm (transformers' grouped_mm experts kernel) run on fake tensors of any dtype.

    Its meta function - what FakeTensorMode runs - checks the inputs as the CUDA CUTLASS kernel needs
    them (bf16 only), but the real kernels take fp32 and fp16 too (CPU; CUDA through its fallback path),
    and an fp32 or fp16 run of a mixture-of-experts model goes through them. For those dtypes we give
    FakeTensorMode the output the meta function would make - same shape, the inputs' dtype - skipping
    only the dtype check; bf16 keeps the meta function as it is. The override is a dispatcher
    registration for the Meta key, removed on exit."""
    try:
        from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm
    except ImportError:  # a torch without grouped_mm: nothing to do
        yield
        return

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.dtype == torch.bfloat16 or mat_a.dtype != mat_b.dtype or bias is not None:
            return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        library.impl("_grouped_mm", meta, "Meta")
    try:
        yield
    finally:
        library._destroy()
