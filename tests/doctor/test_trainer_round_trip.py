"""What is emitted is what was priced (issue 26 item 3): for each trainer, the search's pick is emitted as that
trainer's file, built or parsed by the trainer's own tool where it has one (transformers' TrainingArguments,
accelerate's config loader), read back by `fsdp-plan check`, and priced again: the same trainer, and the JSON
`config`, `memory` and `time` equal to the plan's. The attention too (planner/emit/attention.py): a flex plan of
gpt-oss-20b (transformers' default for it is eager) and a pinned eager plan of a llama read back as planned."""

from __future__ import annotations

import functools
import json

import pytest

from cost_models.fsdp1_adapters import AdapterUnits
from planner import estimate, plan
from planner.doctor import check
from planner.doctor.readers import read_setup
from planner.emit import emit_artifact
from tests.doctor.test_roundtrip import hf_arguments_file

MODEL, GPUS, GPU, SEQ = "llama3-8b", 16, "h100-80gb", 4096


@functools.cache
def picked(trainer: str, gpu: str = GPU, model: str = MODEL, attention: str | None = None):
    """The trainer's best plan: two nodes (HYBRID strategies and resharding to the node are in the space)."""
    return plan(model, gpus=GPUS, gpu=gpu, seq_len=SEQ, trainer=trainer, attention=attention).best


def written(artifact: str, text: str, tmp_path, hf_snippet, load_accelerate):
    """The artifact as the file a user keeps: HF's TrainingArguments built by transformers and saved as JSON, with
    the snippet's model_init_kwargs beside them as TRL's SFTConfig saves them; accelerate's YAML loaded by
    accelerate itself first; torchtitan's override flags as written."""
    if artifact.startswith("hf-trainer"):
        namespace = hf_snippet(text)
        path = hf_arguments_file(namespace["args"], tmp_path / "args.json")
        data = {**json.loads(path.read_text()), "model_init_kwargs": namespace["model_init_kwargs"]}
        path.write_text(json.dumps(data))
        return path
    if artifact.startswith("accelerate"):
        load_accelerate(tmp_path, text, ["--main_process_ip", "10.0.0.1"])  # accelerate accepts it
        path = tmp_path / "accelerate.yaml"
    elif artifact in ("fsdp2", "fsdp1", "lightning"):  # code: read with ast (planner/doctor/readers/python_code.py)
        compile(text, "train.py", "exec")  # Python's own parser takes it
        path = tmp_path / "train.py"
    else:
        path = tmp_path / "overrides.txt"
    path.write_text(text)
    return path


@pytest.mark.parametrize("trainer, artifact, gpu", [
    ("hf", "hf-trainer", GPU), ("hf-fsdp1", "hf-trainer-fsdp1", GPU),
    # accelerate's launcher refuses an fp8 config where torchao is not installed (here): planned on A100s, no FP8
    ("accelerate-fsdp2", "accelerate-fsdp2", "a100-80gb"), ("accelerate", "accelerate", "a100-80gb"),
    ("torchtitan", "torchtitan", GPU), ("torchtitan-0.2", "torchtitan-0.2", GPU),
    ("fsdp2", "fsdp2", GPU), ("fsdp1", "fsdp1", GPU), ("lightning", "lightning", GPU),
])
def test_the_emitted_file_reads_back_as_the_plan_that_was_priced(tmp_path, hf_snippet, load_accelerate,
                                                                  trainer, artifact, gpu):
    assert_read_back(picked(trainer, gpu), trainer, artifact, gpu, tmp_path, hf_snippet, load_accelerate)


def assert_read_back(best, trainer, artifact, gpu, tmp_path, hf_snippet, load_accelerate, model=MODEL, gpus=GPUS):
    path = written(artifact, emit_artifact(artifact, best), tmp_path, hf_snippet, load_accelerate)
    config = best.config  # accelerate's YAML holds no batch: the micro-batch is the training script's
    r = check(read_setup(path), model, gpus, gpu=gpu, seq_len=SEQ, micro_batch=config.micro_batch,
              grad_accum=config.grad_accum)
    back, priced = r.candidate.to_dict(), best.to_dict()
    assert back["trainer"] == priced["trainer"] == trainer
    assert back["config"] == priced["config"]
    assert back["memory"] == priced["memory"]
    assert back["time"] == priced["time"]
    return r


