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
