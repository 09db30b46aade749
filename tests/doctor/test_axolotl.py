"""--emit axolotl (issue 29): the plan as an axolotl 0.21 config, for full, LoRA and QLoRA fine-tuning. axolotl's own
validate_config takes each emitted file and keeps the plan's values (tests/doctor/axolotl_validate.py, in a process
of its own); `fsdp-plan check` reads it back (planner/doctor/readers/axolotl.py) as the plan that was priced: the same
trainer, config, memory (the GPU peak and host RAM) and time. A config written the way axolotl's examples write it
is priced with axolotl's defaults, and its QLoRA pitfalls are found."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner import plan
from planner.doctor import check
from cost_models.specs import FsdpConfig, TrainingSpec
from planner.doctor.readers import read_setup
from planner.emit import emit_artifact
from planner.emit.axolotl import emit_axolotl
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import load_preset
from tests.doctor.cli_run import cli_process

MODEL, GPUS, GPU, SEQ = "llama3-8b", 16, "h100-80gb", 4096
FINETUNES = ("full", "lora", "qlora")
VALIDATOR = Path(__file__).with_name("axolotl_validate.py")


@functools.cache
def picked(finetune: str):
    """The axolotl trainer's best plan on two nodes (full: FULL_SHARD; LoRA: HSDP 2 x 8; QLoRA: SHARD_GRAD_OP, as
    axolotl loads a 4-bit base on a one-dimensional mesh only)."""
    return plan(MODEL, gpus=GPUS, gpu=GPU, seq_len=SEQ, trainer="axolotl", finetune=finetune).best


# the settings the picks above leave out, each written and read back: fp16 with offload, checkpointing and SGD under
# LoRA on one node; fp32 full fine-tuning over HSDP 2 x 8 with eager attention; QLoRA on every linear (all-linear)
VARIANTS = {
    "fp16-offload-ac-sgd-lora": (FsdpConfig(precision="fp16", offload=True, ac_every=1, micro_batch=4, grad_accum=8),
                                 8, TrainingSpec(finetune="lora", optimizer="sgd")),
    "fp32-hsdp-eager": (FsdpConfig(precision="fp32", sharding="HYBRID_SHARD", attention="eager"), 16, TrainingSpec()),
    "qlora-all-linear": (FsdpConfig(), 8, TrainingSpec(finetune="qlora")),
}


def variant_text(name: str) -> str:
    config, gpus, training = VARIANTS[name]
    spec = load_preset(MODEL)
    if name.endswith("all-linear"):
        spec = dataclasses.replace(spec, lora_targets="all-linear")
    return emit_axolotl(config, spec, make_cluster(gpus), training)


@pytest.fixture(scope="module")
def validated() -> dict:
    """finetune or variant -> the keys axolotl's validate_config kept, one subprocess for all (~25 s: axolotl's
    imports)."""
    if importlib.util.find_spec("axolotl") is None:
        pytest.skip("axolotl is not installed: pip install --no-deps --ignore-requires-python axolotl==0.21.0 "
                    "addict==2.4.0")
    texts = [emit_artifact("axolotl", picked(f)) for f in FINETUNES] + [variant_text(v) for v in VARIANTS]
    r = subprocess.run([sys.executable, str(VALIDATOR)], input=json.dumps(texts), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(zip((*FINETUNES, *VARIANTS), json.loads(r.stdout.strip().splitlines()[-1])))


def test_the_other_settings_validate_and_read_back(validated, tmp_path):
    lora = validated["fp16-offload-ac-sgd-lora"]
    assert "error" not in lora, lora
    assert (lora["bf16"], lora["fp16"], lora["optimizer"], lora["optim_args"]) == (False, True, "sgd", "momentum=0.9")
    assert (lora["micro_batch_size"], lora["gradient_accumulation_steps"]) == (4, 8)
    assert lora["fsdp_config"]["offload_params"] is lora["fsdp_config"]["activation_checkpointing"] is True
    full = validated["fp32-hsdp-eager"]
    assert "error" not in full, full
    assert (full["bf16"], full["fp16"], full["attn_implementation"]) == (False, None, "eager")
    assert (full["dp_replicate_size"], full["dp_shard_size"], full["fsdp_config"]["reshard_after_forward"]) == (
        2, 8, True)
    every = validated["qlora-all-linear"]
    assert "error" not in every, every
    assert (every["lora_target_linear"], every["lora_target_modules"]) == (True, None)
    for name, (config, _, training) in VARIANTS.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(variant_text(name))
        setup = read_setup(path)
        back = setup.config
        assert (back.sharding, back.precision, back.offload, back.ac_every, back.micro_batch, back.grad_accum,
                back.attention) == (config.sharding, config.precision, config.offload, config.ac_every,
                                    config.micro_batch, config.grad_accum, config.attention), name
        knobs = dict(setup.training)
        assert (knobs["finetune"], knobs["optimizer"]) == (training.finetune.value, training.optimizer.value), name
        assert knobs.get("lora_targets") == ({"full": None, "lora": "attention", "qlora": "all-linear"}[
            training.finetune.value]), name


@pytest.mark.parametrize("finetune", FINETUNES)
def test_axolotl_validates_the_emitted_config_with_the_plans_values(validated, finetune):
    got, best = validated[finetune], picked(finetune)
    assert "error" not in got, got
    config = best.config
    assert (got["micro_batch_size"], got["gradient_accumulation_steps"], got["sequence_len"]) == (
        config.micro_batch, config.grad_accum, SEQ) == (2, 1, 4096)
    assert (got["bf16"], got["attn_implementation"], got["optimizer"]) == (True, "sdpa", "adamw_torch_fused")
    assert got["fsdp_version"] == got["fsdp_config"]["fsdp_version"] == 2
    reshard = {"full": True, "lora": False, "qlora": False}[finetune]  # FULL_SHARD, HYBRID_SHARD_ZERO2, SHARD_GRAD_OP
    assert got["fsdp_config"]["reshard_after_forward"] is reshard
    assert got["fsdp_config"]["transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert got["dp_replicate_size"] == (2 if finetune == "lora" else None)  # HSDP: a replica per node
    if finetune == "full":
        assert got["adapter"] is None and got["lora_r"] is None
        return
    assert (got["adapter"], got["lora_r"], got["lora_alpha"]) == (finetune, 16, 32)
    assert got["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"] and not got["lora_target_linear"]
    if finetune == "qlora":
        assert got["load_in_4bit"] is True and got["qlora_sharded_model_loading"] is True  # rank 0 stages NF4
        assert got["bnb_config_kwargs"] == {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                                            "bnb_4bit_quant_storage": "bfloat16"}


@pytest.mark.parametrize("finetune", FINETUNES)
def test_the_emitted_config_reads_back_as_the_plan_that_was_priced(tmp_path, finetune):
    best = picked(finetune)
    path = tmp_path / "config.yaml"
    path.write_text(emit_artifact("axolotl", best))
    setup = read_setup(path)
    assert setup.dialect == "axolotl" and setup.seq_len == SEQ
    r = check(setup, MODEL, GPUS, gpu=GPU)  # the micro-batch, sequence and fine-tuning: the file's
    back, priced = r.candidate.to_dict(), best.to_dict()
    assert back["trainer"] == priced["trainer"] == "axolotl"
    for key in ("config", "training", "memory", "time"):  # memory: the GPU peak and the host RAM
        assert back[key] == priced[key], key
    assert back["training"]["finetune"] == finetune
    assert not [f.code for f in r.findings if f.code.startswith("qlora-")]


EXAMPLE = """
base_model: NousResearch/Meta-Llama-3.1-8B
load_in_4bit: true
adapter: qlora
lora_r: 8
lora_target_linear: true
datasets:
  - path: tatsu-lab/alpaca
    type: alpaca
