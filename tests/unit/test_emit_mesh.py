"""The mesh in the emitted configs (issue 17, item 5): --emit torchtitan in torchtitan 0.3's names, parsed by
torchtitan 0.3.0's own ConfigManager (0.2's spellings behind --emit torchtitan-0.2); --emit fsdp2's N-D
init_device_mesh, TP plan, context parallel and fully_shard on the data-parallel sub-mesh, run on a tiny model
under a fake process group; accelerate / HF Trainer ParallelismConfig; and what a dialect cannot express, one
line each."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from cost_models.feasibility import node_shard_group
from cost_models.specs import FsdpConfig, TrainingSpec
from planner.emit.torchtitan.job import emit_torchtitan
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import load_preset
from planner.doctor.readers import read_setup
from planner.doctor.readers.torchtitan import from_torchtitan, torchtitan_settings

LLAMA = load_preset("llama3-8b")
DEEPSEEK = load_preset("deepseek-v3")
ONE_NODE, TWO_NODES = make_cluster(8), make_cluster(16, gpus_per_node=8)


def flag_lines(text: str) -> list[str]:
    """What `$(grep -v '^#' FILE)` hands torchtitan: every line that is not a comment."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(" " not in line for line in lines), lines
    return lines


def _torchtitan_03() -> str | None:
    """Why torchtitan's own parser cannot run here, or None."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (a test-only dependency: pip install -e '.[test]')"
    version = importlib.metadata.version("torchtitan")
    return None if version.startswith("0.3") else f"torchtitan {version} installed; these are 0.3's names"


def parse_with_torchtitan(sets: list[tuple[str, str, list[str]]]) -> list[dict]:
    """Each (module, config, args) through torchtitan's ConfigManager.parse_args (tests/unit/torchtitan_parse.py,
    in the parser process this test process keeps)."""
    from tests.unit.torchtitan_parse import parse

    return parse(sets)


# (plan, model, cluster, seq_len) and what torchtitan must resolve from the emitted flags
PLANS = {
    "plain": (FsdpConfig(), LLAMA, ONE_NODE, 2048,
              dict(dp_replicate=1, dp_shard=8, tp=1, cp=1, ep=1, ac="none", compile=False, global_batch_size=8)),
    "compile-float8": (FsdpConfig(compile=True, float8=True, ac_every=1, micro_batch=2), LLAMA, ONE_NODE, 4096,
                       dict(dp_shard=8, compile=True, components=["model", "loss"], ac="FullAC", local_batch_size=2,
                            global_batch_size=16, seq_len=4096)),
    "selective-op-hsdp": (FsdpConfig(sharding="HYBRID_SHARD", ac_every="selective-op", micro_batch=2, grad_accum=4),
                          LLAMA, TWO_NODES, 8192,
                          dict(dp_replicate=2, dp_shard=8, reshard="default", ac="SelectiveAC",
                               global_batch_size=2 * 16 * 4)),
    # HSDP over shard groups of two nodes (16 GPUs: dp_shard 8 x tp 2), not the node: 4 replicas on 64 GPUs
    "hsdp-groups-of-two-nodes": (FsdpConfig(sharding="HYBRID_SHARD", shard_group_gpus=16, tp=2), LLAMA,
                                 make_cluster(64), 2048, dict(dp_replicate=4, dp_shard=8, tp=2, reshard="default")),
    "tp2-cp4-async": (FsdpConfig(tp=2, cp=4, compile=True, async_tp=True, ac_every=1), LLAMA, TWO_NODES, 131072,
                      dict(dp_replicate=1, dp_shard=2, tp=2, cp=4, async_tp=True, sequence_parallel=True,
                           global_batch_size=2, seq_len=131072)),
    "tp8-no-sp": (FsdpConfig(tp=8, sequence_parallel=False, sharding="SHARD_GRAD_OP"), LLAMA, ONE_NODE, 2048,
                  dict(dp_shard=1, tp=8, sequence_parallel=False, async_tp=False, reshard="never",
                       global_batch_size=1)),
    "cp8": (FsdpConfig(cp=8, ac_every=1), LLAMA, ONE_NODE, 262144, dict(dp_shard=1, cp=8, global_batch_size=1)),
    "ep8-deepseek": (FsdpConfig(ep=8, ac_every=1), DEEPSEEK, make_cluster(64), 4096,
                     dict(dp_shard=64, ep=8, tp=1, ac="FullAC")),
    "bf16-pure-every-2": (FsdpConfig(precision="bf16-pure", offload=True, ac_every=2), LLAMA, ONE_NODE, 2048,
                          dict(dtype="bfloat16", offload=True, ac="FullAC")),  # 0.3 has no every-K: full, noted
}


def _emitted(name: str, version: str = "0.3") -> str:
    config, spec, cluster, seq_len, _ = PLANS[name]
    return emit_torchtitan(config, spec, cluster, TrainingSpec(seq_len=seq_len), version=version)


def _as_parsed(lines: list[str]) -> tuple[str, str, list[str]]:
    """(module, config, the other args). Float8's config function of one's own needs torchao and an FP8 GPU to
    build: the flags are parsed on the model's stock config function (the function itself: below)."""
    module = next(line.split("=", 1)[1] for line in lines if line.startswith("--module="))
    config = next(line.split("=", 1)[1] for line in lines if line.startswith("--config="))
    if module == "fsdp_plan_float8":
        module, config = "llama3", config.removesuffix("_float8")
    return module, config, [line for line in lines if not line.startswith(("--module=", "--config="))]


