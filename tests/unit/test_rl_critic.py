"""PPO's critic (cost_models/rl_critic.py): the value model's parameters by hand, and the critic priced at its own
strategy and dtype (verl 0.9.1's critic.strategy / critic.fsdp.model_dtype; the actor's where the request leaves
them), in its memory, its host RAM and its time."""

import pytest

from cost_models.rl_critic import value_model
from planner.models import resolve_model
from planner.rl import rl_estimate
from planner.rl.evaluate import evaluate_rl
from planner.rl.request import rl_request

# Qwen2.5-7B PPO on 8 x H100 with an FSDP2 bf16 actor
PPO = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8, algorithm="ppo",
           strategy="fsdp2", actor_dtype="bf16")
CRITIC = 7_615_616_512 - 152_064 * 3_584 + 3_584 + 1   # the LM less its vocabulary head, plus Linear(3,584, 1)


def test_the_value_model_has_a_hidden_by_one_head():
    """AutoModelForTokenClassification with num_labels 1: the LM's 7,615,616,512 parameters less its untied
    152,064 x 3,584 head (544,997,376, 7.2% of them), plus a Linear(3,584, 1) with its bias: 7,070,622,721."""
    lm = resolve_model("qwen2.5-7b")
    critic = value_model(lm)
    assert (lm.n_params, lm.head_params) == (7_615_616_512, 544_997_376)
    assert (critic.n_params, critic.head_params, critic.vocab_size) == (CRITIC, 3_585, 1) == (7_070_622_721, 3_585, 1)


@pytest.mark.parametrize("knobs, shard, adam, load", [
    ({}, 1_767_661_953, 3_535_323_905, 15_231_233_024),
    ({"critic_dtype": "fp32"}, 3_535_323_905, 7_070_647_809, 28_282_591_240)], ids=["bf16-as-actor", "fp32"])
def test_the_critic_is_stored_in_its_own_dtype(knobs, shard, adam, load):
    """Per GPU, 7,070,622,721 parameters and the value head's dim-0 padding (FSDP2 pads its 1 x 3,584 weight to
    d x ceil(1 / d) = 8 rows, torch 2.13 _fsdp_param.py padded_sharded_param_size: + 7 x 3,584 = 25,088, so
    7,070,647,809; every other table's rows divide by 8) over 8 ranks, rounded up: bf16 (the actor's, the default)
    2 B each, 1,767,661,953 B, and pure-bf16 Adam 2 x 2 B, 3,535,323,905; fp32 (verl's default, a script without the
    key) 4 B, 3,535,323,905, and Adam 2 x 4 B, 7,070,647,809. Host RAM's load (rank 0 builds a worker whole): the larger
    of the bf16 actor, 7,615,616,512 x 2 = 15,231,233,024 B, and the critic, fp32 3,535,323,905 x 8 =
    28,282,591,240 B (rl_host._sizes: the whole as shard x ranks, so the head's padding, 25,088 x 4 = 100,352 B, is
    counted though rank 0 builds the real, unpadded model: 0.0004% over)."""
    e = rl_estimate("qwen2.5-7b", 8, **PPO, **knobs)
    c = e.memory.critic
    assert (c.params_bytes, c.grads_bytes, c.optimizer_bytes) == (shard, shard, adam)
    assert e.host.load_bytes == load
    assert e.settings.critic_dtype == knobs.get("critic_dtype", "bf16") and e.memory.actor.params_bytes == 1_903_904_128


def test_the_critic_runs_its_own_strategy():
    """critic.strategy fsdp beside an FSDP2 actor: the critic's forward holds FSDP1's units gathered in bf16 - its
    root (the embedding 544,997,376, the final norm 3,584 and the value head 3,585) and two blocks of 233,057,792:
    (545,004,545 + 466,115,584) x 2 = 2,022,240,258 B - not FSDP2's (the root's own norm, the embedding with the
    first block prefetched: (3,584 + 544,997,376 + 233,057,792) x 2 = 1,556,117,504 B); its update is priced on
    FSDP1's copies; the actor's phases do not move."""
    fsdp2, fsdp1 = (rl_estimate("qwen2.5-7b", 8, **PPO, critic_strategy=s) for s in ("fsdp2", "fsdp"))
    assert (fsdp2.memory.critic.unit_gather_bytes, fsdp1.memory.critic.unit_gather_bytes) == (1_556_117_504,
                                                                                          2_022_240_258)
    assert fsdp2.time.critic_s != fsdp1.time.critic_s and fsdp2.time.update_s == fsdp1.time.update_s
    actor = ("log_prob", "update", "optimizer_step")
    assert [p.gpu_bytes for p in fsdp2.memory.phases if p.name in actor] == [
        p.gpu_bytes for p in fsdp1.memory.phases if p.name in actor]


def test_the_critics_time_is_the_value_models_in_a_search_too():
    """A search shares one cache of micro-step prices between the actor and the critic (rl_time's memo): keyed by
    the model too, so the critic is priced on the value model (here as the actor's strategy, dtype and checkpointing:
    every other key equal) with the cache as without it - and below the actor's update and one forward, whose
    vocabulary head it does not have."""
    request = rl_request("qwen2.5-7b", 8, **PPO)
    cached, alone = evaluate_rl(request, memo={}), evaluate_rl(request)
    assert cached.time.critic_s == alone.time.critic_s
    assert alone.time.critic_s < alone.time.update_s + alone.time.log_prob_s / 2
