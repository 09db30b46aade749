"""The generic path: any causal LM transformers builds, priced by a traced block memory profile.

Counts are checked against transformers on the meta device; the profile against the formulas of a family
that has them (Llama: the formulas are within 0.01% of the trace tier, docs/accuracy.md) and the estimate
built on it against the trace tier; the caches against re-profiling; bad input against one-line errors.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from cost_models import activations, activations_backward  # noqa: E402
from cost_models.specs import Attention  # noqa: E402
from planner.api import estimate  # noqa: E402
from planner.errors import PlannerError, UnsupportedModel  # noqa: E402
from planner.models import from_hf_config  # noqa: E402
from planner.models.block_profiles import cache_dir, with_block_profile  # noqa: E402
from tests.doctor.cli_run import cli_process  # noqa: E402

# Families transformers ships that have no reader here (the generic path prices them).
GRANITE = {"model_type": "granite", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 3000, "tie_word_embeddings": True,
           "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
           "logits_scaling": 16.0}
COHERE = {"model_type": "cohere", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 3,
          "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 3000}
LLAMA4 = {"model_type": "llama4_text", "hidden_size": 256, "intermediate_size": 256, "intermediate_size_mlp": 768,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
          "vocab_size": 3000, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 3000}


# Profiles are cached in the test session's FSDP_PLANNER_CACHE (tests/conftest.py), so each (config, dtype,
# attention, seq_len) is traced once per run. The tests whose claim is about the cache itself get a directory
# of their own: Granite's at seq 256 (made, then read by the caching, CLI and no-torch tests: one trace, not
# three), the remote-code Llama's (so the refusal without the flag meets no cached spec), an empty one.
@pytest.fixture(scope="module")
def _module_caches(tmp_path_factory):
    return {name: tmp_path_factory.mktemp(f"{name}-cache") for name in ("granite", "remote-code")}


@pytest.fixture
def granite_cache(_module_caches, monkeypatch):
    monkeypatch.setenv("FSDP_PLANNER_CACHE", str(_module_caches["granite"]))


@pytest.fixture
def remote_cache(_module_caches, monkeypatch):
    monkeypatch.setenv("FSDP_PLANNER_CACHE", str(_module_caches["remote-code"]))


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_PLANNER_CACHE", str(tmp_path / "cache"))


def _meta_count(cfg: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **fields))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cfg", [GRANITE, COHERE, LLAMA4], ids=["granite", "cohere", "llama4_text"])
def test_counts_equal_the_meta_build(cfg):
    spec = from_hf_config(dict(cfg), name=cfg["model_type"])
    assert spec.n_params == _meta_count(cfg)
    assert spec.n_layers == cfg["num_hidden_layers"] and spec.hidden_size == 256


def test_interleaved_moe_layout_read_from_the_built_model():
    """Llama 4: every second layer is sparse, 4 stacked experts of (256 -> 2 x 256) and (256 -> 256)."""
    spec = from_hf_config(dict(LLAMA4), name="llama4")
    moe = spec.moe
    # interleaved, not leading: first_sparse_layer 0 (the profile averages over the pattern)
    assert (moe.n_experts, moe.experts_per_token, moe.n_dense_layers, moe.first_sparse_layer) == (4, 1, 2, 0)
    assert moe.stacked_expert_tensors == ((4, 256 * 2 * 256), (4, 256 * 256))
    assert moe.expert_params == 3 * 256 * 256
    assert moe.dense_layers == (0, 2)  # moe_layers = [1, 3]
    # a token visits 1 of 4 experts in each of the 2 sparse layers
    assert spec.n_params - spec.active_params == 2 * 3 * moe.expert_params
    # Llama4TextMoe's shared_expert is a Llama4TextMLP of intermediate_size (256), the dense blocks' MLP one of
    # intermediate_size_mlp (768): gate, up, down each, read from the module (no config key names the first)
    assert (moe.shared_ffn_size, moe.shared_params, moe.dense_ffn_size) == (256, 3 * 256 * 256, 768)
    assert not spec.shared_expert_gated
    # its eager_attention_forward's softmax keeps the scores' dtype (modeling_llama4.py:267); Granite's is fp32
    assert spec.eager_softmax_fp32 is False and from_hf_config(dict(GRANITE), name="granite").eager_softmax_fp32


def test_a_gated_shared_expert_is_read_from_the_built_model():
    """Qwen3-Next (no reader): its shared expert (shared_expert_intermediate_size) and the sigmoid gate beside it
    (shared_expert_gate, h -> 1) are the MoE module's children that hold no expert-count rows."""
    cfg = {"model_type": "qwen3_next", "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
           "shared_expert_intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 3000, "num_experts": 8, "num_experts_per_tok": 2,
           "linear_num_value_heads": 4, "linear_num_key_heads": 2}
    spec = from_hf_config(cfg, name="qwen3-next")
    assert (spec.moe.shared_ffn_size, spec.moe.shared_params) == (384, 3 * 256 * 384 + 256)
    assert spec.shared_expert_gated and spec.moe.n_dense_layers == 0


