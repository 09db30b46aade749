"""`fsdp-plan check` on QLoRA's silent failures (issue 29 item 2): a script that loads a 4-bit base with
BitsAndBytesConfig and wraps it as --emit fsdp2 / fsdp1 write it, read with ast (planner/doctor/readers/
python_qlora.py); each bad setting below raises its own finding with its fix, the good script none of them. The
FSDP parts are written as a user would (fully_shard per block, FSDP1 with ModuleWrapPolicy): read as --emit's."""

from __future__ import annotations

import pytest

from planner.doctor import check
from planner.doctor.readers import read_setup

LOADING = '''
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

bnb_config = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16,
    bnb_4bit_quant_storage=torch.bfloat16,
)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-70B", quantization_config=bnb_config,
                                                 dtype=torch.bfloat16)
model.gradient_checkpointing_enable()
model.enable_input_require_grads()
model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
'''
QLORA_CODES = {"qlora-integer-quant-storage", "qlora-storage-not-compute-dtype", "qlora-adapters-other-dtype",
               "qlora-without-use-orig-params", "qlora-every-rank-loads", "qlora-checkpointing-without-input-grads"}


def findings(tmp_path, loading: str, snippet: str) -> dict:
    path = tmp_path / "train.py"
    path.write_text(loading + "\n" + snippet)
    setup = read_setup(path)
    report = check(setup, "llama3.1-70b", 2, gpu="rtx4090-24gb")
    assert report.candidate.training.finetune.value == "qlora"  # the file's BitsAndBytesConfig sets it
    return {f.code: f for f in report.findings if f.code in QLORA_CODES}


FSDP2 = '''
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def apply_fsdp(model):
    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    fsdp_kwargs = dict(mesh=mesh, reshard_after_forward=True, offload_policy=CPUOffloadPolicy(),
                       mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for block in model.model.layers:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model
'''
FSDP1 = '''
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

model = FullyShardedDataParallel(
    model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    cpu_offload=CPUOffload(offload_params=True), use_orig_params=True, device_id=torch.cuda.current_device())
'''


def test_the_good_script_has_no_qlora_finding(tmp_path):
    assert findings(tmp_path, LOADING, FSDP2) == {}
    setup = read_setup(tmp_path / "train.py")
    assert setup.qlora.quant_storage == setup.qlora.compute_dtype == "bf16" and setup.qlora.rank0_loading


@pytest.mark.parametrize("edit, code", [
    (("    bnb_4bit_quant_storage=torch.bfloat16,\n", ""), "qlora-integer-quant-storage"),  # bitsandbytes' uint8
    (("bnb_4bit_quant_storage=torch.bfloat16", "bnb_4bit_quant_storage=torch.float16"),
     "qlora-storage-not-compute-dtype"),
    (('with torch.device("meta"):\n    model', 'if True:\n    model'), "qlora-every-rank-loads"),
    (("model.enable_input_require_grads()\n", ""), "qlora-checkpointing-without-input-grads"),
])
def test_each_silent_failure_is_found_with_its_fix(tmp_path, edit, code):
    found = findings(tmp_path, LOADING.replace(*edit), FSDP2)
    assert set(found) == {code}
    assert found[code].fix


def test_fsdp1_block_units_with_fp32_adapters_and_without_use_orig_params(tmp_path):
    full = FSDP1  # ModuleWrapPolicy: adapters share their block's unit
    found = findings(tmp_path, LOADING, full)
    assert set(found) == {"qlora-adapters-other-dtype"}  # peft's fp32 adapters over the bf16 base
    assert "autocast_adapter_dtype=False" in found["qlora-adapters-other-dtype"].fix
    same = LOADING.replace('"o_proj"]))', '"o_proj"]), autocast_adapter_dtype=False)')
    assert findings(tmp_path, same, full) == {}
    found = findings(tmp_path, same, full.replace("use_orig_params=True", "use_orig_params=False"))
    assert set(found) == {"qlora-without-use-orig-params"}


def test_trl_arguments_with_a_quantization_config(tmp_path, hf_snippet):
    """--emit hf-trainer's TrainingArguments and BitsAndBytesConfig, saved as TRL's SFTConfig saves them
    (model_init_kwargs: quantization_config = BitsAndBytesConfig.to_dict(), dtype): the storage read back; with
    bitsandbytes' uint8 default the finding; cpu_ram_efficient_loading counts as loading once."""
    import json

    from cost_models.specs import FsdpConfig, TrainingSpec
    from planner.emit.trainers import emit_hf_trainer
    from planner.hardware import make_cluster
    from planner.models import load_preset

    ns = hf_snippet(emit_hf_trainer(FsdpConfig(offload=True, ac_every=1), load_preset("llama3.1-70b"),
                                    make_cluster(2, gpu="rtx4090-24gb"), TrainingSpec(finetune="qlora")))
    data = ns["args"].to_dict()

    def checked(quantization: dict) -> dict:
        path = tmp_path / "sft_config.json"
        path.write_text(json.dumps({**data, "model_init_kwargs": {"quantization_config": quantization,
                                                                    "dtype": "bfloat16"}}))
        setup = read_setup(path)
        report = check(setup, "llama3.1-70b", 2, gpu="rtx4090-24gb")
        assert report.candidate.training.quantized and setup.qlora.rank0_loading  # cpu_ram_efficient_loading
        return {f.code for f in report.findings if f.code in QLORA_CODES}

    good = ns["bnb_config"].to_dict()
    assert good["bnb_4bit_quant_storage"] == "bfloat16"
    assert checked(good) == set()  # the emitted arguments set cpu_ram_efficient_loading: rank 0 loads
    assert checked({**good, "bnb_4bit_quant_storage": "uint8"}) == {"qlora-integer-quant-storage"}


def test_the_emitted_fsdp2_snippet_reads_back_as_the_qlora_plan(tmp_path):
    """`fsdp-plan ... --finetune qlora --emit fsdp2` then `fsdp-plan check` of that file: the CLI's finetune flag
    used to default to full and override the file's BitsAndBytesConfig (70B priced as full fine-tuning: CPU offload
    1,314 GiB per node), and the snippet's torch.device(device) stopped the reader. Now the file's qlora is priced:
    the same GPU peak as the plan's at the same micro-batch (the snippet writes it only in a comment)."""
    import json

    from tests.doctor.cli_run import run_cli as run

    args = ["--model", "llama3.1-70b", "--gpus", "2", "--gpu", "rtx4090-24gb"]
    path = tmp_path / "train.py"

    plan = json.loads(run([*args, "--finetune", "qlora", "--format", "json"]))["candidates"][0]
    path.write_text(run([*args, "--finetune", "qlora", "--emit", "fsdp2"]))
    checked = json.loads(run(["check", str(path), *args, "--micro-batch", str(plan["config"]["micro_batch"]),
                              "--format", "json"]))
    assert checked["training"]["finetune"] == "qlora" and checked["training"]["quant"] == "nf4"
    assert checked["memory"]["peak_reserved_bytes"] == plan["memory"]["peak_reserved_bytes"]
    assert not any(f["code"].startswith("qlora-") for f in checked["findings"])
