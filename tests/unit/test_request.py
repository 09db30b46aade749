"""The request model (planner/request): each knob declared once, routed into its group by name, and the one
source of the API's and the CLI's names, flags and defaults."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.units import GiB
from planner.errors import PlannerError
from planner.request import (ClusterRequest, ConfigRequest, MeshRequest, Request, SearchRequest, TrainingRequest,
                             build_request, knob_names, knob_table)


def test_every_knob_is_declared_once_in_one_group():
    table = knob_table(Request)  # raises on a name declared twice
    groups = {}
    for k in table.values():
        groups.setdefault(k.group, []).append(k.name)
    assert len(groups["cluster"]) == 13 and groups["cluster"][:3] == ["gpus", "gpus_per_node", "gpu"]
    assert groups["training"] == ["seq_len", "global_batch", "optimizer", "optimizer_impl", "finetune", "lora_rank",
                                  "lora_dropout", "lora_targets", "quant", "double_quant", "quant_storage",
                                  "routing_imbalance", "routing"]
    assert groups["config.mesh"] == ["tp", "cp", "ep", "pp", "pp_schedule", "pp_stages_per_rank", "async_tp",
                                     "sequence_parallel", "shard_group_gpus"]
    assert groups["search"] == ["precisions", "reduce_dtypes"]
    # 66: the trainer (planner/trainers), alloc_conf (PYTORCH_CUDA_ALLOC_CONF) and outside_allocator at the top;
    # lora_targets (the linears LoRA adapts) and lora_dropout (peft's) since 2026-12-07
    assert len(groups["config"]) == 25 and len(table) == 67
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


# --- the CLI and the API read the declarations -------------------------------------------------------------

def _cli_commands():
    import typer

    from planner.cli import app

    group = typer.main.get_command(app)
    return {"plan": group, **group.commands}


def _knob_tables():
    from planner.calibrating import CalibrationRequest
    from planner.rl.request import RlRequest   # rl's knobs, and check's for RL files (mean lengths, engine version)

    return {**knob_table(Request), **knob_table(CalibrationRequest), **knob_table(RlRequest)}


def test_every_flag_of_every_command_is_one_field():
    knobs, requests = _knob_tables(), knob_table(Request)
    spelled: dict[str, set[str]] = {}
    from_request, own = {}, {}
    for name, cmd in _cli_commands().items():
        options = [p for p in cmd.params if p.param_type_name == "option"]  # typer vendors its click
        from_request[name] = sum(p.name in requests for p in options)
        own[name] = {p.name for p in options if p.name not in knobs}
        for p in options:
            for flag in p.opts + p.secondary_opts:
                spelled.setdefault(flag, set()).add(p.name)
            if p.name in knobs:  # a knob's option: its declared flags, never a command's own spelling
                decls = [d for decl in knobs[p.name].flag.decls for d in decl.split("/")]
                assert sorted(p.opts + p.secondary_opts) == sorted(decls), (name, p.name)
    # one flag, one field: only the search's lists share a flag with the one configuration's value
    shared = {flag: names for flag, names in spelled.items() if len(names) > 1}
    assert shared == {"--precision": {"precision", "precisions"}, "--reduce-dtype": {"reduce_dtype", "reduce_dtypes"}}
    # by hand (the cluster's 10 knobs below, + 4 of the host's CPUs since 5b2dbea: --host-cores-per-node,
    # --host-memory-gb-per-s, --host-thread-gb-per-s, --omp-num-threads; not calibrate's 5): estimate 10 cluster (with
    # --model; --power-limit-w) + 9 training + attention + 23 config + 8 mesh +
    # routing x 2 + trainer + alloc_conf + trust_remote_code = 56; plan 10 + 9 + attention + attention_kernel + liger +
    # 4 kernels + 2 search + 8 mesh + routing x 2 + trainer + alloc_conf + trust = 41; explain 10 + 9 +
    # attention + 9 config + 8 mesh + alloc_conf = 38; calibrate 5 cluster + 9 training + attention + precisions + 7
    # config + 7 mesh + shard_group_gpus = 31 (and its own 19 from CalibrationRequest); check 10 + 9 + 6 config +
    # alloc_conf = 26; trace estimate's 56 (its --alloc-conf, once its own option, is the knob); rl 10 cluster +
    # finetune + lora_rank = 12 (the rest are verl's knobs, planner/rl/request.py); + lora_targets (2026-12-07) in
    # every command that takes the training's knobs, and lora_dropout (2026-12-07) beside it; explain's trainer
    # (2026-12-07: a torchtitan / Liger configuration explained as estimate prices it); rl's lora_targets (2026-12-08:
    # verl's model.target_modules, the single-run planner's field and flag)
    assert from_request == {"plan": 49, "estimate": 64, "trace": 64, "explain": 47, "calibrate": 33, "check": 32,
                            "models": 0, "gpus": 0, "schema": 0, "rl": 17}
    assert own["calibrate"] == {"emit", "output_format", "fault"}  # the rest are CalibrationRequest's knobs
    assert own["estimate"] == {"output_format"} and own["check"] == {"dynamic_control_flow", "output_format"}


def test_a_knobs_default_is_the_apis_and_the_clis():
    import inspect

    from planner.api import estimate, plan

    # the CLI's off switch for async_tp is the API's None (off for one configuration, searched by the plan)
    for command, api, own in (("estimate", estimate, {"async_tp": False}), ("plan", plan, {})):
        signature = inspect.signature(api).parameters
        cli = {p.name: p.default for p in _cli_commands()[command].params if p.name in signature}
        assert len(cli) == (65 if command == "estimate" else 50)  # the knobs, --profile; the model is positional
        for name, default in cli.items():
            if name != "model":
                assert default == own.get(name, signature[name].default), (command, name)
    shown = str(inspect.signature(plan))  # help(plan)
    assert shown.startswith("(model, gpus: int | None = None, *, gpus_per_node: int | None = None, gpu: str = "
                            "'a100-80gb', internode_gbps: float | None = None,")
    assert shown.endswith("search: planner.request.groups.SearchRequest | None = None) -> planner.api.Plan")
    assert "config:" not in shown and "sharding:" not in shown  # the search's, not one configuration's


def test_the_api_takes_knobs_or_groups_alike():
    from planner.api import estimate, plan

    flat = estimate("llama3-8b", 16, gpu="h100-80gb", micro_batch=2, tp=2, seq_len=4096)
    grouped = estimate("llama3-8b", cluster=ClusterRequest(gpus=16, gpu="h100-80gb"),
                       training=TrainingRequest(seq_len=4096),
                       config=ConfigRequest(micro_batch=2, mesh=MeshRequest(tp=2)))
    assert (grouped.config.tp, grouped.config.micro_batch, grouped.config.grad_accum) == (2, 2, 1)
    assert grouped.time.step_s == pytest.approx(flat.time.step_s, rel=0)
    assert grouped.memory.peak_reserved_bytes == flat.memory.peak_reserved_bytes
    with pytest.raises(PlannerError, match="^sharding: unknown argument; valid: gpus, gpus_per_node, "):
        plan("llama3-8b", gpus=16, sharding="NO_SHARD")  # one configuration's knob: estimate's, not the search's
    with pytest.raises(PlannerError, match="^precisions: unknown argument"):
        estimate("llama3-8b", 16, precisions=["bf16"])
    with pytest.raises(PlannerError, match="^search: unknown argument; valid: .*, cluster, training, config, mesh$"):
        estimate("llama3-8b", 16, search=SearchRequest(precisions=["bf16"]))


def test_calibration_requests_embed_the_groups():
    from planner.calibrating import CalibrationRequest
    from planner.calibrating.request import training_spec

    r = CalibrationRequest("out", 8, seq_len=512, gpu="h100-80gb", steps=4)
    assert (r.cluster.gpus, r.gpus, r.gpu, r.training.seq_len, r.seq_len, r.steps) == (8, 8, "h100-80gb", 512, 512, 4)
    assert training_spec(r).seq_len == 512 and training_spec(r).optimizer == "adamw"
    same = CalibrationRequest("out", cluster=ClusterRequest(gpus=8, gpu="h100-80gb"),
                              training=TrainingRequest(seq_len=512), steps=4)
    assert same == r
    with pytest.raises(AttributeError):
        r.sharding  # noqa: B018 (not a calibration knob)
