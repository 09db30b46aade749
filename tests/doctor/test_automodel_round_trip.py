"""--emit automodel -> fsdp-plan check: a NeMo Automodel 0.7.0 recipe YAML reads back as the plan that was priced
(equal JSON config, memory, time and training), its keys are the ones Automodel 0.7.0 reads, and what the recipe
cannot hold is one PlannerError line.

Automodel's own loader: nemo-automodel 0.7.0 installs here only beside the project (it pins transformers==5.18.0,
the project runs 5.24, and brings cutlass-dsl, quack-kernels, triton, torchao), so it is not in the test extra;
test_loads_in_automodels_own_loader runs where it is importable (checked in a throwaway venv:
/tmp/amvenv, PYTHONPATH=. python -m pytest this file) and is skipped otherwise. Everywhere,
test_keys_are_automodels checks the keys against the field names of its config dataclasses, copied here from its
0.7.0 source (the files named beside each)."""

import json

import pytest
import yaml

from planner.api import estimate
from planner.doctor import check
from planner.doctor.readers import read_setup
from planner.emit import emit_artifact
from planner.errors import PlannerError
from planner.reports import table as report

# the published rows' setting (shared/reference/published.md, NeMo Automodel): FSDP 8 x EP 8, bf16 params and
# Adam states, fp32 reduce, full checkpointing, DeepEP, the round-robin benchmark gate, TE RMSNorm
QWEN = dict(trainer="automodel", gpu="h100-80gb", seq_len=4096, global_batch=512, micro_batch=4, ep=8,
            precision="bf16-pure", reduce_dtype="fp32", activation_checkpointing="full", sharding="SHARD_GRAD_OP",
            moe_dispatch="deepep", routing="round-robin", norm_kernel="te", optimizer_impl="foreach")
CASES = {
    "qwen3 ep8 deepep": ("qwen3-30b-a3b", 8, QWEN),
    "gpt-oss flex fused adam": ("gpt-oss-20b", 8, {**QWEN, "micro_batch": 2, "global_batch": 256,
                                                   "attention": "flex", "optimizer_impl": "fused"}),
    # attn sdpa (PyTorch SDPA's FlashAttention-2) instead of the trainer's TE (cuDNN) attention
    "qwen3 sdpa flash2": ("qwen3-30b-a3b", 8, {**QWEN, "attention_kernel": "flash2"}),
    "llama hsdp fp32 master": ("llama3-8b", 16, dict(trainer="automodel", gpu="h100-80gb", seq_len=2048,
                                                     micro_batch=2, sharding="HYBRID_SHARD", precision="bf16",
                                                     global_batch=64, activation_checkpointing="none")),
    "llama tp2 compiled blocks": ("llama3-8b", 8, dict(trainer="automodel", gpu="h100-80gb", seq_len=2048,
                                                       micro_batch=1, tp=2, compile=True, compile_scope="blocks",
                                                       precision="fp32", global_batch=8,
                                                       activation_checkpointing="full")),
}

# nemo_automodel 0.7.0: components/distributed/config.py FSDP2Config and MoEParallelizerConfig,
# components/models/common/utils.py BackendConfig (fields and their Literal choices), recipes/_dist_utils.py
# (_PARALLELISM_DEFAULTS and the keys parse_distributed_section pops: strategy, pipeline, moe,
# activation_checkpointing), recipes/_typed_config.py (step_scheduler's runtime keys), training/step_scheduler.py
FSDP2_FIELDS = {"activation_checkpointing", "activation_checkpointing_scope", "autocast_dtype", "defer_fsdp_grad_sync",
                "enable_async_tensor_parallel", "enable_compile", "enable_fsdp2_prefetch",
                "fsdp2_backward_prefetch_depth", "fsdp2_forward_prefetch_depth", "mp_policy", "multimodal",
                "offload_policy", "patch_is_packed_sequence", "reshard_after_forward", "sequence_parallel", "tp_plan"}
DISTRIBUTED_KEYS = FSDP2_FIELDS | {"strategy", "pipeline", "moe", "dp_size", "dp_replicate_size", "tp_size", "cp_size",
                                   "ep_size", "pp_size"}
