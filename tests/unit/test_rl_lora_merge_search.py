"""model.lora.merge searched (planner/rl/search.py lora_merges): both values tried for a verl LoRA actor whose
request leaves it unset, ranked with the rest by step time; the request's value kept where it pins it; the best's
value written by --emit verl and read back by check.

The case, worked by hand: Qwen2.5-7B (7,615,616,512 parameters), rank-32 all-linear LoRA, on 2 x H100 (PCIe 50 GB/s,
the intra-node bus 370 GB/s, HBM 3.35 TB/s), 32 prompts x 4 responses of 1,024 + 1,024 tokens. Each strategy, dtype
and offload choice's best engine runs TP 2, so vLLM holds 7,615,616,512 B of bf16 weights a GPU and, serving the
adapter (unmerged), 103,323,704 B of LoRA buffers (cost_models/rollout_lora.py). FSDP1, no offloads:
- unmerged: the sync summons the model once (the shard over the other rank: shard / 370e9), the engine sleeps at
  level 1, its weights pool out and back over PCIe each step (2 x 7,718,940,216 / 50e9 = 0.30876 s), and each of
  the 1,024 decode steps reads the LoRA buffers too (1,024 x 103,323,704 / 3.35e12 = 0.031583 s, one wave);
- merged: the merge's summon and the state-dict walk gather the shard twice, and merged_lora_context backs the
  whole shard up to the host and back each sync (2 x shard / 50e9); vLLM sleeps at level 2, no LoRA buffers.
fp32 actor (shard (7,615,616,512 + 80,740,352) x 4 / 2 = 15,392,713,728 B): merged costs +0.041602 (sync) +0.306951
(backup 0.615709 less the level-1 copies 0.308758) -0.031583 (decode) = +0.316970 s: unmerged is the faster by 1.2%.
bf16 actor (shard 7,696,356,864 B): +0.020801 (sync) -0.000903 (backup 0.307854 vs 0.308758) -0.031583 = -0.011685 s:
merged is the faster, and the best of the whole plan.
"""

import json

import pytest

from planner.emit.verl import emit_verl
from planner.models import resolve_model
from planner.rl.report import rl_dict, rl_plan_text
from planner.rl.request import rl_request
from planner.rl.search import key, not_searched, plan_rl, spaces

JOB = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, rollout_n=4, train_batch=32, finetune="lora")
PCIE, BUS, HBM = 50e9, 370e9, 3.35e12
WEIGHTS, LORA_BUFFERS = 7_615_616_512, 103_323_704
SHARD = {"fp32": 15_392_713_728, "bf16": 7_696_356_864}


def _choice(e) -> tuple:
    r = e.request
    return r.strategy, r.actor_dtype, r.param_offload, r.optimizer_offload


@pytest.fixture(scope="module")
def plans():
    """The search unpinned, and pinned to each value."""
    return {m: plan_rl(rl_request("qwen2.5-7b", 2, **JOB, **({} if m is None else {"lora_merge": m})), top=16)
            for m in (None, False, True)}


def test_the_search_tries_both_and_keeps_the_faster(plans):
    both, unmerged, merged = plans[None], plans[False], plans[True]
    assert both.searched == 2 * unmerged.searched == 2 * merged.searched
    pinned = {(_choice(e), m): e for m, p in ((False, unmerged), (True, merged)) for e in p.ranked}
    assert len(both.ranked) == 16
    for e in both.ranked:   # each shared choice's best: the better of its two pinned bests, by the ranking rule
        better = min(pinned[_choice(e), False], pinned[_choice(e), True], key=key)
        assert key(e) == key(better) and e.request.lora_merge == better.request.lora_merge
    for dtype, wins, delta in (("fp32", False, 0.316970), ("bf16", True, -0.011685)):
        a, m = (pinned[("fsdp", dtype, False, False), x] for x in (False, True))
        assert (a.settings.sleep_level, m.settings.sleep_level) == (1, 2)
        assert (a.memory.engine.lora_bytes, m.memory.engine.lora_bytes) == (LORA_BUFFERS, 0)
        assert a.memory.engine.weights_bytes == WEIGHTS and a.memory.actor.params_bytes == SHARD[dtype]
        assert m.time.weight_sync_s == pytest.approx(2 * SHARD[dtype] / BUS, rel=1e-9)
        assert a.time.weight_sync_s == pytest.approx(SHARD[dtype] / BUS, rel=1e-9)
        assert m.time.offload_s == pytest.approx(2 * SHARD[dtype] / PCIE, rel=1e-9)
        assert a.time.offload_s == pytest.approx(2 * (WEIGHTS + LORA_BUFFERS) / PCIE, rel=1e-9)
        assert a.time.generation_s - m.time.generation_s == pytest.approx(1024 * LORA_BUFFERS / HBM, rel=1e-6)
        assert m.time.step_s - a.time.step_s == pytest.approx(delta, abs=2e-6)
        row = next(e for e in both.ranked if _choice(e) == ("fsdp", dtype, False, False))
        assert row.request.lora_merge is wins
    assert both.ranked[0].request.lora_merge and _choice(both.ranked[0]) == ("fsdp", "bf16", False, False)
    text = " ".join(rl_plan_text(both).split())
    assert "merge: model.lora.merge" in text and "LoRA merge on" in text


