"""PYTORCH_CUDA_ALLOC_CONF as a knob (issue 27 item 1): the trainer's default, the pipeline replay under it, the
launchers exporting it, plan's shown candidates with estimate's reserved, and explain's segments at the peak.
One small pipeline plan shared by the tests: llama3.2-1b on 4 A100s, pp 2 pinned, torchtitan (~1.5 s)."""

import pytest

from cost_models.caching_allocator import pool_words, replay
from cost_models.pipeline_allocations import rank_replay
from cost_models.units import GiB, MiB
from planner.api import estimate, plan

SETUP = dict(gpus=4, pp=2, tp=1, cp=1, global_batch=8, seq_len=1024)
# outside the allocator (cost_models/outside_allocator.py) on 4 x A100 at pp 2: Ampere's context, the FSDP group's and
# the world's communicators (24 ring channels of NCCL's LL + LL128 + Simple buffers each), one pipeline neighbour
OUTSIDE_BYTES = int(0.45 * GiB) + 2 * 24 * (524_288 + 4_915_200 + 4_194_304) + 2 * 4 * MiB   # 953,994,444


@pytest.fixture(scope="module")
def piped():
    p = plan("llama3.2-1b", trainer="torchtitan", **SETUP)
    flat = [c.memory.peak_reserved_bytes for c in p.candidates[:5]]
    p.replay_top(5)   # what the CLI does for the rows it prints
    p.flat = flat
    return p


def _estimate_of(c, **extra):
    cfg = c.config
    return estimate("llama3.2-1b", trainer=c.trainer, sharding=cfg.sharding.value, precision=cfg.precision.value,
                    compile=cfg.compile, micro_batch=cfg.micro_batch, pp_schedule=cfg.pp_schedule.value,
                    activation_checkpointing=cfg.activation_checkpointing, **SETUP, **extra)


def test_plan_shows_estimates_reserved_under_torchtitans_alloc_conf(piped):
    # torchtitan's run_train.sh exports expandable_segments:True: its candidates carry it, and the top one's
    # reserved is estimate()'s for the same config - the replay of its largest rank + what lies outside the
    # allocator. Measured at this commit: FULL_SHARD bf16 compiled 1F1B, micro-batch 2 x 2 microbatches; rank 1
    # replays to 16,905,142,272 B reserved (14,731,091,968 allocated in blocks) + 953,994,444 = 17,859,136,716 B,
    # where the search's flat figure was 16,028,058,009 + 953,994,444 B.
    best = piped.best
    assert best.config.alloc_conf == "expandable_segments:True" and best.config.pp == 2
    assert best.memory.outside_allocator_bytes == OUTSIDE_BYTES
    assert best.memory.peak_reserved_bytes == _estimate_of(best).memory.peak_reserved_bytes == 17_859_136_716
    rank1 = rank_replay(best.model, best.cluster, best.training, best.config, 1)
    assert rank1.peak_reserved_bytes == best.memory.allocator_reserved_bytes == 17_859_136_716 - OUTSIDE_BYTES
    assert piped.flat[0] == 16_028_058_009 + OUTSIDE_BYTES   # the search's flat figure for that row, before the replay
    assert piped.replayed == 5   # the rest keep the search's figure; ranking is the search's


def test_the_cli_prints_estimates_reserved(capsys):
    import json

    from planner.cli import main

    main(["--model", "llama3.2-1b", "--gpus", "4", "--pp", "2", "--tp", "1", "--cp", "1", "--global-batch", "8",
          "--seq-len", "1024", "--trainer", "torchtitan", "--top", "1", "--format", "json"])
    top = json.loads(capsys.readouterr().out)["candidates"][0]
    assert top["config"]["alloc_conf"] == "expandable_segments:True"
    assert top["memory"]["peak_reserved_bytes"] == 17_859_136_716
    assert top["memory"]["peak_reserved_bytes"] - top["memory"]["outside_allocator_bytes"] == 16_905_142_272


def test_pytorchs_default_for_other_trainers_and_a_bad_value_is_one_line(capsys):
    from planner.cli import main

    c = _estimate_of(plan("llama3.2-1b", **SETUP).best)   # fsdp2: PyTorch's default, nothing exported
    assert c.config.alloc_conf == "" and "alloc_conf" not in c.config.to_dict()
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "llama3.2-1b", "--gpus", "4", "--alloc-conf", "expandable:True"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: alloc_conf: PYTORCH_CUDA_ALLOC_CONF key 'expandable'; choose one of "
                          "max_split_size_mb, expandable_segments, garbage_collection_threshold")