def test_profile_sees_the_layer_pattern_transformers_derives():
    """Llama 4's config.json names no layer_types: transformers derives a no-RoPE, full-attention layer
    every fourth (the rest chunked) and the sparse layers from interleave_moe_layer_step. One period (4)
    + 2 layers are profiled, their lists cut from the derived ones."""
    from calibration.block_profile import _reduced_config, profiled_layers

    assert profiled_layers(dict(LLAMA4)) == 6
    reduced = _reduced_config(dict(LLAMA4), 6)
    assert reduced["no_rope_layers"] == [1, 1, 1, 0, 1, 1] and reduced["moe_layers"] == [1, 3, 5]
    assert reduced["layer_types"][3] == "full_attention" and reduced["layer_types"].count("full_attention") == 1


@pytest.mark.parametrize("setting", [
    # every second block dense: the block gathered at each moment and its prefetch have their own sizes
    dict(gpus=32, precision="fp32", activation_checkpointing="every-2", attention="eager", seq_len=512),
    # chunks shorter than the sequence: SDPA gets a (s, s) boolean mask that every checkpointed block keeps
    dict(gpus=4, precision="bf16-pure", activation_checkpointing="full", attention="sdpa", seq_len=4096,
         attention_chunk_size=1024),
], ids=["interleaved-gathers", "checkpoint-held-mask"])
def test_interleaved_moe_estimate_matches_the_trace(setting):
    """Llama 4 (no reader), priced from its profile, against the trace tier: these rows were +10.8% (a
    sparse block's size at every moment) and -5.1% (the mask) before."""
    from planner.tracing import trace

    setting = dict(setting)
    cfg = {**LLAMA4, "attention_chunk_size": setting.pop("attention_chunk_size", 8192)}
    report = trace(cfg, setting.pop("gpus"), sharding="FULL_SHARD", micro_batch=1, **setting)
    assert abs(report.relative_error) < 0.01, report.relative_error


def test_block_profile_of_a_family_with_formulas_matches_them():
    """The Llama formulas are exact against the trace; the traced profile must agree with them within 2%."""
    spec = from_hf_config(dict(LLAMA), name="llama")
    seq = 512
    profiled = with_block_profile(spec, LLAMA, seq, attentions=("sdpa", "eager"))
    for dtype, c in (("bf16", 2), ("fp32", 4)):
        for attention in (Attention.SDPA, Attention.EAGER):
            terms = profiled.activation_profile.get(dtype, attention.value)
            formula = activations.block_bytes_per_token(spec, c, attention, seq)
            assert terms.saved_bytes_per_token(seq) == pytest.approx(formula, rel=0.02)
    # backward: the MLP moment of an sdpa block holds c*h + 2*c*f above the saved tensors, with fc2's
    # weight gradient (h x f) accumulated
    acts, grads = profiled.activation_profile.get("bf16", "sdpa").backward_peak(4 * seq, seq)
    assert acts / (4 * seq) == pytest.approx(activations_backward.mlp_backward_working_bytes_per_token(spec, 2), rel=0.02)
    assert grads == 256 * 704 * 2


def test_generic_estimate_matches_the_trace():
    """Granite (no reader) priced from its profile, against the trace tier on the same config."""
    from planner.tracing import trace

    kwargs = dict(precision="bf16", micro_batch=2, seq_len=512)
    report = trace(dict(GRANITE), 4, **kwargs)
    assert report.candidate.model.priced_by == "block memory profile"
    assert abs(report.relative_error) < 0.01, report.relative_error


def test_profile_and_spec_are_cached(granite_cache):
    first = estimate(dict(GRANITE), 4, seq_len=256)
    files = sorted(p.name for p in cache_dir().iterdir())
    assert len(files) == 3  # the spec and two profiles (bf16, fp32) for sdpa
    assert "made in" in first.model.activation_profile.source
    second = estimate(dict(GRANITE), 4, seq_len=256)
    assert "cached in" in second.model.activation_profile.source
    assert second.memory.peak_allocated_bytes == first.memory.peak_allocated_bytes
    # a damaged profile is made again, not trusted
    victim = next(p for p in cache_dir().iterdir() if not p.name.startswith("spec-"))
    victim.write_text("{not json")
    third = estimate(dict(GRANITE), 4, seq_len=256)
    assert third.memory.peak_allocated_bytes == first.memory.peak_allocated_bytes
    assert json.loads(victim.read_text())["key"] == victim.stem


