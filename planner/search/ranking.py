"""How the search orders what it costed: throughput first, the simpler config on a tie (rank_key), one row per
visible difference (_distinct), and the nearest misses by how far they overshoot memory (overshoot)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.evaluate import Evaluation



@dataclass
class SearchResult:
    fitting: list[Evaluation]       # best first
    misses: list[Evaluation]        # smallest overshoot first
    n_costed: int
    skipped: list[str] = field(default_factory=list)  # whole options left out, and why
    notes: list[str] = field(default_factory=list)    # what the reader must know about the space (one line each)


def rank_key(e: Evaluation):
    """Throughput first; on a tie (communication-bound steps hide extra compute) the simpler config: no
    offload, less recompute; then less memory."""
    c = e.config
    # selective-op reruns every second matmul and the cheap ops of every block: about every-2's share
    recomputed_fraction = 0.5 if c.selective_op_ac else 1 / c.ac_every if c.ac_every else 0.0
    return (-round(e.time.tokens_per_s_per_gpu, 6), c.offload, recomputed_fraction, c.model_parallel * c.ep,
            c.compile, c.float8, c.async_tp, bool(c.reshard_after_forward), e.memory.peak_reserved_bytes)


def _distinct(ranked: list[Evaluation]) -> list[Evaluation]:
    """Keep the best of the candidates that differ only in prefetch / rate-limiter settings.

    Those settings trade memory or exposed communication without changing what the user sees in the
    table; the variants ranked lower are dominated (no faster, no smaller) and only add noise.
    """
    seen, out = set(), []
    for e in ranked:
        c = e.config
        key = (c.sharding, c.precision, c.offload, c.ac_every, c.selective_op_ac, c.micro_batch, c.grad_accum,
               c.expert_shard_dim, c.expert_units, c.gradient_reduce_dtype, c.compile, c.float8, c.fp8_all_gather,
               c.reshard_after_forward, c.tp, c.cp, c.ep, c.pp, c.pp_schedule, c.pp_stages_per_rank, c.async_tp,
               c.sequence_parallel)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def overshoot(e: Evaluation) -> tuple[float, float]:
    """How far a candidate is from fitting: the larger, then the sum, of GPU memory and host RAM needed
    over available."""
    ratios = [e.memory.peak_reserved_bytes / e.capacity_bytes]
    host = e.memory.host_ram  # host RAM per node, the offloaded state included (cost_models/host_ram.py)
    if e.memory.cpu_ram_capacity_bytes and (host is not None or e.config.offload):
        need = host.peak_bytes if host is not None else e.memory.cpu_bytes_per_node
        ratios.append(need / e.memory.cpu_ram_capacity_bytes)
    return max(ratios), sum(ratios)
