"""A block's operators, in forward order: the matmuls (shapes), the attention kernel and the memory-bound ops.

The step-time model (kernel_time.py) prices each operator class its own way; the selective op-level
checkpointing policy (torchtitan's: every second matmul recomputed) needs the matmuls' order. Counts are
per token of the micro-batch, from the family's structure (ModelSpec), c = compute-dtype bytes.

Memory-bound bytes are what each eager kernel reads and writes in HBM (Hugging Face / torchtitan code as
users run it), and what the same work moves once torch.compile (inductor) fuses each chain of pointwise
ops between two matmuls into one kernel: it reads the chain's inputs and writes its outputs once. Per
element of the tensor the op runs on (h hidden, q = heads x head_dim, kv, f FFN width), bf16 c = 2:
- eager RMSNorm with the fp32 upcast (Hugging Face): upcast (c + 4), pow (8), mean (4), x * rsqrt (8),
  cast back (4 + c), weight (2c): 28 + 4c forward; its autograd backward 80 + 6c (counted in a trace:
  the fp32 products, sums and casts of each op's backward). A fused kernel
  (torchtitan's fused_rmsnorm, LayerNorm, any norm under compile) reads x and writes y (2c), and in
  backward reads x and the gradient and writes dx (3c, + the weight gradient's partial sums: ~4c).
  Gemma's / OLMo 2's fp32-weight norm adds an fp32 product (+8 forward, +16 backward).
- rotary on q and k: rotate_half's slice/neg/cat, two products and a sum (about 12c forward, 15c backward
  with slice_backward's zero-filled copies; torchtitan's complex-number version moves about as much), and in
  backward the q and k gradients copied back to (b, s, heads x d) (2c); fused: read and write once (2c).
- residual adds: 3c each way (read two, write one); under compile folded into the next norm (2c).
- the backward sums the gradients of a tensor read by several ops (q/k/v of one input, gate/up): 3c per
  extra reader; under compile folded into the norm backward (c).
- the attention output's transpose(1, 2).contiguous() copy (Hugging Face): 2c each way (also compiled).
- SwiGLU act(gate) * up: 5c forward (act: 2c, product: 3c), 9c backward; fused 3c and 5c. Plain GELU/ReLU:
  2c and 3c (already one kernel). gelu_new written in Python ops: about 20c and 30c; fused 2c and 3c.
- dropout (p > 0): 2c + 1 (the mask) each way on each residual branch.
Root, per token: the embedding gather (2c h forward, 2c h backward), the final norm, and the loss over V
logits: Hugging Face upcasts to fp32 and takes log_softmax: c + 16 forward, 20 + c backward; fused: c and 2c.
Float8 linears (torchao, tensorwise dynamic scaling): each converted linear's input is scaled (amax: read c)
and cast (read c, write 1) in forward, the output gradient likewise plus the transposed copies the
weight-gradient GEMM reads (2 + 2 per element of the gradient and of the input) in backward; the
weights' casts happen once per micro-step (see weight_cast_bytes). Under compile the scaling fuses into
the neighbouring pointwise kernels (1 byte per input element forward, c + 2 per gradient element backward).

Checked against the kernels of a traced Hugging Face Llama block (calibration/block_ops.py, tests/unit/
test_block_ops.py): these forward bytes are 1.05x what the traced ops read and write; the backward's norm
and rotary coefficients are read from that trace. Models priced by a traced block memory
profile take the traced inventory itself (block_ops).

Ignored: the scalar reductions of norms (per-token statistics), kernels on per-micro-batch tensors (the
rotary tables, masks), the MoE router's small softmax/top-k (counted as a memory op on E elements).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from . import activations_sinks, attention_flex, attention_kernels, moe_lora
from . import moe as moe_model
from .identity_memo import IdentityMemo
from .quick_init import quick_init
from .specs import ModelSpec


@quick_init
@dataclass(frozen=True)
class Matmul:
    """One product per token: y (n) = x (k) @ W (k x n), on `rows_per_token` rows per token (1 for a dense
    layer; a routed expert sees top-k / E of the tokens, `count` = E such products)."""

    name: str
    n: int
    k: int
    rows_per_token: float = 1.0
    count: int = 1
    bias: bool = False        # a biased linear (aten.addmm)
    float8: bool = True       # converted by torchao's convert_to_float8_training (block nn.Linear layers)
    trainable: bool = True    # False: frozen (LoRA base weight): no weight-gradient product

    @property
    def forward_flops_per_token(self) -> float:
        return 2.0 * self.n * self.k * self.rows_per_token * self.count

    @property
    def weight_elements(self) -> int:
        return self.n * self.k * self.count


@quick_init
@dataclass(frozen=True)
class MemoryOp:
    """A chain of pointwise / reduction kernels between matmuls: HBM bytes per token, eager and compiled."""

    name: str
    forward_bytes: float
    backward_bytes: float
    fused_forward_bytes: float
    fused_backward_bytes: float
    kind: str = ""  # the op class a kernel knob replaces: norm, rope, swiglu, loss (cost_models/kernels.py)

    def bytes(self, compiled: bool, backward: bool) -> float:
        if compiled:
            return self.fused_backward_bytes if backward else self.fused_forward_bytes
        return self.backward_bytes if backward else self.forward_bytes


@dataclass(frozen=True)
class BlockOps:
    """One block's operators: matmuls in forward order, the attention kernel, the memory-bound chains."""

    matmuls: tuple[Matmul, ...]
    attention_flops_per_token: float    # forward, as executed: a causal kernel skips the masked half
    attention_reference_flops: float    # forward, the MFU convention (4 * q_dim * s, no causal discount)
    memory_ops: tuple[MemoryOp, ...]
    head_dim: int
    seq_len: int
    traced: bool = False                # counted from a traced block (eager attention's products included)
    attention_speed: tuple[float, float] = (1.0, 1.0)  # (forward, backward) of the flash kernel's rate (flex)
    # a traced inventory: the eager chains identified inside its traced bytes by op class, as the formula prices
    # them (transformers' RMSNorm modules), so a kernel knob can swap them (cost_models/kernels.py)
    traced_identified: tuple[MemoryOp, ...] = ()

    def selective_op_recomputed(self) -> tuple[Matmul, ...]:
        """torchtitan's policy as calibration.apply runs it: of the linear products of a forward (aten.mm, and
        aten.addmm for a biased linear), the 2nd, 4th, ... are recomputed; a grouped expert product
        (aten._grouped_mm) is not on the save list: always recomputed, and not counted."""
        linear = [m for m in self.matmuls if m.count == 1 and m.rows_per_token == 1.0]
        return tuple(linear[1::2]) + tuple(m for m in self.matmuls if m not in linear)


