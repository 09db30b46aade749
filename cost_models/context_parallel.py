"""Context parallelism: ring attention's exchanges, its merge traffic and the K/V buffers it holds.

PyTorch's ring attention as torchtitan runs it (`torch.distributed.tensor.experimental.context_parallel`,
torch/distributed/tensor/experimental/_context_parallel/_attention.py, `_templated_ring_attention` and its
backward; shared/reference/parallelism.md). torch 2.6.0's torch/distributed/tensor/experimental/_attention.py, the
release of torchtitan's December-2024 runs, has the same ring: the same load balancing, all-gather rotater and
dK / dV all-to-all, line for line:

- Each CP rank holds b x s / cp tokens of every sequence, load-balanced for causal masking ("headtail": chunk i
  and 2 cp - 1 - i of 2 cp), so every rank computes 1 / cp of the causal attention: the diagonal step (its
  own two chunks, causal) and cp - 1 steps of half a chunk product each (the first half of the keys, or the
  second half of the queries). The step time prices the attention's FLOPs at the full sequence on s / cp
  tokens (the kernels' rate: below).
- Forward: K and V (flattened, concatenated) travel the ring. With torchtitan's default rotate method
  ("allgather") one all-gather of the rank's K/V is issued before the diagonal step and waited for at the
  second: it hides behind 1 / cp of the attention. ("alltoall" sends one chunk per step; the same bytes.)
- Backward: the K/V are all-gathered again (hidden behind the diagonal step's backward) and the dK / dV
  accumulators, fp32 (`convert_to_f32`), go round the ring once per step with all-to-all permutes (cp of
  them): each hides behind the next step's backward, the last one is exposed.
- Full activation checkpointing re-runs the forward ring in backward; torchtitan's selective op-level policy
  saves the flash kernels' outputs (no recomputed ring).
- The kernel calls' shapes (`ring_kernel_seq_len`): the flash kernel's rate s / (s + s0) (kernel_time.Rates.
  attention_rate) prices the fixed work of a query block (forward) or a key block (backward) spread over the
  key (query) tiles it visits, s / 2 on average in one causal call of length s. With chunks of C = s / (2 cp)
  tokens, rank cp - 1 visits C keys per query block at every forward step (the diagonal step: causal over 2 C;
  steps i <= rank: the first half of the keys) and rank 0 C queries per key block at every backward step (the
  diagonal; steps i > rank: the second half of the queries). The group meets every call (the forward's
  all-gather, the backward's dK / dV permutes), so those ranks set the pace: the ring's kernels, forward,
  backward and recomputed, run at the rate of one causal call of length 2 C = s / cp.
- Merging: every step's output and logsumexp are cast to fp32 and merged into the running output
  (out - sigmoid(lse_step - lse) x (out - out_step), `_SDPAMerger`), the partial (second-half) updates
  rebuild the whole tensor with torch.cat; backward accumulates dQ and dK / dV in fp32 the same way. These
  run eagerly beside the compiled blocks (the ring's dispatch is outside inductor's graphs): memory-bound
  bytes counted below (`ring_merge_bytes`), priced with the other memory-bound work.

Memory (`ring_working_bytes_per_token`, added to the attention's working set in memory.py). The ring runs below
autograd (a DTensor op handler for the flash-attention op): what the block saves for backward is what plain
SDPA saves - q, k, v of the rank's tokens, the merged output and its merged fp32 logsumexp - no per-chunk
outputs or logsumexps; the memory ledger prices those at s / cp tokens (load-balanced: every rank holds 2
chunks of s / 2 cp, the same count). What the ring adds are transients, per token of the rank (q = heads x
head_dim, kv = KV heads x head_dim of a TP rank, c the compute dtype):
- K/V in flight: the all-gathered K and V of the whole ring, cp x 2 kv x c (torchtitan's "allgather" rotate
  method; "alltoall" holds the current and the incoming chunk, the same at cp = 2: a double buffer), and the
  flattened K/V concatenated for the send (2 kv x c);
- forward, while a step merges: the running fp32 output, the step's output upcast, and the two fp32
  temporaries of out - sigmoid(.) x (out - o_i): 16 q (the step's compute-dtype output is plain SDPA's own);
- backward: the fp32 dQ (4 q) and dK/dV accumulators, with the fp32 dK/dV being sent, the one arriving and
  the step's own in fp32 (zeros_like for a step the causal mask skips, or _partial_update's torch.cat):
  4 x 4 x 2 kv, beside the kernel's compute-dtype gradients that plain SDPA also makes.
The larger of the forward and backward sets is charged at the attention's backward moment (under full
checkpointing the recomputed forward's ring runs at that block's moment too). Traced since the ring reaches
the CPU SDPA kernel (calibration/context_parallel.py; equal to a real gloo run to the byte): the two rows of
the mesh grid whose peak is a recomputed block's backward (llama2-mha cp 4 full AC, cp 8 every-2) were short
by 4,108 and 4,132 bytes per token with 3 fp32 dK/dV buffers, -3.7% / -2.2%; with 4, -0.04% / -0.39%.
Inside pipeline stages the stage pieces (pipeline_stage_pieces.py) take both terms too: traced and run on 4 gloo
ranks (pp 2 x cp 2, tests/distributed/test_pp_cp_torchrun.py), the tiny Llama's pipeline ranks -4.45% / -2.14% of
the trace without them, -1.18% / -0.33% with them (-0.36% on rank 0 with the in-place MLP moment of
pipeline_stage_pieces.py).

Ignored: the per-row logsumexp tensors' traffic (heads per token, small beside heads x head_dim). The flash
backward's work per call that does not grow with the keys (rowsum(dO x O), zeroing and casting its fp32 dQ
accumulator: ~14 B per query element) is the kind of fixed work per block the s / (s + s0) rate spreads over
the tiles, so the shorter calls' rate above holds it. K and V repeated per query head before SDPA
(torchtitan's Llama 3 model through 0.1.0: `repeat_kv`, models/llama3/model/model.py) would make the ring move
n_heads / n_kv_heads times the K/V bytes priced here (4x for Llama 3 8B): not priced, the model's K/V heads are
(no trainer tells the cost model which attention inputs its model builds).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import comm
from .specs import FsdpConfig, ModelSpec


@dataclass(frozen=True)
class CpTime:
    """Seconds of one block's ring per micro-batch: the exchanges (all of them, and what the attention does not
    hide) forward and backward (recompute included), and the merge's memory-bound bytes."""

    forward_s: float = 0.0
    forward_exposed_s: float = 0.0
    backward_s: float = 0.0
    backward_exposed_s: float = 0.0
    merge_forward_bytes: float = 0.0
    merge_backward_bytes: float = 0.0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def exposed_s(self) -> float:
        return self.forward_exposed_s + self.backward_exposed_s


