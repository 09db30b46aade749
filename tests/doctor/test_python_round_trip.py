"""The planner's Python artifacts read back (planner/doctor/readers/python_code.py, with `ast`, never run): each
explicit FsdpConfig emitted as --emit fsdp2 / fsdp1 / lightning code (folded as the CLI prints it) reads back as the
FsdpConfig it was written from, field by field; what a form cannot say reads as what that form runs (Lightning
checkpoints every block), and what no snippet says (the micro-batch and accumulation of a loop without a
pipeline: the training script's) reads as 1, for --micro-batch / --grad-accum to set. A construct the reader does
not know is one PlannerError line naming it."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.feasibility import node_shard_group
from cost_models.specs import FsdpConfig, TrainingSpec
from planner.doctor.readers import read_setup
from planner.emit import emit_fsdp1, emit_fsdp2, emit_lightning
from planner.emit.format import fold
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import load_preset

LLAMA, MOE = load_preset("llama3-8b"), load_preset("mixtral-8x7b")
CLUSTER = make_cluster(16, gpus_per_node=8)
TRAINING = TrainingSpec(seq_len=4096)
SNIPPET = fold(emit_fsdp2(FsdpConfig(ac_every=1), LLAMA, CLUSTER, TRAINING))  # edited below into others' forms


def written(emit, config, tmp_path, spec=LLAMA, training=TRAINING, name="train.py"):
    path = tmp_path / name
    path.write_text(fold(emit(config, spec, CLUSTER, training)))
    return read_setup(path)


def assert_same(back: FsdpConfig, emitted: FsdpConfig) -> None:
    back = node_shard_group(back, CLUSTER)  # the mesh's shard group in GPUs, a node's as check reads it
    diff = {f.name: (getattr(back, f.name), getattr(emitted, f.name)) for f in dataclasses.fields(FsdpConfig)
            if getattr(back, f.name) != getattr(emitted, f.name)}
    assert not diff, "read back != emitted, field: (read, emitted): " + "; ".join(f"{k}: {v}" for k, v in diff.items())


def outside_the_loop(config: FsdpConfig) -> FsdpConfig:
    """Without a pipeline the snippet's micro-batch and accumulation are the loop's: read as 1."""
    return config if config.pp > 1 else dataclasses.replace(config, micro_batch=1, grad_accum=1)


FSDP2 = {
    "hsdp": FsdpConfig(sharding="HYBRID_SHARD", micro_batch=2),
    "hsdp-zero2-offload-fp16": FsdpConfig(sharding="HYBRID_SHARD_ZERO2", offload=True, precision="fp16"),
    "no-shard-bf16-pure": FsdpConfig(sharding="NO_SHARD", precision="bf16-pure", grad_accum=4),
    "zero2-reduce-bf16": FsdpConfig(sharding="SHARD_GRAD_OP", reduce_dtype="bf16"),
    "fp32-reduce-bf16": FsdpConfig(precision="fp32", reduce_dtype="bf16"),
    "every-3-compile-with-loss": FsdpConfig(ac_every=3, compile=True, compile_loss=True),
    "compile-blocks-only": FsdpConfig(ac_every=1, compile=True, compile_loss=False),
    "selective-float8-fp8-gather-int-reshard": FsdpConfig(ac_every="selective-op", float8=True, fp8_all_gather=True,
                                                          reshard_after_forward=4),
    "float8-bf16-gather": FsdpConfig(float8=True, fp8_all_gather=False),
    "tp-sequence-parallel": FsdpConfig(tp=2, ac_every=1, compile=True),
    "tp-without-sequence-parallel": FsdpConfig(tp=2, sequence_parallel=False),
    "async-tp": FsdpConfig(tp=4, compile=True, async_tp=True),
    "cp-hsdp": FsdpConfig(cp=2, sharding="HYBRID_SHARD"),
    "hsdp-shard-group-of-4": FsdpConfig(sharding="HYBRID_SHARD", shard_group_gpus=4),
    "tp-hsdp-shard-group-of-4": FsdpConfig(sharding="HYBRID_SHARD_ZERO2", tp=2, shard_group_gpus=4),
    "tp-cp": FsdpConfig(tp=2, cp=2, ac_every=2),
    "pp-1f1b-tp-sp": FsdpConfig(pp=2, tp=2, micro_batch=2, grad_accum=4),
    "pp-interleaved-tp": FsdpConfig(pp=2, tp=2, sequence_parallel=False, pp_schedule="interleaved-1f1b", grad_accum=8),
    "pp-gpipe-checkpointed": FsdpConfig(pp=4, pp_schedule="gpipe", grad_accum=8, ac_every=1),
    "pp-dualpipev": FsdpConfig(pp=2, pp_schedule="dualpipev", grad_accum=8),
    "liger-kernels": FsdpConfig(norm_kernel="liger", rope_kernel="liger", swiglu_kernel="liger", loss_kernel="liger"),
    "liger-norm-swiglu-pp": FsdpConfig(norm_kernel="liger", swiglu_kernel="liger", pp=2, tp=2, grad_accum=4),
}
OTHER_MODELS = {
    "ep": (MOE, FsdpConfig(ep=2, ac_every=1)),
    "ep-hsdp-cp": (MOE, FsdpConfig(sharding="HYBRID_SHARD", cp=2, ep=4)),
    "expert-units": (MOE, FsdpConfig(expert_units=True)),
    "expert-units-dim-1": (MOE, FsdpConfig(expert_units=True, expert_shard_dim=1)),
    "pp-tied-embeddings": (load_preset("llama3.2-1b"), FsdpConfig(pp=2, tp=2, grad_accum=4)),
}


@pytest.mark.parametrize("name", FSDP2)
def test_fsdp2_code_reads_back_as_the_config_it_was_emitted_from(tmp_path, name):
    config = FSDP2[name]
    back = written(emit_fsdp2, config, tmp_path)
    assert back.dialect == "fsdp2-code" and back.fsdp_version == 2 and back.wrap == "block"
    assert_same(back.config, outside_the_loop(config))
    if config.model_parallel > 1:  # MESH_SHAPE: the ranks are the snippet's
        assert back.n_processes == 16
    if config.pp > 1:
        assert back.seq_len == 4096


@pytest.mark.parametrize("name", OTHER_MODELS)
def test_fsdp2_moe_and_tied_code_reads_back(tmp_path, name):
    spec, config = OTHER_MODELS[name]
    assert_same(written(emit_fsdp2, config, tmp_path, spec=spec).config, outside_the_loop(config))


LIGER_LINE = "    apply_liger_kernel_to_llama({})  # Liger Kernel's patches, before wrapping\n"


@pytest.mark.parametrize("switches, kernels", [
    ("", dict(norm_kernel="liger", rope_kernel="liger", swiglu_kernel="liger", loss_kernel="liger")),
    ("rope=False, fused_linear_cross_entropy=False", dict(norm_kernel="liger", swiglu_kernel="liger")),
])
def test_liger_patches_in_a_users_script_read_as_the_kernels(tmp_path, switches, kernels):
    """A script that calls Liger's patch its own way (no model=, switches left to their defaults: liger-kernel
    0.8.5's, planner/emit/kernels.py) reads as its switches."""
    text = SNIPPET.replace("import torch\n", "import torch\nfrom liger_kernel.transformers import "
                                             "apply_liger_kernel_to_llama\n", 1)
    text = text.replace("    block_names = [", LIGER_LINE.format(switches) + "    block_names = [", 1)
    path = tmp_path / "train.py"
    path.write_text(text)
    assert_same(read_setup(path).config, FsdpConfig(ac_every=1, **kernels))
    path.write_text(text.replace(f"_llama({switches})", "_llama(cross_entropy=True, fused_linear_cross_entropy=False)"))
    with pytest.raises(PlannerError) as error:
        read_setup(path)
    assert error.value.field == "liger_kernel_config.cross_entropy"


