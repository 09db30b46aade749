"""`fsdp-plan check` on meshes (issue 17, item 5): the degrees read from torchtitan flags (0.3 and 0.2 spellings) and
accelerate configs, audited with cost_models/mesh_rules.py and the mesh findings: TP across nodes (a warning naming
the inter-node tier), cp not dividing the sequence and ep on a dense model (errors); emit -> check gives the
plan's config back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cost_models.specs import FsdpConfig, TrainingSpec
from planner.doctor import check
from planner.emit import emit_accelerate
from planner.emit.torchtitan.job import emit_torchtitan
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.doctor.readers import read_setup

LLAMA = load_preset("llama3-8b")

ACCELERATE_CP3 = """\
distributed_type: FSDP
mixed_precision: bf16
num_machines: 2
num_processes: 12
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
parallelism_config:
  parallelism_config_dp_shard_size: 4
  parallelism_config_cp_size: 3
"""


def _codes(report) -> dict:
    return {f.code: f.severity for f in report.findings}


def _finding(report, code):
    return next(f for f in report.findings if f.code == code)


def test_tp_across_nodes_is_a_warning_naming_the_inter_node_tier(tmp_path):
    """torchtitan 0.3 flags: tp 16 on 4 nodes of 8 A100s (200 GB/s of network per node)."""
    path = tmp_path / "overrides.txt"
    path.write_text("--module=llama3\n--config=llama3_8b\n--parallelism.data_parallel_shard_degree=2\n"
                    "--parallelism.tensor_parallel_degree=16\n--training.seq_len=8192\nactivation-checkpoint:full\n")
    setup = read_setup(path)
    assert (setup.config.tp, setup.config.ac_every, setup.n_processes, setup.seq_len) == (16, 1, 32, 8192)
    r = check(setup, "llama3-8b")
    assert (r.candidate.cluster.n_gpus, r.candidate.cluster.gpus_per_node) == (32, 8)
    f = _finding(r, "tp-across-nodes")
    assert f.severity == "warning"
    assert f.message.startswith("tp=16 spans 2 nodes of 8 GPUs: each block's TP all-gathers and reduce-scatters")
    assert ("run on the inter-node tier, 25 GB/s per GPU (the node's 200 GB/s of network shared by its 8 GPUs"
            in f.message and "against 230 GB/s inside the node" in f.message)
    assert f.fix.startswith("tp <= 8 (TP inside a node)")
    # and torchtitan 0.3 refuses it: tp 16 does not divide llama3_8b's 8 KV heads (n_kv_heads % tp, decoder.py)
    kv = _finding(r, "tp-does-not-divide-kv-heads")
    assert kv.severity == "error" and kv.message.startswith("tp=16 does not divide llama3-8b's 8 KV heads: ")
    assert "tp-across-nodes" not in _codes(check(setup, "llama3-8b", 32, gpus_per_node=16))  # 16 GPUs a node


def test_cp_that_does_not_divide_the_sequence_is_an_error(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_CP3)
    setup = read_setup(path)
    assert (setup.config.cp, setup.config.tp, setup.n_processes, setup.n_machines) == (3, 1, 12, 2)
    r = check(setup, "llama3-8b", seq_len=8192)
    f = _finding(r, "cp-does-not-divide-sequence")
    assert f.severity == "error" and r.has_errors
    assert f.message == ("cp=3: load-balanced ring attention splits each sequence into 2 x cp = 6 chunks, and "
                         "seq_len=8192 is not a multiple of 6.")
    assert f.fix == "choose one of: 1, 2, 4"  # the cp degrees that divide 8192 / 2 and the 12 GPUs
    assert "cp-does-not-divide-sequence" not in _codes(check(setup, "llama3-8b", seq_len=12288))  # 6 | 12288


def test_ep_on_a_dense_model_is_an_error(tmp_path):
    path = tmp_path / "flags.txt"
    path.write_text("--parallelism.data_parallel_shard_degree=8\n--parallelism.expert_parallel_degree=2\n")
    r = check(read_setup(path), "llama3-8b")
    f = _finding(r, "ep-on-dense-model")
    assert (f.severity, f.message, f.fix) == ("error", "ep=2: llama3-8b has no routed experts (a dense model).",
                                              "use ep 1")


def test_check_json_carries_the_mesh(tmp_path):
    from planner.reports import table as report

    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_CP3)
    data = json.loads(report.check_json(check(read_setup(path), "llama3-8b", seq_len=8192)))
    assert {k: data["config"][k] for k in ("tp", "cp", "ep", "pp")} == {"tp": 1, "cp": 3, "ep": 1, "pp": 1}
    assert "cp-does-not-divide-sequence" in [f["code"] for f in data["findings"]]


@pytest.mark.parametrize("version", ["0.3", "0.2"])
@pytest.mark.parametrize("config, gpus, seq_len", [
    (FsdpConfig(tp=2, cp=4, ac_every=1), 16, 131072),
    (FsdpConfig(sharding="HYBRID_SHARD", tp=4, compile=True, async_tp=True), 16, 8192),
    (FsdpConfig(cp=8, ac_every="selective-op"), 8, 262144),
])
def test_torchtitan_emit_then_check_prices_the_plans_mesh_with_no_mesh_findings(tmp_path, version, config, gpus,
                                                                                seq_len):
    cluster = make_cluster(gpus, gpus_per_node=8)
    path = tmp_path / "overrides.txt"
    path.write_text(emit_torchtitan(config, LLAMA, cluster, TrainingSpec(seq_len=seq_len), version=version))
    setup = read_setup(path)
    r = check(setup, "llama3-8b")
    # 0.3 runs its model configs' chunked loss (ChunkedLossWrapper) whatever was priced; the job's notes say so
    expected = replace(config, loss_kernel="chunked") if version == "0.3" else config
    # the job sets no PYTORCH_CUDA_ALLOC_CONF: torchtitan's run_train.sh exports expandable segments, its default
    expected = replace(expected, alloc_conf="expandable_segments:True")
    assert r.candidate.config == expected and r.candidate.cluster.n_gpus == gpus
    assert r.candidate.training.seq_len == seq_len
    mesh_codes = {"tp-across-nodes", "cp-does-not-divide-sequence", "ep-on-dense-model", "tp-does-not-divide-heads",
                  "tp-does-not-divide-kv-heads", "mesh-does-not-divide-gpus"}
    assert not mesh_codes & set(_codes(r))


def test_accelerate_emit_then_check_gives_the_mesh_back(tmp_path):
    config = FsdpConfig(tp=2, cp=2, sequence_parallel=False, ac_every=1)
    cluster = make_cluster(16, gpus_per_node=8)
    path = tmp_path / "accelerate.yaml"
    path.write_text(emit_accelerate(config, LLAMA, cluster, fsdp_version=2))
    r = check(read_setup(path), "llama3-8b", seq_len=8192)
    assert (r.candidate.config.tp, r.candidate.config.cp, r.candidate.config.sequence_parallel) == (2, 2, False)
    assert r.candidate.cluster.n_gpus == 16 and not r.has_errors


def test_check_without_model_takes_it_from_torchtitans_config_function(tmp_path, capsys):
    from planner.cli import main

    path = tmp_path / "overrides.txt"
    path.write_text(emit_torchtitan(FsdpConfig(tp=2, cp=2, ac_every=1), LLAMA, make_cluster(16, gpus_per_node=8),
                                    TrainingSpec(seq_len=8192)))
    assert read_setup(path).model == "llama3.1-8b"  # torchtitan's llama3_8b trains Llama 3.1 8B
    try:
        main(["check", str(path), "--format", "json"])
        code = 0
    except SystemExit as exc:
        code = exc.code
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["model"]["name"] == "llama3.1-8b"
    assert {k: data["config"][k] for k in ("tp", "cp")} == {"tp": 2, "cp": 2}