def test_the_knob_changes_the_replay(piped):
    # the top config's allocator reserved under each setting, measured at this commit: PyTorch's defaults
    # 17,792,237,568 B (segments stranded between microbatches), max_split_size_mb:64 19,572,719,616 (blocks of 64 MiB
    # and more are never split, so they serve one request each), expandable segments 16,905,142,272 (above); each the
    # largest rank's replay, + OUTSIDE_BYTES. (17,804,820,480 and 19,008,585,728 before pipeline_stage_events.py
    # unsharded each unit at its pre-forward and made the head's gradient at its backward; 18,102,616,064 and
    # 23,200,792,576 before the fused-RMSNorm stages' fix of pipeline_stage_pieces: blocks far below the top were given
    # a working set of every block above them.)
    figures = {conf: alloc + OUTSIDE_BYTES for conf, alloc in (
        ("", 17_792_237_568), ("max_split_size_mb:64", 19_572_719_616), ("expandable_segments:True", 16_905_142_272))}
    for conf, reserved_bytes in figures.items():
        c = _estimate_of(piped.best, alloc_conf=conf)
        top = max(rank_replay(c.model, c.cluster, c.training, c.config, r, snapshots=False).peak_reserved_bytes
                  for r in range(2))
        assert (c.config.alloc_conf, c.memory.peak_reserved_bytes) == (conf, reserved_bytes)
        assert reserved_bytes == top + OUTSIDE_BYTES


def test_launchers_export_it(piped):
    from planner.emit import emit_artifact

    best = piped.best
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n" in emit_artifact("slurm", best)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun " in emit_artifact("torchrun", best)
    assert "launch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun " in emit_artifact("torchtitan", best)
    job = emit_artifact("pytorchjob", best)
    assert "- name: PYTORCH_CUDA_ALLOC_CONF\n" in job and "value: expandable_segments:True\n" in job
    from dataclasses import replace

    plain = replace(best, evaluation=replace(best.evaluation, config=replace(best.config, alloc_conf="")))
    assert all("PYTORCH_CUDA_ALLOC_CONF" not in emit_artifact(k, plain) for k in ("slurm", "torchrun", "pytorchjob"))


def test_pool_words_by_hand():
    # a 12 MiB block freed on stream 0 stays cached there; the same request on "side" maps its own 12 MiB segment
    segments = replay([("alloc", "a", 12 * MiB, 0), ("free", "a"), ("alloc", "b", 12 * MiB, "side")]).segments_at_peak
    assert pool_words(segments) == [
        "default stream large pool: 1 segment, 12 MiB reserved / 0 allocated, largest free block 12.0 MiB",
        "side stream large pool: 1 segment, 12 MiB reserved / 12 allocated, largest free block 0.0 MiB"]


def test_explain_shows_the_segments_at_the_peak(piped):
    from planner.reports.explain import explain_text

    best = piped.best
    text = explain_text(best)
    rank1 = rank_replay(best.model, best.cluster, best.training, best.config, 1)
    # the segments at the reserved peak add up to it (expandable: one segment per stream and pool)
    assert sum(s.size_bytes for s in rank1.segments_at_peak) == rank1.peak_reserved_bytes == 16_905_142_272
    lines = [line for line in text.splitlines() if line.startswith("  segments at the reserved peak: ")]
    assert [line.split(": ", 1)[1] for line in lines] == pool_words(rank1.segments_at_peak)
    assert "under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: peak reserved 15.74 GiB" in text
    assert "outside the allocator: cuda_context: 0.45 GiB: ampere architecture" in text
    assert "outside the allocator: pp_p2p: 0.01 GiB: 1 pipeline neighbour(s)" in text
    step = explain_text(estimate("gpt-125m", gpus=8))   # no pipeline: the step's own replay (step_allocations.py)
    assert "the step's allocations over two steps replayed" in step and "segments at the reserved peak" in step
    assert "segments at the reserved peak" in explain_text(estimate("gpt-125m", gpus=8, offload=True))  # offload too
    # EP with CPU offload (expert_unit_events.py walks EP on the device): the flat rule, the same outside
    flat = explain_text(estimate("mixtral-8x7b", gpus=8, ep=8, offload=True))
    assert "segments at the reserved peak" not in flat and "outside the allocator: cuda_context" in flat
