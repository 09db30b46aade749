"""`fsdp-plan explain`: the winning config's memory and time budget in plain words, term by term,
with the formula and where it comes from. Every number is recomputed from the formula it quotes and
printed beside the cost model's own figure, so a reader can check the arithmetic.
"""

from __future__ import annotations

import math

from cost_models import activations
from cost_models.compute import mfu_flops_per_token, model_flops_per_token, recompute_flops_per_token
from cost_models.memory import UNITS_IN_FLIGHT, ParamCounts
from cost_models.units import DTYPE_BYTES, GiB

from .api import Candidate
from .search import describe


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def memory_terms(c: Candidate) -> list[tuple[str, str, str]]:
    """(term, formula with numbers, source) for each category of the backward-phase peak."""
    m, cfg, L = c.model, c.config, c.model.n_layers
    d = cfg.shard_group_size(c.cluster)
    p = DTYPE_BYTES[cfg.precision.param_dtype]
    cb = DTYPE_BYTES[cfg.precision.compute_dtype]
    counts = ParamCounts.of(m, c.training)
    trainable, frozen = counts.trainable(L), counts.frozen(L)
    opt = c.training.optimizer.state_bytes_per_param(cfg.precision.param_dtype)
    tokens = cfg.micro_batch * c.training.seq_len
    where = "CPU RAM (offloaded)" if cfg.offload else "GPU"
    terms = [
        ("stored parameters", f"{trainable:,} trainable x {p} B + {frozen:,} frozen x {cb if cfg.precision.mixed else p} B"
         f" / d={d} = {_gib(math.ceil((trainable * p + frozen * (cb if cfg.precision.mixed else p)) / d))} on {where}",
         "ZeRO (Rajbhandari et al. 2020) / FSDP (Zhao et al. 2023): each rank keeps 1/d of every unit"),
        ("optimizer state", f"{trainable:,} x {opt:g} B ({c.training.optimizer.value}) / {d} = "
         f"{_gib(math.ceil(trainable * opt / d))} on {where}",
         "Adam/AdamW keep two states per parameter (m, v); SGD one; 8-bit Adam two 1-byte states"),
        ("gradients", f"sharded: {trainable:,} x {p} B / {d} = {_gib(math.ceil(trainable * p / d))} after backward; "
         f"in flight: the root's and one block's compute-dtype gradients "
         f"{_gib(m.root_params * cb + counts.block() * cb)}", "FSDP reduce-scatters each unit's gradient after its backward"),
        ("gathered parameters", f"{min(L, UNITS_IN_FLIGHT)} blocks x {counts.block():,} x {cb} B + root "
         f"{m.root_params:,} x {cb} B = {_gib(c.memory.phases['backward'].unsharded_params)}"
         if cfg.sharding.reshards_after_forward else
         f"all {L} blocks stay gathered from forward to backward ({cfg.sharding.value}): "
         f"{_gib(c.memory.phases['backward'].unsharded_params)}",
         "FSDP paper: peak parameter memory = sharded + the units in flight (current + prefetched)"),
    ]
    terms.append(("collective buffers", f"reduce-scatter input of the block in flight ({counts.trainable_block:,} x "
                  f"{DTYPE_BYTES[cfg.precision.reduce_dtype]} B) and the prefetched block's all-gather output = "
                  f"{_gib(c.memory.phases['backward'].collective_buffers)}",
                  "FSDP2 copies gradients into a flat reduce-scatter buffer in the reduce dtype"))
    per_block = activations.block_bytes_per_token(m, cb, cfg.attention, c.training.seq_len)
    if cfg.ac_every:
        n_ckpt = math.ceil(L / cfg.ac_every)
        act = (f"{n_ckpt} checkpointed blocks keep their input ({m.hidden_size} x {cb} B per token) and "
               f"{L - n_ckpt} keep everything ({per_block:,} B per token); x {tokens:,} tokens, plus one block "
               f"re-run in backward = {_gib(c.memory.phases['backward'].activations)}")
    else:
        act = (f"{L} blocks x {per_block:,} B per token ({per_block / m.hidden_size:.1f} x h) x {tokens:,} tokens "
               f"= {_gib(c.memory.phases['backward'].activations)}")
    terms.append(("activations", act, "Korthikanti et al. 2022 (34 s b h per GPT layer), recounted per "
                  "architecture from what autograd saves (cost_models/activations.py); verify with fsdp-plan trace"))
    kept, peak = activations.logits_bytes_per_token(m, cb)
    terms.append(("logits and loss", f"{tokens:,} tokens x vocab {m.vocab_size:,} x ({kept // m.vocab_size} B kept + "
                  f"{(peak - kept) // m.vocab_size} B fp32 loss temporaries at its peak) = {_gib(tokens * peak)}",
                  "Hugging Face's causal-LM loss upcasts the logits to fp32"))
    prof = c.memory
    terms.append(("reserved", f"peak allocated {_gib(prof.peak_allocated_bytes)} in {prof.peak_phase.replace('_', ' ')}"
                  f" x (1 + fragmentation) + CUDA context = {_gib(prof.peak_reserved_bytes)} of "
                  f"{_gib(c.cluster.gpu.memory_bytes)}", "hardware.md: context 0.5-1 GB; FSDP paper section 7 on "
                  "allocator fragmentation"))
    return terms


