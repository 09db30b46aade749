"""`fsdp-plan rl estimate`: the table, the JSON against its schema (planner/schemas/rl.py) and bad input in one
line with exit code 2. One CLI run per output (in-process: tests/doctor/cli_run.py)."""

import json

import pytest

from planner.line_width import LINE_WIDTH
from planner.schemas.rl import RlEstimateOutput, RlPlanOutput
from tests.doctor.cli_run import cli_process

JOB = ["rl", "estimate", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu", "h100-80gb", "--prompt-len", "1024",
       "--response-len", "4096", "--rollout-n", "8", "--train-batch", "256"]


def run(*args):
    return cli_process(list(args))


@pytest.fixture(scope="module")
def as_json():
    r = run(*JOB, "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_json_follows_its_schema_and_names_the_peak(as_json):
    RlEstimateOutput.model_validate(as_json)
    m = as_json["memory"]
    assert [p["name"] for p in m["phases"]] == ["init", "rollout", "weight_sync", "log_prob", "ref_log_prob",
                                                "update", "optimizer_step", "checkpoint"]
    worst = max(m["phases"], key=lambda p: p["reserved_bytes"])
    assert (m["peak_phase"], m["peak_reserved_bytes"]) == (worst["name"], worst["reserved_bytes"])
    # the rollout holds Adam's fp32 states (7,615,616,512 x 8 B / 8 GPUs) beside the engine: the worst phase here
    assert m["peak_phase"] == "rollout" and m["phases"][1]["gpu_bytes"]["Adam states"] == 7_615_616_512
    # verl sleeps a full model's engine at level 2: no weight backup on the host
    assert not any("backup" in term for term in m["host"]["terms"])
    assert as_json["fits"] is True
    # current vLLM: 0.5 x 81,559 MiB = 42,760,527,872 B - weights 7,615,616,512 - profile run 932,184,064 =
    # 34,212,727,296 B // 16,384 // 28 = 74,577 blocks; 5,120 tokens = 320 blocks: 233 sequences (< max_num_seqs 256)
    assert as_json["engine"]["kv_blocks"] == 74_577 and as_json["engine"]["max_concurrent_seqs"] == 233
    notes = " ".join(as_json["notes"])
    assert "holds 233 sequences of 5120 tokens" in notes and "verl PR 1349" in notes


def test_rl_ranks_what_fits_by_step_time():
    """The issue's "done when" command: a ranked table of configurations that fit, then the best one's phases."""
    r = run("rl", *JOB[2:], "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    RlPlanOutput.model_validate(out)
    steps = [c["time"]["step_s"] for c in out["candidates"]]
    assert out["fits"] and all(c["fits"] for c in out["candidates"]) and steps == sorted(steps)
    # shared 16 (FSDP1 and FSDP2) x engine 90 x actor 252 (tests/unit/test_rl_search.py, by hand); under 2,000 priced
    assert out["searched"] == 362_880 and out["priced"] < 2000
    assert set(out["not_searched"]) == {"offload_policy", "ref_param_offload"}
    best = out["candidates"][0]["knobs"]
    # the best is FSDP2's: bf16, its update's loss holding neither the embedding nor the head (units of their own,
    # resharded after forward: measured on verl's engine, tests/distributed/test_torchrun_verl_actor.py), which fits
    # a faster micro-batch than FSDP1's root allows, though FSDP1 runs each update with fewer copies around the
    # collectives (tests/unit/test_rl_strategy.py); FSDP1's best is ranked too, and the reference offloaded (verl)
    assert (best["strategy"], best["actor_dtype"], best["ref_param_offload"]) == ("fsdp2", "bf16", True)
    assert {c["knobs"]["strategy"] for c in out["candidates"]} == {"fsdp", "fsdp2"}
    # the log-prob forward takes a larger micro-batch (or token budget) than the update, its logits then chunked to
    # fit (tests/unit/test_rl_search.py: 74.7 GB unchunked at 16 sequences)
    update, log_prob = (("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu") if best["use_dynamic_bsz"] else
                        ("ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu"))
    assert best[log_prob] > best[update]
    assert best["entropy_chunking"] and best["max_num_seqs"] in (256, 512, 1024)
    table = run("rl", *JOB[2:], "--strategy", "fsdp")
    assert table.returncode == 0 and "by estimated step time" in table.stdout and "Best:" in table.stdout
    assert "every row: " in table.stdout and "knobs: actor " in table.stdout
    assert "not searched: ref_param_offload: verl offloads the reference" in table.stdout
    assert "note: the actor wrapped with fsdp2, not the request's fsdp" in table.stdout
    assert max(len(line) for line in table.stdout.splitlines()) <= LINE_WIDTH


def test_table_fits_the_terminal():
    r = run(*JOB)
    assert r.returncode == 0, r.stderr
    assert "rollout *" in r.stdout and "Host RAM per node (GiB):" in r.stdout and "fits: yes" in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= LINE_WIDTH


@pytest.mark.parametrize("flag, value, message", [
    ("--engine", "tgi", "error: engine: unknown value 'tgi'; choose one of: vllm, sglang"),
    ("--engine-version", "0.9", "error: engine_version: '0.9' for vllm; choose one of: 0.8, current"),
    ("--strategy", "ddp", "error: strategy: unknown value 'ddp'; choose one of: fsdp, fsdp2"),
    ("--gpu-memory-utilization", "1.2", "error: gpu_memory_utilization: must be in (0, 1], got 1.2"),
    ("--sleep-level", "3", "error: sleep_level: must be 1 or 2, got 3"),
])
def test_bad_input_is_one_line_exit_2(flag, value, message):
    r = run(*JOB, flag, value)
    assert r.returncode == 2 and r.stderr.strip() == message and r.stdout == ""


def test_the_knob_words_name_a_critic_that_is_not_the_actors():
    """PPO's critic strategy and dtype printed where they are not the actor's (the JSON's knobs hold them always)."""
    ppo = [*JOB, "--algorithm", "ppo", "--strategy", "fsdp2", "--actor-dtype", "bf16"]
    own = run(*ppo, "--critic-strategy", "fsdp", "--critic-dtype", "fp32")
    same = run(*ppo)
    assert own.returncode == same.returncode == 0, own.stderr + same.stderr
    words = " ".join(own.stdout.split())
    assert "critic optimizer offload off, critic strategy fsdp, critic dtype fp32, gradient checkpointing" in words
    assert "critic strategy" not in same.stdout and "critic dtype" not in same.stdout
    only = " ".join(run(*ppo, "--critic-dtype", "fp32").stdout.split())
    assert "critic dtype fp32" in only and "critic strategy" not in only