MOE_FIELDS = {"ignore_router_for_ac", "lm_head_precision", "mp_policy", "reshard_after_forward", "wrap_outer_model"}
BACKEND_CHOICES = {"attn": {"torch", "te", "sdpa", "flex", "eager", "tilelang", "cudnn", "fa4", "magi"},
                   "linear": {"torch", "te", "quack"}, "rms_norm": {"torch", "torch_fp32", "te", "quack"},
                   "experts": {"torch", "te", "gmm", "torch_mm", "torch_mm_mxfp8"},
                   "dispatcher": {"torch", "deepep", "hybridep", "uccl_ep", "mok"}}
BACKEND_BOOLS = {"rope_fusion", "fake_balanced_gate", "enable_hf_state_dict_adapter"}
STEP_SCHEDULER_KEYS = {"ckpt_every_steps", "gc_every_steps", "global_batch_size", "log_remote_every_steps",
                       "loss_average_window_steps", "max_steps", "num_epochs", "preemption_signal",
                       "save_checkpoint_every_epoch", "start_epoch", "start_step", "val_every_steps",
                       "validate_on_checkpoint", "local_batch_size", "dp_size", "dataloader"}


def _emitted(case):
    model, gpus, knobs = CASES[case]
    c = estimate(model, gpus, **knobs)
    return c, emit_artifact("automodel", c)


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_through_check(tmp_path, case):
    """The recipe read by `check` is the priced plan: the same JSON config, memory, time and training."""
    model, gpus, knobs = CASES[case]
    c, text = _emitted(case)
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    setup = read_setup(path)
    assert setup.dialect == "automodel" and setup.seq_len == knobs["seq_len"]
    r = check(setup, model, gpus, gpu="h100-80gb")
    planned, read = json.loads(report.estimate_json(c)), json.loads(report.estimate_json(r.candidate))
    for key in ("config", "memory", "time", "training"):
        assert read[key] == planned[key], key


@pytest.mark.parametrize("case", list(CASES))
def test_keys_are_automodels(case):
    data = yaml.safe_load(_emitted(case)[1])
    assert set(data["distributed"]) <= DISTRIBUTED_KEYS
    assert set(data["distributed"].get("moe", {})) <= MOE_FIELDS
    assert set(data["step_scheduler"]) <= STEP_SCHEDULER_KEYS
    backend = data["model"]["backend"]
    assert backend["_target_"] == "nemo_automodel.components.models.common.BackendConfig"
    for key, value in backend.items():
        assert key == "_target_" or value in BACKEND_CHOICES.get(key, ()) or (key in BACKEND_BOOLS and
                                                                             isinstance(value, bool)), (key, value)
    assert data["recipe"] == "TrainFinetuneRecipeForNextTokenPrediction"


def test_qwen_recipe_says_the_published_setting():
    """What published.md's Automodel rows ran, in the recipe's words (hand-checked against the YAML)."""
    data = yaml.safe_load(_emitted("qwen3 ep8 deepep")[1])
    assert data["step_scheduler"]["global_batch_size"] == 512 and data["step_scheduler"]["local_batch_size"] == 4
    assert data["model"]["torch_dtype"] == "bfloat16"  # bf16 params: torch.optim keeps bf16 Adam states
    assert data["distributed"]["mp_policy"]["reduce_dtype"] == "float32"
    assert (data["distributed"]["ep_size"], data["distributed"]["dp_size"]) == (8, 8)
    assert data["distributed"]["moe"]["reshard_after_forward"] is False  # MoEParallelizerConfig's default
    backend = data["model"]["backend"]
    assert (backend["dispatcher"], backend["fake_balanced_gate"], backend["rms_norm"]) == ("deepep", True, "te")


@pytest.mark.parametrize("case, gpu, attn, kernel", [
    ("qwen3 ep8 deepep", "h100-80gb", "te", "cudnn"),     # the trainer's default: TE's cuDNN attention on Hopper
    ("qwen3 sdpa flash2", "h100-80gb", "sdpa", None),     # pinned flash2: PyTorch SDPA (JSON leaves flash2 out)
    ("llama hsdp fp32 master", "a100-80gb", "sdpa", None),  # Ampere: the default falls back to flash2
    ("gpt-oss flex fused adam", "h100-80gb", "flex", None),  # FlexAttention runs its own kernel
])
def test_attention_backend_is_the_priced_kernel(tmp_path, case, gpu, attn, kernel):
    """model.backend.attn says the attention kernel the plan priced (te = cudnn, sdpa = flash2), and reads back as
    it; on an A100 the automodel trainer's TE default is priced as flash2 (no Hopper kernel figures there)."""
    model, gpus, knobs = CASES[case]
    c = estimate(model, gpus, **{**knobs, "gpu": gpu})
    text = emit_artifact("automodel", c)
    assert yaml.safe_load(text)["model"]["backend"]["attn"] == attn
    assert json.loads(report.estimate_json(c))["config"].get("attention_kernel") == kernel
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    r = check(read_setup(path), model, gpus, gpu=gpu)
    assert r.candidate.config == c.config and r.candidate.time.step_s == c.time.step_s


