"""The plan's Liger kernels through HF Trainer and back (issue 26 item 4): --emit hf-trainer writes use_liger_kernel
(+ liger_kernel_config for a subset), transformers' own TrainingArguments builds it, `fsdp-plan check`'s reader reads
the saved arguments back as the same configuration, so the same estimate. What TrainingArguments cannot say (TE
kernels, torchtitan's chunked loss) is a comment; a Liger switch the planner does not price is one line."""

import pytest

from cost_models.specs import FsdpConfig
from planner.doctor.readers import read_setup
from planner.emit.kernels import from_hf_liger
from planner.emit.trainers import emit_hf_trainer
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import load_preset
from tests.doctor.test_roundtrip import hf_arguments_file

SPEC = load_preset("llama2-7b")
NODE = make_cluster(8, gpu="h100-80gb")
ALL = dict(norm_kernel="liger", rope_kernel="liger", swiglu_kernel="liger", loss_kernel="liger")


@pytest.mark.parametrize("config,switches", [
    (FsdpConfig(**ALL), None),
    (FsdpConfig(**{**ALL, "loss_kernel": "eager"}, micro_batch=2),
     {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": False, "cross_entropy": False}),
    (FsdpConfig(**{**ALL, "rope_kernel": "eager"}, compile=True),
     {"rope": False, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True, "cross_entropy": False}),
])
def test_liger_round_trips_through_training_arguments(tmp_path, training_arguments, config, switches):
    args = training_arguments(emit_hf_trainer(config, SPEC, NODE))
    assert args.use_liger_kernel is True and args.liger_kernel_config == switches
    back = read_setup(hf_arguments_file(args, tmp_path / "args.json"))
    # with compile the reader prices the model's own loss eager (compile_loss), as for any TrainingArguments
    assert back.config == FsdpConfig(**{**config.__dict__, "compile_loss": not config.compile})
    assert back.config.to_dict()["loss_kernel" if config.loss_kernel.value == "liger" else "norm_kernel"] == "liger"


def test_kernels_training_arguments_cannot_set_are_said(training_arguments):
    text = emit_hf_trainer(FsdpConfig(norm_kernel="te", loss_kernel="chunked"), SPEC, NODE)
    assert "use_liger_kernel" not in text
    assert "Transformer Engine kernels (norm): TrainingArguments has no such setting" in text
    assert "chunked loss (torchtitan's ChunkedLossWrapper, 8 chunks): TrainingArguments has no such setting" in text
    assert training_arguments(text).use_liger_kernel is False


@pytest.mark.parametrize("data,line", [
    ({"use_liger_kernel": True, "liger_kernel_config": {"cross_entropy": True}},
     "liger_kernel_config.cross_entropy: Liger's unfused cross-entropy is not priced; use fused_linear_cross_entropy "
     "(the default)"),
    ({"use_liger_kernel": True, "liger_kernel_config": {"geglu": True}},
     "liger_kernel_config.geglu: not a switch fsdp-plan prices; choose among: rope, rms_norm, swiglu, "
     "fused_linear_cross_entropy, cross_entropy"),
    ({"use_liger_kernel": "yes"}, "use_liger_kernel: expected true or false, got 'yes'"),
])
def test_a_liger_setting_the_planner_cannot_price_is_one_line(data, line):
    with pytest.raises(PlannerError) as err:
        from_hf_liger(data)
    assert str(err.value) == line
    assert from_hf_liger({"use_liger_kernel": False, "liger_kernel_config": {"rope": False}}) == {}


@pytest.mark.parametrize("config", [FsdpConfig(loss_kernel="chunked"), FsdpConfig(loss_kernel="chunked", compile=True)])
def test_torchtitan_chunked_loss_round_trips_and_parses_in_torchtitan(tmp_path, config):
    from cost_models.specs import TrainingSpec
    from planner.emit.torchtitan.job import emit_torchtitan
    from tests.unit.test_emit_mesh import _torchtitan_03, parse_with_torchtitan

    text = emit_torchtitan(config, load_preset("llama3-8b"), NODE, TrainingSpec(seq_len=4096), version="0.3")
    assert "--loss.num_chunks=8" in text.splitlines()
    path = tmp_path / "overrides.txt"
    path.write_text(text)
    assert read_setup(path).config == config
    why = _torchtitan_03()
    if why:
        pytest.skip(why)
    flags = [line for line in text.splitlines() if line.startswith("--") and not line.startswith(("--module",
                                                                                                 "--config"))]
    (parsed,) = parse_with_torchtitan([["llama3", "llama3_8b", flags]])
    assert (parsed.get("loss"), parsed.get("loss_chunks"), parsed["components"]) == (
        "ChunkedLossWrapper", 8, ["model", "loss"])


def test_torchtitan_says_what_it_cannot_run_and_refuses_other_chunk_counts():
    from planner.emit.kernels import from_torchtitan_loss, torchtitan_kernel_flags

    flags, notes = torchtitan_kernel_flags(FsdpConfig(norm_kernel="te", loss_kernel="liger"), "0.3")
    assert flags == [] and len(notes) == 2 and notes[1].startswith("norm kernels (Liger / Transformer Engine)")
    assert torchtitan_kernel_flags(FsdpConfig(loss_kernel="chunked"), "0.2")[1][0].startswith(
        "chunked loss: torchtitan 0.2 has no ChunkedLossWrapper")
    with pytest.raises(PlannerError, match="^loss.num_chunks: '4'; fsdp-plan prices ChunkedLossWrapper's default of "
                                           "8 chunks$"):
        from_torchtitan_loss({"loss.num_chunks": "4"})


def test_the_fsdp2_snippet_applies_the_planned_liger_kernels():
    from planner.emit.code.fsdp import emit_fsdp2

    text = emit_fsdp2(FsdpConfig(**{**ALL, "loss_kernel": "eager"}), load_preset("llama3-8b"), NODE)
    compile(text, "fsdp2 snippet", "exec")
    assert "from liger_kernel.transformers import apply_liger_kernel_to_llama  # liger-kernel 0.8.5, as planned" in text
    assert ("    apply_liger_kernel_to_llama(\n        rope=True, rms_norm=True, swiglu=True,\n"
            "        fused_linear_cross_entropy=False, cross_entropy=False, model=model)") in text
    assert "apply_liger_kernel" not in emit_fsdp2(FsdpConfig(), load_preset("llama3-8b"), NODE)
