"""Kernels a user switches on per op class (issue 26): what each saves for backward, what it holds on top, and
the HBM bytes it moves, read from the kernel's own code (Liger Kernel 0.8.5, Transformer Engine 2.20,
torchtitan 0.3.0). FsdpConfig.norm_kernel / rope_kernel / swiglu_kernel / loss_kernel choose them; eager is
the model's own PyTorch ops (activations.py, operators.py, loss_memory.py price those).

Saved for backward (c = compute-dtype bytes, per token; h hidden, f FFN width):
- RMSNorm. liger_kernel/ops/rms_norm.py LigerRMSNormFunction.forward: save_for_backward(X, W, RSTD), X the
  input (a view), RSTD one fp32 per row; its backward writes dX into dY (in_place=True). Transformer Engine
  transformer_engine/pytorch/ops/basic/rmsnorm.py RMSNorm.op_forward: save_for_backward(x, rstdevs). Both:
  the input c*h (and a per-row scalar), where the eager fp32-upcast norm keeps 4h + c*h; the block input
  itself for the first norm (as LayerNorm's).
- SwiGLU. liger_kernel/ops/swiglu.py LigerSiLUMulFunction.forward: save_for_backward(a, b), gate and up
  (2cf), silu recomputed in backward, whose kernel writes da and db into a and b (swiglu_backward: tl.store
  into a_ptr, b_ptr): the MLP backward holds the incoming c*h and fc2's input gradient c*f, nothing more.
  Transformer Engine ops/basic/swiglu.py SwiGLU.op_forward: save_for_backward(input_) - the [gate | up]
  input, 2cf - and op_backward allocates its 2cf gradient before clear_tensor_data(input_): the eager
  chain's working set. Eager SwiGLU keeps gate, act(gate), up (3cf).
- RoPE. liger_kernel/ops/rope.py LigerRopeFunction: save_for_backward(cos, sin), rotating q and k in place
  (rope_forward); Transformer Engine attention/rope.py FusedRoPEFunc: save_for_backward(freqs, ...). Eager
  rotary saves only the cos / sin tables as well (q * cos saves cos): no per-token change; the rotated q and
  k are SDPA's saved inputs in every case.
- Loss: liger_loss_bytes and chunked_loss_bytes below.
The routed experts of an MoE block keep their own kernels (Liger's SwiGLU module replaces dense and shared
MLPs only); a model priced by a traced block profile keeps its traced bytes, but for its RMSNorms, whose eager
chains the time swaps for the kernel's (kernel_block_ops; its saved bytes stay the trace's).

Time: a Liger or TE kernel is one kernel each way, reading its inputs and writing its outputs once: the
op's fused bytes (operators.py), whether the block is compiled or not.

Checked against CPU re-implementations of the same autograd functions (calibration/kernel_functions.py: the
same save_for_backward sets, the same in-place writes and chunking, run on real CPU tensors under the
project's memory tracker; Liger and TE run only on GPUs) and a real CPU run of torchtitan's
ChunkedLossWrapper: tests/unit/test_kernels_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import loss_memory, operators
from .operators import BlockOps, MemoryOp
from .specs import FsdpConfig, Kernel, LossKernel, ModelSpec

LIGER_CHUNK_MEM_CONST = 1   # liger_kernel/ops/fused_linear_cross_entropy.py _CHUNK_MEM_CONST (0.8.5)
TORCHTITAN_LOSS_CHUNKS = 8  # torchtitan/components/loss.py ChunkedLossWrapper.Config.num_chunks (0.3.0)


@dataclass(frozen=True)
class Kernels:
    """The kernel of each op class of one configuration."""

    norm: Kernel = Kernel.EAGER
    rope: Kernel = Kernel.EAGER
    swiglu: Kernel = Kernel.EAGER
    loss: LossKernel = LossKernel.EAGER

    @classmethod
    def of(cls, config: FsdpConfig) -> "Kernels":
        return cls(config.norm_kernel, config.rope_kernel, config.swiglu_kernel, config.loss_kernel)

    @property
    def fused_norm(self) -> bool:
        return self.norm is not Kernel.EAGER

    @property
    def fused_swiglu(self) -> bool:
        return self.swiglu is not Kernel.EAGER

    @property
    def fused_kinds(self) -> frozenset[str]:
        """The op classes (operators.MemoryOp.kind) that run one kernel each way."""
        return frozenset(k for k, v in (("norm", self.norm), ("rope", self.rope), ("swiglu", self.swiglu))
                         if v is not Kernel.EAGER)


EAGER = Kernels()


def kernel_block_ops(ops: BlockOps, kernels: Kernels) -> BlockOps:
    """A block's memory-bound ops with the chosen kernels' bytes (their fused bytes). A traced inventory: the
    chains identified in it (BlockOps.traced_identified, its RMSNorms) leave the traced bytes for the kernel's;
    the rest keeps its traced bytes (operators._identified says why)."""
    kinds = kernels.fused_kinds
    if not kinds:
        return ops
    if not ops.traced:
        return replace(ops, memory_ops=tuple(operators.fused(op) if op.kind in kinds else op for op in ops.memory_ops))
    swapped = [op for op in ops.traced_identified if op.kind in kinds]
    if not swapped:
        return ops
    (chain,) = ops.memory_ops  # operators._from_trace: one traced chain
    forward = chain.forward_bytes - sum(op.forward_bytes - op.fused_forward_bytes for op in swapped)
    backward = chain.backward_bytes - sum(op.backward_bytes - op.fused_backward_bytes for op in swapped)
    kernel = replace(chain, forward_bytes=forward, backward_bytes=backward,
                     fused_forward_bytes=min(chain.fused_forward_bytes, forward),
                     fused_backward_bytes=min(chain.fused_backward_bytes, backward))
    return replace(ops, memory_ops=(kernel,))


def root_op_bytes(op: MemoryOp, model: ModelSpec, config: FsdpConfig, c: int) -> tuple[float, float]:
    """(forward, backward) bytes per token of one of the root's ops (operators.root_ops) as the step runs it.

    The final norm: fused with a norm kernel. The loss: eager, or compiled whole (config.loss_compiled); Liger's
    fused linear cross-entropy: liger_cross_entropy_kernel reads each logit twice (the online max / sum pass,
    then the gradient pass) and writes its gradient in place, 3c, nothing in backward; zeros_like(grad_input)
    writes c*h. torchtitan's chunked loss: the inner cross-entropy's bytes (eager, or compiled with
    compile_loss), + per h element the chunk's gradient cast to fp32 (c + 4), stored into GradAccumulator's
    zeroed fp32 buffer (4 + 4 + 4) and cast back (4 + c). Ignored: the h-wide copies of a split along the
    sequence (none for micro-batch 1), Liger's scaling of grad_weight when grad_output != 1 (per micro-step)."""
    if op.kind == "norm":
        return op.bytes(config.norm_kernel is not Kernel.EAGER, False), op.bytes(config.norm_kernel is not Kernel.EAGER,
                                                                                  True)
    if op.kind != "loss" or config.loss_kernel is LossKernel.EAGER:
        fused = op.kind == "loss" and config.loss_compiled
        return op.bytes(fused, False), op.bytes(fused, True)
    v, h = model.vocab_size, model.hidden_size
    if config.loss_kernel is LossKernel.LIGER:
        return 3 * c * v + c * h, 0.0
    compiled = config.compile and config.compile_loss
    return op.bytes(compiled, False) + (2 * c + 20) * h, op.bytes(compiled, True)