def local_kv_bytes(model: ModelSpec, tokens: int, c: int) -> float:
    """A rank's K and V for one attention call: b x s / cp tokens x (kv heads x head_dim) x 2 (model: a TP
    rank's, its KV heads)."""
    return 2.0 * tokens * model.kv_dim * c


def ring_kernel_seq_len(seq_len: int, cp: int) -> int:
    """The causal length whose one flash call runs at the rate of the ring's calls (module notes: chunks of
    s / (2 cp) keys per query block forward, queries per key block backward, on the ranks that set the pace):
    s / cp; the sequence without CP."""
    return seq_len // cp


def ring_merge_bytes(model: ModelSpec, tokens: int, cp: int, c: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes of one attention call's merging on a rank, averaged over the ranks (module
    notes). E = tokens x q heads x head_dim output elements, K = the K and V elements. At step i >= 1 the ranks
    below i update only the second half of their queries (half the rows, then a torch.cat of the whole
    tensor: 8 B per element in fp32); the others update all rows against half the keys."""
    if cp == 1:
        return 0.0, 0.0
    e, k = float(tokens * model.q_dim), 2.0 * tokens * model.kv_dim
    cast, merge, cat, add = 4 + c, 32, 8, 4 + c + 4   # fp32 upcast; out - sigmoid(.) * (out - o_i); cat; fp32 +=
    fwd = cast * e                                    # the diagonal step's output to fp32
    bwd_q = 4 * e + add * e                           # dQ zeros, the diagonal step's +=
    bwd_kv = 4 * k + (add + cat) * k                  # dK/dV zeros, +=, the cat that sends them
    for i in range(1, cp):
        partial = i / cp
        fwd += (1 - partial) * (cast + merge) * e + partial * ((cast + merge) / 2 + cat) * e
        bwd_q += (1 - partial) * add * e + partial * (add / 2 + cat) * e
        bwd_kv += (1 - partial) * (add / 2 + cat) * k + partial * add * k + cat * k
    fwd += cast * e                                   # back to the compute dtype
    bwd_q += cast * e
    bwd_kv += cast * k
    kv_cats = (cp - 1) * 2 * local_kv_bytes(model, tokens, c)  # torch.cat of K and V before each send
    return fwd + kv_cats, bwd_q + bwd_kv + kv_cats


def ring_seconds(model: ModelSpec, config: FsdpConfig, tokens: int, c: int, tier, attention_forward_s: float,
                 attention_backward_s: float, recompute_share: float) -> CpTime:
    """One block's ring for a micro-batch of `tokens` per CP rank (model: a TP rank's). attention_*_s: the block's
    attention kernels on this rank (what the exchanges hide behind); recompute_share: the fraction of blocks whose
    forward full checkpointing re-runs (0 with selective op-level checkpointing: the kernels' outputs are saved)."""

    cp = config.cp
    if cp == 1:
        return CpTime()
    kv = local_kv_bytes(model, tokens, c)
    gather = comm.all_gather_s(cp * kv, cp, tier)          # the whole ring's K/V, (cp - 1) / cp of it received
    permute = tier.latency_s + kv * 4 / c / tier.bus_bytes_per_s   # fp32 dK/dV to the next rank
    fwd_exposed = max(0.0, gather - attention_forward_s / cp)
    step_b = attention_backward_s / cp
    bwd = gather + cp * permute
    bwd_exposed = max(0.0, gather - step_b) + (cp - 1) * max(0.0, permute - step_b) + permute
    merge_f, merge_b = ring_merge_bytes(model, tokens, cp, c)
    return CpTime(forward_s=gather, forward_exposed_s=fwd_exposed,
                  backward_s=bwd + recompute_share * gather,
                  backward_exposed_s=bwd_exposed + recompute_share * fwd_exposed,
                  merge_forward_bytes=merge_f, merge_backward_bytes=merge_b + recompute_share * merge_f)


def ring_working_bytes_per_token(model: ModelSpec, cp: int, c: int) -> int:
    """Bytes per token of a CP rank the ring holds beyond plain SDPA's working set (module notes: K/V in flight,
    then the larger of the forward merge's and the backward accumulators' fp32 tensors). model: a TP rank's."""
    if cp == 1:
        return 0
    q, kv = model.q_dim, 2 * model.kv_dim
    in_flight = cp * kv * c + kv * c
    forward_merge = 16 * q
    backward_accumulators = 4 * q + 4 * 4 * kv
    return in_flight + max(forward_merge, backward_accumulators)


def ring_saved_bytes_per_token(model: ModelSpec, cp: int, c: int) -> int:
    """Bytes per token a (not checkpointed) block saves for backward beyond plain SDPA's under ring attention:
    the merged output (_SDPAMerger's result, cast back to c) is contiguous in (batch, heads, seq, head_dim), so
    the o-projection's (batch, seq, q_dim) input is a copy and both are saved - plain SDPA's output is laid out
    (batch, seq, heads, head_dim) and the o-projection reads a view of it. c x q_dim. Measured with the trace
    tier (calibration/context_parallel.py runs torch's ring on the CPU kernel; equal to a real gloo run to the
    byte): tiny Llama, 2 blocks, 2 x 512 tokens, cp 2: +262,144 bytes = 2 x 2 x 256 x 128 x 2. model: a TP
    rank's."""
    return c * model.q_dim if cp > 1 else 0
