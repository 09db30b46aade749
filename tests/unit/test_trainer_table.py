"""The trainer as an input (issue 26 item 1): the search proposes only what the chosen trainer runs, its own artifact
of the pick says nothing is "other than planned", --emit names the trainer, and a configuration the trainer cannot
run is one line."""

from __future__ import annotations

import functools
import re

import pytest

from planner import plan
from planner.emit import emit_artifact
from planner.errors import PlannerError
from planner.trainers import TRAINERS, refusal, resolve_trainer, trainer_named

# what the emitters say when the artifact cannot hold the plan (planner/emit/*: "more recompute, less memory than
# planned", "more all-gather traffic than planned", "which FSDP1 cannot", "this config cannot set", ...)
MISMATCH = re.compile(r"than planned|which [\w' ]*cannot|cannot set|cannot say|rowwise")


@functools.cache
def bounded_plan(trainer: str):
    """llama3-8b on 16 H100 (two nodes: HYBRID strategies and the reshard-to-node group are in the space)."""
    return plan("llama3-8b", gpus=16, gpu="h100-80gb", seq_len=4096, trainer=trainer)


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_the_search_proposes_only_what_the_trainer_runs(trainer):
    p = bounded_plan(trainer)
    t = trainer_named(trainer)
    assert p.candidates and p.trainer == trainer
    for c in p.candidates + p.misses:
        assert c.trainer == trainer
        assert refusal(t, c.config, c.training) is None, (trainer, c.config)
    configs = [c.config for c in p.candidates]
    if not t.fsdp1_knobs:  # FSDP2 always prefetches and bounds its all-gathers: no FSDP1 switch proposed
        assert all(c.backward_prefetch and c.limit_all_gathers for c in configs)
    if t.checkpointing == ("none", "full"):  # HF / accelerate / Lightning: a bool (every block) or nothing
        assert {c.ac_every for c in configs} <= {0, 1} and not any(c.selective_op_ac for c in configs)
    if not t.fp8_all_gather:
        assert not any(c.fp8_all_gather for c in configs)
    if not t.reshard_int:
        assert not any(c.reshard_after_forward for c in configs)


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_the_trainers_artifact_of_its_pick_holds_the_plan(trainer):
    """What the plan command emits for the trainer is what it priced: no note of a setting the artifact cannot
    hold (before the trainer bounded the search, an HF plan's every-2 checkpointing was emitted as every block,
    "more recompute, less memory than planned")."""
    best = bounded_plan(trainer).best
    text = emit_artifact(trainer_named(trainer).own_artifact, best)
    assert not MISMATCH.search(text), MISMATCH.search(text).group(0)


def test_each_trainer_narrows_the_space_to_its_switches():
    """The default trainer is the FSDP2 code the recommendation prints: FSDP1's switches are left out (the old
    search proposed them on the data-parallel-only mesh); the FSDP1 trainers keep them, and no mesh."""
    from planner.search import SearchSpace
    from planner.trainers import narrow_space

    fsdp2, fsdp1 = narrow_space(SearchSpace(), TRAINERS["fsdp2"]), narrow_space(SearchSpace(), TRAINERS["fsdp1"])
    assert (fsdp2.backward_prefetch, fsdp2.limit_all_gathers) == ((True,), (True,))
    assert (fsdp1.backward_prefetch, fsdp1.limit_all_gathers) == ((True, False), (True, False))
    assert (fsdp2.tp, fsdp2.pp, fsdp1.tp, fsdp1.cp, fsdp1.ep, fsdp1.pp) == (None, None, 1, 1, 1, 1)
    titan = narrow_space(SearchSpace(), TRAINERS["torchtitan"])
    assert titan.ac_every == (0, 1, "selective-op") and titan.float8 == (False,) and titan.compile_loss
    hf = narrow_space(SearchSpace(sequence_parallel=False), TRAINERS["hf"])
    assert hf.ac_every == (0, 1) and hf.compile_loss is False and (hf.ep, hf.pp) == (1, 1)


def test_emit_names_the_trainer_and_a_mismatch_is_one_line():
    assert resolve_trainer(None, "torchtitan").id == "torchtitan"
    assert resolve_trainer(None, "hf-trainer").id == "hf"
    assert resolve_trainer(None, "hf-trainer-fsdp1").id == "hf-fsdp1"
    assert resolve_trainer(None, "accelerate").id == "accelerate"  # its FSDP1 config, on one's own loop
    assert resolve_trainer(None, "torchrun").id == "fsdp2"  # a launch line runs any trainer's script
    assert resolve_trainer(None, None).id == "fsdp2"
    with pytest.raises(PlannerError, match="emit: --emit hf-trainer writes .* choose one of: torchtitan, torchrun"):
        resolve_trainer("torchtitan", "hf-trainer")
    with pytest.raises(PlannerError, match="trainer: unknown trainer 'deepspeed'; choose one of: fsdp2, fsdp1, hf"):
        trainer_named("deepspeed")


