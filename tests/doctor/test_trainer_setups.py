"""check's readers of the trainers' dialects (issue 11): Hugging Face TrainingArguments files and torchtitan flags /
TOML job files follow the trainers' own defaults, and what they cannot price is one PlannerError naming the key."""

from pathlib import Path

import pytest

from planner.errors import PlannerError
from planner.doctor.readers import read_setup
from planner.doctor.readers.torchtitan import from_torchtitan, torchtitan_settings
from planner.doctor.readers.trainers import from_hf_trainer


# ---------------------------------------------------------------- reading TrainingArguments

def test_hf_legacy_strategy_string_and_fsdp_prefixes():
    s = from_hf_trainer({"fsdp": "full_shard auto_wrap offload", "bf16": True,
                         "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}})
    assert (s.fsdp_version, s.config.sharding.value, s.config.offload, s.config.precision.value) == \
        (2, "FULL_SHARD", True, "bf16")
    assert s.config.micro_batch == 8  # TrainingArguments' default per_device_train_batch_size
    v1 = from_hf_trainer({"fsdp": ["hybrid_shard"], "fsdp_config": {"fsdp_version": 1}})
    assert (v1.fsdp_version, v1.config.sharding.value, v1.config.backward_prefetch) == (1, "HYBRID_SHARD", False)
    # fsdp_config wins over the words (transformers' setdefault)
    assert from_hf_trainer({"fsdp": "full_shard", "fsdp_config": {"reshard_after_forward": False}}).config.sharding \
        .value == "SHARD_GRAD_OP"


def test_hf_own_checkpointing_every_n_layers_is_read_and_noted():
    # reentrant around FSDP1 units: the recompute re-gathers (tests/distributed/test_hf_checkpointing_gathers.py)
    s = from_hf_trainer({"fsdp": True, "fsdp_config": {"version": 1}, "gradient_checkpointing": True,
                         "gradient_checkpointing_kwargs": {"every_n_layers": 3, "use_reentrant": True}})
    assert s.config.ac_every == 3 and s.checkpoint_regathers and "all-gathered again" in s.notes[0]
    # transformers 5's default (non-reentrant), and FSDP2 whatever the checkpoint: nothing gathered again
    for data in ({"fsdp": True, "fsdp_config": {"version": 1}, "gradient_checkpointing": True},
                 {"fsdp": True, "activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": 1}}):
        quiet = from_hf_trainer(data)
        assert quiet.config.ac_every == 1 and not quiet.checkpoint_regathers and not quiet.notes
    # other checkpoint kwargs without use_reentrant: torch.utils.checkpoint's default, reentrant
    assert from_hf_trainer({"fsdp": True, "fsdp_config": {"version": 1}, "gradient_checkpointing": True,
                            "gradient_checkpointing_kwargs": {"preserve_rng_state": False}}).checkpoint_regathers
    assert from_hf_trainer({"fsdp": True, "fsdp_config": {"activation_checkpointing": "selective-op"}}).unexpressed \
        == ("selective-op",)


@pytest.mark.parametrize("data, field, words", [
    ({"fsdp": False, "bf16": True}, "fsdp", "FSDP is off"),
    ({"fsdp": "hybrid_shard"}, "fsdp", "FSDP1 only"),
    ({"fsdp": "full_shard sharded"}, "fsdp", "choose from: full_shard"),
    ({"fsdp": True, "fsdp_config": {"offload_params": True}}, "fsdp_config.offload_params", "known: version"),
    ({"fsdp": True, "bf16": True, "fp16": True}, "bf16", "choose one"),
    ({"fsdp": True, "per_device_train_batch_size": 0}, "per_device_train_batch_size", ">= 1"),
    ({"fsdp": True, "fsdp_config": {"version": 3}}, "fsdp_config.version", "1 or 2"),
    ({"fsdp": True, "fsdp_config": {"auto_wrap_policy": "LAYER"}}, "fsdp_config.auto_wrap_policy",
     "TRANSFORMER_BASED_WRAP"),
    ({"fsdp": True, "parallelism_config": {"dp_replicate_size": 2, "dp_shard_size": 1}},
     "parallelism_config.dp_shard_size", "DDP"),
    ({"fsdp": True, "fsdp_config": "fsdp.json"}, "fsdp_config", "inline"),
])
def test_hf_reader_errors_name_the_field(data, field, words):
    with pytest.raises(PlannerError, match=words) as err:
        from_hf_trainer(data)
    assert err.value.field == field


# ---------------------------------------------------------------- reading torchtitan flags and TOML

def test_torchtitan_defaults_are_torchtitans():
    s = from_torchtitan(torchtitan_settings("--training.seq_len 4096\n", Path("f.txt")))
    # shard degree -1 (the rest), selective every-2, local batch 8, bf16 params, fp32 reduction
    assert (s.config.sharding.value, s.config.ac_every, s.config.micro_batch, s.config.precision.value) == \
        ("FULL_SHARD", 2, 8, "bf16")
    assert (s.seq_len, s.n_processes, s.dialect, s.fsdp_version) == (4096, None, "torchtitan", 2)


def test_torchtitan_toml_job_file_with_the_0_1_spellings(tmp_path):
    path = tmp_path / "llama3_8b.toml"
    path.write_text("[job]\ndump_folder = './outputs'\n[model]\nconverters = ['float8']\n"
                    "[training]\nlocal_batch_size = 1\nglobal_batch_size = 64\ncompile = true\n"
                    "[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 8\n"
                    "[activation_checkpoint]\nmode = 'full'\n[float8]\nenable_fsdp_float8_all_gather = true\n")
    s = read_setup(path)
    c = s.config
    assert (c.sharding.value, c.ac_every, c.micro_batch, c.grad_accum) == ("HYBRID_SHARD", 1, 1, 4)  # 64 / (1 x 16)
    assert (c.compile, c.float8, c.fp8_all_gather, s.n_processes, s.n_machines, c.shard_group_gpus) == (
        True, True, True, 16, None, 8)  # the shard group as written; the node size is check's --gpus-per-node


def test_torchtitan_flag_forms(tmp_path):
    settings = torchtitan_settings("# overrides\n--compile.no-enable --training.enable_cpu_offload \\\n"
                                   "--activation_checkpoint.selective_ac_option op --parallelism.data_parallel_shard_degree=1"
                                   " --parallelism.data_parallel_replicate_degree=16\n", tmp_path / "flags")
    s = from_torchtitan(settings)
    assert (s.config.compile, s.config.offload, s.config.selective_op_ac, s.config.sharding.value) == \
        (False, True, True, "NO_SHARD")
    assert torchtitan_settings('{"sharding_strategy": "FULL_SHARD"}', tmp_path / "k.json") is None  # JSON: not flags
    assert torchtitan_settings("---\nsharding_strategy: FULL_SHARD\n", tmp_path / "k.yaml") is None  # YAML start


@pytest.mark.parametrize("text, field, words", [
    ("--parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_schedule=LoopedBFS",
     "parallelism.pipeline_parallel_schedule", "not priced by fsdp-plan; choose one of: GPipe, 1F1B"),
    ("--module llama3 activation-checkpoint:memory-budget", "activation-checkpoint", "not priced"),
    ("--activation_checkpoint.mode=memory_budget", "activation_checkpoint.mode", "not priced"),
    ("--training.mixed_precision_param=float16", "training.mixed_precision_param", "bfloat16, float32"),
    ("--training.global_batch_size=64", "training.global_batch_size", "data_parallel_shard_degree >= 1"),
    ("--parallelism.data_parallel_shard_degree=8 --training.local_batch_size=3 --training.global_batch_size=64",
     "training.global_batch_size", "not a multiple"),
    ("--activation_checkpoint.selective_ac_option=half", "activation_checkpoint.selective_ac_option", "op or an"),
    ("--training.seq_len=4096 seq_len", "config", "not a torchtitan --section.option flag"),
    ("--model.converters=mx", "model.converters", "MX"),
])
def test_torchtitan_reader_errors_name_the_field(tmp_path, text, field, words):
    with pytest.raises(PlannerError, match=words) as err:
        from_torchtitan(torchtitan_settings(text, tmp_path / "flags"))
    assert err.value.field == field