def time_terms(c: Candidate) -> list[tuple[str, str, str]]:
    m, cfg, t = c.model, c.config, c.time
    tokens = cfg.micro_batch * c.training.seq_len
    dtype = cfg.precision.compute_dtype
    peak = c.cluster.gpu.peak_flops.get(dtype, 0)
    flops = model_flops_per_token(m, c.training)
    re = recompute_flops_per_token(m, c.training, cfg)
    return [
        ("FLOPs per token", f"6 x non-embedding params + 12 x L x heads x head_dim x s = {flops / 1e9:,.1f} GFLOP"
         + (f", + {re / 1e9:,.1f} GFLOP recompute ({cfg.activation_checkpointing} checkpointing)" if re else ""),
         "Kaplan et al. 2020; PaLM appendix B; Korthikanti et al. 2022 for recompute"),
        ("compute", f"{cfg.grad_accum} micro-step(s) x {tokens:,} tokens x {(flops + re) / 1e9:,.1f} GFLOP / "
         f"({peak / 1e12:g} TFLOP/s {dtype} peak x {_efficiency(c, flops + re, peak):.2f} achieved) = {t.compute_s:.3f} s",
         "efficiency fitted to torchtitan's published A100 runs (published.md) until calibrated"),
        ("communication", f"{t.total_comm_s:.3f} s of all-gather/reduce-scatter"
         f"{'/all-reduce' if cfg.sharding.is_hybrid else ''} per step, of which {t.exposed_comm_s:.3f} s is not hidden "
         f"behind compute", "ring collectives: (n-1)/n x message / bus bandwidth (NCCL's convention); FSDP prefetch "
         "overlaps the next unit's all-gather with the current unit's compute"),
        ("offload", f"host<->device copies {t.offload_copy_s:.3f} s", "PCIe at the catalog's rate") if cfg.offload
        else ("optimizer step", f"{t.optimizer_s:.4f} s: read/write params and states at HBM speed", "memory-bound"),
        ("step", f"{t.step_s:.3f} s -> {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; MFU = "
         f"{mfu_flops_per_token(m, c.training) / 1e9:,.1f} GFLOP/token x tokens/s / peak = {100 * t.mfu:.1f}%",
         "MFU as torchtitan computes it (6 x all params + attention)"),
    ]


def _efficiency(c: Candidate, flops_per_token: float, peak: float) -> float:
    tokens = c.config.grad_accum * c.config.micro_batch * c.training.seq_len
    return tokens * flops_per_token / (c.time.compute_s * peak) if c.time.compute_s and peak else 0.0


def explain_text(c: Candidate) -> str:
    lines = [f"Why {describe(c.config)} for {c.model.name} on {c.cluster.n_gpus} x {c.cluster.gpu.id}:",
             "", "Memory per GPU:"]
    for term, formula, source in memory_terms(c):
        lines += [f"  {term}: {formula}", f"      source: {source}"]
    lines += ["", "Time per optimizer step:"]
    for term, formula, source in time_terms(c):
        lines += [f"  {term}: {formula}", f"      source: {source}"]
    lines += [f"  note: {n}" for n in c.memory.notes]
    return "\n".join(lines)