# The five 0.2 spellings 0.3.0's parser rejects (issue 17), each alone on 0.3's llama3_8b
SPELLINGS_02 = ["--activation_checkpoint.mode=full", "--model.converters=quantize.linear.float8",
                "--quantize.linear.float8.filter_fqns=output",
                "--quantize.linear.float8.no-enable_fsdp_float8_all_gather",
                "--quantize.linear.float8.no-precompute_float8_dynamic_scale_for_fsdp"]


def float8_function_code(text: str) -> str:
    """The Float8 config function the 0.3 notes write (comment lines indented by two)."""
    return "\n".join(line[4:] for line in text.splitlines() if line.startswith("#   "))


FLOAT8_FUNCTIONS = {"llama3.1-70b": ("llama3_70b_float8", "70B"), "deepseek-v3": ("deepseek_v3_671b_float8", "671B"),
                    "qwen3-30b-a3b": ("qwen3_30b_a3b_float8", "30B-A3B")}


@pytest.fixture(scope="session")  # once per run: xdist may interleave modules, which re-ran module fixtures
def parsed():
    why = _torchtitan_03()
    if why:
        pytest.skip(why)
    sets = [_as_parsed(flag_lines(_emitted(name))) for name in PLANS]
    sets += [("llama3", "llama3_8b", [flag]) for flag in SPELLINGS_02]
    sets += [("<float8 config function>", float8_function_code(emit_torchtitan(
        FsdpConfig(float8=True, compile=True), load_preset(model), ONE_NODE)), [function])
             for model, (function, _) in FLOAT8_FUNCTIONS.items()]
    results = parse_with_torchtitan(sets)
    n, m = len(PLANS), len(SPELLINGS_02)
    return dict(zip(PLANS, results[:n])), results[n:n + m], dict(zip(FLOAT8_FUNCTIONS, results[n + m:]))


@pytest.mark.parametrize("model", FLOAT8_FUNCTIONS)
def test_torchtitan_03_float8_config_function_runs_in_torchtitan(parsed, model):
    """The function builds torchtitan's own flavor of the model, with a Float8LinearConverter config that keeps
    the head in bf16 (its build() is left out: it needs torchao and an FP8 GPU)."""
    got = parsed[2][model]
    assert got["flavor"] == FLOAT8_FUNCTIONS[model][1]
    assert (got["converter"], got["filter_fqns"], got["model_compile_enabled"]) == (
        "Float8LinearConverter.Config", ["lm_head"], True)


@pytest.mark.parametrize("name", PLANS)
def test_torchtitan_03_parses_every_emitted_override_set(parsed, name):
    got = parsed[0][name]
    assert "error" not in got, got
    want = PLANS[name][4]
    assert {key: got[key] for key in want} == want
    assert got["pp"] == 1 and got["mixed_precision_param"] == "bfloat16"
    assert got["checkpoint"] == [True, "checkpoint", 500, "disabled"]  # each rank's shard with DCP, as priced


def test_torchtitan_03_rejects_the_0_2_spellings_the_old_emitter_wrote(parsed):
    for flag, got in zip(SPELLINGS_02, parsed[1]):
        assert got == {"error": f"Unrecognized options: {flag}"}
    old = flag_lines(_emitted("compile-float8", version="0.2"))
    assert sum(line.split("=")[0].replace(".no-", ".") in {f.split("=")[0].replace(".no-", ".") for f in SPELLINGS_02}
               for line in old) == 5  # what --emit torchtitan-0.2 still writes, for 0.2


def test_torchtitan_03_float8_config_function_is_torchtitans_form():
    """The Float8 config function the notes write: valid Python, on names torchtitan 0.3 has (model_registry
    takes converters; Float8LinearConverter.Config has filter_fqns and model_compile_enabled)."""
    import ast

    text = _emitted("compile-float8")
    code = float8_function_code(text)
    tree = ast.parse(code)
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef)] == ["llama3_8b_float8"]
    assert 'filter_fqns=["lm_head"], model_compile_enabled=True' in code
    assert flag_lines(text)[:2] == ["--module=fsdp_plan_float8", "--config=llama3_8b_float8"]
    assert "rowwise" in text and "--model.converters" not in flag_lines(text)


