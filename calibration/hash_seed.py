"""One Python hash seed for the trace tier's command-line tools, so a traced step's allocation order repeats.

    if __name__ == "__main__":
        pin_hash_seed()     # re-executes this program with PYTHONHASHSEED=0 when it is unset
        main()

transformers builds some of a step's tensors in the order of a set of layer-type strings, and a str's hash (so the
set's order) changes with PYTHONHASHSEED: Llama 4's text model makes its full and chunked attention masks
`for layer_type in set(self.config.layer_types)` (transformers 5.24 models/llama4/modeling_llama4.py:546; Gemma 3's
rotary tables, modeling_gemma3.py:533, are of one size, so its sizes' order does not change). Allocated peaks do not
move; the caching allocator's segments follow the order of the first small blocks: the llama4 full fine-tuning row #8 of
benchmarks/memory_accuracy.py --families 2026 replays 2,532 MiB reserved at seed 0 and 2,356 MiB at seeds 1-3
(docs/accuracy.md, 2026-12-08). A real run goes through the same code, so its order varies with the seed as well:
this pins the tools (grids comparable between runs), not the answer. An explicit PYTHONHASHSEED is kept, to look at
another order. Call it from an entry point only: it replaces the process (the pool workers the tools start inherit it).
"""

from __future__ import annotations

import os
import sys

TRACE_HASH_SEED = "0"


def pin_hash_seed() -> None:
    """Re-exec this interpreter with the same command line and PYTHONHASHSEED=TRACE_HASH_SEED, unless it is set."""
    if os.environ.get("PYTHONHASHSEED") is not None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              {**os.environ, "PYTHONHASHSEED": TRACE_HASH_SEED})
