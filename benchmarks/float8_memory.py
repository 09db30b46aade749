"""What torchao's Float8 training adds to, or removes from, one checkpointed Llama block's memory (issue 27).

    python3 -m venv /tmp/aoenv && /tmp/aoenv/bin/pip install torch==2.13.0 \
        && /tmp/aoenv/bin/pip install --no-deps torchao==0.18.0
    /tmp/aoenv/bin/python benchmarks/float8_memory.py          # ~30 s of CPU, fake tensors
    /tmp/aoenv/bin/python benchmarks/float8_memory.py --compiled-linear   # inductor's buffers, ~1 min

torchao is not in the project's environment (calibration/float8.py refuses Float8 on CPU), so this runs in a venv of
its own and imports nothing from the project but benchmarks/live_bytes.py beside it (torch alone). torchao's
Float8Linear (tensorwise dynamic scaling) and its torch._scaled_mm run on CPU fake tensors (FakeTensorMode), where
the live bytes are counted per storage as each op makes it (live_bytes.FakeLiveBytes: it sees every plain aten op,
those inside torchao's tensor subclasses included). One block, whole-block non-reentrant checkpoint, its no-grad
forward then its recompute and backward, each weight gradient dropped as it lands (FSDP reduce-scatters it); three
variants: bf16 linears; Float8 linears (the bf16 weight cast in each use); Float8 with FSDP2's FP8 all-gather (the
gathered weight a 1-byte Float8TrainingTensor, as fsdp_post_all_gather leaves it). With tp > 1 the block is one TP
rank's slice under sequence parallel, its collectives written as new tensors of their outputs' sizes, and Float8 as
torchtitan's Float8 TP of Dec 2024 (torchao's PrepareFloat8ModuleInput / Float8ColwiseParallel /
Float8RowwiseParallel: inputs cast to FP8 before their all-gather, output gradients cast to FP8 e5m2 before theirs,
NoopFwToFloat8BwDynamic).

As torch.compile runs them (the published runs compile the blocks), the casts write only their outputs: the amax
and the scaled cast's abs / fp32 upcast / clamp intermediates are not made (fused_casts); `--eager-casts` keeps
them. SiLU's backward is one kernel each way as on CUDA (the CPU fake's decomposition writes an fp32 chain the GPU
does not). Not modelled: inductor's buffer reuse and fusion of the rest of the block, async TP's fused
all-gather + _scaled_mm, FSDP2's pre-all-gather cast of the shards (once a step under PP), the real allocator.
`--compiled-linear` compiles one Float8Linear with inductor on real CPU tensors (64 tokens, 256 -> 512) and prints
its forward's and backward's buffers as the generated wrapper makes, reuses and frees them.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch
import torch.nn.functional as F
from live_bytes import FakeLiveBytes   # benchmarks/live_bytes.py, beside this script (torch alone)
from torch import nn

warnings.filterwarnings("ignore")
MiB = 2**20
LINEARS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
# (name, hidden, q dim, kv dim, MLP dim, batch, sequence, tp): full model widths, the block sliced by tp
CASES = (("Llama 3.1 8B widths, no TP, 2 x 8,192", 4096, 4096, 1024, 14336, 2, 8192, 1),
         ("Llama 3.1 70B widths, TP 8, 4 x 8,192", 8192, 8192, 1024, 28672, 4, 8192, 8),
         ("Llama 3.1 405B widths, TP 8, 4 x 8,192 (the pp 8 rows)", 16384, 16384, 1024, 53248, 4, 8192, 8))
VARIANTS = ("bf16", "float8", "float8 + FP8 all-gather")


class FusedSilu(torch.autograd.Function):
    """SiLU as CUDA runs it: one kernel forward and one backward, each writing only its output."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(ctx.saved_tensors[0])