def test_te_attention_checked_on_an_a100_is_flash2(tmp_path):
    """A recipe saying attn: te, checked for an A100, is priced as flash2 (as the API prices the trainer's default
    there), not refused: Transformer Engine runs there, only the Hopper kernels' figures do not apply."""
    _, text = _emitted("qwen3 ep8 deepep")
    assert "attn: te" in text
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    r = check(read_setup(path), "qwen3-30b-a3b", 8, gpu="a100-80gb")
    assert r.candidate.config.attention_kernel.value == "flash2"


def test_loads_in_automodels_own_loader(tmp_path):
    """The `automodel recipe.yaml` CLI's own steps (cli/app.py: load_yaml, resolve_recipe_name), then the typed
    configs its recipe builds from the sections (parse_distributed_section, BackendConfig, StepSchedulerConfig).
    load_yaml_config is left out: it imports every _target_ at load time, and the model class's import compiles
    Triton kernels that fail on a CPU-only torch (triton 3.9 autotuner, checked)."""
    pytest.importorskip("nemo_automodel", reason="nemo-automodel 0.7.0 pins transformers 5.18 (module docstring)")
    from nemo_automodel.cli.utils import load_yaml, resolve_recipe_name
    from nemo_automodel.components.models.common.utils import BackendConfig
    from nemo_automodel.components.training.step_scheduler import StepSchedulerConfig
    from nemo_automodel.recipes._dist_utils import parse_distributed_section

    path = tmp_path / "recipe.yaml"
    path.write_text(_emitted("qwen3 ep8 deepep")[1])
    cfg = load_yaml(path)
    assert resolve_recipe_name(cfg["recipe"]).endswith("train_ft.TrainFinetuneRecipeForNextTokenPrediction")
    parsed = parse_distributed_section(cfg["distributed"])
    assert (parsed["ep_size"], parsed["dp_size"], parsed["activation_checkpointing"]) == (8, 8, True)
    assert parsed["moe_parallel_config"].reshard_after_forward is False
    assert str(parsed["strategy_config"].mp_policy.reduce_dtype) == "torch.float32"
    assert parsed["strategy_config"].reshard_after_forward is False
    built = BackendConfig(**{k: v for k, v in cfg["model"]["backend"].items() if k != "_target_"})
    assert (built.dispatcher, built.experts, built.fake_balanced_gate, built.rms_norm) == ("deepep", "torch_mm", True,
                                                                                        "te")
    steps = {k: v for k, v in cfg["step_scheduler"].items() if k != "local_batch_size"}
    assert StepSchedulerConfig(**steps).global_batch_size == 512


@pytest.mark.parametrize("fields, knob", [
    (dict(ac_every="selective-op"), "activation_checkpointing"),
    (dict(ac_every=2), "activation_checkpointing"),
    (dict(compile=True, compile_loss=True), "compile_scope"),
    (dict(precision="fp16"), "precision"),
    (dict(ep=8, moe_dispatch="all-to-all"), "moe_dispatch"),
    (dict(rope_kernel="te"), "rope_kernel"),
    (dict(sharding="NO_SHARD"), "sharding"),
    (dict(attention_kernel="fa3"), "attention_kernel"),
])
def test_what_the_recipe_cannot_hold_is_one_line(fields, knob):
    """Priced by the cost model directly (a trainer would refuse some of these before the emitter sees them)."""
    from cost_models.specs import FsdpConfig, TrainingSpec
    from planner.api import estimate_config
    from planner.hardware import make_cluster
    from planner.models import load_preset

    c = estimate_config(load_preset("qwen3-30b-a3b"), make_cluster(8, "h100-80gb"), TrainingSpec(),
                        FsdpConfig(**fields))
    with pytest.raises(PlannerError) as err:
        emit_artifact("automodel", c)
    assert err.value.field == knob and "\n" not in str(err.value)
