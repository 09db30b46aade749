"""The trainers' dialects (issue 11): --emit hf-trainer builds real transformers TrainingArguments whose resolved
FSDP settings are the plan's; --emit torchtitan-0.2 writes torchtitan 0.2's override flags (checked by hand against
torchtitan 0.2.0 and 0.2.2's own JobConfig parser; 0.3's, parsed by torchtitan 0.3.0 itself:
tests/unit/test_emit_mesh.py); --emit pytorchjob is a Kubeflow manifest running the
torchrun line. Reading them back: test_trainer_setups.py and test_roundtrip.py."""

import os
from unittest import mock

import pytest
import yaml

from cost_models.specs import FsdpConfig, TrainingSpec
from planner import plan
from planner.emit import ARTIFACTS, emit_artifact, emit_torchrun
from planner.emit.launchers import emit_pytorchjob
from planner.emit.torchtitan.job import emit_torchtitan
from planner.emit.trainers import emit_hf_trainer
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import load_preset

SPEC = load_preset("llama3-8b")
ONE_NODE = make_cluster(8)
TWO_NODES = make_cluster(16, gpus_per_node=8)


def flags_of(text: str) -> dict:
    """The flags a shell passes after `$(grep -v '^#' FILE)`: every line that is not a comment."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(" " not in line for line in lines), lines
    flags, subcommands = lines, []
    if lines and not lines[-1].startswith("--"):  # torchtitan 0.3's activation-checkpoint:X, after every flag
        flags, subcommands = lines[:-1], [lines[-1].partition(":")[::2]]
    assert all(line.startswith("--") for line in flags), lines
    return dict([line[2:].partition("=")[::2] for line in flags] + subcommands)


# ---------------------------------------------------------------- --emit hf-trainer

# (config, cluster, fsdp_config version asked for) and what accelerate's plugin must resolve: reshard_after_forward
# (FSDP2: bool; FSDP1: the strategy), the HSDP mesh (replicas, shard) or None
HF_CASES = [
    (FsdpConfig(micro_batch=2, grad_accum=4, ac_every=1), ONE_NODE, 2, True, None),
    (FsdpConfig(sharding="SHARD_GRAD_OP", offload=True, compile=True), ONE_NODE, 2, False, None),
    (FsdpConfig(sharding="HYBRID_SHARD", micro_batch=4), TWO_NODES, 2, True, (2, 8)),
    (FsdpConfig(sharding="HYBRID_SHARD_ZERO2", precision="fp16"), TWO_NODES, 1, "_HYBRID_SHARD_ZERO2", None),
    (FsdpConfig(sharding="NO_SHARD", precision="fp32", backward_prefetch=False), TWO_NODES, 2, "NO_SHARD", None),
]


@pytest.mark.parametrize("config, cluster, version, reshard, mesh", HF_CASES)
def test_hf_trainer_snippet_builds_training_arguments_with_the_plan(training_arguments, config, cluster, version,
                                                                    reshard, mesh):
    from accelerate.utils import FullyShardedDataParallelPlugin

    text = emit_hf_trainer(config, SPEC, cluster, fsdp_version=version)
    assert "fsdp=True," in text and 'fsdp="' not in text  # transformers 5's form, not the strategy string
    args = training_arguments(text)
    expected_version = 1 if config.sharding.value == "NO_SHARD" else version  # accelerate's FSDP2 has no NO_SHARD
    assert args.fsdp is True and args.fsdp_config["version"] == expected_version
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (config.micro_batch,
                                                                                   config.grad_accum)
    assert (args.bf16, args.fp16) == (config.precision.value == "bf16", config.precision.value == "fp16")
    assert args.activation_checkpointing is False  # HF's own would all-gather each block again in backward
    assert args.torch_compile is config.compile
    plugin_args = args.fsdp_plugin_args
    assert plugin_args.get("cpu_offload", False) is config.offload
    assert plugin_args["activation_checkpointing"] is config.checkpoints
    assert plugin_args["cpu_ram_efficient_loading"] is True
    sizes = args.parallelism_config and (args.parallelism_config.dp_replicate_size,
                                         args.parallelism_config.dp_shard_size)
    assert sizes == mesh
    # accelerate's own plugin from these arguments (as Trainer builds it): the strategy and the fp32 reduction
    env = {"FSDP_SYNC_MODULE_STATES": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}
    with mock.patch.dict(os.environ, env):  # sync_module_states / rank-0 loading need a process group to build
        plugin = FullyShardedDataParallelPlugin(**{**plugin_args, "sync_module_states": False,
                                                   "cpu_ram_efficient_loading": False})
    resolved = plugin.reshard_after_forward
    assert (resolved if isinstance(resolved, bool) else resolved.name) == reshard
    if expected_version == 1:
        assert plugin.backward_prefetch is None if not config.backward_prefetch else \
            plugin.backward_prefetch.name == "BACKWARD_PRE"
    if config.precision.mixed:
        import torch
        assert plugin.mixed_precision_policy.reduce_dtype is torch.float32  # accelerate alone: the compute dtype
    else:
        assert "mixed_precision_policy" not in plugin_args


def test_hf_trainer_compiled_loss_is_the_models_own_loss(hf_snippet):
    # With compile the plan counts the loss fused; the snippet's compute_loss_func computes it outside the model
    # (Trainer then calls the model without labels). Its value equals the model's own loss, per token (mean) and
    # as Trainer's gradient-accumulation form (sum / num_items_in_batch).
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ns = hf_snippet(emit_hf_trainer(FsdpConfig(compile=True), SPEC, ONE_NODE))
    assert "compute_loss_func" not in hf_snippet(emit_hf_trainer(FsdpConfig(compile=True, compile_loss=False), SPEC,
                                                                 ONE_NODE))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=500))
    ids = torch.randint(0, 500, (2, 33))
    ids[1, :5] = -100  # ignored labels count as HF counts them
    inputs = ids.clamp(min=0)
    own = model(inputs, labels=ids).loss
    loss_sum = ns["causal_lm_loss_sum"]._torchdynamo_orig_callable  # the compiled function's source (compile itself:
    ns["causal_lm_loss_sum"] = loss_sum                              # tests/unit/test_loss_memory.py)
    ours = ns["compute_loss_func"](model(inputs), ids)
    assert ours.item() == pytest.approx(own.item(), rel=1e-5)
    items = (ids[:, 1:] != -100).sum()
    assert ns["compute_loss_func"](model(inputs), ids, num_items_in_batch=2 * items).item() == pytest.approx(
        own.item() / 2, rel=1e-5)


def test_hf_trainer_says_what_it_cannot_set():
    text = emit_hf_trainer(FsdpConfig(ac_every="selective-op", float8=True, fp8_all_gather=True,
                                      reshard_after_forward=8, forward_prefetch=True), SPEC, TWO_NODES)
    assert "# use_cpu=True," in text  # bf16 needs it only to construct on a machine without a GPU
    assert "gradient_checkpointing) would add an all-gather in backward" in text
    assert "whole blocks, every block (the plan: selective-op)" in text
    assert "convert_to_float8_training" in text and "enable_fsdp_float8_all_gather=True" in text
    assert "int reshard_after_forward" in text and "forward_prefetch=True have no FSDP2 form" in text
    launch = [line for line in text.splitlines() if line.startswith("# launch")][0]
    assert launch.endswith(emit_torchrun(FsdpConfig(), SPEC, TWO_NODES).splitlines()[-1])
    compiled = emit_hf_trainer(FsdpConfig(compile=True), SPEC, ONE_NODE)
    assert "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=true torchrun --standalone" in compiled


# ---------------------------------------------------------------- --emit torchtitan

def test_torchtitan_overrides_for_hsdp_with_every_2_checkpointing():
    config = FsdpConfig(sharding="HYBRID_SHARD_ZERO2", ac_every=2, micro_batch=2, grad_accum=4, offload=True)
    text = emit_torchtitan(config, SPEC, TWO_NODES, TrainingSpec(seq_len=8192), version="0.2")
    assert "torchtitan 0.2 (0.2.0 - 0.2.2) JobConfig names" in text
    assert flags_of(text) == {
        "parallelism.data_parallel_replicate_degree": "2", "parallelism.data_parallel_shard_degree": "8",
        "parallelism.fsdp_reshard_after_forward": "never", "parallelism.tensor_parallel_degree": "1",
        "parallelism.context_parallel_degree": "1", "parallelism.expert_parallel_degree": "1",
        "parallelism.pipeline_parallel_degree": "1",
        "training.local_batch_size": "2", "training.global_batch_size": str(2 * 16 * 4), "training.seq_len": "8192",
        "training.mixed_precision_param": "bfloat16", "training.mixed_precision_reduce": "float32",
        "training.enable_cpu_offload": "", "optimizer.name": "AdamW", "optimizer.implementation": "foreach",
        # checkpoints as the trainer is priced: each rank's shard with DCP, synchronously (0.2.2's [checkpoint])
        "checkpoint.enable": "", "checkpoint.folder": "checkpoint", "checkpoint.interval": "500",
        "checkpoint.async_mode": "disabled",
        "activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "2",
        "compile.no-enable": "",
    }


def test_torchtitan_float8_selective_op_and_what_it_cannot_say():
    config = FsdpConfig(ac_every="selective-op", compile=True, float8=True, fp8_all_gather=True,
                        reshard_after_forward=8, reduce_dtype="bf16")
    text = emit_torchtitan(config, SPEC, TWO_NODES, version="0.2")
    flags = flags_of(text)
    assert flags["activation_checkpoint.selective_ac_option"] == "op" and "compile.enable" in flags
    assert flags["model.converters"] == "quantize.linear.float8"
    assert "quantize.linear.float8.enable_fsdp_float8_all_gather" in flags
    assert flags["quantize.linear.float8.filter_fqns"] == "output"  # the head stays bf16, as planned
    assert "fsdp_reshard_after_forward (default | always | never) cannot say" in text
    assert "torchtitan reduces in float32" in text
    assert flags_of(emit_torchtitan(FsdpConfig(precision="bf16-pure"), SPEC, ONE_NODE, version="0.2"))[
        "training.dtype"] == "bfloat16"


def test_torchtitan_refuses_fp16_and_lora_in_one_line():
    with pytest.raises(PlannerError, match="torchtitan has no fp16") as err:
        emit_torchtitan(FsdpConfig(precision="fp16"), SPEC, ONE_NODE)
    assert len(str(err.value).splitlines()) == 1 and err.value.field == "emit"
    with pytest.raises(PlannerError, match="no LoRA"):
        emit_torchtitan(FsdpConfig(), SPEC, ONE_NODE, TrainingSpec(finetune="lora"))


# ---------------------------------------------------------------- --emit pytorchjob

def test_pytorchjob_manifest_runs_the_torchrun_line_on_every_node():
    job = yaml.safe_load(emit_pytorchjob(FsdpConfig(), SPEC, make_cluster(32, gpus_per_node=8)))
    assert (job["apiVersion"], job["kind"], job["spec"]["nprocPerNode"]) == ("kubeflow.org/v1", "PyTorchJob", "8")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {role: spec["replicas"] for role, spec in replicas.items()} == {"Master": 1, "Worker": 3}
    torchrun = emit_torchrun(FsdpConfig(), SPEC, make_cluster(32, gpus_per_node=8)).splitlines()[-1]
    for spec in replicas.values():
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the operator injects MASTER_ADDR into this container
        # Kubernetes' $(VAR) instead of the shell's $VAR: the rest is emit_torchrun's line
        assert " ".join(container["command"]) == torchrun.replace("$MASTER_ADDR", "$(MASTER_ADDR)")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 29500}]  # MASTER_PORT = 29500
    single = yaml.safe_load(emit_pytorchjob(FsdpConfig(), SPEC, ONE_NODE))["spec"]["pytorchReplicaSpecs"]
    assert list(single) == ["Master"]
    assert single["Master"]["template"]["spec"]["containers"][0]["command"][:2] == ["torchrun", "--standalone"]


def test_pytorchjob_name_is_a_kubernetes_name():
    from dataclasses import replace

    job = yaml.safe_load(emit_pytorchjob(FsdpConfig(), replace(SPEC, name="Org/Model_v2.5"), ONE_NODE))
    assert job["metadata"]["name"] == "fsdp-org-model-v2-5"


def test_every_artifact_emits_for_a_planned_candidate():
    best = plan("llama3-8b", gpus=16, seq_len=4096).best
    for kind in ("hf-trainer", "hf-trainer-fsdp1", "torchtitan", "pytorchjob"):
        assert kind in ARTIFACTS and "FSDP plan for llama3-8b" in emit_artifact(kind, best)
    with pytest.raises(ValueError, match="choose one of"):
        emit_artifact("deepspeed", best)


def test_cli_emits_the_trainers_dialects(capsys):
    from planner.cli import main

    def run(*argv):
        try:
            main(list(argv))
            code = 0
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = run("--model", "llama3-8b", "--gpus", "16", "--emit", "pytorchjob")
    assert code == 0 and yaml.safe_load(out)["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    code, out, _ = run("--model", "llama3-8b", "--gpus", "16", "--emit", "torchtitan")
    assert code == 0 and flags_of(out)["parallelism.data_parallel_shard_degree"] in ("16", "8")
    # torchtitan has no fp16: on a V100 (no bf16) its plan is fp32, and fp16 pinned is refused in one line
    code, out, _ = run("--model", "gpt-1.3b", "--gpus", "8", "--gpu", "v100-32gb", "--emit", "torchtitan")
    assert code == 0 and flags_of(out)["training.mixed_precision_param"] == "float32"
    code, out, err = run("--model", "gpt-1.3b", "--gpus", "8", "--gpu", "v100-32gb", "--precision", "fp16",
                         "--emit", "torchtitan")
    assert code == 2 and out == "" and err.strip() == (
        "error: precision: torchtitan 0.3 runs fp32, bf16, bf16-pure; choose one of them")
