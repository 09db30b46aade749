"""A Llama block's tensors under TP with sequence parallel or without TP, op by op, as torch makes and frees them
(issue 27).

    widths = BlockWidths.of(model, config, tokens)       # model: the TP rank's slice (tensor_parallel.local_model)
    forward_events(widths)      # a checkpointed block's no-grad forward: [("alloc", name, bytes) | ("free", name)]
    backward_events(widths)     # its backward: the output gradient's all-gather, the recompute, then the backward

pipeline_allocations._RankWalk writes a block's recompute and backward as one sweep (its tensors made together, then
freed together). Under TP 8 at Llama 3.1 405B's widths the trace's expandable segment grows where the 1 GiB
all-gathered (b, s, h) tensors find the holes earlier ones left split by smaller tensors, an order the sweep lacks:
its replay reserved 9.6% less than the trace's (docs/accuracy.md, "The 405B pipeline rows' reserved gap"). These
are the trace's events for one block (calibration.trace_pipeline, torch 2.13, eager; the names are local: "x" the
block's input, "dy" its output's gradient, "out" / "dx" what it passes on, "w0".."w8" its weight gradients in
pipeline_allocations.param_tensors' order q, k, v, o, gate, up, down, the two norms). What makes each tensor:
- torchtitan's plan (torch/distributed/tensor/parallel/style.py): SequenceParallel norms on the rank's s / tp tokens;
  PrepareModuleInput all-gathers their Shard(1) output for the column-wise q/k/v and gate/up (DTensor's
  redistribute, funcol.all_gather_tensor: all_gather_into_tensor's output on dim 0, then torch.cat of its chunks
  along dim 1 - two (b, s, h) tensors, the first freed at once; one where b = 1, the cat a view); the row-wise o
  and down outputs are Partial and reduce-scattered to Shard(1) (funcol.reduce_scatter_tensor: their chunks
  torch.cat along dim 0 first, then the s / tp output). In backward the output gradient of o and down is
  all-gathered the same way, and each column-wise linear's Partial input gradient all-reduced on its own
  (funcol.all_reduce: a new tensor), the three (two) summed, and the sum's Shard(1) chunk cloned (redistribute to
  the forward input's placement).
- the RMSNorm (transformers' LlamaRMSNorm under a 16-bit compute dtype): x.to(float32), pow(2), mean, + eps, rsqrt,
  x * rsqrt, .to(bf16), weight * that; its backward the fp32 chain of mul / sum / pow / div / add on the s / tp
  tokens, the weight's gradient a sum over the tokens.
- RoPE's rotate_half (neg of a half, cat) and, in backward, its slice_backward pair; SDPA's output and fp32
  logsumexp, its backward's dq, dk, dv, whose transposes q's and k's products copy (clone) where a rank has more
  than one such head; the checkpoint's early stop (torch.utils.checkpoint, non-reentrant: the recompute ends at
  the forward's last saved tensor, down's input).
Eager ops, as the rest of the walk writes (kernels.memory_kernels: the pipeline ledger prices eager ops under
compile and Float8 too).

Without TP (tp = 1, FSDP alone) the same block is these events less the collectives (traces of FSDP2 steps, aten ops
beside their allocations: a 4-rank step of llama3-gqa of benchmarks/memory_accuracy.py, and the 2-rank bf16 and fp32
steps tests/unit/test_tp1_block_events.py checks event for event): each all-gather's output is its input under a
second name (q/k/v read the norm's output, the MLP's backward the block's output gradient), o's and down's products
are the (b, s, h) outputs, each column-wise linear's input gradient is its own (no all-reduce), their sum is the
norm's gradient (no reduce-scatter). A tensor with two names is freed at the drop of its last: the recompute's norm
output stays to q's backward, the output gradient to the residual's sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from . import kernels, tensor_parallel
from .model_spec import FUSED_GATE_UP_FAMILIES
from .spec_values import Attention
from .specs import FsdpConfig, ModelSpec
from .units import DTYPE_BYTES

FP32_BYTES = DTYPE_BYTES["fp32"]   # the RMSNorm's upcast, its statistics, SDPA's logsumexp


def applies(model: ModelSpec, config: FsdpConfig) -> bool:
    """Whether a checkpointed block of this TP rank's slice runs as these events: sequence parallel or no TP, without
    CP, a Llama block (eager fp32-upcast RMSNorm before each sublayer, SiLU-gated MLP, eager RoPE, no biases, no q/k
    norm, no dropout, dense, q / k / v and gate / up linears of their own), SDPA without a window or soft-cap, a
    16-bit compute dtype (or fp32 without TP), whole-block checkpointing."""
    llama = (model.norm == "rmsnorm" and model.norm_layout == "pre" and model.gated_mlp and model.activation == "silu"
             and not model.parallel_block and not model.dropout and not model.qk_norm and model.rope == "eager"
             and model.moe is None and not model.kv_lora_rank and model.activation_profile is None
             and not model.sliding_window and not model.attn_softcap
             and model.family not in FUSED_GATE_UP_FAMILIES)   # Phi-3: one qkv_proj and one gate_up_proj
    h, f = model.hidden_size, model.ffn_hidden_size
    no_bias = model.block_params == 2 * (model.q_dim + model.kv_dim) * h + 3 * h * f + 2 * h
    return (llama and no_bias and (tensor_parallel.sequence_parallel(config) or config.tp == 1) and config.cp == 1
            and config.attention == Attention.SDPA and not config.selective_op_ac
            and kernels.memory_kernels(config) == kernels.EAGER
            and DTYPE_BYTES[config.precision.compute_dtype] in ((2, FP32_BYTES) if config.tp == 1 else (2,)))


class BlockEvents(tuple):
    """A block's events, ("alloc", name, bytes) | ("free", name), in order."""

    @cached_property
    def template(self) -> tuple[tuple[tuple, ...], tuple[tuple, ...], frozenset, frozenset]:
        """keyed's parts, built once: the events with the block's own tensors (made and freed inside them) under keys
        every block shares, ("block", name); the places of the caller's tensors (freed unmade, or left made):
        (index, kind, name, the event's rest); the caller's names; the block's own."""
        made, live = set(), set()
        for kind, name, *_ in self:
            if kind == "alloc":
                made.add(name), live.add(name)
            else:
                live.discard(name)
        caller = frozenset({name for _, name, *_ in self if name not in made} | live)
        own = tuple(e if e[1] in caller else (e[0], ("block", e[1]), *e[2:]) for e in self)
        slots = tuple((i, e[0], e[1], e[2:]) for i, e in enumerate(self) if e[1] in caller)
        return own, slots, caller, frozenset(made - caller)


