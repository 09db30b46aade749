"""Make the shipped block memory profiles (planner/catalog/block_profiles/<preset>.json): the one command.

    python benchmarks/make_block_profiles.py                 # every preset that needs one (shipped_presets)
    python benchmarks/make_block_profiles.py deepseek-v3     # some of them
    python benchmarks/make_block_profiles.py --check         # trace again and compare; writes nothing,
                                                             # exit 1 naming each stale entry

Each preset is traced (calibration/block_profile.py, fake tensors, needs torch and transformers) for every
compute dtype the planner prices x attention the model runs x sequence length in SHIPPED_SEQ_LENS, under
the installed torch and transformers, whose versions each entry records. About 10-30 s a trace on one CPU
core (deepseek-v3 the longest): 4 presets, ~60 traces, ~20 minutes. Run it after a change to the profile's
schema, to calibration/block_profile.py or to a preset's config, or when the freshness test
(tests/unit/test_shipped_profiles.py) fails after a torch / transformers upgrade, and commit the files.
"""

from __future__ import annotations

import argparse
import sys
import time

from planner.models.block_profiles import (MAKE_COMMAND, PROFILED_DTYPES, SHIPPED_DIR, SHIPPED_SEQ_LENS,
                                           BlockProfileFile, ShippedProfiles, profile_difference, shipped_key,
                                           shipped_presets, trace_profile)
from planner.models.resolve import load_preset, preset_hf_config


def make(preset: str) -> ShippedProfiles:
    """Every (dtype, attention, sequence length) profile of one preset, traced now."""
    spec, hf_config = load_preset(preset), preset_hf_config(preset)
    profiles = []
    for attention in spec.attention_choices:
        for dtype in PROFILED_DTYPES:
            for seq_len in SHIPPED_SEQ_LENS:
                key = shipped_key(hf_config, dtype, attention, seq_len)
                profile = trace_profile(spec, hf_config, dtype, attention, seq_len, key)
                print(f"{preset} {dtype} {attention} seq {seq_len}: {profile.seconds:.1f} s", flush=True)
                profiles.append(profile)
    return ShippedProfiles(preset=preset, made_by=MAKE_COMMAND, profiles=profiles)


def stale(made: ShippedProfiles, path) -> list[str]:
    """One line per entry of the shipped file that a trace now does not reproduce."""
    if not path.exists():
        return [f"{path.name}: not shipped"]
    shipped = {p.key: p for p in ShippedProfiles.model_validate_json(path.read_text(encoding="utf-8")).profiles}
    lines = []
    for profile in made.profiles:
        old: BlockProfileFile | None = shipped.get(profile.key)
        where = f"{path.name} {profile.compute_dtype} {profile.attention} seq {profile.seq_len}"
        if old is None:
            lines.append(f"{where}: missing")
        elif (difference := profile_difference(profile, old)) is not None:
            lines.append(f"{where}: {difference} (made with torch {old.torch_version}, transformers "
                         f"{old.transformers_version})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", help="default: every preset that needs a profile")
    parser.add_argument("--check", action="store_true", help="compare with the shipped files, write nothing")
    args = parser.parse_args(argv)
    presets = args.presets or shipped_presets()
    unknown = sorted(set(presets) - set(shipped_presets()))
    if unknown:
        print(f"error: presets: {', '.join(unknown)} need no block profile; choose from "
              f"{', '.join(shipped_presets())}", file=sys.stderr)
        return 2
    started, problems = time.perf_counter(), []
    SHIPPED_DIR.mkdir(parents=True, exist_ok=True)
    for preset in presets:
        made = make(preset)
        path = SHIPPED_DIR / f"{preset}.json"
        if args.check:
            problems += stale(made, path)
        else:
            path.write_text(made.model_dump_json(indent=1) + "\n", encoding="utf-8")
            print(f"wrote {path}", flush=True)
    print(f"{len(presets)} presets in {time.perf_counter() - started:.0f} s", flush=True)
    for line in problems:
        print(f"stale: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