@pytest.mark.parametrize("trainer, knobs, field", [
    ("hf", dict(activation_checkpointing="selective-op"), "activation_checkpointing"),
    ("hf", dict(tp=2, sequence_parallel=True), "sequence_parallel"),
    ("hf", dict(pp=2), "pp"),
    ("fsdp1", dict(tp=2), "tp"),
    ("torchtitan", dict(activation_checkpointing="every-2"), "activation_checkpointing"),
    ("torchtitan", dict(float8=True), "float8"),          # 0.3's recipes are rowwise only: not priced
    ("torchtitan", dict(finetune="lora"), "finetune"),
    ("fsdp2", dict(backward_prefetch=False), "backward_prefetch"),
    ("lightning", dict(reshard_after_forward=4), "reshard_after_forward"),
])
def test_a_configuration_the_trainer_cannot_run_is_one_line(trainer, knobs, field):
    from planner import estimate

    with pytest.raises(PlannerError) as err:
        estimate("llama3-8b", gpus=16, gpu="h100-80gb", trainer=trainer, **knobs)
    assert str(err.value).startswith(f"{field}: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("args, words", [
    (["--trainer", "torchtitan", "--emit", "hf-trainer"],
     "emit: --emit hf-trainer writes HF Trainer FSDP2's files, not torchtitan 0.3's"),
    (["--trainer", "fsdp1", "--tp", "2"], "tp: the planner's FSDP1 code has no tp axis"),
    (["--trainer", "megatron"], "trainer: unknown trainer 'megatron'; choose one of"),
])
def test_the_cli_refuses_in_one_line_with_exit_2(args, words):
    from tests.doctor.cli_run import cli_process

    r = cli_process(["--model", "llama3-8b", "--gpus", "8", *args])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert words in r.stderr


def test_each_trainer_is_priced_with_its_own_defaults():
    """The optimizer's implementation is the trainer's (HF Trainer's adamw_torch_fused, torchtitan's
    implementation = "fused", torch.optim.AdamW's foreach in the planner's code): the foreach step's sqrt list
    is one fp32 copy of the local shard, llama3-8b's 8,030,261,248 parameters x 4 B / 8 ranks; fused keeps none.
    torchtitan's own Llama norms with torch.nn.RMSNorm (one fused kernel): its norm is priced fused."""
    from planner import estimate

    priced = {t: estimate("llama3-8b", gpus=8, gpu="h100-80gb", trainer=t) for t in ("fsdp2", "hf", "torchtitan")}
    step = {t: c.memory.phases["optimizer_step"] for t, c in priced.items()}
    assert step["fsdp2"].optimizer_temporaries == 8_030_261_248 * 4 // 8
    assert step["hf"].optimizer_temporaries == step["torchtitan"].optimizer_temporaries == 0
    assert {t: c.training.optimizer_impl.value for t, c in priced.items()} == {
        "fsdp2": "foreach", "hf": "fused", "torchtitan": "fused"}
    assert (priced["hf"].model.norm, priced["torchtitan"].model.norm) == ("rmsnorm", "fused_rmsnorm")
    # every torchtitan 0.3 model config takes ChunkedLossWrapper
    assert (priced["hf"].config.loss_kernel.value, priced["torchtitan"].config.loss_kernel.value) == ("eager", "chunked")
    # the same configuration on transformers' Llama (eager RMSNorm): the fused norm's fewer bytes make it faster
    from planner.api import estimate_config

    titan = priced["torchtitan"]
    as_hf = estimate_config(priced["hf"].model, titan.cluster, titan.training, titan.config)
    assert titan.time.step_s < as_hf.time.step_s


def test_the_trainer_flag_names_every_trainer():
    """--trainer's help lists each trainer of the table (it listed 7 of 11: automodel, axolotl and accelerate missing)."""
    from dataclasses import fields

    from planner.request.groups import Request

    text = next(f for f in fields(Request) if f.name == "trainer").metadata["flag"].help
    missing = [t for t in TRAINERS if not re.search(rf"(?<![\w-]){re.escape(t)}(?![\w-])", text)]
    assert not missing, missing
