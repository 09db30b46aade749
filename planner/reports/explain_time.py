"""The time half of `fsdp-plan explain`: the step's budget by operator class, each with its formula.

The seconds are the cost model's own (TimeBreakdown, c.time): nothing here re-derives them. What is
recomputed, from cost_models.operators and kernel_time, is only what the formulas show - the shapes, rates,
bytes and factors - so a reader can redo the arithmetic; BUDGET's classes add up to step_s.
"""

from __future__ import annotations

import math

from cost_models import context_parallel, host_optimizer, moe, operators, tensor_parallel
from cost_models.compute import mfu_flops_per_token, model_flops_per_token, recompute_flops_per_token
from cost_models.kernel_time import Rates
from cost_models.memory import ParamCounts
from cost_models.model_spec import dense_block_spec
from cost_models.pipeline import stages
from cost_models.pipeline_time import largest_rank_params
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.specs import Attention
from cost_models.step_time import priced_block_ops, root_memory_bytes_per_token
from cost_models.units import DTYPE_BYTES
from planner.trainers.table import TRAINERS

# (TimeBreakdown field, term) in the step's order: compute by operator class, then what is not compute.
BUDGET = (("matmul_s", "matmul"), ("attention_s", "attention"), ("memory_bound_s", "memory-bound"),
          ("recompute_s", "recompute"), ("exposed_comm_s", "exposed communication"),
          ("pp_bubble_s", "pipeline bubble"), ("pp_imbalance_s", "pipeline imbalance"),
          ("overlap_slowdown_s", "overlap slowdown"), ("offload_copy_s", "offload copies"),
          ("optimizer_s", "optimizer step"), ("overhead_s", "overhead"))


def _seconds(c, key: str) -> str:
    """'0.1234567 s, 12.3% of the step': seven significant digits, so the printed classes sum to the step."""
    s, step = getattr(c.time, key), c.time.step_s
    return f"{s:.7g} s, {100 * s / step:.1f}% of the step"


def _steps(cfg) -> str:
    """'2 micro-step(s)', or under PP the mean pipeline rank's share: '32 microbatches / pp 16'."""
    return f"{cfg.grad_accum} microbatches / pp {cfg.pp}" if cfg.pp > 1 else f"{cfg.grad_accum} micro-step(s)"


def _mesh_comm(c) -> str:
    """'; tensor parallel 0.62 s (0.62 s exposed), ...': the mesh's share of the communication, where it has one."""
    t, cfg = c.time, c.config
    parts = [f"{name} {total:.4f} s ({exposed:.4f} s exposed)" for name, on, total, exposed in (
        (f"tensor parallel (tp {cfg.tp}{', async' if cfg.async_tp else ''}"
         f"{'' if cfg.sequence_parallel else ', no sequence parallel'})", cfg.tp > 1, t.tp_comm_s, t.tp_exposed_comm_s),
        (f"context parallel (cp {cfg.cp} ring)", cfg.cp > 1, t.cp_comm_s, t.cp_exposed_comm_s),
        (f"expert parallel (ep {cfg.ep} dispatch / combine all-to-alls)", cfg.ep > 1, t.ep_comm_s, t.ep_comm_s)) if on]
    return ("; of it " + ", ".join(parts)) if parts else ""


def _tf(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:,.1f} TFLOP/s"


def _power_cap(gpu) -> str:
    """' x 0.894 clock under a 500 W cap of its 700 W TDP ((500 / 700)^(1/3))', or '' at TDP."""
    if not gpu.power_limit_w:
        return ""
    return (f" x {gpu.clock_scale:.4f} clock under a {gpu.power_limit_w:g} W cap of its {gpu.tdp_w:g} W TDP "
            f"(({gpu.power_limit_w:g} / {gpu.tdp_w:g})^(1/3))")


def _peak(c) -> float:
    gpu = c.cluster.gpu
    return gpu.priced_peak_flops(c.config.precision.compute_dtype)


def _block_kinds(c, m=None) -> list[tuple[int, object, tuple]]:
    """(blocks of this kind, BlockOps, memory ops as step_time prices them): the sparse (or only) block and an
    MoE model's leading dense blocks (m: the model to price, c.model by default; a TP rank's slice for the mesh)."""
    m, cfg = m or c.model, c.config
    cb = DTYPE_BYTES[cfg.precision.compute_dtype]
    dense = dense_block_spec(m)
    kinds = []
    for n, spec in [(m.n_layers - m.n_dense_layers, m)] + ([(m.n_dense_layers, dense)] if dense else []):
        ops, eager = priced_block_ops(spec, c.training, cfg, cb)
        memory = ops.memory_ops + ((eager[1],) if eager is not None else ())
        kinds.append((n, ops, memory))
    return kinds