def test_torchtitan_03_lines_and_degrees():
    lines = flag_lines(_emitted("tp2-cp4-async"))
    assert lines[:2] == ["--module=llama3", "--config=llama3_8b"] and lines[-1] == "activation-checkpoint:full"
    for line in ("--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=4",
                 "--parallelism.expert_parallel_degree=1", "--parallelism.data_parallel_shard_degree=2",
                 "--compile.enable_async_tensor_parallel", "--parallelism.enable_sequence_parallel",
                 "--training.global_batch_size=2"):
        assert line in lines
    assert "--parallelism.expert_parallel_degree=8" in flag_lines(_emitted("ep8-deepseek"))
    assert flag_lines(_emitted("ep8-deepseek"))[:2] == ["--module=deepseek_v3", "--config=deepseek_v3_671b"]
    every2 = _emitted("bf16-pure-every-2")
    assert "the plan checkpoints one block in 2; torchtitan 0.3 has no every-K-th-block option" in every2
    assert "--activation_checkpoint.selective_ac_option=2" in flag_lines(_emitted("bf16-pure-every-2", "0.2"))


def test_torchtitan_02_keeps_its_spellings_and_names_async_tp_under_parallelism():
    lines = flag_lines(_emitted("tp2-cp4-async", version="0.2"))
    assert "--parallelism.enable_async_tensor_parallel" in lines and "--activation_checkpoint.mode=full" in lines
    assert not any(line.startswith(("--module", "--config", "activation-checkpoint:")) for line in lines)
    with pytest.raises(PlannerError, match="torchtitan 0.2 always runs sequence parallel") as err:
        _emitted("tp8-no-sp", version="0.2")
    assert len(str(err.value).splitlines()) == 1 and err.value.field == "sequence_parallel"


@pytest.mark.parametrize("version", ["0.3", "0.2"])
@pytest.mark.parametrize("name", [n for n in PLANS if n not in ("bf16-pure-every-2",)])
def test_torchtitan_round_trip_emit_then_check_gives_the_plan_back(tmp_path, name, version):
    config, spec, cluster, seq_len, _ = PLANS[name]
    if version == "0.2" and not config.sequence_parallel:
        return  # refused above
    path = tmp_path / "overrides.txt"
    path.write_text(_emitted(name, version))
    setup = read_setup(path)
    assert setup.dialect == "torchtitan" and setup.seq_len == seq_len
    # 0.3 runs its config function's loss, ChunkedLossWrapper, whatever was priced (the job's notes say so)
    read = node_shard_group(setup.config, cluster)  # the shard group's GPUs as written: a node's is the default's
    assert read == (replace(config, loss_kernel="chunked") if version == "0.3" else config)
    assert setup.n_processes == cluster.n_gpus
    assert (setup.init, setup.state_dict_type) == ("dcp", "SHARDED_STATE_DICT")  # the trainer's meta-dcp / dcp ways


@pytest.mark.parametrize("mode, way", [("disabled", "dcp"), ("async_with_pinned_mem", "dcp-async")])
def test_torchtitan_checkpoint_flags_price_the_save(tmp_path, mode, way):
    """The emitted [checkpoint] flags save each rank's shard with DCP, which check prices as the plan does: each of
    the node's 8 ranks copies one item ahead of the writer, its slice of the largest tensor (the fp32 embedding,
    128,256 x 4,096 x 4 B / 8) plus the 10 MB copy-ahead; an async mode stages the rank's whole shard to host first:
    fp32 params and Adam's two states, 12 B x 8,030,261,248 parameters / 8, on each of the 8 ranks. Both hold DCP's
    plans and metadata (outside_step.dcp_plan_bytes): 291 parameters' 873 sharded keys (each tensor and Adam's two
    states) in 8 chunks each and 303 written once (291 steps, 12 settings), 7,287 chunks over 1,176 keys: rank 0
    27,677,742 B and 19,488,193 B on each of the other 7 (the per-chunk, per-key and fixed bytes measured there)."""
    from cost_models.outside_step import DCP_OBJECT_BYTES_OTHERS, DCP_OBJECT_BYTES_RANK0
    from planner.doctor import check

    path = tmp_path / "overrides.txt"
    path.write_text(_emitted("plain").replace("--checkpoint.async_mode=disabled", f"--checkpoint.async_mode={mode}"))
    host = check(read_setup(path), "llama3-8b", 8, gpu="h100-80gb").candidate.memory.host_ram
    assert host.save_way.value == way
    rank0, others = (round(chunk * 7_287 + key * 1_176 + fixed) for chunk, key, fixed in (DCP_OBJECT_BYTES_RANK0,
                                                                                          DCP_OBJECT_BYTES_OTHERS))
    assert rank0 + 7 * others == 164_095_093
    assert host.save_bytes == rank0 + 7 * others + (8 * (128_256 * 4_096 * 4 // 8 + 10_000_000) if way == "dcp"
                                                    else 12 * 8_030_261_248)


def test_torchtitan_every_2_reads_back_as_what_0_3_runs():
    settings = torchtitan_settings(_emitted("bf16-pure-every-2"), Path("overrides.txt"))
    config = PLANS["bf16-pure-every-2"][0]
    # what 0.3 runs, said in the notes: every block, and its configs' chunked loss
    assert from_torchtitan(settings).config == replace(config, ac_every=1, loss_kernel="chunked")
    assert from_torchtitan(torchtitan_settings(_emitted("bf16-pure-every-2", "0.2"), Path("o"))).config == config


# ---------------------------------------------------------------- --emit fsdp2 with a mesh

def _tiny_hf_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=128, max_position_embeddings=256, attn_implementation="sdpa")
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides}))