def _elementwise(name: str, elements: float, fwd: float, bwd: float, fused_fwd: float, fused_bwd: float,
                 kind: str = "") -> MemoryOp:
    return MemoryOp(name, elements * fwd, elements * bwd, elements * fused_fwd, elements * fused_bwd, kind)


def fused(op: MemoryOp) -> MemoryOp:
    """The op run as one kernel each way: its fused bytes, compiled or not."""
    return replace(op, forward_bytes=op.fused_forward_bytes, backward_bytes=op.fused_backward_bytes)


def norm_op(model: ModelSpec, c: int, width: int, name: str) -> MemoryOp:
    if model.norm in ("rmsnorm", "rmsnorm_fp32"):
        extra = (8, 16) if model.norm == "rmsnorm_fp32" else (0, 0)
        return _elementwise(name, width, 28 + 4 * c + extra[0], 80 + 6 * c + extra[1], 2 * c, 4 * c, "norm")
    return _elementwise(name, width, 2 * c, 4 * c, 2 * c, 4 * c, "norm")


def _n_norms(model: ModelSpec) -> int:
    if model.parallel_block:
        return 1 if model.family == "falcon" else 2
    return 4 if model.norm_layout == "sandwich" else 2


def _attention_matmuls(model: ModelSpec) -> list[Matmul]:
    h, q, kv = model.hidden_size, model.q_dim, model.kv_dim
    if model.family in ("gpt2", "gpt_neox", "phi3", "falcon", "bloom", "mpt", "phi"):
        bias = model.family not in ("phi3", "falcon", "mpt")
        return [Matmul("qkv", q + 2 * kv, h, bias=bias), Matmul("o", h, q, bias=bias)]
    bias = model.family in ("qwen2", "qwen2_moe")  # q/k/v biases: addmm
    return [Matmul("q", q, h, bias=bias), Matmul("k", kv, h, bias=bias), Matmul("v", kv, h, bias=bias),
            Matmul("o", h, q)]


