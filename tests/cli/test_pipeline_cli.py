"""Pipeline parallelism on the command line (issue 18, items 1, 2, 4-6): the flags and their bad input, the stage
split and the microbatches in the output, each pipeline rank's memory (text and JSON), --emit torchtitan parsed by
torchtitan 0.3.0's own parser, the dialects that cannot express PP, and `fsdp-plan check` reading torchtitan's PP
settings back."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import json

import pytest

from cost_models.memory import MemoryBreakdown
from cost_models.pipeline_memory import PipelineRankMemory
from planner import api
from test_float_flags import invoke  # (exit code, stdout, stderr) of `fsdp-plan ARGV` (tests/cli is on sys.path)
from planner.errors import PlannerError
from planner.schemas import EstimateOutput, ExplainOutput

DONE_WHEN = ["estimate", "--model", "llama3.1-405b", "--gpus", "512", "--gpu", "h100-96gb", "--tp", "8", "--pp", "8",
             "--pp-schedule", "interleaved-1f1b", "--micro-batch", "1", "--global-batch", "256",
             "--activation-checkpointing", "full", "--compile", "--float8", "--async-tp"]
EST = ["estimate", "--model", "llama3.1-8b", "--gpus", "64", "--gpu", "h100-80gb"]
PLAN = ["--model", "llama3.1-8b", "--gpus", "64", "--gpu", "h100-80gb"]


def test_without_a_global_batch_a_pipeline_runs_two_microbatches_per_stage(capsys):
    # as the search takes them: 1F1B on 8 ranks -> 16 microbatches of 1; the global batch is then 16 x 64 / 8 = 128
    code, out, err = invoke(EST + ["--pp", "8"], capsys)
    assert code == 0, err
    assert ("pipeline: pp 8 (8 stages), 1f1b (torch's Schedule1F1B; torchtitan's 1F1B); micro-batch 1 is the pipeline "
            "microbatch: the local batch of 16 sequences (global batch 128 / 8 data-parallel ranks) runs as 16 "
            "microbatches in one schedule step") in out.splitlines()
    # interleaved, 2 stages a rank on 4 ranks: 2 x 8 = 16 microbatches; --grad-accum gives the count itself
    code, out, _ = invoke(EST + ["--pp", "4", "--pp-schedule", "interleaved-1f1b", "--format", "json"], capsys)
    assert json.loads(out)["pipeline"]["microbatches"] == 16
    code, out, _ = invoke(EST + ["--pp", "4", "--grad-accum", "6", "--format", "json"], capsys)
    assert json.loads(out)["pipeline"]["microbatches"] == 6


@functools.cache
def done_when() -> api.Candidate:
    return api.estimate("llama3.1-405b", 512, gpu="h100-96gb", tp=8, pp=8, pp_schedule="interleaved-1f1b",
                        micro_batch=1, global_batch=256, activation_checkpointing="full", compile=True, float8=True,
                        async_tp=True)


# ------------------------------------------------------------------------------------------------ bad input



@pytest.mark.parametrize("argv, line", [
    # 64 stages for llama3.1-8b's 32 blocks
    (EST + ["--pp", "64"], "error: pp: pp=64 x 1 stage per rank = 64 stages for the 32 blocks of llama3.1-8b; "
                           "use pp <= "),
    # 64 GPUs / pp 8 = 8 data-parallel ranks; global batch 32 / 8 = 4 sequences = 4 microbatches of 1 < 8 stages
    (EST + ["--pp", "8", "--global-batch", "32"],
     "error: micro_batch: 1f1b needs at least as many microbatches as stages (8); the local batch makes 4 of "
     "micro-batch 1"),
    (EST + ["--pp", "8", "--pp-schedule", "foo"],
     "error: pp_schedule: unknown value 'foo'; choose one of: gpipe, 1f1b, interleaved-1f1b, zero-bubble, dualpipev"),
    (EST + ["--pp", "8", "--pp-stages-per-rank", "2"],
     "error: pp_stages_per_rank: 2 needs a looped schedule (interleaved-1f1b, zero-bubble, dualpipev); 1f1b runs one "
     "stage per rank"),
    (EST + ["--pp", "4", "--pp-schedule", "dualpipev", "--pp-stages-per-rank", "3"],
     "error: pp_stages_per_rank: dualpipev runs exactly 2 stages per rank (a V), got 3"),
    (EST + ["--pp-schedule", "gpipe"], "error: pp_schedule: needs pipeline parallelism"),
    (PLAN + ["--pp", "64"], "error: pp: pp=64 x 1 stage per rank = 64 stages for the 32 blocks of llama3.1-8b"),
    (PLAN + ["--pp", "8", "--pp-schedule", "LoopedBFS"], "error: pp_schedule: unknown value 'LoopedBFS'"),
    (PLAN + ["--pp-stages-per-rank", "2"], "error: pp_stages_per_rank: pins the pipeline's schedule: give pp >= 2"),
    (["explain"] + EST[1:] + ["--pp", "8", "--pp-schedule", "gpipe", "--pp-stages-per-rank", "2"],
     "error: pp_stages_per_rank: 2 needs a looped schedule"),
    # a split backward with checkpointing is up to 47% above the estimate in the pipeline trace (grid #29): refused
    (EST + ["--pp", "4", "--pp-schedule", "zero-bubble", "--activation-checkpointing", "full"],
     "error: activation_checkpointing: zero-bubble with activation checkpointing is not priced"),
    (EST + ["--pp", "4", "--pp-schedule", "dualpipev", "--activation-checkpointing", "selective-op"],
     "error: activation_checkpointing: dualpipev with activation checkpointing is not priced"),
])
def test_bad_pipeline_input_is_one_line_exit_2(argv, line, capsys):
    code, out, err = invoke(argv, capsys)
    assert code == 2 and err.startswith(line) and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_help_says_the_micro_batch_is_the_pipeline_microbatch(capsys):
    for argv in (["estimate", "--help"], ["--help"], ["explain", "--help"], ["trace", "--help"], ["calibrate", "--help"]):
        code, out, _ = invoke(argv, capsys)
        flat = " ".join(out.split())
        assert code == 0 and "--pp-schedule" in flat and "--pp-stages-per-rank" in flat, argv
        assert "with --pp, --micro-batch is the pipeline microbatch: the local batch (global batch / data-parallel " \
               "ranks) is split into local batch / micro-batch microbatches" in flat, argv


# ------------------------------------------------------------------------------------------------ output

def test_done_when_prints_the_stage_split_and_the_microbatches(capsys):
    code, out, err = invoke(DONE_WHEN, capsys)
    assert code == 0, err
    lines = out.splitlines()
    # 512 GPUs / (tp 8 x pp 8) = 8 data-parallel ranks; 256 / 8 = 32 sequences = 32 microbatches of 1;
    # 126 blocks over 8 x 2 = 16 stages: 126 = 14 x 8 + 2 x 7, the end stages (0 and 15) one block fewer;
    # interleaved: stage s on rank s mod 8
    assert ("pipeline: pp 8 x 2 stages per rank = 16 stages, interleaved-1f1b (torch's ScheduleInterleaved1F1B; "
            "torchtitan's Interleaved1F1B); micro-batch 1 is the pipeline microbatch: the local batch of 32 sequences "
            "(global batch 256 / 8 data-parallel ranks) runs as 32 microbatches in one schedule step") in lines
    assert "  rank 0: stage 0 (embedding + blocks 0-6), stage 8 (blocks 63-70)" in lines
    assert "  rank 1: stage 1 (blocks 7-14), stage 9 (blocks 71-78)" in lines
    assert "  rank 7: stage 7 (blocks 55-62), stage 15 (blocks 119-125 + norm + head + loss)" in lines


def _with_ranks(c: api.Candidate) -> api.Candidate:
    """The candidate with a hand-built pipeline_ranks: rank r peaks at (60 + r) GiB allocated, (64 + r) reserved,
    except rank 3 at 70 / 75 GiB (the largest)."""
    gib = 2**30
    ranks = tuple(PipelineRankMemory(r, (r, r + 8), f"rank {r}", (70 if r == 3 else 60 + r) * gib,
                                     (75 if r == 3 else 64 + r) * gib, MemoryBreakdown(activations=gib * (r + 1)),
                                     f"backward of block {8 * r}") for r in range(8))
    memory = dataclasses.replace(c.memory, pipeline_ranks=ranks)
    return api.Candidate(dataclasses.replace(c.evaluation, memory=memory), c.model, c.cluster, c.training)


def test_each_pipeline_rank_memory_in_text_and_json():
    from planner.reports import table as report

    c = _with_ranks(done_when())
    text = report.estimate_text(c).splitlines()
    assert any(line.startswith("Memory per GPU (GiB) of the largest pipeline rank (rank 3), peak in") for line in text)
    assert "  rank 3 (stages 3, 11): peak allocated 70.0, reserved 75.0 at backward of block 24  <- largest" in text
    assert "  rank 0 (stages 0, 8): peak allocated 60.0, reserved 64.0 at backward of block 0" in text
    data = json.loads(report.estimate_json(c))
    EstimateOutput.model_validate(data)  # the schema describes it
    ranks = data["memory"]["pipeline_ranks"]
    assert [r["peak_reserved_bytes"] // 2**30 for r in ranks] == [64, 65, 66, 75, 68, 69, 70, 71]
    assert ranks[3]["stages"] == [3, 11] and ranks[3]["breakdown"]["activations"] == 4 * 2**30
    stages = data["pipeline"]["stages"]
    assert len(stages) == 16 and sum(s["n_blocks"] for s in stages) == 126
    assert (stages[0]["n_blocks"], stages[0]["embedding"], stages[15]["n_blocks"], stages[15]["head"]) == (7, True, 7, True)
    assert data["pipeline"]["microbatches"] == 32 and data["pipeline"]["torchtitan_schedule"] == "Interleaved1F1B"


def test_the_estimates_headline_is_its_largest_rank():
    # the PP-memory engineer's per-rank figures (cost_models/pipeline_memory.py): the headline is the largest rank's,
    # as torchtitan reports the maximum across ranks, and the text marks that rank
    from planner.reports import table as report

    c = done_when()
    ranks = c.memory.pipeline_ranks
    assert [r.rank for r in ranks] == list(range(8)) and [r.stages for r in ranks] == [(r, r + 8) for r in range(8)]
    top = max(ranks, key=lambda r: r.peak_reserved_bytes)
    assert (c.memory.peak_reserved_bytes, c.memory.peak_allocated_bytes) == (top.peak_reserved_bytes,
                                                                             top.peak_allocated_bytes)
    lines = report.estimate_text(c).splitlines()
    marked = [line for line in lines if line.endswith("<- largest")]
    assert len(marked) == 1 and marked[0].startswith(f"  rank {top.rank} (stages {top.rank}, {top.rank + 8}):")
    EstimateOutput.model_validate(json.loads(report.estimate_json(c)))


def test_explain_walks_each_pipeline_rank():
    from planner.reports.explain import explain_json, explain_text

    c = _with_ranks(done_when())
    text = explain_text(c).splitlines()
    assert ("  pipeline rank 3: stage 3 (blocks 23-30), stage 11 (blocks 87-94); peak allocated 70.00 GiB, reserved "
            "75.00 GiB at backward of block 24 (the largest: the terms below are this rank's)") in text
    assert "  pipeline rank 7: stage 7 (blocks 55-62), stage 15 (blocks 119-125 + norm + head + loss); peak allocated " \
           "67.00 GiB, reserved 71.00 GiB at backward of block 56" in text
    data = json.loads(explain_json(c, "flags"))
    ExplainOutput.model_validate(data)
    terms = [t["term"] for t in data["explanation"]["memory"]]
    assert terms[:10] == ["pipeline"] + [f"pipeline rank {r}" for r in range(8)] + ["peak moment"]
    # the whole-model formulas (all 126 blocks' parameters over d) do not describe a rank: its categories instead
    # its rank figures are set by hand, not a replay's: the flat reserved, then the memory outside the allocator
    # (cost_models/outside_allocator.py: the CUDA context and NCCL at least, then their total and what is inside)
    after = terms[terms.index("reserved") + 1:]
    assert "stored parameters" not in terms and after[-2:] == ["outside the allocator, total",
                                                              "inside the allocator, not counted again"]
    assert {"outside the allocator: cuda_context", "outside the allocator: nccl"} <= set(after[:-2])
    assert all(t.startswith("outside the allocator: ") for t in after[:-2])
    assert all(t in ("sharded params", "unsharded params", "sharded grads", "unsharded grads", "optimizer state",
                     "activations", "logits and loss", "optimizer temporaries", "collective buffers")
               for t in terms[10:terms.index("reserved")])


# ------------------------------------------------------------------------------------------------ emit

def _flag_words(text: str) -> list[str]:
    """What `$(grep -v '^#' FILE)` hands torchtitan: the words of every line that is not a comment."""
    return [w for line in text.splitlines() if line and not line.startswith("#") for w in line.split()]


def _torchtitan_03() -> str | None:
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (a test-only dependency: pip install -e '.[test]')"
    version = importlib.metadata.version("torchtitan")
    return None if version.startswith("0.3") else f"torchtitan {version} installed; these are 0.3's names"


def _planned(**kwargs) -> api.Candidate:
    return api.estimate(**kwargs)


EMITTED = {  # plan -> what torchtitan must resolve
    "interleaved": (dict(model="llama3.1-8b", gpus=64, gpu="h100-80gb", tp=2, pp=4, pp_schedule="interleaved-1f1b",
                         micro_batch=2, global_batch=128),
                    # 64 / (2 x 4) = 8 data-parallel ranks; 128 / 8 = 16 sequences = 8 microbatches of 2
                    dict(pp=4, pp_schedule="Interleaved1F1B", pp_microbatch_size=2, local_batch_size=16,
                         global_batch_size=128, tp=2, dp_shard=8, disable_cuda_graphs=True)),
    "1f1b": (dict(model="llama3.1-8b", gpus=16, gpu="h100-80gb", pp=2, micro_batch=1, global_batch=64),
             # 16 / 2 = 8 ranks; 64 / 8 = 8 microbatches of 1
             dict(pp=2, pp_schedule="1F1B", pp_microbatch_size=1, local_batch_size=8, global_batch_size=64)),
    "gpipe": (dict(model="llama3.1-8b", gpus=8, gpu="h100-80gb", pp=8, pp_schedule="gpipe", micro_batch=4,
                   global_batch=16),
              dict(pp=8, pp_schedule="GPipe", pp_microbatch_size=4, local_batch_size=16, global_batch_size=16)),
    "zero-bubble": (dict(model="llama3.1-8b", gpus=16, gpu="h100-80gb", pp=4, pp_schedule="zero-bubble",
                         micro_batch=1, global_batch=32),  # 16 / 4 = 4 ranks; 32 / 4 = 8 microbatches; 8 stages
                    dict(pp=4, pp_schedule="InterleavedZeroBubble", pp_microbatch_size=1, local_batch_size=8)),
    "dualpipev": (dict(model="llama3.1-8b", gpus=16, gpu="h100-80gb", pp=4, pp_schedule="dualpipev", micro_batch=1,
                       global_batch=32),
                  dict(pp=4, pp_schedule="DualPipeV", pp_microbatch_size=1, local_batch_size=8)),
}


@pytest.fixture(scope="session")  # once per run: xdist may interleave modules, which re-ran module fixtures
def torchtitan_parsed():
    why = _torchtitan_03()
    if why:
        pytest.skip(why)
    from planner.emit import emit_artifact

    texts = {name: emit_artifact("torchtitan", _planned(**plan)) for name, (plan, _) in EMITTED.items()}
    sets = []
    for text in texts.values():
        words = _flag_words(text)
        module, config = words[0].split("=", 1)[1], words[1].split("=", 1)[1]
        sets.append(("llama3", config.removesuffix("_float8") if module == "fsdp_plan_float8" else config, words[2:]))
    from tests.unit.torchtitan_parse import parse

    return texts, dict(zip(EMITTED, parse(sets)))


def torchtitan_parts(got: dict, n_layers: int) -> list[list[str]]:
    """The stages torchtitan 0.3 builds from the parsed settings: module_fqns_per_model_part as written, else its own
    generator (pipeline_parallel.py: _get_pipeline_metadata's stage count, _generate_llm_fqn_per_model_part)."""
    import math

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    if got["module_fqns_per_model_part"]:
        return got["module_fqns_per_model_part"]
    first, last, per_stage = got["pp_first_stage_less_layers"], got["pp_last_stage_less_layers"], got["pp_layers_per_stage"]
    single = issubclass(get_schedule_class(got["pp_schedule"]), PipelineScheduleSingle)
    n_stages = (math.ceil((n_layers + first + last) / per_stage) if per_stage is not None
                else got["pp"] * (1 if single else 2))
    return _generate_llm_fqn_per_model_part(n_stages, n_layers, first, last)


def _torchtitan_blocks(got: dict, n_layers: int) -> list[int]:
    """Blocks per stage torchtitan runs from what it parsed: module_fqns_per_model_part as given, else its own
    generator from the stage weights (planner/doctor/readers/pipeline.py mirrors it)."""
    from planner.doctor.readers.pipeline import KEY, PipelineSettings, _schedule

    if got["module_fqns_per_model_part"]:
        return [sum(n.startswith("layers.") for n in p) for p in got["module_fqns_per_model_part"]]
    settings = PipelineSettings(pp=got["pp"], schedule=_schedule({KEY.format("schedule"): got["pp_schedule"]}),
                                layers_per_stage=got.get("pp_layers_per_stage"),
                                first_less=got.get("pp_first_stage_less_layers", 1),
                                last_less=got.get("pp_last_stage_less_layers", 1))
    return list(settings.blocks_per_stage(n_layers))


@pytest.mark.parametrize("name", list(EMITTED))
def test_torchtitan_03_parses_the_pipeline_and_carries_the_schedule(torchtitan_parsed, name):
    _, parsed = torchtitan_parsed
    got = parsed[name]
    assert "error" not in got, got
    for key, value in EMITTED[name][1].items():
        assert got[key] == value, (key, got[key], value)
    stages = _planned(**EMITTED[name][0]).to_dict()["pipeline"]["stages"]
    assert _torchtitan_blocks(got, 32) == [s["n_blocks"] for s in stages]  # torchtitan runs the priced split
    parts = got["module_fqns_per_model_part"]
    if parts:  # named: every block once, in order, the embedding first and norm + head last
        assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
        assert [n for p in parts for n in p if n.startswith("layers.")] == [f"layers.{i}" for i in range(32)]


def test_torchtitan_split_of_the_interleaved_plan_by_hand(torchtitan_parsed):
    # 32 blocks over 4 x 2 = 8 stages: 4 each, embedding on stage 0, norm + head on stage 7
    _, parsed = torchtitan_parsed
    assert _torchtitan_blocks(parsed["interleaved"], 32) == [4] * 8
    parts = parsed["interleaved"]["module_fqns_per_model_part"]
    if parts:
        assert parts[0] == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"]
        assert parts[7] == ["layers.28", "layers.29", "layers.30", "layers.31", "norm", "lm_head"]


def test_check_reads_the_emitted_pipeline_back(torchtitan_parsed, tmp_path):
    from planner.doctor import check
    from planner.doctor.readers import read_setup

    texts, _ = torchtitan_parsed
    plan, _ = EMITTED["interleaved"]
    path = tmp_path / "overrides.txt"
    path.write_text(texts["interleaved"])
    setup = read_setup(path)
    c = setup.config
    assert (c.pp, c.pp_schedule.value, c.pp_stages_per_rank, c.micro_batch, c.grad_accum, c.tp) == (
        4, "interleaved-1f1b", 2, 2, 8, 2)
    assert setup.n_processes == 64
    report = check(setup, "llama3.1-8b", gpu="h100-80gb")
    codes = {f.code for f in report.findings}
    assert "pp-split-not-priced" not in codes and "pp-too-few-microbatches" not in codes


# ------------------------------------------------------------------------------------------------ other dialects

@pytest.mark.parametrize("kind, words", [
    ("fsdp1", "FSDP1 (FullyShardedDataParallel) cannot express the plan's mesh"),
    ("accelerate", "accelerate's FSDP1 config cannot express the plan's mesh"),
    ("accelerate-fsdp2", "accelerate has no pipeline parallelism"),
    ("lightning", "Lightning's FSDPStrategy (FSDP1) cannot express the plan's mesh"),
    ("hf-trainer", "HF Trainer has no pipeline parallelism"),
    ("hf-trainer-fsdp1", "HF Trainer's FSDP1 (fsdp_config version 1) cannot express the plan's mesh"),
])
def test_dialects_without_pipelines_say_so_in_one_line(kind, words):
    from planner.emit import emit_artifact

    c = _planned(model="llama3.1-8b", gpus=16, gpu="h100-80gb", pp=2, micro_batch=1, global_batch=64)
    with pytest.raises(PlannerError) as err:
        emit_artifact(kind, c)
    assert err.value.field == "pp" and words in str(err.value) and len(str(err.value).splitlines()) == 1


def test_recommendation_falls_back_to_torchtitan_when_fsdp2_cannot_write_it():
    from planner.emit import emit_fsdp2, recommendation_text

    c = _planned(model="llama3.1-8b", gpus=16, gpu="h100-80gb", pp=2, micro_batch=1, global_batch=64)
    try:
        emit_fsdp2(c.config, c.model, c.cluster, c.training)
    except PlannerError:
        text = recommendation_text(c)
        assert text.startswith("Recommended config (torchtitan: the FSDP2 snippet cannot write it")
        assert "--parallelism.pipeline_parallel_degree=2" in text.splitlines()
        assert "--parallelism.pipeline_parallel_schedule=1F1B" in text.splitlines()
    else:
        assert "PipelineStage" in recommendation_text(c)  # the PP-run engineer's snippet writes the stages


# ------------------------------------------------------------------------------------------------ check

def _check_flags(tmp_path, text: str, **kwargs):
    from planner.doctor import check
    from planner.doctor.readers import read_setup

    path = tmp_path / "overrides.txt"
    path.write_text(text)
    return check(read_setup(path), "llama3.1-8b", gpu="h100-80gb", **kwargs)


BASE = ("--module=llama3 --config=llama3_8b --parallelism.data_parallel_shard_degree=4 --training.disable_cuda_graphs "
        "--training.local_batch_size=8 ")


def test_check_warns_of_torchtitans_own_split(tmp_path):
    # no module names: torchtitan's generator counts the embedding and the head as one block each: 34 over 4 stages
    # = 8 r 2, the two extra on stages 0 and 1, stage 0 and 3 one fewer -> 8, 9, 8, 7 against the even 8, 8, 8, 8
    r = _check_flags(tmp_path, BASE + "--parallelism.pipeline_parallel_degree=4 "
                                      "--parallelism.pipeline_parallel_microbatch_size=2")
    c = r.candidate.config
    assert (c.pp, c.pp_schedule.value, c.micro_batch, c.grad_accum) == (4, "1f1b", 2, 4)  # 8 / 2 = 4 microbatches
    split = [f for f in r.findings if f.code == "pp-split-not-priced"]
    assert split and split[0].message.startswith("torchtitan runs 8, 9, 8, 7 blocks on stages 0-3; the estimate "
                                                 "prices the even split 8, 8, 8, 8")


def test_check_layers_per_stage_gives_the_stages_per_rank(tmp_path):
    # layers_per_stage 9: ceil((32 + 1 + 1) / 9) = 4 stages over pp 2 = 2 per rank (a looped schedule)
    r = _check_flags(tmp_path, BASE + "--parallelism.pipeline_parallel_degree=2 "
                                      "--parallelism.pipeline_parallel_schedule=Interleaved1F1B "
                                      "--parallelism.pipeline_parallel_layers_per_stage=9")
    c = r.candidate.config
    assert (c.pp, c.pp_schedule.value, c.pp_stages_per_rank, c.micro_batch, c.grad_accum) == (
        2, "interleaved-1f1b", 2, 1, 8)


def test_check_audits_the_pipeline_by_the_same_rules(tmp_path):
    # local batch 8 in microbatches of 4: 2 microbatches for 1F1B's 4 stages (torch raises)
    r = _check_flags(tmp_path, BASE + "--parallelism.pipeline_parallel_degree=4 "
                                      "--parallelism.pipeline_parallel_microbatch_size=4")
    found = [f for f in r.findings if f.code == "pp-too-few-microbatches"]
    assert found and found[0].severity == "error" and "(4)" in found[0].message and "makes 2" in found[0].message


@pytest.mark.parametrize("text, field, words", [
    ("--parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_schedule=ZBVZeroBubble",
     "parallelism.pipeline_parallel_schedule", "not priced by fsdp-plan"),
    ("--parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_microbatch_size=3",
     "parallelism.pipeline_parallel_microbatch_size", "must divide training.local_batch_size (8)"),
    ("--parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_schedule_csv=s.csv",
     "parallelism.pipeline_parallel_schedule_csv", "CSV"),
    ("--parallelism.pipeline_parallel_degree=2 --parallelism.module_fqns_per_model_part a,b c,d e",
     "parallelism.module_fqns_per_model_part", "3 stages do not divide over pipeline_parallel_degree=2"),
    # 32 blocks + 3 + 1 over 16 stages: 2 a stage, and the embedding weighs 3 (torchtitan raises)
    ("--parallelism.pipeline_parallel_degree=16 --parallelism.pipeline_parallel_first_stage_less_layers=3",
     "parallelism.pipeline_parallel_degree", "torchtitan cannot split 32 blocks over 16 stages"),
    ("--parallelism.pipeline_parallel_degree=2 --training.global_batch_size=64",
     "training.global_batch_size", "accumulation on top of the pipeline"),  # 64 / (8 x 4) = 2 schedule steps
])
def test_check_pipeline_settings_errors_name_the_key(tmp_path, text, field, words, capsys):
    path = tmp_path / "overrides.txt"
    path.write_text(BASE + text)
    code, out, err = invoke(["check", str(path), "--model", "llama3.1-8b", "--gpu", "h100-80gb"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(f"error: {field}: "), err
    assert words in err


def test_plan_json_with_a_pinned_pipeline_validates(capsys):
    from planner.schemas import PlanOutput

    code, out, err = invoke(["--model", "llama3.2-1b", "--gpus", "16", "--gpu", "h100-80gb", "--global-batch", "32",
                             "--tp", "1", "--cp", "1", "--pp", "2", "--format", "json", "--top", "3"], capsys)
    assert code == 0, err
    data = json.loads(out)
    PlanOutput.model_validate(data)
    for c in data["candidates"]:
        # 16 / 2 = 8 data-parallel ranks, 32 / 8 = 4 sequences a rank: micro-batch x microbatches = 4
        assert c["config"]["pp"] == 2 and c["pipeline"]["local_batch"] == 4
        assert c["pipeline"]["microbatch_size"] * c["pipeline"]["microbatches"] == 4
        assert [s["n_blocks"] for s in c["pipeline"]["stages"]][:2] in ([8, 8], [4, 4])  # 16 blocks, 2 or 4 stages


def test_calibrate_takes_the_pipeline_flags(monkeypatch, capsys):
    import planner.calibrating as calibrating

    seen = {}

    def fake_calibrate(request):  # the runs themselves are the runner's (tests/distributed); here: what it is asked
        seen["config"] = request.config
        raise SystemExit(0)

    monkeypatch.setattr(calibrating, "calibrate", fake_calibrate)
    invoke(["calibrate", "--gpus", "4", "--model", "llama3.2-1b", "--device", "cpu", "--pp", "2",
            "--pp-schedule", "gpipe", "--out", "unused"], capsys)
    c = seen["config"]
    assert (c.pp, c.pp_schedule.value, c.pp_stages_per_rank, c.grad_accum) == (2, "gpipe", 1, 4)  # 2 a stage
    invoke(["calibrate", "--gpus", "4", "--model", "llama3.2-1b", "--device", "cpu", "--pp", "2", "--global-batch",
            "8", "--out", "unused"], capsys)
    assert seen["config"].grad_accum == 4  # 4 GPUs / pp 2 = 2 data-parallel ranks: 8 / 2 = 4 microbatches of 1


def test_check_reads_a_toml_job_files_model_parts(tmp_path):
    # torchtitan 0.2's TOML: 4 parts of 9, 7, 8 and 8 blocks over pp 2 -> 2 stages a rank (interleaved); the
    # estimate prices 8, 8, 8, 8
    from planner.doctor import check
    from planner.doctor.readers import read_setup

    counts, first, parts = (9, 7, 8, 8), 0, []
    for i, n in enumerate(counts):
        names = (["tok_embeddings"] if i == 0 else []) + [f"layers.{b}" for b in range(first, first + n)]
        parts.append(names + (["norm", "output"] if i == len(counts) - 1 else []))
        first += n
    path = tmp_path / "llama3_8b.toml"
    path.write_text("[parallelism]\ndata_parallel_shard_degree = 4\npipeline_parallel_degree = 2\n"
                    'pipeline_parallel_schedule = "Interleaved1F1B"\n'
                    f"module_fqns_per_model_part = {json.dumps(parts)}\n"
                    "[training]\nlocal_batch_size = 8\n")
    setup = read_setup(path)
    assert (setup.config.pp, setup.config.pp_stages_per_rank, setup.config.grad_accum) == (2, 2, 8)
    r = check(setup, "llama3.1-8b", gpu="h100-80gb")
    split = [f for f in r.findings if f.code == "pp-split-not-priced"]
    assert split and split[0].message.startswith("torchtitan runs 9, 7, 8, 8 blocks on stages 0-3")