def rank_view(c):
    """(model, tokens per micro-step) of one mesh rank as step_time prices it: its TP slice of the model on its
    s / cp tokens of each sequence (the model itself and micro-batch x s without a mesh)."""
    cfg = c.config
    return tensor_parallel.local_model(c.model, cfg), cfg.micro_batch * c.training.seq_len // cfg.cp


def _matmul(c, rates: Rates, profile: Profile) -> str:
    cfg, gpu = c.config, c.cluster.gpu
    model, tokens = rank_view(c)
    dtype = cfg.precision.compute_dtype
    float8 = cfg.float8 and rates.float8_flops_per_s > 0

    def shapes(matmuls) -> str:
        out = []
        for mm in matmuls:
            rows = tokens * mm.rows_per_token
            f8 = " fp8" if float8 and mm.float8 else ""
            out.append(f"{mm.name} {rows:g}x{mm.n}x{mm.k}{f' x{mm.count}' if mm.count > 1 else ''}{f8} "
                       f"[{rates.shape_factor(rows, mm.n, mm.k):.4f}]")
        return ", ".join(out)

    blocks = " + ".join(f"{n} blocks x ({shapes(ops.matmuls)})" for n, ops, _ in _block_kinds(c, model))
    head, _ = operators.root_ops(model, DTYPE_BYTES[dtype])
    frozen = " (2 for a frozen LoRA base weight: no weight gradient)" if c.training.adapter_rank else ""
    peak = _peak(c)
    large = gpu.matmul_efficiency or profile.default_gpu_matmul_efficiency
    fp8 = (f"; fp8 products at {gpu.peak_flops['fp8'] / 1e12:g} TFLOP/s fp8 peak x the same fractions = "
           f"{_tf(rates.float8_flops_per_s)}" if float8 else "")
    return (f"{_seconds(c, 'matmul_s')} = {_steps(cfg)} x [{blocks}"
            + (f" + {shapes([head])}" if head is not None else "")
            + f"] of m x n x k [shape factor], each 2mnk FLOPs x 3 passes (forward, input and weight gradients)"
            f"{frozen} / (rate x shape factor); rate = {peak / 1e12:g} TFLOP/s {dtype} peak x {large:g} large-GEMM "
            f"efficiency ({gpu.id} catalog){_power_cap(gpu)} x {profile.efficiency(dtype):g} training fraction "
            f"(profile) = "
            f"{_tf(rates.matmul_flops_per_s)}{fp8}; shape factor = product over m, n, k of x / (x + "
            f"{rates.half_dim:g})")