@pytest.mark.parametrize("trainer, artifact, gpus, group", [
    ("fsdp2", "fsdp2", 32, 16), ("torchtitan", "torchtitan", 32, 16), ("hf", "hf-trainer", 32, 16),
    ("fsdp1", "fsdp1", 8, 2),
])
def test_an_hsdp_shard_group_reads_back(tmp_path, hf_snippet, load_accelerate, trainer, artifact, gpus, group):
    """HSDP over shard groups other than the node (8 GPUs): two nodes' 16 GPUs (mesh (2, 16)), or 2 GPUs of one
    node (mesh (4, 2)), written as init_device_mesh / FSDP1's device_mesh / data_parallel_shard_degree /
    ParallelismConfig's dp_shard_size and priced again as the same shard group, not as nodes of the group's size."""
    best = estimate(MODEL, gpus, gpu=GPU, seq_len=SEQ, trainer=trainer, sharding="HYBRID_SHARD",
                    shard_group_gpus=group)
    assert best.config.dp_degrees(gpus, 8) == (gpus // group, group)
    r = assert_read_back(best, trainer, artifact, GPU, tmp_path, hf_snippet, load_accelerate, gpus=gpus)
    assert (r.candidate.config.shard_group_gpus, r.candidate.cluster.gpus_per_node) == (group, 8)


# The dialects that write the attention (planner/emit/attention.py): code (fsdp2, fsdp1, lightning), model_init_kwargs
# (hf-trainer), a comment accelerate ignores (accelerate: check says so). accelerate on A100s: no FP8, as above.
ATTENTION_DIALECTS = [("hf", "hf-trainer", GPU), ("hf-fsdp1", "hf-trainer-fsdp1", GPU),
                      ("accelerate-fsdp2", "accelerate-fsdp2", "a100-80gb"), ("accelerate", "accelerate", "a100-80gb"),
                      ("fsdp2", "fsdp2", GPU), ("fsdp1", "fsdp1", GPU), ("lightning", "lightning", GPU)]


@pytest.mark.parametrize("model, attention", [("gpt-oss-20b", None), (MODEL, "eager")])
@pytest.mark.parametrize("trainer, artifact, gpu", ATTENTION_DIALECTS)
def test_the_planned_attention_reads_back(tmp_path, hf_snippet, load_accelerate, model, attention, trainer,
                                          artifact, gpu):
    """gpt-oss-20b's first choice is flex (transformers' default for it, eager, has s x s scores); llama's eager
    pinned. Only accelerate's comment draws a finding: the training script must apply it."""
    best = picked(trainer, gpu, model, attention)
    assert best.config.attention.value == (attention or "flex")
    r = assert_read_back(best, trainer, artifact, gpu, tmp_path, hf_snippet, load_accelerate, model)
    assert r.setup.attention_from == ("comment" if artifact.startswith("accelerate") else "code")
    said = [f.code for f in r.findings if f.code.startswith("attention-")]
    assert said == (["attention-only-in-a-comment"] if artifact.startswith("accelerate") else [])


@pytest.mark.parametrize("trainer, artifact", [("hf", "hf-trainer"), ("fsdp2", "fsdp2")])
def test_flash_attention_3_pinned_reads_back(tmp_path, hf_snippet, load_accelerate, trainer, artifact):
    """--attention-kernel fa3 (Hopper) on transformers' models: the file asks transformers for "flash_attention_3"
    and reads back as sdpa attention on the fa3 kernel, priced the same (a 1.73x attention speed over flash2,
    cost_models/attention_kernels.py: the plan's step is faster than the default's)."""
    best = plan(MODEL, gpus=GPUS, gpu=GPU, seq_len=SEQ, trainer=trainer, attention_kernel="fa3").best
    assert (best.config.attention.value, best.config.attention_kernel.value) == ("sdpa", "fa3")
    text = emit_artifact(artifact, best)
    assert '"flash_attention_3"' in text
    assert_read_back(best, trainer, artifact, GPU, tmp_path, hf_snippet, load_accelerate)
    default = picked(trainer)
    assert default.config.attention_kernel.value == "flash2"
    assert best.time.attention_s < default.time.attention_s * best.config.micro_batch / default.config.micro_batch


@pytest.mark.parametrize("trainer, artifact, gpu, units", [
    ("fsdp1", "fsdp1", GPU, AdapterUnits.CAST), ("hf-fsdp1", "hf-trainer-fsdp1", GPU, AdapterUnits.AUTOCAST),
    ("accelerate", "accelerate", "a100-80gb", AdapterUnits.AUTOCAST)])
def test_an_fsdp1_lora_plan_reads_back_with_its_adapter_units(tmp_path, hf_snippet, load_accelerate, trainer, artifact,
                                                              gpu, units):
    """--emit fsdp1 of a LoRA plan wraps each adapter as a unit casting its inputs (CustomPolicy(lora_unit)); HF
    Trainer and accelerate wrap them as units too (peft's fsdp_auto_wrap_policy), under autocast. The plan prices
    them (cost_models/fsdp1_adapters.py: llama3-8b on 16 H100 at micro-batch 4 under fsdp1, 66.8 GiB allocated
    at block 31's backward; 67.6 at the loss backward while Liger's loss was priced with a head gradient the frozen
    head does not make, 793914a); check reads the file and prices the same."""
    best = plan(MODEL, gpus=GPUS, gpu=gpu, seq_len=SEQ, trainer=trainer, finetune="lora").best
    path = written(artifact, emit_artifact(artifact, best), tmp_path, hf_snippet, load_accelerate)
    r = check(read_setup(path), MODEL, GPUS, gpu=gpu, seq_len=SEQ, micro_batch=best.config.micro_batch,
              grad_accum=best.config.grad_accum, finetune="lora")
    assert r.setup.adapter_units is units and r.candidate.to_dict() == best.to_dict()
    if trainer == "fsdp1":
        assert best.memory.peak_allocated_bytes == pytest.approx(66.8 * 2**30, rel=2e-3)