@pytest.fixture
def fake_group():
    """A fake process group of `world` ranks (this rank 0): collectives move nothing, shapes are real."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world: int):
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())

    yield start
    from calibration.fake_world import _forget_dtensor_placements

    if dist.is_initialized():
        dist.destroy_process_group()
    # DTensor's caches hold this world's meshes and groups: a later fake world of the same mesh shape in this process
    # (the pipeline trace of test_emit_pp_sp_torchrun, run after this file on one worker) redistributed through them
    _forget_dtensor_placements()


MESH_PLANS = [  # (config, cluster): the snippet's MESH_SHAPE / MESH_DIMS must be the plan's mesh
    (FsdpConfig(tp=2), make_cluster(4), (2, 2), ("dp_shard", "tp")),
    (FsdpConfig(tp=2, sequence_parallel=False, ac_every=1), make_cluster(4), (2, 2), ("dp_shard", "tp")),
    (FsdpConfig(sharding="HYBRID_SHARD", tp=2), make_cluster(8, gpus_per_node=4), (2, 2, 2),
     ("dp_replicate", "dp_shard", "tp")),
    (FsdpConfig(cp=4, ac_every=1), make_cluster(8), (2, 4), ("dp_shard", "cp")),
    (FsdpConfig(sharding="HYBRID_SHARD", tp=2, cp=2, compile=True, async_tp=True), TWO_NODES, (2, 2, 2, 2),
     ("dp_replicate", "dp_shard", "cp", "tp")),
    (FsdpConfig(tp=8), ONE_NODE, (1, 8), ("dp_shard", "tp")),
]


@pytest.mark.parametrize("config, cluster, shape, dims", MESH_PLANS, ids=lambda v: str(v)[:40])
def test_fsdp2_mesh_snippet_compiles_with_the_plans_mesh_and_short_lines(config, cluster, shape, dims):
    from cost_models.mesh import mesh_of
    from planner.emit import emit_fsdp2

    code = emit_fsdp2(config, LLAMA, cluster)
    namespace: dict = {}
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)  # imports resolve on this torch
    assert max(len(line) for line in code.splitlines()) <= 100
    assert (namespace["MESH_SHAPE"], namespace["MESH_DIMS"]) == (shape, dims)
    assert dict(mesh_of(config, cluster).used_dims()) == dict(zip(dims, shape))
    # torchtitan's order: TP, then checkpointing, compile, fully_shard
    order = [code.find(s) for s in ("parallelize_module(model.get_submodule", "checkpoint_wrapper(block",
                                    "block.compile()", "fully_shard(block")]
    present = [i for i in order if i >= 0]
    assert present == sorted(present)
    if config.cp > 1:
        assert ('context_parallel(  # each rank keeps s / cp tokens of each sequence\n'
                '            mesh["cp"], buffers=[input_ids, labels, positions], buffer_seq_dims=[1, 1, 1]))') in code
        assert 'mesh["dp_shard", "cp"]._flatten("dp_shard_cp")' in code
    fsdp_mesh = ('mesh["dp_replicate", "dp_shard_cp"]' if "dp_replicate" in dims and config.cp > 1 else
                 'mesh["dp_replicate", "dp_shard"]' if "dp_replicate" in dims else
                 'mesh["dp_shard_cp"]' if config.cp > 1 else 'mesh["dp_shard"]')
    assert f"dp_mesh = {fsdp_mesh}" in code and "    mesh=dp_mesh," in code


@pytest.mark.parametrize("sequence_parallel, tied", [(True, False), (False, False), (True, True)])
def test_fsdp2_tp_snippet_runs_a_training_step_on_a_tiny_llama(fake_group, sequence_parallel, tied):
    """The emitted TP + FSDP2 code on a tiny transformers Llama, 4 fake ranks (dp_shard 2 x tp 2): the mesh is
    the plan's, the linears are DTensors sharded as the plan says, and a forward and backward run (with
    sequence parallel through the snippet's own forward_backward, loss parallel)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from planner.emit import emit_fsdp2

    config = FsdpConfig(tp=2, sequence_parallel=sequence_parallel, ac_every=1)
    code = emit_fsdp2(config, replace(LLAMA, tied_embeddings=tied), make_cluster(4))
    fake_group(4)
    namespace: dict = {}
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)
    made = {}
    real_mesh = namespace["init_device_mesh"]
    namespace["init_device_mesh"] = lambda *a, **k: made.setdefault("mesh", real_mesh(*a, **k))
    torch.manual_seed(0)
    model = namespace["apply_fsdp"](_tiny_hf_llama(tie_word_embeddings=tied), device="cpu")
    mesh = made["mesh"]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied  # one vocab-sharded weight
    assert tuple(mesh.shape) == (2, 2) and mesh.mesh_dim_names == ("dp_shard", "tp")
    attention = model.model.layers[0]._checkpoint_wrapped_module.self_attn
    q, o = attention.q_proj.weight, attention.o_proj.weight
    assert isinstance(q, DTensor) and q.device_mesh.mesh_dim_names == ("dp_shard", "tp")
    # TP: q colwise (Shard(0)), o rowwise (Shard(1)); FSDP shards dim 0 over dp_shard on top (strided over tp)
    assert (q.placements[1], o.placements[1]) == (Shard(0), Shard(1)) and q.placements[0].dim == 0
    assert q.to_local().shape == (64 // 2 // 2, 64)
    norm = model.model.layers[0]._checkpoint_wrapped_module.input_layernorm.weight
    assert norm.placements == ((Shard(0), Replicate()) if sequence_parallel else (Shard(0),))
    ids = torch.randint(0, 128, (2, 16))
    if sequence_parallel:
        loss = namespace["forward_backward"](model, mesh, ids)
    else:
        logits = model(input_ids=ids).logits
        assert logits.shape == (2, 16, 128)  # colwise_gather_output: the whole vocabulary on every rank
        loss = logits.float().mean()
        loss.backward()
    assert loss.shape == () and q.grad is not None and q.grad.placements == q.placements


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_fsdp2_tp_plan_names_each_familys_linears_as_transformers_tp_plan_does(sequence_parallel):
    """Every dense family TP is planned for (cost_models/mesh_rules.TP_MLP_PLANS): the snippet's block plan holds
    exactly the entries transformers 5.24's own base_model_tp_plan holds, under its names and in its kind (colwise /
    rowwise linears; with sequence parallel the norms and module inputs beside them). Starcoder2's plain MLP is
    c_fc / c_proj, not Llama's gate / up / down, which would name no module of its blocks. Qwen3's and Gemma 3's
    q / k norms ("replicated_with_grad_allreduce") are a norm inside the attention with replicated weights and
    a local output (SequenceParallel on the heads: DTensor sums their gradients over tp); without them each rank's
    norm weights learned from its own heads (tests/distributed/test_emit_mesh_torchrun.py's Qwen3 case). OLMo 2,
    whose transformers plan gathers q / k / v (colwise_gather_output) for norms over the whole width, is refused
    (test_olmo2_tp_is_refused_in_one_line)."""
    from transformers import CONFIG_MAPPING

    from cost_models.mesh_rules import TP_MLP_PLANS
    from planner.emit import emit_fsdp2

    def hf_kind(name, style):
        kind = type(style).__name__
        if kind == "SequenceParallel" and name.startswith("self_attn."):  # a norm on the attention's own heads
            assert style.use_local_output, name   # the attention goes on with local tensors
            return "replicated_with_grad_allreduce"
        return {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise"}.get(kind)

    assert "olmo2" not in TP_MLP_PLANS
    for family in TP_MLP_PLANS:
        code = emit_fsdp2(FsdpConfig(tp=2, sequence_parallel=sequence_parallel), replace(LLAMA, family=family),
                          make_cluster(4))
        namespace: dict = {}
        exec(compile(code, "<emitted fsdp2>", "exec"), namespace)
        plan = {name: hf_kind(name, style) for name, style in namespace["block_tp_plan"]().items()}
        plan = {name: kind for name, kind in plan.items() if kind}
        hf = {key.removeprefix("layers.*."): style for key, style in CONFIG_MAPPING[family].base_model_tp_plan.items()}
        assert plan == hf, family
    assert {"mlp.c_fc", "mlp.c_proj"} <= set(plan) and "mlp.gate_proj" not in plan   # the last: starcoder2


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_fsdp2_tp_qk_norms_are_sharded_on_the_heads_transformers_norms(family):
    """The q / k norms' input is a DTensor sharded on the dimension that holds the heads in transformers' own
    attention: a hook on a tiny model's q_norm / k_norm reads the input's shape (batch 3, 5 tokens, 4 query and 2
    KV heads of 16): Qwen3 norms (b, s, heads, d) before its transpose, Gemma 3 (b, heads, s, d) after."""
    import torch
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    from planner.emit import emit_fsdp2

    config = CONFIG_MAPPING[family](hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_hidden_layers=1, vocab_size=128,
                                    attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config)
    attention = model.model.layers[0].self_attn
    shapes = {}
    for name, heads in (("q_norm", 4), ("k_norm", 2)):
        getattr(attention, name).register_forward_pre_hook(
            lambda m, args, name=name, heads=heads: shapes.update({name: list(args[0].shape).index(heads)}))
    with torch.no_grad():
        model(input_ids=torch.zeros(3, 5, dtype=torch.long))
    namespace: dict = {}
    exec(compile(emit_fsdp2(FsdpConfig(tp=2), replace(LLAMA, family=family), make_cluster(4)), "<fsdp2>", "exec"),
         namespace)
    plan = namespace["block_tp_plan"]()
    assert {name: plan[f"self_attn.{name}"].sequence_sharding[0].dim for name in shapes} == shapes
    assert shapes == ({"q_norm": 2, "k_norm": 2} if family == "qwen3" else {"q_norm": 1, "k_norm": 1})


def test_fsdp2_sp_plan_runs_every_norm_of_the_residual_stream_on_sequence_shards():
    """With sequence parallel the block's norms between the residual stream and its modules take the Shard(1)
    DTensor the row-wise outputs leave: every norm child of a tiny transformers block (one layer of each planned
    family) is SequenceParallel in the snippet's plan - Gemma 2 / 3's sandwich four, not Llama's two (the other
    two met the DTensor with a plain weight: 'aten.mul.Tensor got mixed torch.Tensor and DTensor' on 2 gloo ranks,
    by hand; their losses now equal one process's within 5e-7)."""
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    from cost_models.mesh_rules import TP_MLP_PLANS
    from planner.emit import emit_fsdp2

    for family in TP_MLP_PLANS:
        config = CONFIG_MAPPING[family](hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, num_hidden_layers=1, vocab_size=128)
        block = AutoModelForCausalLM.from_config(config).model.layers[0]
        norms = {name for name, child in block.named_children() if "norm" in type(child).__name__.lower()}
        namespace: dict = {}
        exec(compile(emit_fsdp2(FsdpConfig(tp=2), replace(LLAMA, family=family), make_cluster(4)), "<fsdp2>",
                     "exec"), namespace)
        plan = namespace["block_tp_plan"]()
        assert {name for name, style in plan.items() if "." not in name
                and type(style).__name__ == "SequenceParallel"} == norms, family
        assert len(norms) == (4 if family in ("gemma2", "gemma3_text") else 2), family


def test_olmo2_tp_is_refused_in_one_line():
    """OLMo 2's q / k norms span the whole projection width: transformers gathers q / k / v to every rank
    (colwise_gather_output); a plain column-wise split would norm each rank's slice alone, so TP is refused
    (search: tp 1 only) rather than written or priced wrong."""
    from cost_models.mesh_rules import tp_degrees

    olmo2 = load_preset("olmo2-7b")
    assert olmo2.qk_norm == "full" and tp_degrees(olmo2) == [1]


# ---------------------------------------------------------------- accelerate / HF Trainer: ParallelismConfig

TP_CP = FsdpConfig(tp=2, cp=2, sequence_parallel=False)  # FSDP 4 x CP 2 x TP 2 on 16 GPUs


def test_accelerate_fsdp2_mesh_is_a_parallelism_config_accelerate_launch_resolves(tmp_path, load_accelerate):
    import yaml

    from planner.emit import emit_accelerate
    from planner.doctor.readers import from_accelerate

    text = emit_accelerate(TP_CP, LLAMA, TWO_NODES, fsdp_version=2)
    data = yaml.safe_load(text)
    assert data["parallelism_config"] == {"parallelism_config_dp_replicate_size": 1,
                                          "parallelism_config_dp_shard_size": 4, "parallelism_config_tp_size": 2,
                                          "parallelism_config_cp_size": 2}
    _, env, _, _ = load_accelerate(tmp_path, text, ["--main_process_ip", "10.0.0.1"])
    sizes = {k: env[f"PARALLELISM_CONFIG_{k.upper()}"] for k in ("dp_replicate_size", "dp_shard_size", "tp_size",
                                                                  "cp_size")}
    assert sizes == {"dp_replicate_size": "1", "dp_shard_size": "4", "tp_size": "2", "cp_size": "2"}
    assert 'tp_plan="auto", tp_size=2' in text and "accelerator.maybe_context_parallel(" in text
    back = from_accelerate(data)  # check reads the degrees back
    assert back.config == TP_CP and back.n_processes == 16


def test_hf_trainer_mesh_is_the_plans_parallelism_config(tmp_path, training_arguments):
    from planner.emit.trainers import emit_hf_trainer
    from planner.doctor.readers.trainers import from_hf_trainer

    text = emit_hf_trainer(TP_CP, LLAMA, TWO_NODES)
    assert "ParallelismConfig(dp_replicate_size=1, dp_shard_size=4, tp_size=2, cp_size=2)" in " ".join(text.split())
    pc = training_arguments(text).parallelism_config
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (1, 4, 2, 2)
    back = from_hf_trainer({"fsdp": True, "bf16": True, "per_device_train_batch_size": 1, "parallelism_config": {
        "dp_replicate_size": 1, "dp_shard_size": 4, "tp_size": 2, "cp_size": 2}})
    assert (back.config.tp, back.config.cp, back.config.sequence_parallel, back.n_processes) == (2, 2, False, 16)


# what a dialect cannot express: one PlannerError line naming the field and what to use instead
CANNOT = [
    ("fsdp1", FsdpConfig(tp=2), "tp", "FSDP1 (FullyShardedDataParallel) cannot express the plan's mesh (tp=2)"),
    ("accelerate", FsdpConfig(cp=2), "cp", "accelerate's FSDP1 config cannot express the plan's mesh (cp=2)"),
    ("lightning", FsdpConfig(tp=2, cp=2), "tp", "Lightning's FSDPStrategy (FSDP1) cannot express"),
    ("hf-trainer-fsdp1", FsdpConfig(tp=2, sequence_parallel=False), "tp", "HF Trainer's FSDP1"),
    ("accelerate-fsdp2", FsdpConfig(ep=2), "ep", "accelerate has no expert parallelism"),
    ("hf-trainer", FsdpConfig(ep=2), "ep", "HF Trainer has no expert parallelism"),
    ("accelerate-fsdp2", FsdpConfig(tp=2), "sequence_parallel",
     "accelerate runs TP as transformers' tp_plan, which has no sequence parallel (the plan has it)"),
    ("hf-trainer", FsdpConfig(tp=2), "sequence_parallel", "plan with --no-sequence-parallel"),
    ("accelerate-fsdp2", FsdpConfig(tp=8, sequence_parallel=False), "tp",
     "accelerate cannot hold the plan's mesh FSDP 1 x TP 8: accelerate's FSDP2 needs dp_shard or cp > 1"),
]


@pytest.mark.parametrize("kind, config, field, words", CANNOT, ids=lambda v: str(v)[:30])
def test_a_dialect_that_cannot_hold_the_mesh_says_so_in_one_line(kind, config, field, words):
    from types import SimpleNamespace

    from planner.emit import emit_artifact

    candidate = SimpleNamespace(config=config, model=LLAMA, cluster=ONE_NODE, training=TrainingSpec())
    with pytest.raises(PlannerError) as err:
        emit_artifact(kind, candidate)
    assert err.value.field == field and words in str(err.value) and len(str(err.value).splitlines()) == 1
    assert "use --emit" in str(err.value) or "plan with" in str(err.value)


@pytest.mark.parametrize("kind", ["torchrun", "slurm", "pytorchjob"])
def test_launchers_say_the_mesh_is_the_scripts(kind):
    from types import SimpleNamespace

    from planner.emit import emit_artifact

    candidate = SimpleNamespace(config=FsdpConfig(tp=2, cp=2), model=LLAMA, cluster=ONE_NODE, training=None)
    text = emit_artifact(kind, candidate)
    comments = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))  # folded at 100
    assert ("the plan's mesh (tp=2, cp=2) is built by the training script (--emit fsdp2 writes it; --emit "
            "torchtitan sets its degrees); this only launches the ranks") in comments