def _attention(c, rates: Rates, profile: Profile) -> str:
    cfg = c.config
    m, tokens = rank_view(c)
    s = c.training.seq_len  # a CP rank's queries still attend over the whole sequence's keys
    _, ops, _ = _block_kinds(c, m)[0]
    head = f"{_seconds(c, 'attention_s')} = {_steps(cfg)} x {m.n_layers} blocks x "
    if cfg.attention is Attention.EAGER:
        d = ops.head_dim
        return (head + f"{m.n_heads} heads x (QK^T {tokens}x{s}x{d} + P @ V {tokens}x{d}x{s}) x 2mnk FLOPs x 3 "
                f"passes at the matmul rate {_tf(rates.matmul_flops_per_s)} x shape factor (eager: all {s} keys, "
                f"no causal skipping); the scores' traffic ({m.n_heads} x {s} x (3 x c + 8) B per token) is "
                "memory-bound")
    keys = ops.attention_flops_per_token / (4 * m.q_dim)
    gpu = c.cluster.gpu
    kernel = gpu.attention_efficiency or profile.default_attention_efficiency
    if cfg.attention_kernel.value != "flash2":  # cost_models/attention_kernels.py
        kernel_words = (f" x {gpu.attention_speed(cfg.attention_kernel.value):.3f} ({cfg.attention_kernel.value}'s "
                        "speed over it: FlashAttention-3 paper figures)")
    else:
        kernel_words = ""
    length = context_parallel.ring_kernel_seq_len(s, cfg.cp)  # CP: the ring's calls set the kernel's rate
    rate = rates.attention_rate(length, ops.head_dim)
    why = "the causal kernel skips the masked blocks" if m.causal else "not causal: every key"
    passes = "(1 forward + 2.5 backward)"
    if cfg.attention is Attention.FLEX:  # cost_models/attention_flex.py
        why = "FlexAttention visits its block mask's kv blocks: causal, a sliding window's band, layers averaged"
        passes = f"(1 / {ops.attention_speed[0]:g} forward + 2.5 / {ops.attention_speed[1]:g} backward)"
    return (head + f"{passes} x {ops.attention_flops_per_token / 1e6:,.1f} MFLOP per token "
            f"(4 x q_dim {m.q_dim} x {keys:g} keys per query of s = {s}: {why}) x {tokens:,} tokens / {_tf(rate)}; "
            f"rate = {_peak(c) / 1e12:g} TFLOP/s peak x {kernel:g} flash-kernel efficiency ({gpu.id} catalog)"
            f"{_power_cap(gpu)}"
            f"{kernel_words} x "
            f"{profile.attention_efficiency:g} (profile) x L / (L + {rates.attention_half_seq:g}) = "
            f"{length / (length + rates.attention_half_seq):.3f} (L = {length}"
            + (" = s / cp: ring attention's calls, cost_models/context_parallel.py" if cfg.cp > 1 else " = s")
            + ") x head-dim factor "
            f"{rate / (rates.attention_flops_per_s * length / (length + rates.attention_half_seq)):.3f} "
            f"(head_dim {ops.head_dim}: d / (d + 24), 1 at 128)")


def _memory_bound(c, rates: Rates, profile: Profile) -> str:
    cfg = c.config
    model, tokens = rank_view(c)
    compiled = cfg.compile
    root = root_memory_bytes_per_token(model, cfg, DTYPE_BYTES[cfg.precision.compute_dtype])
    kinds = _block_kinds(c, model)
    per_step = [(n * tokens * (op.bytes(compiled, False) + op.bytes(compiled, True)), op.name)
                for n, _, memory in kinds for op in memory]
    per_step += [(tokens * (forward + backward), name) for name, forward, backward in root]
    blocks = " + ".join(f"{n} blocks x {sum(op.bytes(compiled, False) for op in mem):,.0f} + "
                        f"{sum(op.bytes(compiled, True) for op in mem):,.0f} B per token (forward + backward)"
                        for n, _, mem in kinds)
    root_bytes = sum(forward + backward for _, forward, backward in root)
    per_token_s = rates.memory_s(sum(b for b, _ in per_step))
    rest = c.time.memory_bound_s / (cfg.grad_accum / cfg.pp if cfg.pp > 1 else cfg.grad_accum) - per_token_s
    biggest = ", ".join(f"{name} {b / 1e9:.2f} GB" for b, name in sorted(per_step, reverse=True)[:3])
    mode = ("compiled: inductor fuses each block's pointwise chains" + (" and the loss" if cfg.loss_compiled else "")
            if compiled else "eager kernels")
    return (f"{_seconds(c, 'memory_bound_s')} = {_steps(cfg)} x ([{blocks} + root {root_bytes:,.0f}"
            f" B per token (final norm, embedding eager; loss over {model.vocab_size:,} logits)] x {tokens:,} tokens "
            f"({mode}) / {rates.memory_bytes_per_s / 1e12:.2f} TB/s = {per_token_s:.4f} s, + {rest:.4f} s of "
            + ("FSDP2's copy-in/out around each collective" if TRAINERS[c.trainer].fsdp_version == 2 else
               "FSDP1's shard casts and its flat gradient's cat, cast and divisions (cost_models/fsdp_copies.py)")
            + (" and the Float8 weights' casts" if cfg.float8 else "")
            + (", DTensor's reorder copies around sequence-parallel collectives" if cfg.tp > 1 and cfg.sequence_parallel
               else "") + (", the ring attention's fp32 merges" if cfg.cp > 1 else "")
            + (f" (a TP rank's slice of the model, tp {cfg.tp})" if cfg.tp > 1 else "")
            + f"); {c.cluster.gpu.hbm_bytes_per_s / 1e12:g} TB/s HBM x {profile.memory_bound_efficiency:g} "
            f"memory-bound efficiency; biggest per micro-step: {biggest}")


