"""calibration/store.py: schema-checked results.jsonl and profile.json, atomic writes, cluster fingerprints."""

import dataclasses
import json
import subprocess
import sys

import pytest

from calibration import store
from cost_models.profile import DEFAULT_PROFILE, Profile

FP = store.Fingerprint(device_type="cuda", device_name="NVIDIA H100 80GB HBM3", devices_per_node=8, n_nodes=2,
                       torch_version="2.13.0", nccl_version="2.27.3")


def setup(**config) -> store.RunSetup:
    return store.RunSetup(
        model={"name": "toy", "n_layers": 2}, full_n_layers=2, gpu={"id": "h100-80gb", "name": "H100"}, n_gpus=8,
        gpus_per_node=8, internode_bytes_per_s=1e11, training={"seq_len": 128},
        config={"sharding": "FULL_SHARD", "precision": "bf16", **config}, fsdp_version=2, device="cuda",
        steps=5, warmup=2)


def predicted() -> store.Predicted:
    return store.Predicted(step_s=1.0, peak_allocated_bytes=10, peak_reserved_bytes=12, exposed_comm_s=0.1,
                           compute_s=0.8, tokens_per_s_per_gpu=100.0)


def measured_record(run="a") -> store.RunRecord:
    m = store.Measured(step_s=1.1, step_s_all=[1.0, 1.1, 1.2], tokens_per_s_per_gpu=90.0, peak_allocated_bytes=11,
                       peak_reserved_bytes=13, memory_source="cuda_allocator")
    return store.RunRecord(run_id=run, model_name="toy", setup=setup(), predicted=predicted(), measured=m,
                           fingerprint=FP)


def error_record(run="b") -> store.RunRecord:
    return store.RunRecord(run_id=run, model_name="toy", setup=setup(), predicted=predicted(),
                           error=store.RunError(kind="oom", message="CUDA out of memory", rank=3))


def test_results_round_trip(tmp_path):
    path = tmp_path / "results.jsonl"
    store.append_record(path, measured_record())
    store.append_record(path, error_record())
    records = store.read_records(path)
    assert [r.run_id for r in records] == ["a", "b"]
    assert records[0].measured.step_s == 1.1 and records[1].error.rank == 3
    assert path.read_text().count("\n") == 2  # one line per run


def test_missing_results_file_is_empty(tmp_path):
    assert store.read_records(tmp_path / "nothing.jsonl") == []


def test_torn_last_line_is_skipped_other_bad_lines_fail(tmp_path):
    path = tmp_path / "results.jsonl"
    store.append_record(path, measured_record())
    store.append_record(path, error_record())
    fragment = '{"schema_version": 1, "run_id": "tor'  # a crash mid-write: 36 bytes of a record
    with open(path, "a") as f:
        f.write(fragment)
    records, torn = store.read_results(path)
    assert [r.run_id for r in records] == ["a", "b"]  # nothing measured before the kill is lost
    assert (torn.path, torn.line, torn.size_bytes) == (path, 3, len(fragment))
    assert torn.note().startswith(f"{path}:3: skipped a torn last line (36 bytes;")
    with pytest.warns(UserWarning, match=f"{path}:3: skipped a torn last line"):
        assert [r.run_id for r in store.read_records(path)] == ["a", "b"]
    path.write_text(path.read_text() + "\n")  # now complete but broken: an error naming the line
    with pytest.raises(store.StoreError, match=r"results.jsonl:3 is not JSON"):
        store.read_records(path)


def test_torn_multibyte_character_is_torn_not_a_crash(tmp_path):
    path = tmp_path / "results.jsonl"
    store.append_record(path, measured_record())
    path.write_bytes(path.read_bytes() + '{"run_id": "\u00d7'.encode()[:-1])  # cut inside a UTF-8 "×"
    records, torn = store.read_results(path)
    assert [r.run_id for r in records] == ["a"] and torn.line == 2
    path.write_bytes(path.read_bytes() + b"\n")
    with pytest.raises(store.StoreError, match=r"results.jsonl:2 is not JSON: invalid UTF-8"):
        store.read_records(path)


def test_appending_after_a_torn_line_keeps_every_record(tmp_path):
    """What --resume does after a hard kill: drop the fragment, append the rerun; every record reads back."""
    path = tmp_path / "results.jsonl"
    store.append_record(path, measured_record())
    with open(path, "a") as f:
        f.write('{"schema_version": 1, "run_id": "tor')
    _, torn = store.read_results(path)
    store.drop_torn_line(torn)
    store.append_record(path, error_record())
    assert store.read_results(path) == ([measured_record(), error_record()], None)
    # a last record whole but for its newline (killed between the two writes) is kept, and the next one
    # appended after it starts a line of its own
    path.write_text(path.read_text().rstrip("\n"))
    store.append_record(path, measured_record("c"))
    assert [r.run_id for r in store.read_records(path)] == ["a", "b", "c"]


