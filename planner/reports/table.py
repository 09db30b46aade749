"""Tables and text for people, JSON for scripts. The only place that formats units (with its sibling
table_calibration.py, a calibration's report)."""

from __future__ import annotations

import json
import textwrap

from tabulate import tabulate

from cost_models.units import GiB

from planner.api import Candidate, Plan
from planner.line_width import LINE_WIDTH
from planner.reports.table_pipeline import largest_rank, pipeline_lines, rank_memory_lines
from planner.search.words import pipeline_words, technique_words


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.1f}"


def _model_state_bytes(c: Candidate) -> int:
    b = c.memory.breakdown
    return b.sharded_params + b.sharded_grads + b.optimizer_state + b.optimizer_temporaries


def _row(rank, c: Candidate) -> list:
    cfg, b, t = c.config, c.memory.breakdown, c.time
    return [
        rank, cfg.sharding.value + (" +experts dim 1" if cfg.expert_shard_dim else "") + (" +expert units" if cfg.expert_units else ""), mesh_words(cfg), cfg.precision.value + (f" (reduce {cfg.reduce_dtype})" if cfg.reduce_dtype else ""), "yes" if cfg.offload else "no", cfg.activation_checkpointing,
        cfg.micro_batch, cfg.grad_accum, "yes" if cfg.backward_prefetch else "no",
        ", ".join(technique_words(cfg, compact=True)) or "-",
        gib(c.memory.peak_reserved_bytes), gib(_model_state_bytes(c)),
        gib(b.unsharded_params + b.unsharded_grads + b.collective_buffers), gib(b.activations),
        gib(b.logits_and_loss), f"{t.step_s:.3f}", f"{t.tokens_per_s_per_gpu:,.0f}", f"{100 * t.mfu:.1f}%",
        gib(c.memory.host_ram.peak_bytes) if c.memory.host_ram is not None else "-",
    ]


def mesh_words(config) -> str:
    """The degrees beside FSDP in a table cell: "tp 8, cp 2" (or "-")."""
    return ", ".join([f"{name} {getattr(config, name)}" for name in ("tp", "cp", "ep") if getattr(config, name) > 1]
                     + pipeline_words(config, compact=True)) or "-"


_HEADERS = ["#", "sharding", "mesh", "precision", "offload", "act. ckpt", "micro", "accum", "bwd prefetch", "techniques",
            "peak GiB", "states GiB", "gathered GiB", "activ. GiB", "logits GiB", "step s", "tok/s/GPU", "MFU", "host GiB/node"]


# The default view fits LINE_WIDTH columns; --wide shows every column (_HEADERS).
# The columns a reader needs first, most needed first: the narrow view drops from the end until the table fits.
# What tells candidates apart (the configuration) comes before the memory breakdown, so two rows never look alike.
_NARROW = ["#", "tok/s/GPU", "peak GiB", "MFU", "sharding", "mesh", "act. ckpt", "micro", "accum", "techniques",
           "precision", "offload", "bwd prefetch", "step s", "host GiB/node", "activ. GiB", "states GiB", "gathered GiB",
           "logits GiB"]
_KEPT = {"#", "tok/s/GPU", "peak GiB", "MFU", "step s"}  # shown even when every row has the same value


def _table(rows: list[list], headers: list[str], wrap: dict[str, int] | None = None) -> str:
    """rows under headers; `wrap` folds the named columns' cells to at most that many characters a line."""
    widths = [(wrap or {}).get(h) for h in headers]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True,
                    maxcolwidths=widths if any(widths) else None)


def candidates_table(candidates: list[Candidate], top: int, wide: bool = False) -> str:
    """The candidates as a table. Narrow (the default): a column whose value is the same in every row moves to one
    "every row:" line under the table, and the least needed columns go until the table fits LINE_WIDTH."""
    rows = [_row(i + 1, c) for i, c in enumerate(candidates[:top])]
    if wide:
        return _table(rows, _HEADERS)
    index = {h: i for i, h in enumerate(_HEADERS)}
    same = [h for h in _NARROW if h not in _KEPT and len({row[index[h]] for row in rows}) == 1]
    shown = [h for h in _NARROW if h not in same]
    dropped, wrap = [], {}
    while True:
        ordered = [h for h in _HEADERS if h in shown]
        text = _table([[row[index[h]] for h in ordered] for row in rows], ordered, wrap)
        if max(len(line) for line in text.splitlines()) <= LINE_WIDTH or len(shown) <= len(_KEPT):
            break
        if "techniques" in shown and not wrap:  # first fold the longest cells (a row on two lines), then drop
            wrap = {"techniques": 20}
            continue
        dropped.append(shown.pop())
    notes = ([f"every row: {', '.join(f'{h} {rows[0][index[h]]}' for h in _HEADERS if h in same)}"]
             if same else []) + ([f"not shown: {', '.join(dropped)} (--wide shows every column)"] if dropped else [])
    return "\n".join([text] + _wrap("; ".join(notes)))


