"""A family's activation formula against a traced block memory profile of a preset, on the preset's own shapes.

    python benchmarks/formula_vs_profile.py [--seq-len 4096] llama3-8b mistral-7b ...   # ~1 min a preset, 2 cores
    python benchmarks/formula_vs_profile.py --grid deepseek-v3 gpt-oss [--ep]   # the 2026 grid's rows (or EP rows)

Traces the preset's block (calibration/block_profile.py: full width, a few layers, fake tensors; bf16, its first
attention) at the sequence length and prints one line per preset: the profile's saved bytes per token of a block
as (preset, attention, seq_len, a, q, dense (a, q) or None) - a + q x seq_len, the constants
tests/unit/test_family_activations.py holds the formulas to - then the formula's figure and their ratio, for
the block and for the activations of estimate(64 GPUs, micro-batch 1). With --grid, the rows of
benchmarks/memory_accuracy.py's 2026 family grid (--ep: its expert-parallel rows) of those architectures, each
traced once and priced as the planner prices it (a profiled family: its block profile) and by the formula (the
same spec without its profile), both against the trace's peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import time


def compare(preset: str, seq_len: int) -> str:
    from cost_models import activations
    from cost_models.specs import ActivationProfile, Attention
    from planner.api import estimate
    from planner.models.block_profiles import profile_key, trace_profile
    from planner.models.resolve import load_preset, preset_hf_config

    spec, hf_config = load_preset(preset), preset_hf_config(preset)
    attention = spec.attention_choices[0]
    started = time.perf_counter()
    terms = trace_profile(spec, hf_config, "bf16", attention, seq_len,
                          profile_key(hf_config, "bf16", attention, seq_len)).terms.activation_terms()
    formula = activations.block_bytes_per_token(spec, 2, Attention(attention), seq_len)
    profiled = dataclasses.replace(spec, activation_profile=ActivationProfile(terms=(("bf16", attention, terms),)))

    def acts(s):
        return estimate(s, gpus=64, seq_len=seq_len, micro_batch=1, precision="bf16").memory.breakdown.activations

    dense = None if terms.dense is None else (round(terms.dense.saved_per_token, 1),
                                              round(terms.dense.saved_per_token_per_seq, 3))
    recorded = (preset, attention, seq_len, round(terms.saved_per_token, 1), round(terms.saved_per_token_per_seq, 3),
                dense)
    return (f"{recorded!r}  formula {formula} B/token, block {formula / terms.saved_bytes_per_token(seq_len):.4f}, "
            f"estimate {acts(spec) / acts(profiled):.4f} ({time.perf_counter() - started:.0f} s)")


def grid_row(row: dict) -> dict:
    """One grid row: the trace's peak, the planner's estimate and the formula's (a top-level function: the
    process pool pickles it)."""
    from memory_accuracy import arch_config

    from planner.api import estimate_config
    from planner.tracing import trace

    report = trace(arch_config(row["arch"]), row["gpus"], **{k: v for k, v in row.items() if k not in ("arch", "gpus")})
    c = report.candidate
    formula = estimate_config(dataclasses.replace(c.model, activation_profile=None), c.cluster, c.training, c.config)
    traced = report.traced.peak_allocated_bytes
    return {**row, "priced_by": c.model.priced_by, "relative_error": report.relative_error,
            "formula_error": formula.memory.peak_allocated_bytes / traced - 1}


def grid(archs: list[str], ep: bool) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import memory_accuracy

    rows = memory_accuracy.mesh_grid() if ep else memory_accuracy.grid(memory_accuracy.GRIDS["2026"])
    rows = [r for r in rows if r["arch"] in archs and (not ep or r.get("ep", 1) > 1)]
    for r in memory_accuracy.run(rows, 2, one=grid_row):
        print(f"{r['arch']:12} {r['sharding']:18} {r['precision']:9} {r['activation_checkpointing']:7} "
              f"{r['attention']:5} mb {r['micro_batch']} seq {r['seq_len']:5} gpus {r['gpus']:4}  {r['priced_by']}: "
              f"{100 * r['relative_error']:+.2f}%  formula: {100 * r['formula_error']:+.2f}%", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", help="presets (with --grid: the grid's architectures)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--grid", action="store_true", help="the 2026 family grid's rows of these architectures")
    parser.add_argument("--ep", action="store_true", help="with --grid: the mesh grid's expert-parallel rows")
    args = parser.parse_args(argv)
    if args.grid:
        grid(args.names, args.ep)
        return
    for preset in args.names:
        print(compare(preset, args.seq_len), flush=True)


if __name__ == "__main__":
    from calibration.hash_seed import pin_hash_seed

    pin_hash_seed()  # the traced allocation order follows the hash seed (calibration/hash_seed.py)
    main()