def _mlp_matmuls(model: ModelSpec) -> list[Matmul]:
    h, f = model.hidden_size, model.ffn_hidden_size
    m = model.moe
    if m is None:
        bias = model.family in ("gpt2", "gpt_neox", "bloom", "phi", "starcoder2", "bert", "opt")
        if model.gated_mlp:
            return [Matmul("gate", f, h), Matmul("up", f, h), Matmul("down", h, f)]
        return [Matmul("fc1", f, h, bias=bias), Matmul("fc2", h, f, bias=bias)]
    out = [Matmul("router", m.n_experts, h, float8=False)]
    if m.shared_ffn_size:
        fs = m.shared_ffn_size
        out += [Matmul("shared gate", fs, h), Matmul("shared up", fs, h), Matmul("shared down", h, fs)]
    rows = m.experts_per_token / m.n_experts
    fe = m.expert_ffn_size
    width = 2 * fe if model.gated_mlp else fe
    out += [Matmul("experts gate|up", width, h, rows, m.n_experts, float8=False),
            Matmul("experts down", h, fe, rows, m.n_experts, float8=False)]
    return out


def _fit_to_params(model: ModelSpec, matmuls: list[Matmul]) -> list[Matmul]:
    """Shape-derived matmuls against the block's parameter count: what the shapes miss (latent attention's
    down/up projections, extra gates) becomes one h-wide product; shapes that overcount are scaled down."""
    h = model.hidden_size
    weights = sum(m.n * m.k * (m.count if m.rows_per_token < 1 else 1) for m in matmuls)
    target = moe_model.active_block_params(model) + (model.moe.inactive_params if model.moe else 0)
    target -= _n_norms(model) * h
    rest = target - weights
    if rest > 0.01 * target:
        return matmuls + [Matmul("other projections", max(1, rest // h), h)]
    if rest < -0.01 * target:  # e.g. multi-head latent attention: q_dim / kv_dim do not describe the projections
        attn = [m for m in matmuls if m.name in ("q", "k", "v", "o", "qkv")]
        attn_weights = sum(m.n * m.k for m in attn)
        scale = max(0.05, (attn_weights + rest) / attn_weights)
        return [replace(m, n=max(1, round(m.n * scale))) if m in attn else m for m in matmuls]
    return matmuls


def window_masks(model: ModelSpec, seq_len: int) -> bool:
    """Whether transformers hands SDPA a sliding-window mask: from a window as long as the sequence on
    (masking_utils skips it only while kv_length < the window)."""
    return 0 < model.sliding_window <= seq_len


def attention_forward_flops(model: ModelSpec, seq_len: int) -> tuple[float, float]:
    """(executed, reference) forward FLOPs per token of QK^T and PV: reference 4 * q_dim * s (torchtitan's
    MFU count); a causal kernel computes about half (the blocks above the diagonal skipped). A sliding
    window no longer than the sequence makes transformers hand SDPA an explicit (s, s) mask, and a masked
    kernel computes every block: all s keys (the traced Gemma 3 block does)."""
    reference = 4.0 * model.q_dim * seq_len
    if not model.causal or window_masks(model, seq_len):
        return reference, reference
    return reference / 2, reference


@lru_cache(maxsize=256)  # the search prices thousands of configurations of one model
def block_ops(model: ModelSpec, c: int, seq_len: int, lora_rank: int = 0, attention: str = "sdpa") -> BlockOps:
    """The (sparse, for MoE) block's operators; model_spec.dense_block_spec(model) gives the dense blocks'. A model
    priced by a traced block memory profile takes the operators counted in that trace (full fine-tuning;
    LoRA's frozen products are priced from the structure)."""
    formula = _formula_block_ops(model, c, seq_len, lora_rank, attention)
    traced = _traced(model, c, attention) if not lora_rank else None
    if traced is None:
        return formula
    ops = _from_trace(formula, traced, model, seq_len)
    if attention == "flex":  # the kernel's work is its block mask's, which a fake-tensor trace cannot read
        ops = replace(ops, attention_flops_per_token=formula.attention_flops_per_token,
                      attention_reference_flops=formula.attention_reference_flops,
                      attention_speed=formula.attention_speed)
    return ops


def _traced(model: ModelSpec, c: int, attention: str):
    profile = model.activation_profile
    terms = profile.get("fp32" if c == 4 else "bf16", attention) if profile is not None else None
    return terms.operators if terms is not None else None


def _from_trace(formula: BlockOps, traced, model: ModelSpec, seq_len: int) -> BlockOps:
    """The traced inventory (calibration/block_ops.py): its matmuls, its attention FLOPs scaled from the traced
    sequence to this one, its eager bytes; what compile would fuse stays the formula's estimate."""
    matmuls = tuple(Matmul(f"traced product {i + 1}", n, k, rows, count, float8=count == 1 and rows == 1.0)
                    for i, (n, k, rows, count) in enumerate(traced.matmuls))
    traced_keys = traced.attention_reference_flops / (4.0 * model.q_dim) if traced.attention_reference_flops else 0
    scale = seq_len / traced_keys if traced_keys else 1.0
    fused_fwd = sum(op.fused_forward_bytes for op in formula.memory_ops)
    fused_bwd = sum(op.fused_backward_bytes for op in formula.memory_ops)
    memory = MemoryOp("traced pointwise ops", traced.memory_forward_bytes_per_token,
                      traced.memory_backward_bytes_per_token, min(fused_fwd, traced.memory_forward_bytes_per_token),
                      min(fused_bwd, traced.memory_backward_bytes_per_token))
    return BlockOps(matmuls, traced.attention_flops_per_token * scale, traced.attention_reference_flops * scale,
                    (memory,), formula.head_dim, seq_len, traced=True, traced_identified=_identified(formula, model))


def _identified(formula: BlockOps, model: ModelSpec) -> tuple[MemoryOp, ...]:
    """The formula's ops a traced block is known to run as eager chains of the same bytes: its RMSNorms, which
    every traced family takes from transformers' RMSNorm code (norm_op's bytes against the counter of
    calibration/block_ops.py on the module alone: Llama's 36 / 92 B per element exactly, GPT-OSS's fp32-weight
    norm 40.1 / 104.2 counted against rmsnorm_fp32's 44 / 108, tests/unit/test_traced_kernels.py). Not identified:
    RoPE (its bytes depend on each family's rotary code and layout) and SwiGLU (a traced MoE's routed experts keep
    their own kernels; GPT-OSS's is a clamped variant), which keep their traced bytes."""
    if model.norm not in ("rmsnorm", "rmsnorm_fp32"):
        return ()
    return tuple(op for op in formula.memory_ops if op.kind == "norm")


def _formula_block_ops(model: ModelSpec, c: int, seq_len: int, lora_rank: int = 0,
                       attention: str = "sdpa") -> BlockOps:
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    matmuls = _fit_to_params(model, _attention_matmuls(model) + _mlp_matmuls(model))
    if lora_rank:
        trained = moe_lora.TRAINED_MATMULS if model.lora_moe else ()  # all-linear on an MoE: W_eff's gradients
        matmuls = [m if m.name in trained else replace(m, trainable=False) for m in matmuls]
        for i, o in model.lora_shapes:
            matmuls += [Matmul("lora A", lora_rank, i, float8=False), Matmul("lora B", o, lora_rank, float8=False)]
        if model.lora_moe:  # peft's merges, once per forward: per sequence (moe_lora.trained_flops_per_token)
            matmuls += [Matmul(name, n, k, rows / seq_len, count, float8=False)
                        for name, rows, k, n, count in moe_lora.merge_products(model, lora_rank)]
    ops = [norm_op(model, c, h, f"norm {i + 1}") for i in range(_n_norms(model))]
    if model.qk_norm:
        ops.append(norm_op(model, c, q + kv, "q/k norms"))
    if model.family not in ("gpt2", "bert", "opt", "bloom", "mpt"):  # rotary
        rope = [_elementwise("rotary", q + kv, 12 * c, 15 * c, 2 * c, 2 * c, "rope"),
                _elementwise("q/k gradient copies", q + kv, 0, 2 * c, 0, 0, "rope")]  # back to (b, s, heads x d)
        ops += [fused(op) for op in rope] if model.rope == "fused" else rope
    ops.append(_elementwise(attention_kernels.OUTPUT_COPY, q, 2 * c, 2 * c, 2 * c, 2 * c))
    ops.append(_elementwise("residual adds", 2 * h, 3 * c, 3 * c, 2 * c, 2 * c))
    readers = (2 if len(_attention_matmuls(model)) > 2 else 0) + (1 if model.gated_mlp and model.moe is None else 0)
    ops.append(_elementwise("gradient sums", readers * h, 0, 3 * c, 0, c))
    if model.moe is None:
        ops.append(_mlp_activation_op(model, c, f, 1.0))
    else:
        m = model.moe
        ops.append(_mlp_activation_op(model, c, m.expert_ffn_size, m.experts_per_token))
        if m.shared_ffn_size:
            ops.append(_mlp_activation_op(model, c, m.shared_ffn_size, 1.0, "shared expert activation"))
        # routing: permute the routed rows in and out, weight and sum them (k rows of h each way)
        ops.append(_elementwise("expert routing", m.experts_per_token * h, 6 * c, 6 * c, 4 * c, 4 * c))
        ops.append(_elementwise("router softmax/top-k", m.n_experts, 12, 12, 8, 8))
    if model.dropout:
        ops.append(_elementwise("dropout", 2 * h, 2 * c + 1, 2 * c + 1, 1, 1))
    if attention == "flex":
        return _flex_block_ops(model, c, seq_len,
                               BlockOps(tuple(matmuls), 0.0, 0.0, tuple(ops), model.head_dim, seq_len))
    executed, reference = attention_forward_flops(model, seq_len)
    return BlockOps(tuple(matmuls), executed, reference, tuple(ops), model.head_dim, seq_len)


def _flex_block_ops(model: ModelSpec, c: int, seq_len: int, ops: BlockOps) -> BlockOps:
    """FlexAttention (attention_flex.py): the kv blocks its block mask visits (a sliding window's band, not all s
    keys), at its fractions of the flash kernel's rate; gpt-oss' sinks renormalise the output afterwards
    (activations_sinks.py): read out, write it (2c), and about twice that backward, fused under compile."""
    windowed = model.n_layers - model.full_attention_layers if window_masks(model, seq_len) else 0
    executed = attention_flex.forward_flops_per_token(model.q_dim, seq_len, windowed, model.n_layers,
                                                      model.sliding_window)
    memory = ops.memory_ops
    if activations_sinks.has_sinks(model):
        memory += (_elementwise("sink renormalisation", model.q_dim, 2 * c, 4 * c, 2 * c, 3 * c),)
    return replace(ops, attention_flops_per_token=executed, attention_reference_flops=4.0 * model.q_dim * seq_len,
                   memory_ops=memory,
                   attention_speed=(attention_flex.FORWARD_SPEED, attention_flex.BACKWARD_SPEED))


def _mlp_activation_op(model: ModelSpec, c: int, width: int, rows: float, name: str = "MLP activation") -> MemoryOp:
    if model.gated_mlp:  # Liger's / TE's SwiGLU replace dense and shared MLPs, not routed experts (kernels.py)
        routed = model.moe is not None and name == "MLP activation"
        return _elementwise(name, width * rows, 5 * c, 9 * c, 3 * c, 5 * c, "" if routed else "swiglu")
    if model.activation in ("gelu_new", "gelu_pytorch_tanh_python", "quick_gelu"):
        return _elementwise(name, width * rows, 20 * c, 30 * c, 2 * c, 3 * c)
    return _elementwise(name, width * rows, 2 * c, 3 * c, 2 * c, 3 * c)


def root_ops(model: ModelSpec, c: int) -> tuple[Matmul | None, tuple[MemoryOp, ...]]:
    """The output head (None for an encoder without one) and the root's memory-bound work per token."""
    h, v = model.hidden_size, model.vocab_size
    head = Matmul("output head", v, h, float8=False) if (model.head_params or model.tied_embeddings) else None
    ops = (norm_op(model, c, h, "final norm"),
           _elementwise("embedding", h, 2 * c, 2 * c, 2 * c, 2 * c),
           _elementwise("loss", v, c + 16, 20 + c, c, 2 * c, "loss"))
    return head, ops


def float8_cast_op(matmuls: tuple[Matmul, ...], c: int) -> MemoryOp:
    """torchao's dynamic scaling of the converted linears' activations and gradients (module docstring)."""
    ins = sum(m.k * m.rows_per_token * m.count for m in matmuls if m.float8)
    outs = sum(m.n * m.rows_per_token * m.count for m in matmuls if m.float8)
    return MemoryOp("float8 casts", ins * (2 * c + 1), outs * (2 * c + 3) + 2 * ins,
                    ins * 1.0, outs * (c + 2) + 2 * ins)


def float8_weight_elements(model: ModelSpec, c: int, seq_len: int) -> int:
    """Weights of one (sparse) block that torchao converts to Float8 linears (what an FP8 all-gather moves)."""
    return sum(m.weight_elements for m in block_ops(model, c, seq_len).matmuls if m.float8)


_FP8_SAVING = IdentityMemo(limit=256)  # (model, c, seq_len): the ledgers under the FP8 all-gather read it


def fp8_all_gather_saving_bytes(model: ModelSpec, c: int, seq_len: int) -> int:
    """Bytes one block's all-gather (and its output) moves less with FSDP2's FP8 all-gather: the Float8
    linears' weights in 1 byte instead of c."""
    return _FP8_SAVING.get(model, (c, seq_len), lambda: (c - 1) * float8_weight_elements(model, c, seq_len))


_SELECTIVE_SAVED = IdentityMemo(limit=256)  # (model, seq_len, rank): every ledger shape under selective-op reads it


def selective_op_saved_elements(model: ModelSpec, seq_len: int, lora_rank: int = 0) -> float:
    """Per token: outputs of the matmuls torchtitan's selective-op policy saves (the 1st, 3rd, ... aten.mm)."""
    return _SELECTIVE_SAVED.get(model, (seq_len, lora_rank), lambda: _selective_op_saved_elements(model, seq_len,
                                                                                                  lora_rank))


def _selective_op_saved_elements(model: ModelSpec, seq_len: int, lora_rank: int) -> float:
    ops = block_ops(model, 2, seq_len, lora_rank)
    recomputed = ops.selective_op_recomputed()
    return sum(m.n * m.rows_per_token * m.count for m in ops.matmuls if m not in recomputed)


def weight_cast_bytes(matmuls: tuple[Matmul, ...], c: int, fp8_all_gather: bool) -> float:
    """Per micro-step and block: casting the gathered Float8 weights (amax read, the cast and its transposed
    copy); with FP8 all-gather the weights arrive cast (precomputed scales): only the transposed copy."""
    w = sum(m.weight_elements for m in matmuls if m.float8)
    return w * (2.0 if fp8_all_gather else 3 * c + 2)