def test_a_pinned_value_is_kept_and_a_full_actor_has_none(plans):
    """--lora-merge / --no-lora-merge pin it: every row keeps it, and the output says it was not searched; full
    fine-tuning's space is the same as before (no merge), nor is the knob in its JSON."""
    for m in (False, True):
        assert {e.request.lora_merge for e in plans[m].ranked} == {m}
        assert "lora_merge" in not_searched(plans[m].request)
        assert {rl_dict(e)["knobs"]["lora_merge"] for e in plans[m].ranked} == {m}
    assert "lora_merge" not in not_searched(plans[None].request)
    qwen7 = resolve_model("qwen2.5-7b")
    full = {k: v for k, v in JOB.items() if k != "finetune"}
    engine = spaces(rl_request("qwen2.5-7b", 2, **full), qwen7, 2)[1]
    lora = spaces(rl_request("qwen2.5-7b", 2, **JOB), qwen7, 2)[1]
    assert len(lora) == 2 * len(engine) and not any("lora_merge" in c for c in engine)
    assert [c["lora_merge"] for c in lora[:10]] == [False] * 5 + [True] * 5   # each group's utilizations, verl's first


def test_the_best_merge_is_emitted_and_read_back(plans, tmp_path):
    """--emit verl writes actor_rollout_ref.model.lora.merge as the best runs it (True here; the fp32 row's False),
    and check reads it back: the same knobs, phases and step time, exactly."""
    from tests.doctor.cli_run import run_cli

    fp32 = next(e for e in plans[None].ranked if _choice(e) == ("fsdp", "fp32", False, False))
    for e, value in ((plans[None].ranked[0], "True"), (fp32, "False")):
        script = emit_verl(e)
        assert f"actor_rollout_ref.model.lora.merge={value} " in script
        (tmp_path / "best.sh").write_text(script)
        checked = json.loads(run_cli(["check", str(tmp_path / "best.sh"), "--format", "json"]))
        planned = rl_dict(e)
        assert checked["knobs"] == planned["knobs"] and checked["knobs"]["lora_merge"] is (value == "True")
        assert checked["time"] == planned["time"] and checked["memory"]["phases"] == planned["memory"]["phases"]


def test_the_pruned_search_is_the_products_best_with_both_merges(monkeypatch):
    """The pruned search against the whole product (tests/unit/test_rl_search.py's SMALL space, LoRA, both merges):
    FSDP1's merged sync gathers twice, so its engine side's seconds exceed FSDP2's there, and _engine_side_as_fsdp2
    prices FSDP2's fitting choices until their f passes the fastest FSDP1 f found: still each shared choice's best."""
    import planner.rl.search as search
    from tests.unit.test_rl_search import SMALL_JOB, _pruned_and_exhaustive

    monkeypatch.setattr(search, "ULYSSES", (1,))   # half the actor side: the test's time
    plan, exhaustive, size = _pruned_and_exhaustive(monkeypatch, rl_request("qwen2.5-7b", 2, finetune="lora",
                                                                             **SMALL_JOB))
    assert size == 2 * 5120 // 2 and len(exhaustive) == 16
    assert {e.request.lora_merge for e in plan.ranked} == {False, True}


def test_fsdp1s_engine_choices_are_priced_past_a_slower_merged_sync(monkeypatch):
    """_engine_side_as_fsdp2 where FSDP1's f exceeds FSDP2's by more for one choice than another (a merged LoRA's
    FSDP1 sync gathers twice): FSDP2's fitting choices by f 1.0 (merged) and 1.1 (unmerged), FSDP1's 1.3 and 1.15.
    Stopping at the first FSDP1 fit's FSDP2 f (1.0) would keep FSDP1's 1.3; the search prices on while FSDP2's f is
    at most the fastest FSDP1 f found (1.1 <= 1.3) and keeps 1.15."""
    import planner.rl.search as search

    fsdp1_f = {0: 1.3, 1: 1.15, 2: 1.4}
    monkeypatch.setattr(search, "side_fits", lambda e, engine_side: True)
    monkeypatch.setattr(search, "_f", lambda e: fsdp1_f[e])
    priced = search._engine_side_as_fsdp2(lambda knobs: knobs["i"], {}, [{"i": i} for i in range(3)], {},
                                          [(1.0, 0), (1.1, 1), (1.2, 2)])
    assert priced == [(0, 0), (1, 1)]   # 1.2 > 1.15: FSDP1's choice 2 cannot beat it (its f >= 1.2)


def test_what_verl_refuses_is_skipped():
    """--layered-summon under load_format dummy (verl's default): an adapter raises at its first sync (utils/
    fsdp_utils.py collect_lora_params, rl_strategy.sync_refusals), a merged LoRA never syncs the base apart; so the
    search keeps merged engine choices only, and pinned unmerged nothing fits, the refusal said."""
    layered = dict(JOB, layered_summon=True)
    both = plan_rl(rl_request("qwen2.5-7b", 2, **layered), top=16)
    assert len(both.ranked) == 16 and {e.request.lora_merge for e in both.ranked} == {True}
    refused = plan_rl(rl_request("qwen2.5-7b", 2, **layered, lora_merge=False), top=1)
    assert not refused.ranked and refused.misses[0].reasons[0].startswith("load_format: dummy under layered_summon")