FSDP1 = {
    "full-shard": FsdpConfig(micro_batch=4),
    "hsdp-zero2-offload-fp16": FsdpConfig(sharding="HYBRID_SHARD_ZERO2", offload=True, precision="fp16"),
    "hsdp-shard-group-of-2": FsdpConfig(sharding="HYBRID_SHARD", shard_group_gpus=2),  # its 2-D device_mesh
    "no-shard-bf16-pure": FsdpConfig(sharding="NO_SHARD", precision="bf16-pure"),
    "fp32-reduce-bf16": FsdpConfig(precision="fp32", reduce_dtype="bf16"),
    "fsdp1-switches": FsdpConfig(sharding="SHARD_GRAD_OP", backward_prefetch=False, forward_prefetch=True,
                                 limit_all_gathers=False),
    "every-4-compile": FsdpConfig(ac_every=4, compile=True, compile_loss=False),
    "selective-float8-compile-loss": FsdpConfig(ac_every="selective-op", float8=True, compile=True),
    "liger-kernels": FsdpConfig(norm_kernel="liger", rope_kernel="liger", loss_kernel="liger"),
}


@pytest.mark.parametrize("name", FSDP1)
def test_fsdp1_code_reads_back_as_the_config_it_was_emitted_from(tmp_path, name):
    config = FSDP1[name]
    back = written(emit_fsdp1, config, tmp_path)
    assert back.dialect == "fsdp1-code" and back.fsdp_version == 1 and back.wrap == "block"
    assert back.use_orig_params is True and back.sync_module_states is False
    assert_same(back.config, outside_the_loop(config))


