"""Ulysses' all-to-all bytes (cost_models/rl_ulysses.py), worked by hand for Qwen2.5-7B (hidden 3584, q dim 3584,
4 KV heads of 128: KV dim 512, 28 layers) in bf16; the all-to-all's allocation rule measured with verl 0.9.1's
own functions on 2 gloo ranks (/tmp/iss28u/a2a.py: a head split peaks 3.00 inputs, a sequence split 2.00)."""

import dataclasses

import pytest

from cost_models import rl_ulysses
from cost_models.profile import DEFAULT_PROFILE
from cost_models.rl_actor import actor_run, actor_states, forward_only_bytes
from cost_models.rl_batch import RlBatch, batch_plan
from cost_models.rl_settings import RlSettings
from planner.hardware import make_cluster
from planner.models import resolve_model


@pytest.fixture(scope="module")
def qwen7():
    return resolve_model("qwen2.5-7b")


def test_all_to_all_rule():
    assert rl_ulysses.all_to_all_bytes(32_768, head_split=True) == 98_304   # split copies + list + cat
    assert rl_ulysses.all_to_all_bytes(32_768, head_split=False) == 65_536  # batch-1 sequence split: views


def test_attention_moment_by_hand(qwen7):
    # Ulysses 2: no repeat. 2 x (2 x 3584 + (3584 + 1024) before + (3584 + 1024) after + 3584 out) + 2 x 2 x 3584
    assert rl_ulysses.kv_repeats(qwen7, 2) == 1
    assert rl_ulysses.attention_moment_bytes_per_token(qwen7, 2, 2) == 2 * 19_968 + 14_336 == 54_272
    assert rl_ulysses.saved_surplus_bytes_per_token(qwen7, 2, 2) == 0
    # Ulysses 8 over 4 KV heads: k, v repeated twice: after = 3584 + 2 x 2 x 512 = 5632
    assert rl_ulysses.kv_repeats(qwen7, 8) == 2
    assert rl_ulysses.attention_moment_bytes_per_token(qwen7, 2, 8) == 2 * 20_992 + 14_336 == 56_320
    assert rl_ulysses.saved_surplus_bytes_per_token(qwen7, 2, 8) == 2 * 2 * 512 == 2_048


def test_log_prob_bound_covers_the_moment(qwen7):
    # the block's bound (225,392 + 2 x 2 x 3584 = 239,728 B/token) is above 54,272: no term; a smaller bound shows it
    fwd, ref = forward_only_bytes(qwen7, 4_000, 2, RlSettings(), sp=2)
    assert "Ulysses all-to-all" not in fwd and fwd["forward activations"] == 4_000 * 239_728
    # the reference's pass: the same forward, its logits without the entropy (4,000 x 152,064 x 2 B; the old pass's
    # no-grad entropy x 3)
    assert ref == {"forward activations": 4_000 * 239_728, "logits": 1_216_512_000}
    assert fwd["logits and entropy"] == 3 * 1_216_512_000
    assert rl_ulysses.forward_only_extra_bytes(qwen7, 4_000, 2, 2, 50_000) == 4_000 * 4_272
    assert rl_ulysses.forward_only_extra_bytes(qwen7, 4_000, 2, 1, 0) == 0


@pytest.mark.parametrize("checkpointing, layers", [(True, 1), (False, 28)])
def test_update_holds_the_repeated_kv(qwen7, checkpointing, layers):
    """Same tokens per GPU, Ulysses 1 vs 8: the update's peak grows by 2,048 B x tokens x (1 or 28 layers)."""
    cluster = make_cluster(8, gpu="h100-80gb")
    batch = RlBatch(train_batch_size=64, rollout_n=8, ppo_mini_batch_size=32, max_prompt_length=1024,
                    max_response_length=1024, ppo_micro_batch_size_per_gpu=4, log_prob_micro_batch_size_per_gpu=4,
                    mean_prompt_length=300, mean_response_length=500)
    plan = batch_plan(batch, 8, qwen7.n_heads, qwen7.n_kv_heads, 2)
    settings = RlSettings(gradient_checkpointing=checkpointing)
    run = actor_run(qwen7, cluster, settings, plan)
    one = actor_states(run, settings, plan, DEFAULT_PROFILE)
    eight = actor_states(run, settings, dataclasses.replace(plan, ulysses=8), DEFAULT_PROFILE)
    tokens = plan.update_tokens_per_gpu
    assert tokens == 3_200
    assert eight.update_steady.total_bytes - one.update_steady.total_bytes == 2_048 * tokens * layers
