"""Emit -> read back: an accelerate config written by the planner, read by `check`, is the same config;
and the seed article's own snippets get the findings its corrections call for."""

from pathlib import Path

import pytest
import yaml

from cost_models.feasibility import node_shard_group
from cost_models.specs import FsdpConfig
from planner import plan
from planner.doctor import check
from planner.emit import emit_accelerate
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.doctor.readers import from_accelerate, read_setup
from tests.doctor.cli_run import cli_process

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
SPEC = load_preset("llama2-7b")
FIELDS = ("sharding", "precision", "offload", "ac_every", "backward_prefetch", "forward_prefetch")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("config", [
    FsdpConfig(),
    FsdpConfig(sharding="SHARD_GRAD_OP", precision="fp16", ac_every=1, offload=True),
    FsdpConfig(sharding="HYBRID_SHARD", precision="fp32"),
    FsdpConfig(sharding="HYBRID_SHARD_ZERO2", ac_every=1),
])
def test_accelerate_round_trip(tmp_path, load_accelerate, config, version):
    cluster = make_cluster(16, gpus_per_node=8)
    text = emit_accelerate(config, SPEC, cluster, fsdp_version=version)
    back = from_accelerate(yaml.safe_load(text))
    if version == 2:  # FSDP2 always prefetches; accelerate's FSDP2 form has no prefetch keys
        config = FsdpConfig(**{**config.__dict__, "backward_prefetch": True, "forward_prefetch": False})
    assert {f: getattr(back.config, f) for f in FIELDS} == {f: getattr(config, f) for f in FIELDS}
    assert (back.fsdp_version, back.n_processes, back.n_machines, back.wrap) == (version, 16, 2, "block")
    assert back.fsdp2_removed == ()
    loaded = load_accelerate(tmp_path, text, ["--main_process_ip", "10.0.0.1"])[0]  # accelerate accepts it
    assert loaded.fsdp_config["fsdp_version"] == version and loaded.num_processes == 16


def test_planner_pick_round_trips_through_check_with_no_findings(tmp_path):
    # planned for accelerate's FSDP1 (the trainer the accelerate config belongs to: its compile scope is the
    # blocks), so what check reads back is the plan that was priced
    p = plan("llama2-7b", gpus=16, seq_len=4096, trainer="accelerate")
    path = tmp_path / "accelerate.yaml"
    path.write_text(emit_accelerate(p.best.config, p.model, p.cluster, p.training))
    r = check(read_setup(path), "llama2-7b", micro_batch=p.best.config.micro_batch, seq_len=4096)
    assert r.candidate.cluster.n_gpus == 16 and r.candidate.cluster.gpus_per_node == 8
    assert r.candidate.config == p.best.config and r.candidate.trainer == "accelerate"
    assert r.candidate.time.tokens_per_s_per_gpu == pytest.approx(p.best.time.tokens_per_s_per_gpu, rel=1e-9)
    assert r.candidate.memory.peak_reserved_bytes == p.best.memory.peak_reserved_bytes
    assert not [f for f in r.findings if f.severity != "advice"], r.findings


# --- the seed article's snippets (shared/seed/digest.md) ---------------------------------------------------

def seed_codes(name, model, gpus=8, **kw):
    return {f.code: f.severity for f in check(read_setup(EXAMPLES / name), model, gpus, **kw).findings}


def test_seed_getting_started_has_no_wrap_policy():
    # FSDP(model, device_id=rank) on a 13B model: one giant unit, does not fit 80 GB
    assert seed_codes("seed_getting_started.yaml", "gpt-13b")["no-auto-wrap-policy"] == "error"


def test_seed_fp16_without_scaler():
    assert seed_codes("seed_mixed_precision.yaml", "gpt-13b")["fp16-without-sharded-scaler"] == "error"


def test_seed_performance_settings_are_explained():
    found = seed_codes("seed_performance.yaml", "gpt-13b")
    assert found["limit-all-gathers-is-a-rate-limiter"] == "advice"  # not message merging
    assert found["needless-sync-module-states"] == "advice"          # adds a broadcast, not fewer syncs
    dynamic = seed_codes("seed_performance.yaml", "gpt-13b", dynamic_control_flow=True)
    assert dynamic["forward-prefetch-dynamic-graph"] == "error"      # static graphs only


def test_seed_over_50b_recipe():
    found = seed_codes("seed_over_50b.yaml", "llama2-70b")
    assert found["hybrid-on-one-node"] == "warning"
    assert found["size-based-wrap"] == "advice"
    # CPU offload keeps the fp32 params and Adam states in host RAM (1,284.8 GiB on the node) and the DCP save's
    # get_state_dict copies them (12 B x 68.98B params = 770.9 GiB) beside it: 2,057.8 GiB with the processes' 2.1,
    # above the 2,048 GiB node
    assert found["host-ram-does-not-fit"] == "error"
    # across nodes HYBRID is meaningful
    assert "hybrid-on-one-node" not in seed_codes("seed_over_50b.yaml", "llama2-70b", gpus=32)