def test_fsdp2_refuses_transformers_plan_with_tied_embeddings_in_one_line():
    from planner.emit import emit_fsdp2

    tied = load_preset("llama3.2-1b")
    assert tied.tied_embeddings
    with pytest.raises(PlannerError, match="ties its embedding to the head") as err:
        emit_fsdp2(FsdpConfig(tp=2, sequence_parallel=False), tied, ONE_NODE)
    assert err.value.field == "sequence_parallel" and len(str(err.value).splitlines()) == 1
    emit_fsdp2(FsdpConfig(tp=2), tied, ONE_NODE)  # sequence parallel: embedding and head both split on the vocab


@pytest.mark.parametrize("model", ["llama3-8b", "mixtral-8x7b", "deepseek-v3"])
def test_fsdp2_mesh_snippets_with_every_technique_compile_with_short_lines(model):
    from planner.emit import emit_fsdp2

    spec = load_preset(model)
    moe = spec.moe is not None
    for config in (FsdpConfig(tp=2, ac_every="selective-op", compile=True, float8=True, fp8_all_gather=True,
                              reshard_after_forward=2),
                   # EP beside TP is refused in this dialect (test_fsdp2_ep_snippet_...): tp 2 on the dense model
                   FsdpConfig(tp=1 if moe else 2, cp=2, ep=2 if moe else 1, ac_every=2, offload=True, precision="bf16-pure",
                              expert_units=moe),
                   FsdpConfig(sharding="HYBRID_SHARD", cp=2, ep=4 if moe else 1)):
        code = emit_fsdp2(config, spec, TWO_NODES, TrainingSpec(seq_len=4096))
        compile(code, f"<fsdp2 {model}>", "exec")
        assert max(len(line) for line in code.splitlines()) <= 100
        assert ("# expert parallel (ep " in code) is (config.ep > 1)
        assert ("ep_experts, efsdp_mesh = apply_expert_parallel(model, device_type)" in code) is (config.ep > 1)