def keyed(events: BlockEvents, names: dict) -> list[tuple]:
    """The events under a caller's keys: `names` maps each of the caller's tensors to its key (None: not these events'
    to free). The block's own tensors share one key per name across blocks: each is freed before the events end, and
    the walk writes one block's events at a time, so no two are ever live together."""
    own, slots, caller, block_names = events.template
    if not caller <= names.keys() or not block_names.isdisjoint(names):
        raise ValueError(f"names {sorted(names)}: the caller's tensors are {sorted(caller)}")
    out = list(own)
    for i, kind, name, rest in reversed(slots):   # from the last: a dropped event leaves the earlier places as they are
        key = names[name]
        if key is None:
            del out[i]
        else:
            out[i] = (kind, key, *rest)
    return out


@dataclass(frozen=True)
class BlockWidths:
    """One TP rank's block: tokens (b x s, the all-gathered sequence), tp, and its widths: h, q / tp, kv / tp,
    f / tp, heads / tp, KV heads / tp; c bytes per element of the compute dtype; b the microbatch's sequences."""

    tokens: int
    tp: int
    h: int
    q: int
    kv: int
    f: int
    heads: int
    kv_heads: int
    c: int
    b: int

    @classmethod
    def of(cls, model: ModelSpec, config: FsdpConfig, tokens: int) -> BlockWidths:
        return cls(tokens, config.tp, model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size,
                   model.n_heads, model.n_kv_heads, DTYPE_BYTES[config.precision.compute_dtype], config.micro_batch)

    @property
    def stream(self) -> int:
        """A residual-stream tensor: (b, s / tp, h) in the compute dtype (the walk's tokens x hs)."""
        return self.tokens * -(-self.h * self.c // self.tp)

    @property
    def weight_grads(self) -> tuple[int, ...]:
        """Bytes of the weight gradients w0..w8 (compute dtype): q, k, v, o, gate, up, down, the two norms."""
        h, c = self.h, self.c
        return tuple(n * c for n in (self.q * h, self.kv * h, self.kv * h, h * self.q, h * self.f, h * self.f,
                                     h * self.f, h, h))


class _Events:
    """The events being written, with the block's sizes by name."""

    def __init__(self, w: BlockWidths):
        t, c, tp = w.tokens, w.c, w.tp
        self.viewed = w.b == 1   # all_gather_tensor's re-cat along dim 1 is a view of its output (one sequence)
        self.size = {"X": t * w.h * c, "S": w.stream, "S32": t * -(-w.h * FP32_BYTES // tp),
                     "stat": -(-t // tp) * FP32_BYTES, "Q": t * w.q * c, "Qh": t * (w.q // 2) * c, "K": t * w.kv * c,
                     "Kh": t * (w.kv // 2) * c, "F": t * w.f * c, "lse": t * w.heads * FP32_BYTES}
        self.size.update({f"w{i}": n for i, n in enumerate(w.weight_grads)})
        self.events: list[tuple] = []
        self.fp32 = w.c == FP32_BYTES   # fp32 compute (tp = 1): the RMSNorm's casts are no-ops
        self.tp1 = w.tp == 1   # no collectives: a gathered or reduced tensor is its input under a second name
        self.names: dict[str, set] = {}   # tp = 1: a tensor's names not yet dropped, by the name it was made under
        self.alias: dict[str, str] = {}   # tp = 1: a second name -> the tensor's own

    def make(self, name: str, kind: str) -> str:
        self.events.append(("alloc", name, self.size[kind]))
        return name

    def drop(self, *names: str) -> None:
        for n in names:
            own = self.alias.pop(n, n)
            left = self.names.get(own, {own})
            left.discard(n)
            if not left:
                self.names.pop(own, None)
                self.events.append(("free", own))

    def rename(self, name: str, source: str) -> None:
        """tp = 1: `name` is `source` (freed once both are dropped)."""
        self.alias[name] = source
        self.names.setdefault(source, {source}).add(name)

    def reduced(self, name: str, source: str) -> None:
        """The column-wise linears' summed input gradient `source` reduce-scattered to the s / tp tokens (`name`),
        `source` freed: funcol.reduce_scatter_tensor's output (tp = 1: `source` itself)."""
        if self.tp1:
            self.rename(name, source)
        else:
            self.make(name, "S")
        self.drop(source)

    def cast(self, name: str, kind: str, source: str) -> None:
        """`source` cast to fp32 or back (`name`): a copy, or in fp32 compute `source` itself (.to() of the same
        dtype returns its input)."""
        if self.fp32:
            self.rename(name, source)
        else:
            self.make(name, kind)

    def norm(self, p: str, keep: bool, source: str) -> None:
        """RMSNorm's forward of `source` on the rank's tokens; keep (with grad): its fp32 input, rsqrt and 16-bit
        product saved."""
        self.cast(p + "x32", "S32", source)
        self.make(p + "pow", "S32"), self.make(p + "mean", "stat")
        self.drop(p + "pow")
        self.make(p + "eps", "stat"), self.make(p + "rsqrt", "stat")
        self.drop(p + "eps")
        self.make(p + "mul32", "S32")
        if not keep:
            self.drop(p + "rsqrt", p + "x32")
        self.cast(p + "bf", "S", p + "mul32")
        self.make(p + "out", "S")
        if not keep:
            self.drop(p + "bf")
        self.drop(p + "mul32", p + "mean")

    def gather(self, name: str, source: str) -> None:
        """A Shard(1) -> Replicate all-gather of `source`: all_gather_into_tensor's output, the cat of its chunks
        along dim 1 (torch._utils._maybe_view_chunk_cat: a view where b = 1); tp = 1: `source` itself."""
        if self.tp1:
            self.rename(name, source)
            return
        if self.viewed:
            self.make(name, "X")
            return
        self.make(name + ".ag", "X"), self.make(name, "X")
        self.drop(name + ".ag")

    def rope(self, p: str, kind: str, backward: bool = False) -> str:
        """RoPE on q or k (kind "Q" / "K"), x * cos + rotate_half(x) * sin: a product, neg of a half, their cat, a
        product, the sum (returned). Backward, of its gradient: a product, neg of a half, two slice_backward, their
        sum (returned)."""
        a, b, c, d = (p + n for n in (("bm", "sb1", "sb2", "badd") if backward else ("m1", "cat", "m2", "r")))
        neg = p + ("bneg" if backward else "neg")
        self.make(a, kind), self.make(neg, kind + "h"), self.make(b, kind)
        self.drop(neg)
        self.make(c, kind)
        self.drop(a if backward else b)
        self.make(d, kind)
        self.drop(*((b, c) if backward else (a, c)))
        return d

    def row_out(self, name: str) -> None:
        """A row-wise linear's Partial (b, s, h) output reduce-scattered to Shard(1): the product, the cat of its
        chunks along dim 0, the s / tp output (tp = 1: the product itself)."""
        if self.tp1:
            self.make(name, "S")
            return
        self.make(name + ".mm", "X"), self.make(name + ".cat", "X"), self.make(name, "S")
        self.drop(name + ".cat", name + ".mm")

    def attention(self, keep: bool) -> None:
        self.norm("n1.", keep, "x")
        self.gather("xa", "n1.out")
        self.make("q", "Q"), self.make("k", "K"), self.make("v", "K")
        self.rope("q.", "Q"), self.rope("k.", "K")
        self.drop("q", "k")
        self.make("sdpa", "Q"), self.make("lse", "lse")
        if not keep:
            self.drop("lse")
        self.row_out("o")
        self.drop(*(() if keep else ("sdpa", "q.r", "k.r", "v", "xa")), "n1.out")
        self.make("h1", "S")
        self.drop("o")

    def norm_backward(self, p: str, grad: str, residual: str, out: str, then: tuple[str, ...] = ()) -> None:
        """RMSNorm's backward from the gradient `grad` (freed): the weight's gradient (a sum), the fp32 chain, the
        input's gradient cast back and added to the residual's gradient `residual` (freed) into `out`; `then`
        freed once its saved fp32 input is. In fp32 compute autograd sums the input's gradients as they come
        (torch/csrc/autograd/input_buffer.cpp, InputBuffer::add): the residual's with the direct product's, then
        that with the statistics' path."""
        self.make(p + "a", "S"), self.make(p + "b", "S")
        self.drop(p + "bf")
        weight = "w7" if p == "n1." else "w8"
        self.make(weight, weight)
        self.drop(p + "b", grad)
        self.cast(p + "a32", "S32", p + "a")
        self.drop(p + "a")
        self.make(p + "m1", "S32"), self.make(p + "m2", "S32"), self.make(p + "s1", "stat")
        self.drop(p + "m1", p + "a32")
        if self.fp32:
            self.make(p + "acc", "S")
            self.drop(residual, p + "m2")
        self.make(p + "p", "stat"), self.make(p + "m3", "stat"), self.make(p + "m4", "stat")
        self.drop(p + "m3", p + "p", p + "rsqrt", p + "s1")
        self.make(p + "d", "S32")
        self.drop(p + "m4")
        self.make(p + "p2", "S32"), self.make(p + "m5", "S32"), self.make(p + "m6", "S32")
        self.drop(p + "m5", p + "p2", p + "x32", p + "d", *then)
        if self.fp32:
            self.make(out, "S")
            self.drop(p + "acc", p + "m6")
            return
        self.make(p + "sum", "S32")
        self.drop(p + "m2", p + "m6")
        self.make(p + "dx", "S")
        self.drop(p + "sum")
        self.make(out, "S")
        self.drop(residual, p + "dx")

    def column_grad(self, w: str, grad: str, frees: tuple[str, ...] = ()) -> str:
        """A column-wise linear's backward: its weight's gradient, its Partial input gradient (b, s, h), `grad` and
        `frees` then `grad` dropped, the input gradient all-reduced into a new tensor (returned; tp = 1: the input
        gradient)."""
        self.make(w, w), self.make(w + ".dx", "X")
        self.drop(*frees, grad)
        if self.tp1:
            return w + ".dx"
        self.make(w + ".ar", "X")
        self.drop(w + ".dx")
        return w + ".ar"

    def contiguous(self, grad: str, kind: str, heads: int) -> str:
        """RoPE's gradient is (b, heads, s, d) contiguous; the linear's (b, s, heads x d) view of its transpose needs
        a copy (clone) unless there is one head (SDPA's dv already has the layout of v's view: none)."""
        if heads == 1:
            return grad
        self.make(grad + ".c", kind)
        self.drop(grad)
        return grad + ".c"

    def rope_backward(self, p: str, grad: str, kind: str) -> str:
        """RoPE's backward: the gradient's rotation summed (rope), then the gradient times cos added to it."""
        rotated = self.rope(p, kind, backward=True)
        self.make(p + "bm2", kind)
        self.drop(grad)
        self.make(p + "dr", kind)
        self.drop(rotated, p + "bm2")
        return p + "dr"


@lru_cache(maxsize=16)
def forward_events(w: BlockWidths) -> BlockEvents:
    """A checkpointed block's forward under no_grad, from its input "x" (kept) to its output "out" (left made)."""
    e = _Events(w)
    e.attention(keep=False)
    e.norm("n2.", False, "h1")
    e.gather("xm", "n2.out")
    e.make("gate", "F"), e.make("silu", "F")
    e.drop("gate")
    e.make("up", "F"), e.make("mul", "F")
    e.drop("silu", "up")
    e.row_out("down")
    e.drop("mul", "xm", "n2.out")
    e.make("out", "S")
    e.drop("down", "h1")
    return BlockEvents(e.events)


@lru_cache(maxsize=16)
def backward_events(w: BlockWidths) -> BlockEvents:
    """The block's backward from its output gradient "dy" (freed once the residual's sum is made) to its input's
    gradient "dx" (left made): the gradient's all-gather for down, the recompute, the MLP's, the norms' and the
    attention's backward; the block's input "x" freed in the first norm's backward; w0..w8 left made."""
    e = _Events(w)
    e.gather("dy.g", "dy")
    e.attention(keep=True)
    e.norm("n2.", True, "h1")
    e.gather("xm", "n2.out")
    e.make("gate", "F"), e.make("silu", "F"), e.make("up", "F"), e.make("mul", "F")
    e.drop("n2.out", "h1")
    # the MLP: down's weight and input gradients, the gate product's two factors, up's, silu's, gate's
    e.make("w6", "w6"), e.make("dmul", "F")
    e.drop("mul", "dy.g")
    e.make("dup", "F"), e.make("dsilu", "F")
    e.drop("silu", "up", "dmul")
    up = e.column_grad("w5", "dup")
    e.make("dsb", "F")
    e.drop("gate", "dsilu")
    gate = e.column_grad("w4", "dsb", ("xm",))
    e.make("dxm", "X")
    e.drop(up, gate)
    e.reduced("dn2", "dxm")
    e.norm_backward("n2.", "dn2", "dy", "dh1")
    # attention: o's output gradient all-gathered, o's gradients, SDPA's, RoPE's, v's, k's, q's
    e.gather("do", "dh1")
    e.make("w3", "w3"), e.make("dattn", "Q")
    e.drop("do")
    e.make("dq", "Q"), e.make("dk", "K"), e.make("dv", "K")
    e.drop("sdpa", "lse", "v", "q.r", "k.r", "dattn")
    dk = e.rope_backward("k.", "dk", "K")
    dq = e.rope_backward("q.", "dq", "Q")
    v = e.column_grad("w2", "dv")
    k = e.column_grad("w1", e.contiguous(dk, "K", w.kv_heads))
    e.make("dxkv", "X")
    e.drop(v, k)
    q = e.column_grad("w0", e.contiguous(dq, "Q", w.heads), ("xa",))
    e.make("dxa", "X")
    e.drop("dxkv", q)
    e.reduced("dn1", "dxa")
    e.norm_backward("n1.", "dn1", "dh1", "dx", ("x",))
    return BlockEvents(e.events)