def test_remote_code_is_refused_without_the_flag():
    cfg = {**LLAMA, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    with pytest.raises(PlannerError, match="--trust-remote-code") as err:
        from_hf_config(cfg)
    assert err.value.field == "trust_remote_code"


def test_unknown_model_type_names_the_transformers_version():
    import transformers

    with pytest.raises(UnsupportedModel, match=transformers.__version__):
        from_hf_config({"model_type": "not-a-model", "hidden_size": 8})


def test_cli_refuses_remote_code_in_one_line_and_writes_nothing(tmp_path, empty_cache):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    r = cli_process(["--model", str(path), "--gpus", "8"])
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--trust-remote-code" in r.stderr
    assert "Traceback" not in r.stderr
    assert not cache_dir().exists()


def test_cli_says_which_path_priced_the_model(tmp_path, granite_cache):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GRANITE))
    r = cli_process(["--model", str(path), "--gpus", "4", "--seq-len", "256"])
    assert r.returncode == 0, r.stderr
    # the profile test_profile_and_spec_are_cached made: "cached in <dir> (first made in X s)"
    assert "activations: traced block memory profile" in r.stdout and "made in" in r.stdout


def test_a_cached_generic_model_plans_without_importing_torch(tmp_path, granite_cache):
    """After the first profile the search is as fast as for a preset: no torch, no transformers, no build."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GRANITE))
    estimate(str(path), 4, seq_len=256)  # makes the spec and its profiles (this process has torch already)
    code = ("import sys; from planner.api import plan; p = plan(sys.argv[1], 4, seq_len=256); "
            "print(p.best is not None, 'torch' in sys.modules, 'transformers' in sys.modules, p.model.priced_by)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "False", "block", "memory", "profile"]


def _remote_code_dir(tmp_path):
    """A model whose code lives next to its config.json (auto_map), as on the Hub: a Llama under another name."""
    d = tmp_path / "remote-llama"
    d.mkdir()
    (d / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyRemoteConfig(LlamaConfig):\n    model_type = 'tiny_remote'\n")
    (d / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_tiny import TinyRemoteConfig\n\n\n"
        "class TinyRemoteForCausalLM(LlamaForCausalLM):\n    config_class = TinyRemoteConfig\n")
    cfg = {**LLAMA, "model_type": "tiny_remote", "auto_map": {"AutoConfig": "configuration_tiny.TinyRemoteConfig",
                                                               "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM"}}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_remote_code_runs_with_the_flag_and_is_priced_like_its_llama(tmp_path, remote_cache):
    d = _remote_code_dir(tmp_path)
    with pytest.raises(PlannerError, match="--trust-remote-code"):
        estimate(str(d), 4, seq_len=256)
    remote = estimate(str(d), 4, seq_len=256, trust_remote_code=True)
    llama = estimate(dict(LLAMA), 4, seq_len=256)
    assert remote.model.n_params == llama.model.n_params == _meta_count(LLAMA)
    assert remote.model.priced_by == "block memory profile" and llama.model.priced_by == "formula"
    # the traced profile of the same block agrees with the Llama formulas
    assert remote.memory.peak_allocated_bytes == pytest.approx(llama.memory.peak_allocated_bytes, rel=0.01)


def test_the_trace_tier_builds_remote_code_with_the_flag(tmp_path, remote_cache):
    """calibration.build takes the model class from the model's directory, as the profile does."""
    from planner.tracing import trace

    report = trace(str(_remote_code_dir(tmp_path)), 4, seq_len=256, trust_remote_code=True)
    assert abs(report.relative_error) < 0.001, report.relative_error


def test_a_model_whose_code_does_not_trace_falls_back_to_the_generic_recipe_and_says_why():
    """JetMoE routes with data-dependent shapes (a .item() on the router output): no fake-tensor profile."""
    cfg = {"model_type": "jetmoe", "hidden_size": 128, "num_hidden_layers": 3, "num_key_value_heads": 4,
           "kv_channels": 32, "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 1000}
    candidate = estimate(dict(cfg), 2, seq_len=128)
    assert candidate.model.n_params == _meta_count(cfg)
    assert candidate.model.priced_by == "formula"
    assert any("no block memory profile" in n and "DataDependent" in n for n in candidate.memory.notes)


DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
               "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 3000,
               "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
               "n_group": 2, "topk_group": 1, "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
               "qk_rope_head_dim": 16, "v_head_dim": 32, "rope_scaling": None}


def test_a_family_without_an_attention_formula_is_priced_by_its_profile():
    """DeepSeek's latent attention has no formula: with transformers installed its blocks are profiled, the
    leading dense block apart (the formula path was 35% low on the benchmark's deepseek-v3 row, the profile
    without the dense block 6.5% low here). Measured today: -1.04%; a gap of ~530 B per token and sparse
    block between the plain bf16 profile and the FSDP2 trace is not explained yet, hence 2%."""
    from planner.tracing import trace

    report = trace(dict(DEEPSEEK_V3), 4, precision="bf16", micro_batch=2, seq_len=256, attention="eager")
    assert report.candidate.model.priced_by == "block memory profile"
    assert report.candidate.model.moe.n_dense_layers == 1
    assert report.candidate.model.activation_profile.terms[0][2].dense is not None
    assert abs(report.relative_error) < 0.02, report.relative_error