def test_fsdp1_says_what_fsdp1_runs_for_fsdp2_only_options(tmp_path):
    """FP8 all-gather and an int reshard are FSDP2's: the FSDP1 snippet (and its reading) gathers in bf16 over the
    whole group, as its notes say."""
    config = FsdpConfig(float8=True, fp8_all_gather=True, reshard_after_forward=8)
    back = written(emit_fsdp1, config, tmp_path)
    assert_same(back.config, FsdpConfig(float8=True))


def test_fsdp1_lora_units_read_as_lora(tmp_path):
    back = written(emit_fsdp1, FsdpConfig(), tmp_path, training=TrainingSpec(seq_len=4096, finetune="lora"))
    assert dict(back.training)["finetune"] == "lora"


LIGHTNING = {
    "full-shard-every-block": (FsdpConfig(ac_every=1, grad_accum=4), FsdpConfig(ac_every=1, grad_accum=4)),
    "hsdp-zero2-offload-fp16": (FsdpConfig(sharding="HYBRID_SHARD_ZERO2", offload=True, precision="fp16"), None),
    "bf16-true": (FsdpConfig(sharding="NO_SHARD", precision="bf16-pure"), None),
    "fp32": (FsdpConfig(precision="fp32", sharding="SHARD_GRAD_OP"), None),
    "fsdp1-switches": (FsdpConfig(backward_prefetch=False, forward_prefetch=True, limit_all_gathers=False), None),
    "compile-in-configure-model": (FsdpConfig(compile=True, compile_loss=False), None),
    # what Lightning runs where the plan asked for more (its comments say so): every block checkpointed
    "every-3-runs-every-block": (FsdpConfig(ac_every=3), FsdpConfig(ac_every=1)),
    "selective-runs-every-block": (FsdpConfig(ac_every="selective-op"), FsdpConfig(ac_every=1)),
}


@pytest.mark.parametrize("name", LIGHTNING)
def test_lightning_code_reads_back(tmp_path, name):
    config, runs = LIGHTNING[name]
    back = written(emit_lightning, config, tmp_path)
    assert back.dialect == "lightning" and (back.n_processes, back.n_machines) == (16, 2)
    assert_same(back.config, dataclasses.replace(runs or config, micro_batch=1))  # DataLoader's batch_size


@pytest.mark.parametrize("emit", [emit_fsdp2, emit_fsdp1, emit_lightning])
@pytest.mark.parametrize("optimizer, impl", [("adamw", "fused"), ("adamw", "for-loop"), ("adam", "foreach"),
                                             ("sgd", "fused"), ("adamw-8bit", "fused")])
def test_the_optimizer_reads_back(tmp_path, emit, optimizer, impl):
    training = TrainingSpec(seq_len=4096, optimizer=optimizer, optimizer_impl=impl)
    back = written(emit, FsdpConfig(), tmp_path, training=training)
    assert dict(back.training) == {"optimizer": optimizer, "optimizer_impl": impl}


@pytest.mark.parametrize("scaler, read", [("", None), ("ShardedGradScaler()", "sharded"),
                                           ("torch.amp.GradScaler(\"cuda\")", "plain")])
def test_the_fp16_scaler_is_read_from_the_code(tmp_path, scaler, read):
    """The emitted fp16 snippet only says (a note) to scale the loss: not stated; a script that builds one says."""
    text = fold(emit_fsdp2(FsdpConfig(precision="fp16"), LLAMA, CLUSTER, TRAINING))
    if scaler:
        text = text.replace("import torch\n", "import torch\nfrom torch.distributed.fsdp.sharded_grad_scaler import "
                                               "ShardedGradScaler\n", 1) + f"\nscaler = {scaler}\n"
    path = tmp_path / "train.py"
    path.write_text(text)
    assert read_setup(path).grad_scaler == read


def test_text_without_the_py_suffix_is_read_as_code(tmp_path):
    assert written(emit_fsdp2, FsdpConfig(tp=2), tmp_path, name="snippet.txt").config.tp == 2