def _wrap(text: str, indent: int = 2) -> list[str]:
    """A line of prose folded to LINE_WIDTH, later lines indented (long words such as paths are not broken)."""
    return textwrap.wrap(text, LINE_WIDTH, subsequent_indent=" " * indent, break_long_words=False,
                         break_on_hyphens=False) if text else []


def power_cap(gpu) -> str:
    """' at 750 W (TDP 1000 W)' for a power-capped GPU (--power-limit-w, or the catalog's), else ''."""
    return f" at {gpu.power_limit_w:g} W (TDP {gpu.tdp_w:g} W)" if gpu.power_limit_w else ""


def plan_text(p: Plan, top: int, wide: bool = False) -> str:
    c0 = p.cluster
    lines = [
        *model_lines(p.model),
        f"cluster: {c0.n_gpus} x {c0.gpu.name} ({gib(c0.gpu.memory_bytes)} GiB){power_cap(c0.gpu)}, "
        f"{c0.gpus_per_node} per node, "
        f"{c0.internode_bytes_per_s * 8 / 1e9:.0f} Gbit/s between nodes",
        training_line(p.training),
        trainer_line(p.trainer),
        f"costed {p.n_costed} configurations: {len(p.candidates)} fit, {len(p.misses)} nearest misses",
        "",
    ]
    if p.candidates:
        lines += [f"Top {min(top, len(p.candidates))} (ranked by tokens/s per GPU; peak = reserved incl. CUDA context):",
                  candidates_table(p.candidates, top, wide), ""]
        best = p.best
        if best.config.pp > 1:
            lines += [w for line in pipeline_lines(best.model, best.config, best.cluster, best.memory)
                      for w in _wrap(line, 4)] + [""]
        outside = [first_step_line(best.memory), *host_ram_lines(best.memory)]
        lines += [w for line in outside for w in _wrap(line, 4)] + [""]
        if best.memory.notes:
            lines += [w for n in best.memory.notes for w in _wrap(f"note: {n}")] + [""]
    elif not p.misses:  # nothing was costed: the cause is in skipped / notes, never an empty table
        lines += ["Nothing could be costed:"] + [w for reason in p.notes + p.skipped for w in _wrap(f"  - {reason}", 4)]
        return "\n".join(lines)
    else:
        lines += ["Nothing fits. Nearest misses:", candidates_table(p.misses, top, wide), ""]
        lines += [w for i, c in enumerate(p.misses[:top]) for w in _wrap(f"  #{i + 1}: {'; '.join(c.reasons)}", 6)]
        lines += ["", "Would fit with:" if p.suggestions else "No single change makes the nearest miss fit."]
        lines += [w for s in p.suggestions for w in _wrap(f"  - {s}", 4)]
    lines += [w for reason in p.skipped for w in _wrap(f"skipped: {reason}")]
    lines += [w for n in p.notes for w in _wrap(f"note: {n}")]
    return "\n".join(lines)


def model_lines(spec) -> list[str]:
    """"name: 46.70B parameters (12.88B active), 32 x Block" and, for a model priced by a traced block
    profile, where its activation memory comes from."""
    active = f" ({spec.active_params / 1e9:.2f}B active)" if spec.moe is not None else ""
    lines = [f"{spec.name}: {spec.n_params / 1e9:.2f}B parameters{active}, {spec.n_layers} x {spec.block_class}"]
    if spec.activation_profile is not None:
        lines += _wrap(f"activations: {spec.activation_profile.source}")
    return lines


def trainer_line(trainer_id: str) -> str:
    """"trainer: torchtitan 0.3 (the search proposes what it runs, priced with its defaults)"."""
    from planner.trainers import trainer_named

    return f"trainer: {trainer_named(trainer_id).title} (searched and priced as it runs; --trainer to change)"


def training_line(training) -> str:
    """"training: seq 2048, adamw (fused step), lora fine-tuning (rank 16, dropout 0.05), global batch 64"."""
    dropout = f", dropout {training.adapter_dropout:g}" if training.adapter_dropout else ""
    return (f"training: seq {training.seq_len}, {training.optimizer.value} ({training.optimizer_impl.value} step), "
            f"{training.finetune.value} fine-tuning"
            + (f" (rank {training.lora_rank}{dropout})" if training.finetune.value == "lora" else "")
            + (f" (rank {training.lora_rank}{dropout}, {training.quant.value}"
               f"{', double quant' if training.double_quant else ''}, {training.quant_storage} storage)"
               if training.quantized else "")
            + (f", global batch {training.global_batch}" if training.global_batch else ""))


