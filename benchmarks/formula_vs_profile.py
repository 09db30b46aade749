"""A family's activation formula against a traced block memory profile of a preset, on the preset's own shapes.

    python benchmarks/formula_vs_profile.py [--seq-len 4096] llama3-8b mistral-7b ...   # ~1 min a preset, 2 cores

Traces the preset's block (calibration/block_profile.py: full width, a few layers, fake tensors; bf16, its first
attention) at the sequence length and prints one line per preset: the profile's saved bytes per token of a block
as (preset, attention, seq_len, a, q, dense (a, q) or None) - a + q x seq_len, the constants
tests/unit/test_family_activations.py holds the formulas to - then the formula's figure and their ratio, for
the block and for the activations of estimate(64 GPUs, micro-batch 1).
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="+")
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args(argv)
    for preset in args.presets:
        print(compare(preset, args.seq_len), flush=True)


if __name__ == "__main__":
    main()