def _recompute(c, rates: Rates) -> str:
    cfg, L = c.config, c.model.n_layers
    tokens = cfg.micro_batch * c.training.seq_len
    if cfg.selective_op_ac:
        _, ops, memory = _block_kinds(c)[0]
        names = ", ".join(mm.name for mm in ops.selective_op_recomputed())
        forward = sum(op.bytes(cfg.compile, False) for op in memory)
        return (f"{_seconds(c, 'recompute_s')} = {_steps(cfg)} x {L} blocks x (every second linear "
                f"product's forward ({names}) at {_tf(rates.matmul_flops_per_s)} x shape factor + the memory-bound "
                f"forward, {forward:,.0f} B per token / {rates.memory_bytes_per_s / 1e12:.2f} TB/s) x {tokens:,} "
                "tokens (selective-op); the attention kernel's output and the other products are saved")
    if cfg.ac_every:
        n = math.ceil(L / cfg.ac_every)
        return (f"{_seconds(c, 'recompute_s')} = {_steps(cfg)} x {n} of {L} blocks (every "
                f"{cfg.ac_every}) x the block's whole forward again in backward (its matmul, attention and "
                "memory-bound forward, as priced above)")
    return f"{_seconds(c, 'recompute_s')}: no activation checkpointing"


def _host_step(c, per_rank: float, profile: Profile) -> str:
    """The CPU-offloaded optimizer step's formula with its numbers (host_optimizer.py)."""
    host, ranks = c.cluster.host_cpu, host_optimizer.ranks_per_node(c.cluster)
    moved = host_optimizer.bytes_per_param(c.training, c.config.precision.param_dtype)
    return (f"{per_rank:,.0f} trainable params per rank x {moved:g} B ({c.training.optimizer_impl.value} "
            f"{c.training.optimizer.value}) / {host_optimizer.rank_bytes_per_s(c.cluster, profile) / 1e9:.4g} GB/s = "
            f"min(min({host.threads_per_rank} thread(s), {host.cores_per_node} cores / {ranks} ranks) x "
            f"{host.thread_bytes_per_s / 1e9:.4g} GB/s, {host.memory_bytes_per_s / 1e9:g} GB/s host memory x "
            f"{profile.host_memory_efficiency:g} / {ranks} ranks) on the CPU")


