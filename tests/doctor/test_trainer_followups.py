"""Follow-ups of the trainer dialects (issue 11) in `fsdp-plan check`: the config argument's help names every
format read_setup reads; the sequence length a torchtitan job gives is the one checked unless --seq-len says
otherwise; TrainingArguments' reentrant checkpointing around FSDP1 units (a re-gather per block) is a finding;
the selective-op finding speaks the setup's own dialect, and torchtitan (which can express it) gets none."""

import json
from pathlib import Path

from planner.doctor import check
from planner.doctor.readers import read_setup
from planner.doctor.readers.torchtitan import from_torchtitan, torchtitan_settings
from planner.doctor.readers.trainers import from_hf_trainer
from tests.cli.test_check_inputs import invoke


def findings(setup, model="llama3-8b", gpus=16, **kw):
    return {f.code: f for f in check(setup, model, gpus, gpu="h100-80gb", **kw).findings}


def test_check_help_names_every_format(capsys):
    code, out, _ = invoke(["check", "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0
    for words in ("accelerate config", "FSDP1", "fully_shard", "TrainingArguments", "torchtitan", ".toml",
                  "--section.option"):
        assert words in text, words


def test_torchtitan_seq_len_is_checked_unless_the_flag_says_otherwise(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text("[training]\nseq_len = 8192\nlocal_batch_size = 1\n"
                   "[parallelism]\ndata_parallel_shard_degree = 8\n[activation_checkpoint]\nmode = 'none'\n")
    setup = read_setup(job)
    assert check(setup, "gpt-125m").candidate.training.seq_len == 8192   # gpus: the file's shard degree
    assert check(setup, "gpt-125m", seq_len=1024).candidate.training.seq_len == 1024

    def peak(*flags):
        code, out, err = invoke(["check", str(job), "--model", "gpt-125m", "--format", "json", *flags], capsys)
        assert code in (0, 1), err
        return json.loads(out)["memory"]["peak_allocated_bytes"]

    from_file = peak()
    assert from_file == peak("--seq-len", "8192") > peak("--seq-len", "2048") > peak("--seq-len", "1024")
    # a file that gives none: 2048, torchtitan's own default and the CLI's
    job.write_text(job.read_text().replace("seq_len = 8192\n", ""))
    assert peak() == peak("--seq-len", "2048")


HF_FSDP1 = {"fsdp": True, "bf16": True, "per_device_train_batch_size": 1, "fsdp_config": {"version": 1},
            "gradient_checkpointing": True}


def test_reentrant_trainer_checkpointing_around_fsdp1_units_is_a_warning():
    reentrant = {**HF_FSDP1, "gradient_checkpointing_kwargs": {"use_reentrant": True, "every_n_layers": 2}}
    f = findings(from_hf_trainer(reentrant))["checkpointing-outside-fsdp-units"]
    assert f.severity == "warning" and "third time" in f.message and "16 blocks" in f.message  # 32 layers / 2
    assert "use_reentrant: false" in f.fix and "not every 2th" in f.fix
    # non-reentrant (transformers 5's default), FSDP2, or params kept gathered after forward: no re-gather
    for data in (HF_FSDP1, {**reentrant, "fsdp_config": {"version": 2}},
                 {**reentrant, "fsdp_config": {"version": 1, "reshard_after_forward": "shard_grad_op"}}):
        assert "checkpointing-outside-fsdp-units" not in findings(from_hf_trainer(data))


def test_selective_op_finding_names_the_dialect():
    hf = from_hf_trainer({"fsdp": True, "bf16": True, "per_device_train_batch_size": 1,
                          "fsdp_config": {"activation_checkpointing": "selective-op"}})
    f = findings(hf)["selective-op-not-expressible"]
    assert f.severity == "error" and f.message.startswith("Hugging Face TrainingArguments cannot express")
    assert "accelerate" not in f.message and "torchtitan" in f.fix
    # torchtitan says it: selective, option op
    tt = from_torchtitan(torchtitan_settings("--activation_checkpoint.mode selective "
                                             "--activation_checkpoint.selective_ac_option op "
                                             "--parallelism.data_parallel_shard_degree 16 "
                                             "--training.local_batch_size 1\n", Path("o.txt")))
    assert tt.config.selective_op_ac and not tt.unexpressed
    assert "selective-op-not-expressible" not in findings(tt)
