"""FSDP1's and FSDP2's copies around their collectives, for real: worker_fsdp_copies.py wraps two blocks of two
bias-free 64 x 64 linears with calibration.apply's apply_fsdp1 / apply_fsdp2 on gloo ranks and counts, op by op, the
bytes each copy reads and writes over two micro-steps; cost_models/fsdp_copies.py must give them to the byte, for
each API and precision (tests/unit/test_fsdp_copies.py works the same figures by hand).

When this was written (torch 2.13), on 2 ranks: bf16 with fp32 reduction 884,736 B under either API (FSDP1: shard
casts, the split's backward cat, the fp32 cast, the pre-divide, the shard accumulate; FSDP2: foreach casts,
all_gather_copy_in, split_with_sizes_copy, _chunk_cat, the accumulate); bf16-pure 311,296 (FSDP1) against 573,440
(FSDP2); bf16 with a bf16 reduction 655,360 against 917,504; bf16-pure with an fp32 reduction 737,280 each. On 4
ranks (FSDP1 also post-divides the shard) bf16: 802,816 against 671,744. No other op touched a param-sized tensor.
The cases run in the shared 2- and 4-rank torchrun launches (cases.shared; < 1 s each)."""

from __future__ import annotations

import pytest

from cost_models.fsdp_copies import accumulate_bytes, gather_copy_bytes, reduce_copy_bytes
from cost_models.specs import FsdpConfig
from cost_models.units import DTYPE_BYTES
from tests.distributed.cases import shared
from tests.distributed.worker_fsdp_copies import BLOCKS, WIDTH

pytestmark = pytest.mark.distributed

CONFIGS = [{"precision": "bf16"}, {"precision": "bf16-pure"}, {"precision": "bf16", "reduce_dtype": "bf16"},
           {"precision": "bf16-pure", "reduce_dtype": "fp32"}]
MICRO_STEPS = 2
CASES = {2: [{"fsdp": f, "config": c, "micro_steps": MICRO_STEPS} for c in CONFIGS for f in (1, 2)],
         4: [{"fsdp": f, "config": CONFIGS[0], "micro_steps": MICRO_STEPS} for f in (1, 2)]}
LAUNCHES = {world: shared(__file__, "worker_fsdp_copies", cases, timeout_s=120, nproc=world)
            for world, cases in CASES.items()}


def priced_bytes(case: dict, world: int) -> float:
    """What fsdp_copies prices for the worker's model and micro-steps (FULL_SHARD: every block gathered twice)."""
    config = FsdpConfig(**case["config"])
    precision, fsdp2, n = config.precision, case["fsdp"] == 2, BLOCKS * 2 * WIDTH * WIDTH
    c = DTYPE_BYTES[precision.compute_dtype]
    step = 2 * gather_copy_bytes(fsdp2, precision, n * c, n, n * c, world) \
        + reduce_copy_bytes(fsdp2, precision, config.gradient_reduce_dtype, n, world, world)
    return MICRO_STEPS * step + (MICRO_STEPS - 1) * accumulate_bytes(precision, n, world)


@pytest.mark.parametrize("world, i", [(w, i) for w, cases in CASES.items() for i in range(len(cases))])
def test_counted_copies_are_the_priced_bytes(world, i):
    case, run = CASES[world][i], LAUNCHES[world]()[i]
    assert run["unexpected"] == [], run
    assert run["bytes"] == priced_bytes(case, world), run["by_op"]
