"""The attention a plan priced is the one its artifact runs (planner/emit/attention.py): the --emit fsdp2 snippet,
exec-ed on a small transformers model built with from_config on one gloo rank, leaves the planned implementation on
the model after apply_fsdp (transformers' own default before it: eager for gpt-oss, which has no SDPA; SDPA for
Llama); `check` reads attn_implementation from an HF arguments file (TRL's model_init_kwargs, or beside
TrainingArguments) and, where a file sets none, prices transformers' default and says so in one finding."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from cost_models.specs import FsdpConfig, TrainingSpec
from planner import estimate
from planner.doctor import check
from planner.doctor.readers import read_setup
from planner.emit import emit_fsdp2, emit_lightning
from planner.emit.trainers import emit_hf_trainer
from planner.emit.format import fold
from planner.errors import PlannerError
from planner.hardware import make_cluster
from planner.models import from_hf_config
from tests.unit.test_emit_pipeline import TINY as PIPELINE_LLAMA, fake_rank  # noqa: F401 (a fixture)

# gpt-oss as tests/unit/test_attention_flex.py builds it; the 4-block Llama of tests/unit/test_apply.py
GPT_OSS = dict(model_type="gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=32, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)
LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, num_hidden_layers=4, vocab_size=512)
ONE_CPU = make_cluster(1, gpus_per_node=1)


@pytest.fixture
def gloo_rank():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield 1
    dist.destroy_process_group()


def _model(fields: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**fields)
    return AutoModelForCausalLM.from_config(config).train()  # no attn_implementation: transformers' default


def _apply(fields: dict, attention: str, **knobs):
    code = fold(emit_fsdp2(FsdpConfig(attention=attention, **knobs), from_hf_config(fields), ONE_CPU))  # as the CLI prints
    assert max(len(line) for line in code.splitlines()) <= 100
    namespace: dict = {}
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)
    model = _model(fields)
    before = model.config._attn_implementation
    return before, namespace["apply_fsdp"](model, device=torch.device("cpu"))


def test_the_fsdp2_snippet_sets_flex_on_gpt_oss(gloo_rank):
    """transformers' flex path runs no backward on CPU (calibration/flex_kernel.py): the implementation is checked,
    not run; gpt-oss' default without the snippet is eager, whose s x s scores the flex plan never priced."""
    pytest.importorskip("transformers")
    before, model = _apply(GPT_OSS, "flex")
    assert before == "eager"
    assert model.config._attn_implementation == "flex_attention"
    assert all(layer.self_attn.config._attn_implementation == "flex_attention" for layer in model.model.layers)


def test_the_fsdp2_snippet_sets_eager_on_llama_and_trains(gloo_rank):
    """A pinned eager plan on Llama (default SDPA), fp32: after apply_fsdp the model runs eager - it returns the
    s x s probabilities, (batch 2, 4 heads, 64, 64), which SDPA never materialises (transformers returns None
    there) - and its FSDP2 step's loss is the unwrapped eager model's to fp32 rounding (rel 1e-6)."""
    pytest.importorskip("transformers")
    before, model = _apply(LLAMA, "eager", precision="fp32")
    assert (before, model.config._attn_implementation) == ("sdpa", "eager")
    reference = _model(LLAMA)
    reference.set_attn_implementation("eager")
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids, output_attentions=True)
    out.loss.backward()
    assert [tuple(a.shape) for a in out.attentions] == [(2, 4, 64, 64)] * 4
    assert out.loss.item() == pytest.approx(reference(input_ids=ids, labels=ids).loss.item(), rel=1e-6)


