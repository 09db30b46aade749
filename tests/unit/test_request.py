"""The request model (planner/request): each knob declared once, routed into its group by name, and the one
source of the API's and the CLI's names, flags and defaults."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.units import GiB
from planner.errors import PlannerError
from planner.request import (ClusterRequest, ConfigRequest, MeshRequest, Request, TrainingRequest, build_request,
                             knob_names, knob_table)


def test_every_knob_is_declared_once_in_one_group():
    table = knob_table(Request)  # raises on a name declared twice
    groups = {}
    for k in table.values():
        groups.setdefault(k.group, []).append(k.name)
    assert len(groups["cluster"]) == 8 and groups["cluster"][:3] == ["gpus", "gpus_per_node", "gpu"]
    assert groups["training"] == ["seq_len", "global_batch", "optimizer", "finetune", "lora_rank",
                                  "routing_imbalance"]
    assert groups["config.mesh"] == ["tp", "cp", "ep", "pp", "pp_schedule", "pp_stages_per_rank", "async_tp",
                                     "sequence_parallel"]
    assert groups["search"] == ["precisions", "reduce_dtypes"]
    assert len(groups["config"]) == 17 and len(table) == 43
    # the flag of a knob is its name in kebab case, so a flag names one field per command
    for k in table.values():
        if k.flag.decls:
            long_flag = k.flag.decls[0].split("/")[0]
            assert long_flag in (f"--{k.name.replace('_', '-')}", "--precision", "--reduce-dtype"), k.name


def test_knobs_route_to_their_groups_over_the_groups_given():
    r = build_request("llama3-8b", 16, tp=2, seq_len=4096, gpu_memory="40GiB", compile=True)
    assert (r.cluster.gpus, r.cluster.gpu_memory, r.training.seq_len) == (16, "40GiB", 4096)
    assert (r.config.compile, r.mesh.tp, r.mesh.pp) == (True, 2, None)
    base = ClusterRequest(gpus=8, gpu="h100-80gb", gpus_per_node=8)
    r = build_request("m", cluster=base, gpus_per_node=4, mesh=MeshRequest(pp=2), micro_batch=2,
                      config=ConfigRequest(sharding="HYBRID_SHARD", mesh=MeshRequest(tp=4)))
    assert (r.cluster.gpus, r.cluster.gpu, r.cluster.gpus_per_node) == (8, "h100-80gb", 4)
    # mesh= replaces the config's mesh; the flat knob replaces the group's value, the rest of the group stays
    assert (r.mesh.pp, r.mesh.tp, r.config.micro_batch, r.config.sharding) == (2, None, 2, "HYBRID_SHARD")
    assert build_request("m", 8).training == TrainingRequest()


def test_unknown_names_and_bad_degrees_are_one_line():
    with pytest.raises(PlannerError) as e:
        build_request("m", 8, sequence_paralel=False)
    text = str(e.value)
    assert text.startswith("sequence_paralel: unknown argument; valid: ") and "\n" not in text
    assert "sequence_parallel" in text and "routing_imbalance" in text
    with pytest.raises(PlannerError, match="sharding: unknown argument"):
        build_request("m", 8, valid=knob_names("cluster"), sharding="NO_SHARD")
    with pytest.raises(PlannerError, match=r"^pp: must be an integer >= 1, got 0$"):
        build_request("m", 8, pp=0)
    with pytest.raises(PlannerError, match="cluster: expected a ClusterRequest, got dict"):
        build_request("m", cluster={"gpus": 8})


def test_cluster_and_training_specs():
    cluster = ClusterRequest(gpus=16, gpu_memory="40GiB", cpu_ram_per_node="1TiB").spec()
    assert (cluster.n_gpus, cluster.gpus_per_node) == (16, 8)
    assert cluster.gpu.memory_bytes == 40 * GiB and cluster.cpu_ram_bytes_per_node == 1024 * GiB
    with pytest.raises(PlannerError, match=r"^cpu_ram_per_node: not a size: '1TB!'"):
        ClusterRequest(gpus=8, cpu_ram_per_node="1TB!").spec()
    with pytest.raises(PlannerError, match="^gpus: missing"):
        ClusterRequest().spec()
    t = TrainingRequest(seq_len=4096, global_batch=64).spec()
    assert (t.seq_len, t.global_batch, t.lora_rank) == (4096, 64, 16)


def test_groups_are_frozen_values():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClusterRequest(gpus=8).gpus = 16
    assert MeshRequest(tp=2, pp=4).degrees() == {"tp": 2, "pp": 4}
    assert MeshRequest(tp=2).degrees(default=1) == {"tp": 2, "cp": 1, "ep": 1, "pp": 1}