def test_seed_lora_recipe():
    found = seed_codes("seed_lora.yaml", "bloom-7b1", finetune="lora", lora_rank=8)
    assert found["lora-without-use-orig-params"] == "error"
    assert "no-auto-wrap-policy" in found


def test_seed_claim_200b_lora_on_8_gpus_only_with_short_sequences():
    # "a 200B-class model can be LoRA-fine-tuned on one 8-GPU machine": frozen bf16 weights alone are
    # 2 bytes x 175B / 8 = 43.7 GB per GPU; it fits 80 GB only with short sequences and checkpointing.
    short = plan("gpt-175b", gpus=8, finetune="lora", seq_len=512)
    assert short.best is not None and short.best.config.ac_every >= 1
    assert short.best.memory.breakdown.sharded_params == pytest.approx(174.6e9 * 2 / 8, rel=0.01)
    assert plan("gpt-175b", gpus=8, finetune="lora", seq_len=32768).best is None


def test_check_cli_exit_codes(tmp_path):
    bad = cli_process(["check", str(EXAMPLES / "seed_mixed_precision.yaml"), "--model", "gpt-13b", "--gpus", "8"])
    assert bad.returncode == 1 and "[ERROR] fp16-without-sharded-scaler" in bad.stdout
    # at the planner's micro-batch (the file leaves it at 1, which the planner ranks 11% slower: a warning)
    ok = cli_process(["check", str(EXAMPLES / "seed_performance.yaml"), "--model", "gpt-13b", "--gpus", "8",
                      "--micro-batch", "2", "--format", "json"])
    assert ok.returncode == 0, ok.stderr
    import json
    assert {f["severity"] for f in json.loads(ok.stdout)["findings"]} == {"advice"}
    broken = tmp_path / "fsdp.yaml"
    broken.write_text("sharding_strategy: [unclosed")
    r = cli_process(["check", str(broken), "--model", "gpt-13b", "--gpus", "8"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "config" in r.stderr
    typo = tmp_path / "typo.json"
    typo.write_text('{"sharding_strategy": "FULL_SHARDED"}')
    r = cli_process(["check", str(typo), "--model", "gpt-13b", "--gpus", "8"])
    assert r.returncode == 2 and "sharding_strategy" in r.stderr and "FULL_SHARD" in r.stderr


# --- the trainers' dialects (issue 11): emit -> the trainer's own file -> check reads the same config ----------

TWO_NODES = make_cluster(16, gpus_per_node=8)


def hf_arguments_file(args, path: Path) -> Path:
    """TrainingArguments saved the way scripts save them (to_dict, as JSON or YAML). accelerate's
    ParallelismConfig.to_json() returns None (accelerate 1.15), so to_dict() loses the HSDP mesh: it is written
    as the mapping check reads."""
    data = args.to_dict()
    if args.parallelism_config is not None:
        pc = args.parallelism_config
        data["parallelism_config"] = {"dp_replicate_size": pc.dp_replicate_size, "dp_shard_size": pc.dp_shard_size}
    path.write_text(yaml.safe_dump(data) if path.suffix == ".yaml" else __import__("json").dumps(data))
    return path


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("config", [
    FsdpConfig(micro_batch=2, grad_accum=4),
    FsdpConfig(sharding="SHARD_GRAD_OP", precision="fp16", ac_every=1, offload=True),
    FsdpConfig(sharding="HYBRID_SHARD", precision="fp32", compile=True),
    FsdpConfig(sharding="HYBRID_SHARD_ZERO2", ac_every=1, forward_prefetch=True, backward_prefetch=False),
    FsdpConfig(sharding="NO_SHARD", micro_batch=4),
])
def test_hf_trainer_round_trip(tmp_path, training_arguments, config, version):
    from planner.emit.trainers import emit_hf_trainer

    args = training_arguments(emit_hf_trainer(config, SPEC, TWO_NODES, fsdp_version=version))
    back = read_setup(hf_arguments_file(args, tmp_path / ("args.yaml" if version == 1 else "args.json")))
    expected_version = 1 if config.sharding.value == "NO_SHARD" else version  # accelerate's FSDP2 has no NO_SHARD
    if expected_version == 2:  # FSDP2 always prefetches in backward and has no forward_prefetch flag
        config = FsdpConfig(**{**config.__dict__, "backward_prefetch": True, "forward_prefetch": False})
    # the compiled loss is the snippet's compute_loss_func (code), not an argument: read back, the loss is eager
    # the shard group read as written (8 GPUs), one node's as check prices it
    expected = FsdpConfig(**{**config.__dict__, "compile_loss": not config.compile})
    assert node_shard_group(back.config, TWO_NODES) == expected
    assert (back.dialect, back.fsdp_version, back.wrap, back.init) == ("hf-trainer", expected_version, "block", "rank0")
    assert back.sync_module_states  # rank 0 loads; FSDP1's sync_module_states / FSDP2's broadcast share it
    assert back.n_processes == (16 if config.sharding.is_hybrid and expected_version == 2 else None)


def _flags_as_toml(text: str) -> str:
    """The same overrides as a torchtitan TOML job file: --a.b=v -> [a] b = v, --a.b -> true, --a.no-b -> false."""
    import re

    tables: dict = {}
    for line in text.splitlines():
        if not line.startswith("--"):
            continue
        name, eq, value = line[2:].partition("=")
        section, _, option = name.rpartition(".")
        if not eq:
            value = "false" if option.startswith("no-") else "true"
            option = option.removeprefix("no-")
        elif not re.fullmatch(r"-?\d+", value):
            value = f'"{value}"'
        tables.setdefault(section, []).append(f"{option} = {value}")
    return "".join(f"[{s}]\n" + "\n".join(rows) + "\n" for s, rows in tables.items())


@pytest.mark.parametrize("form", ["flags", "toml"])
@pytest.mark.parametrize("config", [
    FsdpConfig(micro_batch=2, grad_accum=3),
    FsdpConfig(sharding="SHARD_GRAD_OP", ac_every=4, offload=True, precision="bf16-pure"),
    FsdpConfig(sharding="HYBRID_SHARD", ac_every="selective-op", compile=True, float8=True, fp8_all_gather=True),
    FsdpConfig(sharding="HYBRID_SHARD_ZERO2", ac_every=1, precision="fp32", float8=True),
    FsdpConfig(sharding="NO_SHARD", micro_batch=4),
])
def test_torchtitan_round_trip(tmp_path, config, form):
    from planner.emit.torchtitan.job import emit_torchtitan
    from cost_models.specs import TrainingSpec

    # 0.2's names (TOML job files are 0.2's form; 0.3's flags round-trip in tests/unit/test_emit_mesh.py)
    text = emit_torchtitan(config, SPEC, TWO_NODES, TrainingSpec(seq_len=4096), version="0.2")
    path = tmp_path / ("overrides.txt" if form == "flags" else "job.toml")
    path.write_text(text if form == "flags" else _flags_as_toml(text))
    back = read_setup(path)
    assert node_shard_group(back.config, TWO_NODES) == config
    assert (back.dialect, back.fsdp_version, back.seq_len, back.n_processes) == ("torchtitan", 2, 4096, 16)
    # HSDP: the shard group's GPUs as written (a node's here), the node from the cluster, not from the replicas
    assert (back.n_machines, back.config.shard_group_gpus) == (None, 8 if config.sharding.is_hybrid else 0)


@pytest.mark.parametrize("kind", ["hf-trainer", "torchtitan"])
def test_planner_pick_round_trips_through_the_trainers_with_no_findings(tmp_path, training_arguments, kind):
    from planner.emit import emit_artifact

    # planned for the trainer the file belongs to (HF Trainer compiles the blocks only, its loss stays eager;
    # torchtitan's compile.components carries the compiled loss): read back, it is the plan that was priced
    p = plan("llama2-7b", gpus=16, seq_len=4096, trainer={"hf-trainer": "hf", "torchtitan": "torchtitan"}[kind])
    text = emit_artifact(kind, p.best)
    path = hf_arguments_file(training_arguments(text), tmp_path / "args.json") if kind == "hf-trainer" else \
        tmp_path / "overrides.txt"
    if kind == "torchtitan":
        path.write_text(text)
    r = check(read_setup(path), "llama2-7b", 16, seq_len=4096)
    assert r.candidate.config == p.best.config
    assert r.candidate.time.tokens_per_s_per_gpu == pytest.approx(p.best.time.tokens_per_s_per_gpu, rel=1e-9)
    assert not [f for f in r.findings if f.severity != "advice"], r.findings


def test_check_cli_reads_torchtitan_flags(tmp_path):
    flags = tmp_path / "overrides.txt"
    flags.write_text("--parallelism.data_parallel_shard_degree=8\n--activation_checkpoint.mode=full\n"
                     "--training.local_batch_size=2\n")
    ok = cli_process(["check", str(flags), "--model", "llama3-8b", "--format", "json"])
    assert ok.returncode in (0, 1), ok.stderr  # the file names the GPU count: no --gpus
    import json
    report = json.loads(ok.stdout)
    assert report["source"] == str(flags) and report["config"]["micro_batch"] == 2
    flags.write_text("--parallelism.pipeline_parallel_degree=2\n--parallelism.pipeline_parallel_microbatch_size=3\n")
    bad = cli_process(["check", str(flags), "--model", "llama3-8b"])
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "parallelism.pipeline_parallel_microbatch_size" in bad.stderr