def test_the_pipeline_snippet_sets_it_on_the_model_its_stages_share(fake_rank):
    """pp 2 x tp 2 on 4 fake ranks (tests/unit/test_emit_pipeline.py's tiny Llama, built with SDPA): apply_fsdp gets
    a Stage, not the Hugging Face model, so build_pipeline sets it on the causal LM, whose config its blocks
    share: rank 0's stage runs eager."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from planner.models import from_module

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**PIPELINE_LLAMA, attn_implementation="sdpa"))
    config = FsdpConfig(pp=2, tp=2, sequence_parallel=False, grad_accum=4, precision="fp32", attention="eager")
    code = fold(emit_fsdp2(config, from_module(model, name="tiny"), make_cluster(4), TrainingSpec(seq_len=32)))
    fake_rank(4, 0)
    namespace: dict = {}
    exec(compile(code, "<emitted fsdp2>", "exec"), namespace)
    _, (stage,), _, _ = namespace["build_pipeline"](model, "cpu")
    assert model.config._attn_implementation == "eager"
    assert [block.self_attn.config._attn_implementation for block in stage.layers.values()] == ["eager"] * 2


def test_the_hf_and_lightning_forms_set_it_through_transformers(hf_snippet):
    """hf-trainer's model_init_kwargs given to from_config, and the Lightning snippet's set_attention(model) (its
    constant and function run alone: the Trainer needs GPUs), turn a tiny gpt-oss from eager to flex_attention."""
    import ast

    from transformers import AutoConfig, AutoModelForCausalLM

    spec, config = from_hf_config(GPT_OSS), FsdpConfig(attention="flex")
    kwargs = hf_snippet(emit_hf_trainer(config, spec, ONE_CPU))["model_init_kwargs"]
    built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**GPT_OSS), **kwargs)
    assert built.config._attn_implementation == "flex_attention"
    tree = ast.parse(fold(emit_lightning(config, spec, ONE_CPU)))
    wanted = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "set_attention")
              or (isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "ATTN_IMPLEMENTATION")]
    namespace: dict = {}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "<lightning>", "exec"), namespace)
    model = _model(GPT_OSS)
    assert model.config._attn_implementation == "eager"
    namespace["set_attention"](model)
    assert model.config._attn_implementation == "flex_attention"


HF_ARGS = {"fsdp": True, "fsdp_config": {"version": 2}, "per_device_train_batch_size": 1, "bf16": True}


@pytest.mark.parametrize("extra, attention, attention_from", [
    ({"model_init_kwargs": {"attn_implementation": "flex_attention"}}, "flex", "code"),  # TRL's SFTConfig
    ({"attn_implementation": "eager"}, "eager", "code"),  # TRL's ModelConfig beside TrainingArguments
    ({}, "sdpa", "unstated"),  # FsdpConfig's own until check prices transformers' default
])
def test_hf_arguments_carry_the_attention(tmp_path, extra, attention, attention_from):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({**HF_ARGS, **extra}))
    setup = read_setup(path)
    assert (setup.config.attention.value, setup.attention_from) == (attention, attention_from)
    path.write_text(json.dumps({**HF_ARGS, "attn_implementation": "flash_attention_2"}))
    with pytest.raises(PlannerError) as error:
        read_setup(path)
    assert error.value.field == "attn_implementation"
    assert "choose one of: sdpa, eager, flex_attention" in str(error.value)


def test_a_gpt_oss_file_without_the_attention_is_priced_as_eager_and_says_so(tmp_path):
    """No attn_implementation: transformers runs eager on gpt-oss (no SDPA with sinks), so check prices eager, as
    the estimate prices an eager gpt-oss-20b (memory bytes equal), with one finding naming flex's fix."""
    path = tmp_path / "args.json"
    path.write_text(json.dumps(HF_ARGS))
    r = check(read_setup(path), "gpt-oss-20b", 8, gpu="h100-80gb", seq_len=4096)
    assert r.candidate.config.attention.value == "eager"
    priced = estimate("gpt-oss-20b", 8, gpu="h100-80gb", seq_len=4096, attention="eager", trainer="hf",
                      micro_batch=1, sharding="FULL_SHARD", precision="bf16")
    assert r.candidate.memory.peak_allocated_bytes == priced.memory.peak_allocated_bytes
    said = [f for f in r.findings if f.code.startswith("attention-")]
    assert [f.code for f in said] == ["attention-not-set"]
    assert 'set_attn_implementation("flex_attention")' in said[0].fix


def test_check_from_flags_prices_the_attention_the_planner_runs():
    """No file, no --attention: gpt-oss is priced with flex (it has no SDPA), as its estimate is (memory bytes equal);
    a llama keeps sdpa."""
    from planner.doctor.readers import UserSetup

    flags = UserSetup(config=FsdpConfig(sharding="FULL_SHARD", precision="bf16"), source="flags")
    r = check(flags, "gpt-oss-20b", 8, gpu="h100-80gb", seq_len=4096)
    assert r.candidate.config.attention.value == "flex"
    priced = estimate("gpt-oss-20b", 8, gpu="h100-80gb", seq_len=4096, micro_batch=1, sharding="FULL_SHARD",
                      precision="bf16", activation_checkpointing="none")
    assert priced.config.attention.value == "flex"
    assert r.candidate.memory.peak_allocated_bytes == priced.memory.peak_allocated_bytes
    assert check(flags, "llama3-8b", 8, gpu="h100-80gb").candidate.config.attention.value == "sdpa"