def time_terms(c, profile: Profile = DEFAULT_PROFILE) -> list[tuple[str, str, str]]:
    """(term, formula with numbers, source): FLOPs per token, then one term per BUDGET class, then the step.
    `profile`: the one c was costed with (the formulas' coefficients; the seconds are c.time's)."""
    m, cfg, t = c.model, c.config, c.time
    dtype = cfg.precision.compute_dtype
    rates = Rates.of(c.cluster.gpu, dtype, profile, cfg.attention_kernel.value)
    flops, re = model_flops_per_token(m, c.training), recompute_flops_per_token(m, c.training, cfg)
    d = cfg.shard_group_size(c.cluster)
    per_rank = ParamCounts.of(m, c.training, d, bool(cfg.expert_shard_dim)).trainable(m.n_layers) / d
    if cfg.pp > 1:  # the pipeline rank holding the most (its TP slice): the slowest optimizer step
        local = rank_view(c)[0]
        per_rank = largest_rank_params(local, cfg, ParamCounts.of(local, c.training, d))[0] / d
    p = DTYPE_BYTES[cfg.precision.param_dtype]
    opt = c.training.optimizer.state_bytes_per_param(cfg.precision.param_dtype)
    terms = [
        ("FLOPs per token", ("4 x frozen non-embedding params + 6 x adapter params" if c.training.adapter_rank
                             else "6 x non-embedding params") + (f" (active: {m.active_params:,} of {m.n_params:,}, "
                                                                 f"{m.moe.experts_per_token} of {m.moe.n_experts} "
                                                                 "experts per token)" if m.moe else "")
         + f" + 12 x L x heads x head_dim x s = {flops / 1e9:,.1f} GFLOP"
         + (f", + {re / 1e9:,.1f} GFLOP recompute ({cfg.activation_checkpointing} checkpointing)" if re else ""),
         "Kaplan et al. 2020; PaLM appendix B; Korthikanti et al. 2022 for recompute"),
        ("matmul", _matmul(c, rates, profile),
         "hardware.md (best measured large GEMM / peak); training fraction fitted to torchtitan's published runs "
         "(benchmarks/throughput_accuracy.py); shape factor x0 a stated estimate (cost_models/kernel_time.py)"),
        ("attention", _attention(c, rates, profile),
         "eager attention: its score products over all keys (cost_models/kernel_time.py)"
         if cfg.attention is Attention.EAGER else "FlashAttention-2 and -3 papers: kernel efficiency, causal work, "
         "backward 2.5x the forward, sequence and head-dim factors (cost_models/kernel_time.py)"
         + ("; FlexAttention at 90% / 85% of FlashAttention-2 forward / backward (PyTorch FlexAttention blog, "
            "Aug 2024; cost_models/attention_flex.py)" if cfg.attention is Attention.FLEX else "")),
        ("memory-bound", _memory_bound(c, rates, profile),
         "memory-bound efficiency fitted with the matmul fraction to torchtitan's published runs "
         "(benchmarks/throughput_accuracy.py --fit; one streaming kernel reaches 80-90% of HBM, hardware.md); bytes "
         "per op from the Hugging Face / torchtitan kernels and inductor's fusion (cost_models/operators.py)"),
        ("recompute", _recompute(c, rates), "torchtitan's activation checkpointing (full blocks, or the op-level "
         "policy as calibration/apply.py runs it); Korthikanti et al. 2022"),
        ("exposed communication", f"{_seconds(c, 'exposed_comm_s')}: of {t.total_comm_s:.4f} s of all-gather/"
         f"reduce-scatter{'/all-reduce' if cfg.sharding.is_hybrid else ''} per step, what compute does not hide"
         + _mesh_comm(c) + (f"; of it stage-to-stage sends {t.pp_comm_s:.4f} s (pipeline bubble below)"
                            if cfg.pp > 1 else ""),
         "ring collectives: (n-1)/n x message / bus bandwidth (NCCL's convention); FSDP prefetch overlaps the "
         "next unit's all-gather with the current unit's compute"
         + ("; TP: Korthikanti et al. 2022 (sequence parallel), exposed unless async TP hides a collective behind "
            "the products it is fused with (cost_models/tensor_parallel.py)" if cfg.tp > 1 else "")
         + ("; CP: PyTorch's ring attention, its K/V all-gather behind the diagonal step, the fp32 dK/dV permutes "
            "behind the next steps (cost_models/context_parallel.py)" if cfg.cp > 1 else "")),
        *(_pipeline_terms(c, profile) if cfg.pp > 1 else ()),
        ("overlap slowdown", f"{_seconds(c, 'overlap_slowdown_s')} = {profile.overlap_slowdown:g} x min(hidden "
         f"communication {t.total_comm_s - t.exposed_comm_s:.4f} s, compute {t.compute_s:.4f} s)",
         "a stated estimate (profile.overlap_slowdown): NCCL's ring kernels take SMs and HBM bandwidth"),
        ("offload copies", f"{_seconds(c, 'offload_copy_s')}: host<->device copies of every unit's shard at "
         f"{c.cluster.gpu.pcie_bytes_per_s / 1e9:g} GB/s PCIe x {profile.pcie_efficiency:g}",
         "the catalog's PCIe rate (hardware.md)") if cfg.offload else None,
        ("optimizer step", f"{_seconds(c, 'optimizer_s')} = " + (
            _host_step(c, per_rank, profile)
            if cfg.offload else f"{per_rank:,.0f} trainable params per rank x (2 x {p} + {p} + 2 x {opt:g}) B (read/"
            f"write the param and its states, read the gradient) / ({c.cluster.gpu.hbm_bytes_per_s / 1e12:g} TB/s "
            f"HBM x {profile.optimizer_hbm_efficiency:g})"),
         "the step streams through host memory (cost_models/host_optimizer.py: torch's passes per implementation; a "
         "thread's rate measured on an H100 host, published.md)" if cfg.offload else "memory-bound elementwise update"),
        ("overhead", f"{_seconds(c, 'overhead_s')} = {cfg.grad_accum} micro-step(s) x "
         f"{profile.microstep_overhead_s:g} s (kernel launches, hooks, data loading)", "a stated estimate (profile)"),
        ("step", f"{t.step_s:.7g} s (the classes above) -> {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; MFU = "
         f"{mfu_flops_per_token(m, c.training) / 1e9:,.1f} GFLOP/token x tokens/s / peak = {100 * t.mfu:.1f}% "
         f"(HFU, recompute counted: {100 * t.hfu:.1f}%)",
         "MFU as torchtitan computes it (6 x all params + attention)" + (", active params for MoE" if m.moe else "")),
    ]
    terms = [term for term in terms if term is not None]
    why = moe.comm_bound_note(m, t.exposed_comm_s, t.step_s,
                              moe.padding_factor(m, d, bool(cfg.expert_shard_dim)) if m.moe else 1.0,
                              cfg.sharding.value, cfg.micro_batch)
    if why:
        at = next(i for i, (name, *_) in enumerate(terms) if name == "overlap slowdown")
        terms.insert(at, ("why communication", why, "FSDP gathers every parameter of a unit; an MoE token computes "
                          "with its top-k experts only (cost_models/moe.py)"))
    return terms


