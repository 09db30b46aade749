"""The optimizer the plan priced, in each artifact and back (planner/emit/optimizer.py): HF TrainingArguments' `optim`
(built by transformers itself), torchtitan's optimizer.implementation (parsed by torchtitan 0.3's own
ConfigManager), the code snippets' make_optimizer (run: it builds the optimizer on a real module), and `fsdp-plan
check` reading each file back to the same optimizer, implementation and estimate."""

from __future__ import annotations

import pytest

from cost_models.specs import FsdpConfig, TrainingSpec
from planner.doctor import check
from planner.doctor.readers import read_setup
from planner.doctor.readers.trainers import from_hf_trainer
from planner.emit import emit_fsdp1, emit_fsdp2, emit_hf_trainer, emit_torchtitan
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import load_preset
from tests.doctor.test_roundtrip import hf_arguments_file
from tests.unit.test_emit_mesh import _torchtitan_03, flag_lines, parse_with_torchtitan

SPEC, CLUSTER = load_preset("llama3-8b"), make_cluster(8)

# (optimizer, implementation, offload) -> TrainingArguments' optim, and what it reads back as (optimizer, impl)
HF_CASES = [
    ("adamw", "fused", False, "adamw_torch_fused", ("adamw", "fused")),
    ("adamw", "foreach", False, "adamw_torch", ("adamw", "foreach")),
    ("adamw", "for-loop", True, "adamw_torch", ("adamw", "for-loop")),  # torch's default on CPU (offloaded) params
    ("adamw", "for-loop", False, "adamw_torch", ("adamw", "foreach")),  # not expressible: said in a comment
    ("adamw-8bit", "fused", False, "adamw_bnb_8bit", ("adamw-8bit", "fused")),
    ("sgd", "foreach", False, "sgd", ("sgd", "foreach")),
]


@pytest.mark.parametrize("optimizer, impl, offload, optim, back", HF_CASES, ids=lambda v: str(v))
def test_hf_trainer_optim_round_trip(tmp_path, training_arguments, optimizer, impl, offload, optim, back):
    training = TrainingSpec(optimizer=optimizer, optimizer_impl=impl)
    config = FsdpConfig(offload=offload)
    text = emit_hf_trainer(config, SPEC, CLUSTER, training)
    args = training_arguments(text)
    assert str(args.optim.value if hasattr(args.optim, "value") else args.optim) == optim
    if optimizer == "sgd":
        assert args.optim_args == "momentum=0.9"
    if back[1] != impl:
        assert "which TrainingArguments cannot ask for" in text
    setup = read_setup(hf_arguments_file(args, tmp_path / "args.json"))
    assert dict(setup.training) == {"optimizer": back[0], "optimizer_impl": back[1]}
    r = check(setup, "llama3-8b", 8, micro_batch=1)
    assert (r.candidate.training.optimizer.value, r.candidate.training.optimizer_impl.value) == back
    priced = {"for-loop": 525_338_624, "foreach": 4_015_130_624, "fused": 0}[back[1]]
    if optimizer == "adamw":
        assert r.candidate.memory.phases["optimizer_step"].optimizer_temporaries == (0 if offload else priced)


def test_hf_trainer_without_optim_runs_transformers_default_fused():
    setup = from_hf_trainer({"fsdp": True, "bf16": True})
    assert dict(setup.training) == {"optimizer": "adamw", "optimizer_impl": "fused"}
    other = from_hf_trainer({"fsdp": True, "optim": "adafactor"})
    assert other.training == () and "optim adafactor is not priced by fsdp-plan" in other.notes[-1]


@pytest.mark.parametrize("version", ["0.3", "0.2"])
@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_torchtitan_implementation_round_trip(tmp_path, version, impl):
    text = emit_torchtitan(FsdpConfig(), SPEC, CLUSTER, TrainingSpec(optimizer_impl=impl), version=version)
    assert f"--optimizer.implementation={impl}" in flag_lines(text)
    path = tmp_path / "overrides.txt"
    path.write_text(text)
    setup = read_setup(path)
    assert dict(setup.training) == {"optimizer": "adamw", "optimizer_impl": impl}
    r = check(setup, "llama3-8b", 8)
    assert r.candidate.training.optimizer_impl.value == impl


def test_torchtitan_parses_the_implementation_and_refuses_what_it_cannot_run():
    why = _torchtitan_03()
    if why:
        pytest.skip(why)
    sets = []
    for impl in ("fused", "foreach", "for-loop"):
        lines = flag_lines(emit_torchtitan(FsdpConfig(), SPEC, CLUSTER, TrainingSpec(optimizer_impl=impl)))
        sets.append(("llama3", "llama3_8b", [line for line in lines if not line.startswith(("--module=", "--config="))]))
    assert [r["optimizer_impl"] for r in parse_with_torchtitan(sets)] == ["fused", "foreach", "for-loop"]
    with pytest.raises(PlannerError, match="optimizer: torchtitan builds Adam and AdamW only, not sgd"):
        emit_torchtitan(FsdpConfig(), SPEC, CLUSTER, TrainingSpec(optimizer="sgd"))


def test_torchtitan_file_without_implementation_is_fused_and_bf16_states_are_refused(tmp_path):
    path = tmp_path / "overrides.txt"
    path.write_text("--module=llama3\n--config=llama3_8b\n")
    assert dict(read_setup(path).training) == {"optimizer": "adamw", "optimizer_impl": "fused"}
    path.write_text("--module=llama3\n--config=llama3_8b\n--optimizer.implementation=fused_opt_states_bf16\n")
    with pytest.raises(PlannerError, match="optimizer.implementation: 'fused_opt_states_bf16' is not priced"):
        read_setup(path)


@pytest.mark.parametrize("emit", [emit_fsdp1, emit_fsdp2])
@pytest.mark.parametrize("impl, flags", [("fused", {"fused": True}), ("foreach", {"foreach": True}),
                                         ("for-loop", {"foreach": False})])
def test_code_snippets_build_the_priced_optimizer(emit, impl, flags):
    torch = pytest.importorskip("torch")
    text = emit(FsdpConfig(), SPEC, CLUSTER, TrainingSpec(optimizer_impl=impl))
    namespace: dict = {}
    exec(compile(text, "<snippet>", "exec"), namespace)  # defines apply_fsdp and make_optimizer; runs neither
    optimizer = namespace["make_optimizer"](torch.nn.Linear(4, 4))
    assert type(optimizer) is torch.optim.AdamW
    assert {k: optimizer.defaults[k] for k in flags} == flags