def test_schema_violations_name_the_line_and_field(tmp_path):
    path = tmp_path / "results.jsonl"
    good = json.loads(measured_record().model_dump_json())
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "surprise": 1}) + "\n")
    with pytest.raises(store.StoreError, match=r":2: surprise: Extra inputs are not permitted"):
        store.read_records(path)
    path.write_text(json.dumps({**good, "schema_version": 99}) + "\n")
    with pytest.raises(store.StoreError, match="schema_version 99; this fsdp-plan reads 1"):
        store.read_records(path)


def test_a_record_has_exactly_one_outcome():
    with pytest.raises(ValueError, match="exactly one"):
        store.RunRecord(run_id="x", model_name="toy", setup=setup(), predicted=predicted())


def test_run_id_is_stable_and_config_specific():
    assert store.run_id(setup()) == store.run_id(setup())
    assert store.run_id(setup()) != store.run_id(setup(micro_batch=2))
    # the GPU's measured figures (a re-probed CPU) do not change the id, its type does
    a, b = setup(), setup()
    b.gpu = {"id": "h100-80gb", "name": "H100", "peak_flops": {"bf16": 1.0}}
    assert store.run_id(a) == store.run_id(b)


def test_write_atomic_replaces_whole_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "profile.json"
    store.write_atomic(path, "one\n")
    store.write_atomic(path, "two\n")
    assert path.read_text() == "two\n"
    assert [p.name for p in path.parent.iterdir()] == ["profile.json"]


def profile_file(**changes) -> store.ProfileFile:
    profile = dataclasses.replace(DEFAULT_PROFILE, compute_efficiency={"bf16": 0.5, "fp16": 0.5, "fp32": 0.7},
                                  microstep_overhead_s=0.02, fragmentation=0.1)
    return store.ProfileFile(created="2025-01-01T00:00:00+00:00", fingerprint=FP, gpu_id="h100-80gb",
                             coefficients=store.Coefficients.of(profile),
                             fit=store.FitSummary(n_runs=3, fitted=["microstep_overhead_s"], step_error_before=0.3,
                                                  step_error_after=0.05), **changes)


def test_profile_round_trip_gives_the_same_coefficients(tmp_path):
    path = tmp_path / "profile.json"
    store.write_profile(path, profile_file())
    loaded = store.load_profile(path, gpu_id="h100-80gb")
    assert isinstance(loaded, Profile)
    assert loaded.compute_efficiency["bf16"] == 0.5 and loaded.microstep_overhead_s == 0.02
    assert loaded.fragmentation == 0.1 and "fitted" in loaded.source


def test_coefficients_mirror_every_profile_field():
    # outside_allocator: a run's --outside-allocator overrides, not stored with the fitted coefficients
    profile_fields = {f.name for f in dataclasses.fields(Profile)} - {"source", "outside_allocator"}
    assert set(store.Coefficients.model_fields) == profile_fields


def test_profile_from_another_gpu_is_refused_unless_forced(tmp_path):
    path = tmp_path / "profile.json"
    store.write_profile(path, profile_file())
    with pytest.raises(store.StoreError, match=r"fitted on h100-80gb .* this plan is for a100-80gb.*--force-profile"):
        store.load_profile(path, gpu_id="a100-80gb")
    assert store.load_profile(path, gpu_id="a100-80gb", force=True).microstep_overhead_s == 0.02


def test_profile_from_another_cluster_is_refused_unless_forced():
    pf = profile_file()
    store.check_fingerprint(pf, FP.model_copy(update={"n_nodes": 16}))  # more nodes: same cluster kind
    other = FP.model_copy(update={"torch_version": "2.5.1", "nccl_version": "2.21.5"})
    with pytest.raises(store.StoreError, match=r"another cluster \(torch_version '2.5.1' here, '2.13.0' in the "
                                               r"profile; nccl_version .*--force-profile"):
        store.check_fingerprint(pf, other)
    store.check_fingerprint(pf, other, force=True)