def _pipeline_terms(c, profile: Profile) -> tuple[tuple[str, str, str], ...]:
    """The schedule's bubble and the slowest rank's excess, with the stage passes the walk took
    (cost_models/pipeline_time.py); the exposed sends and FSDP's once-per-step collectives named."""
    from cost_models.pipeline_time import textbook_bubble_fraction
    from cost_models.step_time import estimate_step_time

    cfg, t = c.config, c.time
    walked: dict = {}
    estimate_step_time(c.model, c.cluster, c.training, cfg, profile, terms=walked)
    passes, p2p_s, pipe = walked["pipeline_passes"], walked["pipeline_p2p_s"], walked["pipeline"]
    pp, v, m, schedule = cfg.pp, cfg.pp_stages_per_rank, cfg.pp_microbatches, cfg.pp_schedule
    layout = stages(c.model, cfg)

    def ms(x: float) -> str:
        return f"{1e3 * x:.2f} ms"

    shown = sorted({0, len(layout) // 2, len(layout) - 1})
    per_stage = "; ".join(f"stage {i} ({layout[i].describe()}, rank {layout[i].rank}): F {ms(passes[i].forward_s)}, "
                          f"B {ms(passes[i].backward_s)}" + (f" (W {ms(passes[i].weight_s)})"
                                                              if schedule.value in ("zero-bubble", "dualpipev") else "")
                          for i in shown)
    try:
        ideal = f"; equal stages: {100 * textbook_bubble_fraction(schedule, pp, v, m):.1f}% of the step"
    except ValueError:
        ideal = "; W passes (the weight-gradient half of each matmul backward, at the fused backward's rate) fill it"
    slowest = pipe.rank_busy_s and pipe.slowest_rank
    bubble = (f"{_seconds(c, 'pp_bubble_s')}: {schedule.torch_class} on pp {pp} ranks x {v} stage(s) per rank, {m} "
              f"microbatches of {cfg.micro_batch}; torch's order walked with each stage's passes per microbatch "
              f"({per_stage}): the step without sends {pipe.step_s - pipe.p2p_exposed_s - pipe.fsdp_exposed_s:.4f} s = "
              f"{m} x the slowest rank's {ms(pipe.mean_rank_s + pipe.imbalance_s / m)} + warm-up and cool-down "
              f"{t.pp_bubble_s:.4f} s ({100 * t.pp_bubble_s / t.step_s:.1f}% of the step{ideal}); sends: "
              f"{ms(p2p_s)} each ({cfg.micro_batch} x {c.training.seq_len // cfg.cp} tokens x {c.model.hidden_size} x "
              f"2 B{f' / tp {cfg.tp}' if cfg.tp > 1 and cfg.sequence_parallel else ''} to the next stage's rank), "
              f"{t.pp_comm_s:.4f} s of them on the critical path; FSDP gathers each stage once per step and "
              f"reduce-scatters after its last backward: {pipe.fsdp_exposed_s:.4f} s exposed")
    imbalance = (f"{_seconds(c, 'pp_imbalance_s')} = {m} microbatches x (the slowest rank {slowest}: "
                 f"{ms(pipe.mean_rank_s + pipe.imbalance_s / m)} - the mean rank {ms(pipe.mean_rank_s)}) of F + B; "
                 "the first stage holds the embedding, the last the final norm, head and loss")
    return (("pipeline bubble", bubble, "GPipe (Huang et al. 2019), 1F1B / interleaved 1F1B (Narayanan et al. 2021, "
             "SC21), zero bubble (Qi et al. 2023), DualPipeV: torch.distributed.pipelining's orders "
             "(cost_models/pipeline_orders.py) walked as an event simulation (cost_models/pipeline_time.py)"),
            ("pipeline imbalance", imbalance, "stage passes from the per-block and root prices above "
             "(cost_models/pipeline.py's split)"))