@pytest.mark.parametrize("edit, field", [
    (("    fully_shard(model, **fsdp_kwargs)", "    model.set_modules_to_forward_prefetch([])\n"
      "    fully_shard(model, **fsdp_kwargs)"), "set_modules_to_forward_prefetch"),
    (("import torch\n", "import torch\nfrom torch.distributed.fsdp import register_fsdp_forward_method\n"),
     "register_fsdp_forward_method"),
    (("CheckpointImpl.NO_REENTRANT", "CheckpointImpl.REENTRANT"), "checkpoint_impl"),
    (("checkpoint_impl=CheckpointImpl.NO_REENTRANT", "checkpoint_impl=CheckpointImpl.NO_REENTRANT, "
      "context_fn=my_policy"), "context_fn"),
    (("mp_policy=MixedPrecisionPolicy(", "mp_policy=MixedPrecisionPolicy(output_dtype=torch.float32, "),
     "mp_policy.output_dtype"),
    (("fully_shard(model, **fsdp_kwargs)", "fully_shard(model, **fsdp_kwargs, ignored_params=set())"),
     "fully_shard.ignored_params"),
    (("reshard_after_forward=True", "reshard_after_forward=flag"), "reshard_after_forward"),
    (("foreach=True)", "foreach=True, amsgrad=True)\n    return torch.optim.Adagrad(params)"), "optimizer"),
])
def test_a_construct_it_does_not_read_is_one_line_naming_it(tmp_path, edit, field):
    assert edit[0] in SNIPPET
    path = tmp_path / "train.py"
    path.write_text(SNIPPET.replace(*edit))
    with pytest.raises(PlannerError) as error:
        read_setup(path)
    assert error.value.field == field and "\n" not in str(error.value)


@pytest.mark.parametrize("edit, field", [
    (("STAGE_BLOCKS = [(0, 16), (16, 16)]", "STAGE_BLOCKS = [(0, 14), (14, 18)]"), "STAGE_BLOCKS"),
    (("STAGES_OF_RANK = [[0], [1]]", "STAGES_OF_RANK = [[1], [0]]"), "STAGES_OF_RANK"),
    (("N_MICROBATCHES = 4", "N_MICROBATCHES = 0"), "N_MICROBATCHES"),
])
def test_a_pipeline_split_it_does_not_price_is_one_line(tmp_path, edit, field):
    text = fold(emit_fsdp2(FSDP2["pp-1f1b-tp-sp"], LLAMA, CLUSTER, TRAINING))
    assert edit[0] in text
    path = tmp_path / "train.py"
    path.write_text(text.replace(*edit))
    with pytest.raises(PlannerError) as error:
        read_setup(path)
    assert error.value.field == field


def test_expert_parallel_reads_its_token_movement(tmp_path):
    text = fold(emit_fsdp2(FsdpConfig(ep=2), MOE, CLUSTER, TRAINING))
    path = tmp_path / "train.py"
    path.write_text(text.replace('ep_implementation="all_to_all"', 'ep_implementation="deepep"'))
    with pytest.raises(PlannerError) as error:
        read_setup(path)
    assert error.value.field == "ep_implementation"


def test_fsdp_plan_check_exits_2_with_the_line(tmp_path, capsys):
    from planner.cli import main

    path = tmp_path / "train.py"
    path.write_text(SNIPPET.replace("CheckpointImpl.NO_REENTRANT", "CheckpointImpl.REENTRANT"))
    with pytest.raises(SystemExit) as exited:
        main(["check", str(path), "--model", "llama3-8b", "--gpus", "16"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and err.startswith("error: checkpoint_impl: CheckpointImpl.REENTRANT")
    assert len(err.splitlines()) == 1


USERS_SCRIPT = '''
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def shard(net):
    mesh = init_device_mesh("cuda", (2, 8), mesh_dim_names=("dp_replicate", "dp_shard"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(net, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return torch.optim.AdamW(net.parameters(), lr=3e-4, fused=True)
'''


def test_a_script_written_by_hand_in_the_same_constructs(tmp_path):
    """Not the emitter's names: the root is the fully_shard outside the loop, the policy passed by name."""
    path = tmp_path / "train.py"
    path.write_text(USERS_SCRIPT)
    back = read_setup(path)
    assert_same(back.config, FsdpConfig(sharding="HYBRID_SHARD_ZERO2"))
    # the mesh says the shard group (8 GPUs), not the node: check takes that from --gpus-per-node (default 8)
    assert (back.n_processes, back.n_machines, back.config.shard_group_gpus) == (16, None, 8)
    assert dict(back.training) == {"optimizer": "adamw", "optimizer_impl": "fused"}