def test_bad_profile_files_fail_with_the_reason(tmp_path):
    path = tmp_path / "p.json"
    with pytest.raises(store.StoreError, match="no such file"):
        store.load_profile(path)
    path.write_text("{}")
    with pytest.raises(store.StoreError, match="not an fsdp-plan profile"):
        store.load_profile(path)
    data = json.loads(profile_file().model_dump_json())
    # a profile fitted before the operator-level step time (its compute efficiency meant a fraction of peak)
    path.write_text(json.dumps({**data, "schema_version": 1}))
    with pytest.raises(store.StoreError, match="schema_version 1; this fsdp-plan reads 2 or 3 or 4 or 5: calibrate again"):
        store.load_profile(path)
    data["coefficients"]["fragmentation"] = "lots"
    path.write_text(json.dumps(data))
    with pytest.raises(store.StoreError, match="coefficients.fragmentation"):
        store.load_profile(path)


def test_schema_2_profiles_read_with_the_mesh_rates_at_their_default(tmp_path):
    # written before the mesh's rates existed: priced at the tier's rate then, so read with 1.0
    path = tmp_path / "v2.json"
    data = json.loads(profile_file().model_dump_json())
    assert data["schema_version"] == 5 and data["coefficients"]["tp_comm_efficiency"] == 1.0
    for name in ("tp_comm_efficiency", "ep_comm_efficiency", "host_memory_efficiency"):
        del data["coefficients"][name]
    # schemas 2 to 4 held a flat CPU optimizer rate no fit set: dropped (the host's CPUs price the step now)
    data["coefficients"]["cpu_optimizer_params_per_s"] = 4e8
    path.write_text(json.dumps({**data, "schema_version": 2}))
    loaded = store.load_profile(path)
    assert loaded.tp_comm_efficiency == 1.0 and loaded.ep_comm_efficiency == 1.0
    assert loaded.host_memory_efficiency == DEFAULT_PROFILE.host_memory_efficiency
    assert loaded.microstep_overhead_s == 0.02
    # a fitted rate survives the round trip in schema 3
    fitted = dataclasses.replace(DEFAULT_PROFILE, tp_comm_efficiency=0.62, ep_comm_efficiency=0.3)
    store.write_profile(path, profile_file().model_copy(update={"coefficients": store.Coefficients.of(fitted)}))
    loaded = store.load_profile(path)
    assert (loaded.tp_comm_efficiency, loaded.ep_comm_efficiency) == (0.62, 0.3)


def test_records_carry_the_mesh_degrees_and_old_records_read_as_data_parallel():
    from calibration.fit import specs_from_setup
    from cost_models.specs import FsdpConfig
    from planner.hardware import get_gpu
    from planner.models import load_preset

    tp2 = FsdpConfig(sharding="FULL_SHARD", precision="fp32", tp=2).to_dict()
    assert (tp2["tp"], tp2["cp"], tp2["ep"], tp2["pp"]) == (2, 1, 1, 1)
    setup = store.RunSetup(model=dataclasses.asdict(load_preset("gpt-125m")), full_n_layers=12,
                           gpu=store.gpu_spec_dict(get_gpu("a100-80gb")), n_gpus=2, gpus_per_node=2,
                           internode_bytes_per_s=1e9, training={"seq_len": 64}, config=tp2, fsdp_version=2,
                           device="cpu", steps=1, warmup=0)
    # a record written before the mesh: no degrees in its config, which ran data parallelism only
    old = setup.model_copy(update={"config": {k: v for k, v in tp2.items() if k not in ("tp", "cp", "ep", "pp")}})
    assert store.run_id(setup) != store.run_id(old)  # the degree is part of what defines a run
    assert specs_from_setup(setup)[3].tp == 2
    assert specs_from_setup(old)[3].tp == 1


def test_store_does_not_import_torch():
    code = "import sys, calibration.store, calibration.fit, calibration.launch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_model_spec_from_dict_restores_nested_specs():
    """A job file's / stored run's spec (dataclasses.asdict, through JSON) comes back equal, with its
    MoeSpec and ActivationProfile: ModelSpec(**data) left them dicts and MoE calibration runs crashed."""
    from cost_models.specs import ActivationProfile, ActivationTerms, BackwardMoment
    from planner.models import from_hf_config

    moe = from_hf_config({"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "vocab_size": 512, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    assert moe.moe is not None and moe.moe.stacked_expert_tensors
    terms = ActivationTerms(1.5, 0.25, (BackwardMoment(10, 2.0, 3.0, 0.5),))
    profiled = dataclasses.replace(moe, activation_profile=ActivationProfile(terms=(("bf16", "sdpa", terms),), source="x"))
    for spec in (moe, profiled):
        assert store.model_spec_from_dict(json.loads(json.dumps(dataclasses.asdict(spec)))) == spec