class RMSNorm(nn.Module):   # torchtitan's Python RMSNorm (eager here: its few tokens under SP, the same both ways)
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def _gather(tp):   # Shard(1) -> Replicate: the all-gather's output forward, a reduce-scatter's backward
    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.cat([x] * tp, dim=1)

        @staticmethod
        def backward(ctx, g):
            return g.narrow(1, 0, g.shape[1] // tp).clone()
    return Gather


def _scatter(tp):  # Partial -> Shard(1): the reduce-scatter's output forward, an all-gather's backward
    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.narrow(1, 0, x.shape[1] // tp).clone()

        @staticmethod
        def backward(ctx, g):
            return torch.cat([g] * tp, dim=1)
    return Scatter


class Block(nn.Module):
    """A Llama block (pre-norm, GQA SDPA, SiLU-gated MLP); with tp > 1 one TP rank's slice under sequence
    parallel, Float8 as torchtitan's Float8 TP."""

    def __init__(self, h, q, kv, f, tp, float8, head_dim=128):
        super().__init__()
        self.head_dim, self.tp, self.float8 = head_dim, tp, float8
        self.gather, self.scatter = _gather(tp), _scatter(tp)
        self.attention_norm, self.ffn_norm = RMSNorm(h), RMSNorm(h)
        self.wq, self.wk, self.wv = (nn.Linear(h, d // tp, bias=False) for d in (q, kv, kv))
        self.wo = nn.Linear(q // tp, h, bias=False)
        self.w1, self.w3, self.w2 = nn.Linear(h, f // tp, bias=False), nn.Linear(h, f // tp, bias=False), \
            nn.Linear(f // tp, h, bias=False)

    def _cast(self, x, lin):   # Prepare / Rowwise input: cast before the all-gather (the linear then casts nothing)
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        return hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, lin.linear_mm_config) \
            if self.float8 and self.tp > 1 else x

    def _out(self, y, lin):    # Colwise / Rowwise output: its gradient cast to FP8 e5m2 first in backward
        from torchao.float8.float8_scaling_utils import NoopFwToFloat8BwDynamic
        return NoopFwToFloat8BwDynamic.apply(y, lin.linear_mm_config, torch.float8_e5m2) \
            if self.float8 and self.tp > 1 else y

    def _input(self, x, lin):
        return self.gather.apply(self._cast(x, lin)) if self.tp > 1 else x

    def _row(self, x, lin):
        y = lin(self._cast(x, lin))
        return self._out(self.scatter.apply(y), lin) if self.tp > 1 else y

    def forward(self, x):
        b, d = x.shape[0], self.head_dim
        y = self._input(self.attention_norm(x), self.wq)
        s = y.shape[1]
        q, k, v = (self._out(lin(y), lin).view(b, s, -1, d).transpose(1, 2) for lin in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self._row(a.transpose(1, 2).reshape(b, s, -1), self.wo)
        z = self._input(self.ffn_norm(x), self.w1)
        return x + self._row(FusedSilu.apply(self._out(self.w1(z), self.w1)) * self._out(self.w3(z), self.w3), self.w2)


@contextlib.contextmanager
def fused_casts():
    """torch.compile's casts: the amax a scalar, the scaled cast only its FP8 output (no abs / fp32 / clamp)."""
    import torchao.float8.float8_training_tensor as ftt
    import torchao.float8.float8_utils as fu
    saved = fu.tensor_to_amax, ftt._ToFloat8ConstrFunc.forward

    def cast(ctx, tensor, scale, float8_dtype, linear_mm_config=None, gemm_input_role=ftt.GemmInputRole.INPUT,
             axiswise_dim=None):
        return ftt.Float8TrainingTensor(torch.empty_like(tensor, dtype=float8_dtype), scale, tensor.dtype,
                                        linear_mm_config=linear_mm_config, gemm_input_role=gemm_input_role,
                                        axiswise_dim=axiswise_dim)
    fu.tensor_to_amax = lambda x, *a, **k: x.new_empty((), dtype=torch.float32)
    ftt._ToFloat8ConstrFunc.forward = staticmethod(cast)
    try:
        yield
    finally:
        fu.tensor_to_amax, ftt._ToFloat8ConstrFunc.forward = saved[0], staticmethod(saved[1])


def _fp8_weights(block: Block) -> None:
    """FSDP2's unsharded weight under the FP8 all-gather: fsdp_post_all_gather's Float8TrainingTensor, 1 byte."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    for name in LINEARS:
        lin = getattr(block, name)
        data = torch.empty_like(lin.weight, dtype=torch.float8_e4m3fn)
        lin.weight = nn.Parameter(Float8TrainingTensor(data, torch.ones((), dtype=torch.float32), torch.bfloat16,
                                                       lin.linear_mm_config, GemmInputRole.WEIGHT))


def measure(h, q, kv, f, b, s, tp, variant) -> dict:
    """One block's checkpointed forward, recompute and backward: bytes held before it (weights, its input and
    output gradient) and its peak above them, with the FP8 storages live at the peak."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    mode = FakeLiveBytes(on=False)
    with mode:
        torch.set_default_dtype(torch.bfloat16)
        block = Block(h, q, kv, f, tp, variant != "bf16")
        torch.set_default_dtype(torch.float32)
        if variant != "bf16":
            convert_to_float8_training(block, config=Float8LinearConfig())
        if variant == "float8 + FP8 all-gather":
            _fp8_weights(block)
        for p in block.parameters():   # FSDP reduce-scatters each unsharded gradient: none accumulates here
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        x = torch.randn(b, s // tp, h, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(b, s // tp, h, dtype=torch.bfloat16)
        mode.on = True
        weights = 0
        for t in [*block.parameters(), x, dy]:
            inner = getattr(t, "_data", t)
            mode.track(inner, "held")
            weights += 0 if t is x or t is dy else inner.untyped_storage().nbytes()
        held = mode.current
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        out.backward(dy)
        mode.on = False
    fp8 = [e for e in mode.peak_live if e[3].startswith("float8") or e[3] == "uint8"]
    return dict(weights=weights, above=mode.peak - held, fp8_at_peak=[e for e in fp8 if e[1] != "held"])


def compiled_linear() -> None:
    """One Float8Linear under torch.compile (inductor, CPU): the buffers of its forward and backward wrappers."""
    import re

    from torch._inductor.utils import run_and_get_code
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    linear = nn.Sequential(nn.Linear(256, 512, bias=False, dtype=torch.bfloat16))
    convert_to_float8_training(linear, config=Float8LinearConfig())
    compiled = torch.compile(linear)
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    for name, code in zip(("forward", "backward"), codes):
        print(f"{name} (x: 64 x 256 bf16 input, weight 512 x 256; tangents: the output's gradient)")
        for line in code.split("def call(self, args):")[1].split("runner = Runner")[0].splitlines():
            if re.match(r"\s*(buf\d+ = |del |return |extern_kernels|\w+(, \w+)* = args)", line):
                print("   ", line.strip()[:150])


def main() -> None:
    if "--compiled-linear" in sys.argv:
        compiled_linear()
        return
    casts = contextlib.nullcontext() if "--eager-casts" in sys.argv else fused_casts()
    print(f"casts: {'eager' if '--eager-casts' in sys.argv else 'fused (each writes only its output)'}; eager op order; MiB")
    with casts:
        for name, h, q, kv, f, b, s, tp in CASES:
            print(f"\n{name}: h {h:,}, q {q // tp:,}, kv {kv // tp:,}, MLP {f // tp:,} a rank, {b * s:,} tokens")
            print(f"  {'variant':26s} {'weights':>8s} {'peak above held':>16s} {'vs bf16':>8s}   FP8 tensors live at the peak")
            base = None
            for variant in VARIANTS:
                r = measure(h, q, kv, f, b, s, tp, variant)
                base = r["above"] if base is None else base
                fp8 = ", ".join(f"{shape} {dtype} ({made_by})" for _, made_by, shape, dtype in r["fp8_at_peak"])
                print(f"  {variant:26s} {r['weights'] / MiB:8.0f} {r['above'] / MiB:16.0f} "
                      f"{(r['above'] - base) / MiB:+8.0f}   {fp8 or '-'}")


if __name__ == "__main__":
    main()
