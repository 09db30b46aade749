"""planner/emit/torchtitan/split.py against torchtitan 0.3's own stage generator."""

import pytest

from cost_models.pipeline import blocks_per_stage
from planner.emit.torchtitan.split import generated_blocks_per_stage, split_flags

pp = pytest.importorskip("torchtitan.distributed.pipeline_parallel")


def torchtitan_blocks(n_layers, n_stages, first, last):
    try:
        parts = pp._generate_llm_fqn_per_model_part(n_stages, n_layers, first, last)
    except ValueError:
        return None
    return tuple(sum(name.startswith("layers.") for name in part) for part in parts)


@pytest.mark.parametrize("n_layers", [8, 10, 32, 80, 126])
def test_generator_port_equals_torchtitan(n_layers):
    for n_stages in (2, 3, 4, 8, 16, 24, 128):
        for first in range(3):
            for last in range(3):
                assert generated_blocks_per_stage(n_layers, n_stages, first, last) == \
                    torchtitan_blocks(n_layers, n_stages, first, last), (n_layers, n_stages, first, last)


def test_the_plans_even_split_in_two_flags():
    # llama3-8b (32 blocks) on 4 stages: 8 each, embedding and head weigh nothing
    assert split_flags(32, blocks_per_stage(32, 4), pp=4, looped=False) == {
        "pipeline_parallel_first_stage_less_layers": 0, "pipeline_parallel_last_stage_less_layers": 0}
    # llama3.1-405b (126) on pp 8 x V 2: 7, 8 x 14, 7 = torchtitan's default weights (1, 1) at its default V 2
    assert split_flags(126, blocks_per_stage(126, 16), pp=8, looped=True) == {
        "pipeline_parallel_first_stage_less_layers": 1, "pipeline_parallel_last_stage_less_layers": 1}
    # Meta's 405B layout, pp 16 x V 8: embedding-only and head-only end stages; V 8 needs layers_per_stage 1
    flags = split_flags(126, blocks_per_stage(126, 128), pp=16, looped=True)
    assert flags == {"pipeline_parallel_first_stage_less_layers": 1, "pipeline_parallel_last_stage_less_layers": 1,
                     "pipeline_parallel_layers_per_stage": 1}
    # 80 blocks on 24 stages: ours keeps the 3-block stages at the ends, torchtitan gives the extras to the first
    assert split_flags(80, blocks_per_stage(80, 24), pp=12, looped=True) is None
