"""QLoRA through HF Trainer and accelerate (issue 29 item 1): --emit hf-trainer writes bnb_config and lora_config,
which transformers and peft construct here with the plan's values (storage dtype = compute dtype, FSDP's
cpu_ram_efficient_loading; FSDP1 with use_orig_params); accelerate's YAML loads, the loading code in its header."""

import pytest
import torch

from cost_models.specs import FsdpConfig, TrainingSpec
from planner.emit.trainers import emit_accelerate, emit_hf_trainer
from planner.hardware import make_cluster
from planner.models import load_preset

SPEC = load_preset("llama3.1-70b")
PAIR = make_cluster(2, gpu="rtx4090-24gb")
QLORA = TrainingSpec(finetune="qlora", lora_rank=64, quant="nf4", double_quant=True)


@pytest.mark.parametrize("fsdp_version", [2, 1])
def test_hf_trainer_builds_the_planned_bitsandbytes_and_lora_configs(hf_snippet, fsdp_version):
    pytest.importorskip("peft")
    config = FsdpConfig(offload=True, ac_every=1, micro_batch=2)
    ns = hf_snippet(emit_hf_trainer(config, SPEC, PAIR, QLORA, fsdp_version=fsdp_version))
    bnb, lora, args = ns["bnb_config"], ns["lora_config"], ns["args"]
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant
    assert bnb.bnb_4bit_quant_storage == bnb.bnb_4bit_compute_dtype == torch.bfloat16
    assert lora.r == 64 and lora.lora_alpha == 128 and set(lora.target_modules) == {"q_proj", "k_proj", "v_proj",
                                                                                     "o_proj"}
    assert args.fsdp_config["cpu_ram_efficient_loading"] in (True, "true")
    if fsdp_version == 1:
        assert args.fsdp_config["use_orig_params"] in (True, "true")


def test_fp16_and_fp4_without_double_quant(hf_snippet):
    training = TrainingSpec(finetune="qlora", quant="fp4", double_quant=False, quant_storage="fp16")
    bnb = hf_snippet(emit_hf_trainer(FsdpConfig(precision="fp16"), SPEC, PAIR, training))["bnb_config"]
    assert bnb.bnb_4bit_quant_type == "fp4" and not bnb.bnb_4bit_use_double_quant
    assert bnb.bnb_4bit_quant_storage == bnb.bnb_4bit_compute_dtype == torch.float16


def test_accelerate_yaml_loads_and_names_the_loading(tmp_path, load_accelerate):
    text = emit_accelerate(FsdpConfig(offload=True, ac_every=1), SPEC, PAIR, QLORA, fsdp_version=2)
    assert "bnb_4bit_quant_storage=torch.bfloat16" in text and "bnb_4bit_quant_type=\"nf4\"" in text
    assert "fsdp_cpu_ram_efficient_loading: true" in text
    load_accelerate(tmp_path, text)  # accelerate's own loader and launch-time resolution accept it


@pytest.mark.parametrize("kind, targets", [("fsdp2", "attention"), ("fsdp1", "attention"), ("fsdp2", "all-linear")])
def test_fsdp_snippets_end_with_the_loading_they_were_planned_with(kind, targets):
    """The planner's own FSDP code (the default trainer's artifact) runs as Python and defines the same
    bnb_config / lora_config after its wrapping code, its adapters on the linears priced."""
    pytest.importorskip("peft")
    from planner import estimate
    from planner.emit import emit_artifact

    candidate = estimate("llama3-8b", 2, gpu="a100-80gb", finetune="qlora", lora_rank=32, quant="fp4",
                         double_quant=False, lora_targets=targets)
    ns: dict = {}
    exec(compile(emit_artifact(kind, candidate), f"<{kind}>", "exec"), ns)
    bnb, lora = ns["bnb_config"], ns["lora_config"]
    assert bnb.bnb_4bit_quant_type == "fp4" and not bnb.bnb_4bit_use_double_quant
    assert bnb.bnb_4bit_quant_storage == bnb.bnb_4bit_compute_dtype == torch.bfloat16 and lora.r == 32
    assert lora.target_modules == ({"q_proj", "k_proj", "v_proj", "o_proj"} if targets == "attention" else "all-linear")
    assert callable(ns["apply_fsdp"])


@pytest.mark.parametrize("targets", ["attention", "all-linear"])
def test_fsdp1_qlora_wraps_each_adapter_as_planned(tmp_path, targets):
    """--emit fsdp1 of a QLoRA plan wraps each adapter as its own unit casting its inputs, as LoRA's (a bf16 base and
    fp32 adapters cannot share one flat parameter; it wrote ModuleWrapPolicy before), and check reads back the plan:
    its LoraConfig's target_modules too (all-linear: priced with the MLP's adapters)."""
    from planner import plan
    from planner.doctor import check
    from planner.doctor.readers import read_setup
    from planner.emit import emit_artifact

    best = plan("llama3-8b", gpus=8, gpu="h100-80gb", seq_len=4096, trainer="fsdp1", finetune="qlora",
                lora_targets=targets).best
    text = emit_artifact("fsdp1", best)
    assert "CustomPolicy(lora_unit)" in text and "cast_forward_inputs" in text
    path = tmp_path / "train.py"
    path.write_text(text)
    r = check(read_setup(path), "llama3-8b", 8, gpu="h100-80gb", seq_len=4096, micro_batch=best.config.micro_batch,
              grad_accum=best.config.grad_accum, finetune="qlora")
    assert r.setup.adapter_units and r.candidate.to_dict() == best.to_dict()
    assert dict(r.setup.training)["lora_targets"] == r.candidate.model.lora_targets.value == targets
