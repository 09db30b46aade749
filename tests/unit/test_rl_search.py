"""The RL search's space (planner/rl/search.py), counted by hand."""

from planner.rl.request import rl_request
from planner.rl.search import search_space


def test_space_sizes():
    # static: 2 param x 2 optimizer offloads x 5 micro-batches x 5 utilizations x TP 1/2/4 (28 heads, 8 GPUs)
    assert len(search_space(rl_request("qwen2.5-7b", 8), 8, 28)) == 300
    # dynamic, 1024 + 8192 tokens: the budgets holding one sequence (16k, 32k) instead; TP 1/2/4/8 (32 heads)
    dynamic = search_space(rl_request("qwen3-8b", 8, use_dynamic_bsz=True, prompt_len=1024, response_len=8192), 8, 32)
    assert len(dynamic) == 2 * 2 * 2 * 5 * 4
    assert {k["ppo_max_token_len_per_gpu"] for k in dynamic} == {16384, 32768}
    # PPO: the critic's two offloads too
    assert len(search_space(rl_request("qwen2.5-7b", 8, algorithm="ppo"), 8, 28)) == 4 * 300