def test_fsdp2_cp_micro_step_feeds_the_real_positions_and_keeps_attention_causal(fake_group):
    """context_parallel itself has no CPU path (its ring attention dispatches CUDA SDPA kernels only): here it
    is stood in by what it does to rank 0 of cp = 2, keeping load-balanced chunks 0 and 3 of every buffer. The
    snippet's micro-step must then give the rotary embedding those tokens' real positions and leave the mask
    to SDPA's is_causal (an explicit mask, which Hugging Face builds when position_ids jump, ring attention
    cannot take), with the targets shifted before the split."""
    import contextlib
    from unittest import mock

    import torch

    from planner.emit import emit_fsdp2

    code = emit_fsdp2(FsdpConfig(cp=2, precision="fp32"), LLAMA, make_cluster(2))
    fake_group(2)
    namespace: dict = {}
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)
    seen: dict = {"sdpa": []}

    @contextlib.contextmanager
    def rank0_of_cp2(mesh, buffers, buffer_seq_dims):
        assert mesh.mesh_dim_names == ("cp",) and buffer_seq_dims == [1, 1, 1] and len(buffers) == 3
        for buffer in buffers:
            quarter = buffer.shape[1] // 4
            kept = torch.cat([buffer[:, :quarter], buffer[:, 3 * quarter:]], dim=1).clone()
            buffer.resize_(kept.shape).copy_(kept)
        seen["labels"] = buffers[1].clone()
        yield

    made = {}
    real_mesh = namespace["init_device_mesh"]
    namespace.update(context_parallel=rank0_of_cp2,
                     init_device_mesh=lambda *a, **k: made.setdefault("mesh", real_mesh(*a, **k)))
    model = namespace["apply_fsdp"](_tiny_hf_llama(), device="cpu")
    assert made["mesh"].mesh_dim_names == ("dp_shard", "cp") and tuple(made["mesh"].shape) == (1, 2)
    model.model.rotary_emb.register_forward_hook(
        lambda m, args, kwargs, out: seen.update(positions=kwargs["position_ids"].clone()), with_kwargs=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen["sdpa"].append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    ids = torch.arange(16).repeat(2, 1)
    with mock.patch("torch.nn.functional.scaled_dot_product_attention", spy):
        loss = namespace["forward_backward"](model, made["mesh"], ids)
    assert seen["positions"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] * 2
    assert seen["labels"].tolist() == [[1, 2, 3, 4, 13, 14, 15, -100]] * 2  # shifted before the split
    assert seen["sdpa"] == [(None, True)] * 2  # both blocks: no explicit mask, causal
    assert loss.shape == () and not model.model.rotary_emb._forward_pre_hooks  # the hook is gone again


def test_fsdp2_ep_snippet_shards_each_ranks_experts_over_efsdp(fake_group):
    """The emitted EP + FSDP2 code on a tiny transformers Mixtral (8 experts), 4 fake ranks, ep 2: the experts'
    view is (dp_replicate 1, efsdp 2, ep 2, etp 1), each rank keeps 8 / 2 = 4 experts (transformers' ep_plan),
    and FSDP shards those 4 over efsdp 2: 2 expert rows per rank of each stacked tensor; the rest of the block
    over dp_shard 4. The experts' gradient is averaged over the 4 data-parallel ranks."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from torch.distributed.tensor import DTensor

    from planner.emit import emit_fsdp2
    from planner.models import from_hf_config

    hf = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    spec = from_hf_config({"model_type": "mixtral", **hf}, name="tiny-mixtral")
    config = FsdpConfig(ep=2)
    code = emit_fsdp2(config, spec, make_cluster(4))
    assert max(len(line) for line in code.splitlines()) <= 100
    fake_group(4)
    namespace: dict = {}
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)
    assert namespace["EP_MESH_SHAPE"] == (1, 2, 2, 1) and namespace["MESH_SHAPE"] == (4,)
    model = namespace["apply_fsdp"](MixtralForCausalLM(MixtralConfig(**hf, attn_implementation="sdpa")),
                                    device="cpu")
    experts = model.model.layers[0].mlp.experts
    for p in experts.parameters():
        # one DTensor over (efsdp, ep): the 8 experts split 4 per EP rank, those 4 over efsdp: 2 rows here
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("efsdp", "ep")
        assert p.shape[0] == 8 and p.to_local().shape[0] == 2
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.device_mesh.mesh_dim_names == ("dp_shard",) and q.to_local().shape[0] == 64 // 4
    with pytest.raises(PlannerError, match="ep: ep=2 with tp=2"):
        emit_fsdp2(FsdpConfig(ep=2, tp=2), spec, make_cluster(4))