def liger_chunk_rows(tokens: int, model: ModelSpec) -> int:
    """Rows of one chunk of Liger's fused linear cross-entropy (fused_linear_cross_entropy_forward):
    next_power_of_2(cdiv(BT, cdiv(V, C * H))), at most BT."""
    inc = -(-model.vocab_size // (LIGER_CHUNK_MEM_CONST * model.hidden_size))
    return min(tokens, 1 << max(0, (-(-tokens // inc) - 1).bit_length()))


def liger_loss_bytes(model: ModelSpec, c: int, tokens: int, head_grad: bool = True) -> int:
    """Bytes Liger's fused linear cross-entropy holds at its peak beyond the head's input (the hidden states,
    which the root's saved bytes count; the function frees them on return, keeping its grad_input instead).

    liger_kernel/ops/fused_linear_cross_entropy.py fused_linear_cross_entropy_forward (0.8.5): grad_input =
    zeros_like(input) (c*h per token) and grad_weight = zeros_like(weight) (V x h in the gathered weight's
    dtype, c under mixed precision), both kept for backward, where they become the hidden states' and the
    head's gradients; loss_1d (fp32) and target_mask (bool) per row; one chunk's logits (chunk x V in c: the
    cross-entropy kernel writes their gradient in place, then two matmuls fold it into grad_input and
    grad_weight). head_grad False: a frozen head (LoRA) makes no grad_weight (0.8.5: `if weight_needs_grad else
    None`, weight_needs_grad = weight.requires_grad)."""
    v, h = model.vocab_size, model.hidden_size
    return tokens * (c * h + 5) + v * h * c * head_grad + liger_chunk_rows(tokens, model) * v * c


def chunked_loss_bytes(model: ModelSpec, c: int, tokens: int, compiled: bool, head_grad: bool = True) -> int:
    """Bytes torchtitan's ChunkedLossWrapper (torchtitan/components/loss.py, 0.3.0) holds at its peak beyond
    the hidden states it chunks (which the root's saved bytes count as the head's input).

    It runs lm_head, the loss and their backward chunk by chunk (T / 8 tokens each) inside the loss call,
    beside GradAccumulator's fp32 buffer (torch.zeros_like(hidden, dtype=float32): 4h per token) and, from
    the second chunk, the head's weight gradient accumulated so far (V x h in c). A chunk peaks either in the
    loss's backward - the inner cross-entropy's peak per logit (loss_memory.loss_events; compiled: compile
    components "loss"), plus the chunk's logits, which the loop's `logits` keeps alive through it - or in
    lm_head's backward (the logits and their gradient in c, the chunk's input gradient c*h, and the new weight
    gradient beside the accumulated one until AccumulateGrad adds it in place). head_grad False: a frozen head
    (LoRA), whose backward makes no weight gradient."""
    chunk = tokens / TORCHTITAN_LOSS_CHUNKS
    v, h = model.vocab_size, model.hidden_size
    head = v * h * c * head_grad
    at_loss = chunk * v * (loss_memory._loss_bytes(c, compiled)[1] + (0 if compiled else c)) + head
    at_head = chunk * (2 * v * c + h * c) + 2 * head
    return round(4 * h * tokens + max(at_loss, at_head))


def memory_kernels(config: FsdpConfig) -> Kernels:
    """The kernels whose memory the ledger prices: all of them without tensor or pipeline parallelism; with
    them, the eager ops' bytes stand (an upper bound: sequence parallelism's split of the norms' saved bytes,
    tensor_parallel.py, and the pipeline stages' pieces are the eager ops')."""
    return Kernels.of(config) if config.tp == 1 and config.pp == 1 else EAGER


def loss_peak_bytes(model: ModelSpec, c: int, config: FsdpConfig, kernels: Kernels, tokens: int,
                    eager_peak_bytes: int, head_grad: bool = True) -> int:
    """The loss's bytes at its peak on `tokens` tokens: eager_peak_bytes (the model's own loss, the ledger's
    figure) or the loss kernel's (liger_loss_bytes, chunked_loss_bytes; head_grad False: the head frozen)."""
    if kernels.loss is LossKernel.EAGER:
        return eager_peak_bytes
    if kernels.loss is LossKernel.LIGER:
        return liger_loss_bytes(model, c, tokens, head_grad)
    return chunked_loss_bytes(model, c, tokens, config.compile and config.compile_loss, head_grad)


def loss_reserved_extra_bytes(model: ModelSpec, c: int, config: FsdpConfig, kernels: Kernels, tokens: int,
                              eager_bytes: int) -> int:
    """Bytes the caching allocator strands above the loss's peak (loss_memory): eager_bytes for the model's
    own loss; a chunk's for the chunked loss's inner cross-entropy; none for Liger's (one chunk buffer)."""
    if kernels.loss is LossKernel.EAGER:
        return eager_bytes
    if kernels.loss is LossKernel.LIGER:
        return 0
    chunk = tokens // TORCHTITAN_LOSS_CHUNKS
    return chunk * loss_memory.logits_reserved_extra_bytes_per_token(model, c, config.compile and config.compile_loss)


def head_seconds(rates, head, tokens: int, config: FsdpConfig, model: ModelSpec) -> float:
    """The output head's three products (logits, the input's and the weight's gradients; 2 x tokens x V x h FLOPs
    each) as the loss runs them: on all the micro-batch's rows at once, or chunk by chunk - Liger's fused linear
    cross-entropy on liger_chunk_rows rows (torch.mm / addmm per chunk, fused_linear_cross_entropy_forward),
    torchtitan's chunked loss on T / 8 - at the same FLOPs, each chunk's product at the shape factor of its rows
    (kernel_time.Rates.matmul_forward_s): nothing recomputed, the skinnier products slower."""
    rows = {LossKernel.LIGER: liger_chunk_rows(tokens, model),
            LossKernel.CHUNKED: tokens // TORCHTITAN_LOSS_CHUNKS}.get(config.loss_kernel, tokens) or tokens
    if rows == tokens:
        return 3 * rates.matmul_forward_s(head, tokens)
    return 3 * rates.matmul_forward_s(head, rows) * tokens / rows


_OP_OF = {"norm_kernel": ("norm", "RMSNorm"), "rope_kernel": ("rope", "rotary embedding"),
          "swiglu_kernel": ("swiglu", "SwiGLU MLP")}


def kernel_refusal(model: ModelSpec, config: FsdpConfig) -> tuple[str, str] | None:
    """(field, reason) for a kernel the model has no op for; None when every chosen kernel applies. An MoE model's
    routed experts keep their own kernels (priced eager) beside a SwiGLU kernel; a model priced by a traced block
    profile keeps its traced (eager) block bytes, and its time but for the RMSNorms (kernel_block_ops): the other
    kernels change its root (final norm, loss) only."""
    chosen = [name for name in ("norm_kernel", "rope_kernel", "swiglu_kernel", "loss_kernel")
              if getattr(config, name).value != "eager"]
    if not chosen:
        return None
    kinds = {op.kind for op in operators.block_ops(model, 2, 2048).memory_ops}
    for name in chosen:
        if name == "loss_kernel":
            if operators.root_ops(model, 2)[0] is None:
                return name, f"{model.name} has no output head for a fused or chunked loss: use eager"
            continue
        kind, what = _OP_OF[name]
        missing = {"norm": model.norm not in ("rmsnorm", "rmsnorm_fp32"),
                   "rope": kind not in kinds and model.activation_profile is None, "swiglu": not model.gated_mlp}[kind]
        if missing:
            return name, f"{model.name} has no {what}: the {getattr(config, name).value} kernel replaces none of its " \
                         "ops; use eager"
    return None