def estimate_text(c: Candidate) -> str:
    cfg, m, t = c.config, c.memory, c.time
    rows = [[k, gib(v)] for k, v in m.breakdown.to_dict().items()]
    rows += [["peak allocated", gib(m.peak_allocated_bytes)], ["peak reserved (+context, fragmentation)",
                                                               gib(m.peak_reserved_bytes)]]
    trows = [[k, f"{v:.4f}"] for k, v in t.to_dict().items() if k.endswith("_s")]
    lines = [
        f"{c.model.name} ({c.model.n_params / 1e9:.2f}B) on {c.cluster.n_gpus} x {c.cluster.gpu.id}"
        f"{power_cap(c.cluster.gpu)}: "
        + ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items()),
        training_line(c.training),
        *pipeline_lines(c.model, cfg, c.cluster),
        "",
        f"Memory per GPU (GiB){_of_largest_rank(m)}, peak in {m.peak_phase.replace('_', ' ')}:",
        tabulate(rows, tablefmt="simple", disable_numparse=True),
        *rank_memory_lines(m),
    ]
    if m.cpu_bytes_per_node:
        lines.append(f"CPU RAM per node for offloaded state: {gib(m.cpu_bytes_per_node)} GiB")
    lines += [w for line in [first_step_line(m), *host_ram_lines(m)] for w in _wrap(line, 4)]
    lines += ["", "Step time (s):", tabulate(trows, tablefmt="simple", disable_numparse=True),
              f"tokens/s per GPU: {t.tokens_per_s_per_gpu:,.0f}   MFU: {100 * t.mfu:.1f}%", "",
              "fits: yes" if c.fits else "fits: NO - " + "; ".join(c.reasons)]
    lines += [f"note: {n}" for n in m.notes]
    return "\n".join(lines)


def host_ram_lines(memory) -> list[str]:
    """Host RAM per node (rank 0's) by what holds it, against the node's RAM, and the load / save ways with why."""
    h = memory.host_ram
    if h is None:
        return []
    capacity = memory.cpu_ram_capacity_bytes
    of = f" of {gib(capacity)} GiB" if capacity else ""
    return [f"Host RAM per node: {gib(h.peak_bytes)} GiB{of} at its peak = processes {gib(h.process_bytes)} + the "
            f"largest of loading {gib(h.load_bytes)}, offloaded state {gib(h.offloaded_bytes)} + checkpoint save "
            f"{gib(h.save_bytes)} or + resume {gib(h.resume_bytes)}"
            + (f"; the save adds {gib(h.save_gpu_bytes)} GiB per GPU" if h.save_gpu_bytes else ""),
            f"Load and checkpoint ways: {h.why}"]


def first_step_line(memory) -> str:
    """The first step against the steady one: its optimizer state made in its optimizer step (torch's lazy
    _init_group), so its forward and backward run without it (MemoryEstimate.first_step_allocated_bytes); the
    reserved at its end where the step replay runs."""
    reserved, state = memory.first_step_reserved_bytes, memory.phases["optimizer_step"].optimizer_state
    if not state:
        return (f"First step: as the steady one, {gib(memory.peak_allocated_bytes)} GiB allocated (no optimizer state "
                "on the GPU)")
    return (f"First step: {gib(memory.first_step_allocated_bytes)} GiB allocated at its peak (steady "
            f"{gib(memory.peak_allocated_bytes)}): the optimizer state, {gib(state)} GiB, made in its optimizer step "
            "beside the gradients and the step's temporaries"
            + (f"; {gib(reserved)} GiB reserved at its end (steady {gib(memory.peak_reserved_bytes)})"
               if reserved else ""))


def _of_largest_rank(memory) -> str:
    top = largest_rank(memory)
    return f" of the largest pipeline rank (rank {top.rank})" if top is not None else ""


def estimate_dict(c: Candidate, **extra) -> dict:
    """estimate's JSON object (planner.schemas' EstimateOutput): the model, then `extra` keys (explain's), then
    the candidate."""
    return {"model": c.model.summary_dict(), **extra, **c.to_dict()}


def estimate_json(c: Candidate) -> str:
    return json.dumps(estimate_dict(c), indent=2)


def plan_json(p: Plan, top: int) -> str:
    return json.dumps(p.to_dict(top), indent=2)


def check_text(r) -> str:
    s = r.setup
    lines = [f"Checking {s.source} (FSDP{s.fsdp_version})", "", estimate_text(r.candidate), ""]
    if not r.findings:
        lines.append("No findings: this setup matches what the planner would do.")
    for f in r.findings:
        lines += [f"[{f.severity.upper()}] {f.code}: {f.message}", f"    fix: {f.fix}"]
    counts = {label: sum(f.severity == sev for f in r.findings)
              for sev, label in (("error", "errors"), ("warning", "warnings"), ("advice", "advice"))}
    lines += ["", ", ".join(f"{label}: {n}" for label, n in counts.items())]
    return "\n".join(lines)


def check_json(r) -> str:
    return json.dumps(r.to_dict(), indent=2)