learning_rate: 0.0002
bf16: auto
gradient_checkpointing: true
fsdp_config:
  fsdp_offload_params: true
  fsdp_cpu_ram_efficient_loading: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_state_dict_type: FULL_STATE_DICT
"""


def _checked(tmp_path, text: str):
    path = tmp_path / "qlora.yaml"
    path.write_text(text)
    return check(read_setup(path), "llama3.1-8b", 8, gpu="h100-80gb")


def test_an_example_config_is_priced_with_axolotls_defaults(tmp_path):
    """axolotl's defaults where the file is silent: micro-batch 1, sequence_len 512, FSDP2 resharding after forward;
    its BitsAndBytesConfig (nf4, double quantization, bf16 storage); lora_r 8 as written, on every linear
    (lora_target_linear); the FULL_STATE_DICT save gathered on rank 0 is found."""
    r = _checked(tmp_path, EXAMPLE)
    c, t = r.candidate.config, r.candidate.training
    assert (c.micro_batch, c.sharding.value, c.offload, c.ac_every, c.precision.value) == (
        1, "FULL_SHARD", True, 1, "bf16")
    assert (t.seq_len, t.finetune.value, t.lora_rank, t.quant.value, t.double_quant, t.quant_storage) == (
        512, "qlora", 8, "nf4", True, "bf16")
    codes = {f.code for f in r.findings}
    assert "full-state-dict-save" in codes and not {c for c in codes if c.startswith("qlora-")}
    # lora_target_linear: adapters on q, o (4096 -> 4096), k, v (4096 -> 1024), gate, up (4096 -> 14336), down
    assert r.candidate.model.lora_targets.value == "all-linear" and not r.setup.notes
    assert r.candidate.model.lora_params_per_block(8) == 8 * (2 * 8192 + 2 * 5120 + 3 * 18432) == 655_360


@pytest.mark.parametrize("edit, code", [
    # axolotl stores the 4-bit base in bf16 whatever the precision: fp16 training gathers two dtypes
    (("bf16: auto", "fp16: true"), "qlora-storage-not-compute-dtype"),
    (("learning_rate", "bnb_config_kwargs: {bnb_4bit_quant_storage: uint8}\nlearning_rate"),
     "qlora-integer-quant-storage"),
    (("  fsdp_cpu_ram_efficient_loading: true\n", ""), "qlora-every-rank-loads"),
])
def test_the_qlora_pitfalls_in_an_axolotl_config(tmp_path, edit, code):
    found = {f.code for f in _checked(tmp_path, EXAMPLE.replace(*edit)).findings if f.code.startswith("qlora-")}
    assert found == {code}


@pytest.mark.parametrize("edit, words", [
    (("fsdp_config:", "fsdp_version: 1\nfsdp_config:"), "fsdp_version: 1: axolotl 0.21 runs FSDP2 only"),
    (("adapter: qlora", "adapter: ia3"), "adapter: unknown value 'ia3'; choose one of: lora, qlora"),
    (("gradient_checkpointing: true", "gradient_checkpointing: offload"), "gradient_checkpointing: offload: "),
])
def test_bad_input_is_one_line_with_exit_2(tmp_path, edit, words):
    path = tmp_path / "bad.yaml"
    path.write_text(EXAMPLE.replace(*edit))
    r = cli_process(["check", str(path), "--model", "llama3.1-8b", "--gpus", "8"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert words in r.stderr


def test_qlora_over_hsdp_replicas_is_refused_in_one_line():
    """axolotl stages a 4-bit base through rank 0's CPU on a one-dimensional mesh only: QLoRA under HSDP is left out
    of its search (the pick above is SHARD_GRAD_OP) and refused when pinned."""
    from planner import estimate

    with pytest.raises(PlannerError) as err:
        estimate(MODEL, gpus=GPUS, gpu=GPU, trainer="axolotl", finetune="qlora", sharding="HYBRID_SHARD")
    assert str(err.value).startswith("sharding: ") and "\n" not in str(err.value)
    assert picked("qlora").config.sharding.value == "SHARD_GRAD_OP"


@pytest.mark.parametrize("training, field", [
    (TrainingSpec(finetune="qlora", quant="fp4"), "quant"),  # axolotl stages nf4 only
    (TrainingSpec(optimizer="adamw-8bit"), "optimizer"),     # bitsandbytes' 8-bit AdamW: refused under FSDP2
])
def test_what_axolotl_refuses_is_one_line(training, field):
    with pytest.raises(PlannerError) as err:
        emit_axolotl(FsdpConfig(), load_preset(MODEL), make_cluster(8), training)
    assert str(err.value).startswith(f"{field}: ") and "\n" not in str(err.value)


def test_the_cli_round_trip_of_a_qlora_plan(tmp_path):
    """`fsdp-plan --trainer axolotl --finetune qlora --lora-targets all-linear` then `--emit axolotl` and `fsdp-plan
    check` of that file, as a user runs them: llama3.1-70b on 2 x RTX 4090 reads back as the plan (its adapters on
    every linear: lora_target_linear; 19,978,427,439 B reserved per GPU when written, 19,974,711,548 with the attention
    projections' alone: offloaded, checkpointed), its allocated peak under the card's 24 GB, with no finding."""
    from tests.doctor.cli_run import run_cli as run

    args = ["--model", "llama3.1-70b", "--gpus", "2", "--gpu", "rtx4090-24gb"]
    qlora = ["--finetune", "qlora", "--lora-targets", "all-linear"]

    planned = json.loads(run([*args, "--trainer", "axolotl", *qlora, "--format", "json"]))
    path = tmp_path / "config.yaml"
    path.write_text(run([*args, *qlora, "--emit", "axolotl"]))
    assert "lora_target_linear: true" in path.read_text()
    checked = json.loads(run(["check", str(path), *args, "--format", "json"]))
    best = planned["candidates"][0]
    for key in ("trainer", "config", "training", "memory", "time"):
        assert checked[key] == best[key], key
    assert checked["model"] == planned["model"] and checked["model"]["lora_targets"] == "all-linear"
    # the RTX 4090's 24 GB: the flat rule's reserved fits it; the step's replay under CPU offload (offload_events.py,
    # 27,538,069,913 B at this commit) passes it, a warning (c10 frees cached segments and retries), not a refusal
    assert checked["memory"]["peak_allocated_bytes"] < 24 * 10**9 < checked["memory"]["peak_reserved_bytes"]
    assert checked["findings"] == []
