"""The trace tier: a CI-sized FSDP2 step on fake tensors, checked by hand, and the golden accuracy grid.

The full grid (48 configurations, 6 architectures) is benchmarks/memory_accuracy.py; docs/accuracy.md
holds its figures. Here: the model states of a traced step against a hand count, a handful of
configurations where the analytic estimate must stay within the tolerance the grid achieved, and the
command-line surface (JSON shape, --verify-top, errors).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from calibration.reference import tiny_llama_spec  # noqa: E402
from calibration.trace import TraceUnsupported, UntraceableModel, trace_memory  # noqa: E402
from cost_models.memory import estimate_memory  # noqa: E402
from cost_models.profile import DEFAULT_PROFILE  # noqa: E402
from cost_models.specs import FsdpConfig, TrainingSpec  # noqa: E402
from planner.hardware import make_cluster  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.tracing import TraceReport, trace  # noqa: E402

F32 = 4
# Tolerance of the golden grid: the full benchmark's maximum error was 1.9% (docs/accuracy.md); these
# small configurations must stay within 3%, the median target of the issue.
TOLERANCE = 0.03


def test_traced_model_states_equal_the_hand_count():
    """Reference Llama, fp32, AdamW, sharded over 4 ranks: every weight's dim 0 divides by 4 (no padding). Run as
    HSDP on one 8-GPU node with shard groups of 4 GPUs (shard_group_gpus; mesh (2, 4)): FSDP at a world of 4 for
    every sharded state, as the estimate prices it."""
    spec = tiny_llama_spec()  # 2 blocks of 36,992 params + root 32,832 (embedding, head, final norm)
    n_params = 2 * 36_992 + 32_832
    assert spec.n_params == n_params
    hsdp = FsdpConfig(precision="fp32", sharding="HYBRID_SHARD", shard_group_gpus=4)
    r = trace_memory(spec, hsdp, n_gpus=8, gpus_per_node=8, seq_len=32)
    step = r.phases["optimizer_step"].breakdown
    shard = n_params * F32 // 4                       # 26,704 bytes per rank
    assert step["sharded_params"] == shard
    assert step["sharded_grads"] == shard
    n_tensors = 2 * 9 + 3                             # Adam's step counters: one fp32 scalar per tensor
    assert step["optimizer_state"] == 2 * shard + n_tensors * F32
    # the foreach step's sqrt(exp_avg_sq) list: one more sharded copy
    assert step["optimizer_temporaries"] == shard
    model_states = step["sharded_params"] + step["sharded_grads"] + step["optimizer_state"]
    assert model_states == 4 * shard + n_tensors * F32 == 427_348
    # nothing else is alive during the step but the token ids (int64, 1 x 32)
    assert r.phases["optimizer_step"].peak_allocated_bytes == model_states + shard + 32 * 8
    assert r.builder == "reference" and r.world_size == 8 and r.shard_group_size == 4
    estimated = estimate_memory(spec, make_cluster(8, gpus_per_node=8), TrainingSpec(seq_len=32), hsdp,
                                DEFAULT_PROFILE).phases["optimizer_step"]
    assert (estimated.sharded_params, estimated.sharded_grads, estimated.optimizer_state) == (
        step["sharded_params"], step["sharded_grads"], step["optimizer_state"] - n_tensors * F32)  # no step counters


# Scaled-down configs of the benchmark's architectures (2 layers), quick to trace.
TINY = {
    "llama": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 3000,
              "max_position_embeddings": 4096},
    "llama8": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 3000,
               "max_position_embeddings": 4096},  # enough blocks for the gradients done in a backward to matter
    "gpt2": {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 3000,
             "n_positions": 4096, "bos_token_id": 0, "eos_token_id": 0},
    "qwen2": {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 9000,
              "tie_word_embeddings": True, "max_position_embeddings": 4096},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "vocab_size": 3000, "max_position_embeddings": 4096,
                 "rotary_pct": 0.25},
    "phi3": {"model_type": "phi3", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 3000,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "pad_token_id": 0,
             "bos_token_id": 1, "eos_token_id": 2},
    # a vocabulary near h: under all-linear LoRA the last block's down projection's forward (its adapter beside every
    # saved tensor) is the step's peak, above the loss
    "llama-v320": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
                   "max_position_embeddings": 4096},
}

GOLDEN = [
    ("llama", 8, dict(sharding="FULL_SHARD", precision="bf16", micro_batch=2, seq_len=512)),
    # compile: the loss compiled, traced as calibration/fused_loss.py (the blocks trace eager: compile is
    # taken to save what eager saves)
    ("llama", 8, dict(sharding="FULL_SHARD", precision="bf16", micro_batch=2, seq_len=512, compile=True)),
    ("llama", 4, dict(sharding="FULL_SHARD", precision="fp32", activation_checkpointing="full", attention="eager",
                      micro_batch=1, seq_len=256)),
    ("gpt2", 4, dict(sharding="SHARD_GRAD_OP", precision="bf16", activation_checkpointing="every-2",
                     micro_batch=2, seq_len=256)),
    ("qwen2", 16, dict(sharding="HYBRID_SHARD", gpus_per_node=8, precision="bf16-pure", micro_batch=1,
                       seq_len=1024)),
    ("gpt_neox", 2, dict(sharding="NO_SHARD", precision="bf16", attention="eager", micro_batch=2, seq_len=256)),
    ("phi3", 8, dict(sharding="HYBRID_SHARD_ZERO2", gpus_per_node=4, precision="fp32",
                     activation_checkpointing="every-2", micro_batch=1, seq_len=512)),
    # gradient accumulation: each micro-step's new gradient shards are added into the kept ones in place (the
    # estimate counted them on top: +10.9% on an 8-block llama at seq 256)
    ("llama8", 2, dict(sharding="FULL_SHARD", precision="bf16", activation_checkpointing="full", micro_batch=1,
                       seq_len=256, grad_accum=2)),
]


@pytest.mark.parametrize("arch,gpus,kwargs", GOLDEN, ids=[f"{a}-{k['sharding']}" + ("-compile" if k.get("compile") else "") for a, _, k in GOLDEN])
def test_golden_estimate_within_tolerance_of_trace(arch, gpus, kwargs):
    r = trace(dict(TINY[arch]), gpus, **kwargs)
    est = r.candidate.memory.peak_allocated_bytes
    traced = r.traced.peak_allocated_bytes
    assert abs(est - traced) / traced <= TOLERANCE, (
        f"estimate {est:,} vs trace {traced:,} ({100 * (est / traced - 1):+.1f}%), estimate peak at "
        f"{r.candidate.memory.peak_moment}; traced breakdown {r.traced.breakdown}")
    # the categories that are pure model state agree exactly where both sides hold them
    b_est, b_tr = r.candidate.memory.phases["optimizer_step"], r.traced.phases["optimizer_step"].breakdown
    assert b_est.sharded_params == pytest.approx(b_tr["sharded_params"], rel=0.02)  # padding to d rows


# LoRA (rank 16 on the attention projections, peft): benchmarks/memory_accuracy.py --finetune lora gives
# median 0.01%, max 2.2% over its 60 configurations (the model without the frozen-weight accounting:
# median 3.5%, max 25%). These rows include the ones that model got most wrong (no checkpointing, bf16).
LORA_GOLDEN = [
    ("llama", 8, dict(sharding="FULL_SHARD", precision="bf16", micro_batch=2, seq_len=512)),
    ("gpt2", 4, dict(sharding="SHARD_GRAD_OP", precision="bf16-pure", attention="eager", micro_batch=2,
                     seq_len=256)),
    ("qwen2", 8, dict(sharding="FULL_SHARD", precision="fp32", activation_checkpointing="full", micro_batch=1,
                      seq_len=512)),
    ("gpt_neox", 2, dict(sharding="NO_SHARD", precision="bf16", micro_batch=2, seq_len=256)),
    ("phi3", 8, dict(sharding="HYBRID_SHARD", gpus_per_node=4, precision="bf16", activation_checkpointing="every-2",
                     micro_batch=1, seq_len=512)),
    # all-linear (the MLP's linears adapted too: their inputs saved by the adapters): measured -0.02% (GPT-2's Conv1D
    # c_fc / c_proj, eager), +0.07% (NeoX's parallel block, two norms), -0.04% (Phi-3's fused gate_up_proj), -0.07%
    # (the forward of the last down projection's adapter, the peak) when written
    ("gpt2", 4, dict(sharding="SHARD_GRAD_OP", precision="bf16-pure", attention="eager", micro_batch=2, seq_len=256,
                     lora_targets="all-linear")),
    ("gpt_neox", 2, dict(sharding="NO_SHARD", precision="bf16", micro_batch=2, seq_len=256, lora_targets="all-linear")),
    ("phi3", 8, dict(sharding="HYBRID_SHARD", gpus_per_node=4, precision="bf16", activation_checkpointing="every-2",
                     micro_batch=1, seq_len=512, lora_targets="all-linear")),
    ("llama-v320", 2, dict(sharding="FULL_SHARD", precision="bf16", micro_batch=2, seq_len=128,
                           lora_targets="all-linear")),
]


@pytest.mark.parametrize("arch,gpus,kwargs", LORA_GOLDEN, ids=[f"{a}-{k['sharding']}" + (
    "-all-linear" if k.get("lora_targets") else "") for a, _, k in LORA_GOLDEN])
def test_lora_golden_estimate_within_tolerance_of_trace(arch, gpus, kwargs):
    pytest.importorskip("peft")
    r = trace(dict(TINY[arch]), gpus, finetune="lora", lora_rank=8, **kwargs)
    est, traced = r.candidate.memory.peak_allocated_bytes, r.traced.peak_allocated_bytes
    assert abs(est - traced) / traced <= TOLERANCE, (
        f"estimate {est:,} vs trace {traced:,} ({100 * (est / traced - 1):+.1f}%); traced {r.traced.breakdown}")
    if kwargs.get("lora_targets"):  # priced as peft adapts them: the same phase, within 0.5%
        assert abs(est - traced) / traced < 0.005 and r.candidate.memory.peak_phase == r.traced.peak_phase
    assert r.candidate.memory.breakdown.activations == pytest.approx(r.traced.breakdown["activations"], rel=0.05)
    # model states exactly (a tied embedding traced as two tensors would add a vocab x hidden copy)
    b_est, b_tr = r.candidate.memory.phases["optimizer_step"], r.traced.phases["optimizer_step"].breakdown
    assert b_est.sharded_params == pytest.approx(b_tr["sharded_params"], rel=0.02)
    assert b_est.optimizer_state == pytest.approx(b_tr["optimizer_state"], rel=0.02)


def test_lora_traced_model_states_equal_the_hand_count():
    """Reference Llama (2 blocks: q, k, v, o of 64x64, 64x32, 64x32, 64x64), rank 4, bf16 mixed on 4 ranks:
    the frozen base is stored in bf16, the adapters in fp32 with fp32 gradients and AdamW state."""
    pytest.importorskip("peft")
    spec = tiny_llama_spec()
    assert spec.lora_target_shapes == ((64, 64), (64, 32), (64, 32), (64, 64))
    lora = 2 * 4 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64)           # 3,584 adapter params
    assert lora == spec.n_layers * spec.lora_params_per_block(4)
    r = trace_memory(spec, FsdpConfig(precision="bf16"), n_gpus=4, gpus_per_node=4, seq_len=32,
                     finetune="lora", lora_rank=4)
    step = r.phases["optimizer_step"].breakdown
    assert step["sharded_params"] == (spec.n_params * 2 + lora * F32) // 4  # 53,408 + 3,584 bytes per rank
    assert step["sharded_grads"] == lora * F32 // 4
    n_tensors = 2 * 4 * 2                                               # lora_A and lora_B of 4 linears x 2 blocks
    assert step["optimizer_state"] == 2 * lora * F32 // 4 + n_tensors * F32


def test_report_json_shape_and_difference():
    r = trace(dict(TINY["llama"]), 4, seq_len=256)
    d = r.to_dict()
    assert d["source"] == "trace"
    assert set(d["memory"]) >= {"peak_allocated_bytes", "peak_reserved_bytes", "peak_phase", "breakdown"}
    assert d["memory"]["peak_allocated_bytes"] == sum(d["memory"]["breakdown"].values())
    assert d["analytic"]["memory"]["peak_allocated_bytes"] == r.candidate.memory.peak_allocated_bytes
    assert d["difference"]["peak_allocated_bytes"] == (r.candidate.memory.peak_allocated_bytes
                                                       - r.traced.peak_allocated_bytes)
    assert set(d["config"]) == set(r.candidate.to_dict()["config"])


def test_reserved_from_the_allocator_replay_of_the_traced_step():
    """The traced step's allocations replayed through cost_models/caching_allocator.py: the replay sees the same
    storages as the tracker (its requested peak is the traced peak, to the byte), rounds each to 512 B, and
    reserves whole segments (multiples of 2 MiB). Measured at this commit: 90 MiB reserved for 50.7 MiB
    allocated, a tiny model whose 20 MiB large-pool segments dominate."""
    from cost_models.units import MiB

    arch, gpus, kwargs = GOLDEN[0]
    r = trace(dict(TINY[arch]), gpus, **kwargs)
    replayed = r.traced.allocator
    assert replayed.peak_requested_bytes == r.traced.peak_allocated_bytes
    assert r.traced.peak_allocated_bytes <= replayed.peak_allocated_bytes <= replayed.peak_reserved_bytes
    assert replayed.peak_reserved_bytes % (2 * MiB) == 0 and replayed.peak_reserved_bytes == 90 * MiB
    # + the estimate's memory outside the allocator (a trace sees the allocator's tensors only)
    assert r.peak_reserved_bytes == replayed.peak_reserved_bytes + r.candidate.memory.outside_allocator_bytes
    flat = trace(dict(TINY[arch]), gpus, reserved_from="flat", **kwargs)
    assert flat.peak_reserved_bytes == r.profile.reserved_bytes(r.traced.peak_allocated_bytes, r.outside_allocator_bytes)
    d = r.to_dict()["memory"]
    assert (d["reserved_from"], d["peak_reserved_flat_bytes"]) == ("replay", flat.peak_reserved_bytes)
    with pytest.raises(PlannerError, match="reserved_from"):
        trace(dict(TINY[arch]), gpus, reserved_from="constant", **kwargs)
    # the same allocations under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: 104 MiB measured at this commit
    # (each stream's large pool maps 20 MiB pages, more than the 90 MiB of segments for this tiny model)
    expandable = TraceReport(r.candidate, r.traced, r.profile, alloc_conf="expandable_segments:True")
    assert expandable.replay_reserved_bytes - r.outside_allocator_bytes == 104 * MiB
    with pytest.raises(PlannerError, match="alloc_conf"):
        TraceReport(r.candidate, r.traced, r.profile, alloc_conf="expandable:True")


def test_the_cli_replays_under_alloc_conf(tmp_path, capsys):
    """`fsdp-plan trace --alloc-conf`: the same 104 MiB of expandable segments as the API (above); a key torch does
    not know is one line naming the field, exit 2."""
    import json

    from cost_models.units import MiB
    from planner.cli import main

    arch, gpus, kwargs = GOLDEN[0]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY[arch]))
    flags = ["trace", "--model", str(path), "--gpus", str(gpus), "--sharding", kwargs["sharding"], "--precision",
             kwargs["precision"], "--micro-batch", str(kwargs["micro_batch"]), "--seq-len", str(kwargs["seq_len"])]
    main([*flags, "--alloc-conf", "expandable_segments:True", "--format", "json"])
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["peak_reserved_bytes"] == 104 * MiB + memory["outside_allocator_bytes"]  # + the context, NCCL, ...
    with pytest.raises(SystemExit) as exit_:
        main([*flags, "--alloc-conf", "expandable:True"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: alloc_conf: PYTORCH_CUDA_ALLOC_CONF key 'expandable'")
    assert len(err.splitlines()) == 1


def test_unsupported_and_untraceable_are_errors_not_crashes(monkeypatch):
    with pytest.raises(TraceUnsupported, match="CPU offload"):
        trace_memory(tiny_llama_spec(), FsdpConfig(offload=True), n_gpus=2, gpus_per_node=2, seq_len=8)
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(PlannerError, match="LoRA.*needs peft: pip install 'fsdp-planner\\[lora\\]'"):
        trace(dict(TINY["llama"]), 2, seq_len=8, finetune="lora")
    monkeypatch.delitem(sys.modules, "peft")

    import torch

    class DataDependent(torch.nn.Module):
        """A model whose forward branches on tensor values: fake tensors cannot answer."""

        def __init__(self, spec):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
            self.embed = torch.nn.Embedding(spec.vocab_size, 8)

        def forward(self, ids, labels=None):
            x = self.embed(ids)
            if x.sum() > 0:  # data-dependent control flow
                x = x * 2
            return (x.sum(),)

    monkeypatch.setattr("calibration.build.build_model", lambda spec, *a, **k: DataDependent(spec))
    with pytest.raises(UntraceableModel, match="failed under FakeTensorMode.*data-dependent"):
        trace_memory(tiny_llama_spec(), FsdpConfig(), n_gpus=2, gpus_per_node=2, seq_len=8)


def test_missing_transformers_says_how_to_install(monkeypatch):
    from planner.tracing import require_trace_dependencies

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(PlannerError, match=r"pip install 'fsdp-planner\[trace\]'"):
        require_trace_dependencies({"model_type": "llama"})
    require_trace_dependencies(None)  # the reference model needs no transformers


def _cli(*args):
    """Run `fsdp-plan ARGS` in-process (torch and transformers are already imported here)."""
    from typer.testing import CliRunner

    from planner.cli import app

    result = CliRunner().invoke(app, list(args), catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return 2, result.stdout, f"error: {result.exception}"
    return result.exit_code, result.stdout, ""


# A trace depends only on its arguments (frozen specs, keyed by their value repr): within this module each
# configuration is traced once (GOLDEN[0] serves the golden row, the allocator replay and its flat twin; the
# CLI tests render one trace as JSON, then as a table).
_TRACES: dict[str, object] = {}


@pytest.fixture(autouse=True)
def one_trace_per_configuration(monkeypatch):
    """The configurations this test traced (each traced once in the module): the keys it asked for."""
    import calibration.trace

    real, asked = calibration.trace.trace_memory, set()

    def shared(spec, config, **kwargs):
        key = repr((spec, config, sorted(kwargs.items())))
        if " at 0x" in key:  # an argument without a value repr: not shared
            return real(spec, config, **kwargs)
        asked.add(key)
        if key not in _TRACES:
            _TRACES[key] = real(spec, config, **kwargs)
        return _TRACES[key]

    monkeypatch.setattr(calibration.trace, "trace_memory", shared)
    return asked


def test_cli_trace_json_and_table(tmp_path, one_trace_per_configuration):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY["llama"]))
    code, stdout, err = _cli("trace", "--model", str(cfg), "--gpus", "4", "--seq-len", "128", "--format", "json")
    assert code == 0, err
    d = json.loads(stdout)
    assert d["source"] == "trace" and "analytic" in d and "difference" in d
    assert d["memory"]["breakdown"]["sharded_params"] > 0
    code, stdout, err = _cli("trace", "--model", str(cfg), "--gpus", "4", "--seq-len", "128")
    assert code == 0 and "estimate - trace" in stdout and "fits (traced): yes" in stdout
    assert "peak reserved (allocator replay + context)" in stdout and "allocator replay at its reserved peak" in stdout
    assert len(one_trace_per_configuration) == 1  # the table rendered the trace the JSON run made
    code, _, err = _cli("trace", "--model", str(cfg), "--gpus", "4", "--offload")
    assert code == 2 and err.startswith("error: trace:") and "offload" in err


def test_cli_verify_top_marks_candidates(tmp_path, one_trace_per_configuration):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY["llama"]))
    # --no-liger: the trace tier runs the model's own ops (Liger's kernels are GPU-only Triton), so the search is
    # kept to what it can trace
    code, stdout, err = _cli("--model", str(cfg), "--gpus", "2", "--seq-len", "128", "--top", "2",
                             "--verify-top", "1", "--format", "json", "--no-liger")
    assert code == 0, err
    d = json.loads(stdout)
    first = d["candidates"][0]["verification"]
    assert first["confirmed"] is True and first["traced_peak_allocated_bytes"] > 0
    assert abs(first["analytic_vs_trace"]) <= TOLERANCE
    assert "verification" not in d["candidates"][1]
    code, stdout, err = _cli("--model", str(cfg), "--gpus", "2", "--seq-len", "128", "--top", "1",
                             "--verify-top", "1", "--no-liger")
    assert code == 0 and "confirmed" in stdout
    assert len(one_trace_per_configuration) == 1  # the table verified the candidate the JSON run traced


def test_import_planner_tracing_does_not_import_torch():
    code = "import sys, planner, planner.tracing, planner.cli.trace; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_sliding_window_mask_is_counted():
    # Mistral with a window shorter than the sequence: each layer saves an (s, s) mask in the compute dtype
    # and a copy of the attention output. Traced vs estimated on a 2-layer Mistral, 512 tokens, window 128.
    from planner.tracing import trace

    cfg = {"model_type": "mistral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "sliding_window": 128}
    r = trace(cfg, gpus=2, seq_len=512).to_dict()
    assert abs(r["difference"]["peak_allocated_relative"]) < 0.005
    # the mask alone: 2 layers x 512 x 512 x 2 bytes = 1 MiB, well above that tolerance
    assert 2 * 512 * 512 * 2 > 0.005 * r["memory"]["peak_allocated_bytes"]


def test_phi3_sliding_window_is_read_and_counted():
    # Phi-3 windows every layer when its config sets sliding_window (Phi-3-mini-4k: 2047); the same mask as
    # Mistral's, and the output copy its cat-built rotary already makes. 2-layer Phi-3, 512 tokens, window 128.
    from planner.models import from_hf_config

    cfg = {**TINY["phi3"], "sliding_window": 128}
    assert from_hf_config(dict(cfg)).sliding_window == 128
    assert from_hf_config({**TINY["phi3"], "sliding_window": None}).sliding_window == 0
    assert from_hf_config(dict(TINY["phi3"])).sliding_window == 0   # PHI3Config's default: no window
    r = trace(cfg, 4, precision="bf16", micro_batch=2, seq_len=512)
    assert abs(r.relative_error) < 0.005
    # the masks: 2 layers x (2 x 512 x 512) x 2 bytes = 2 MiB, 3.5% of the peak: far above the tolerance
    assert 2 * 2 * 512 * 512 * 2 > 0.03 * r.traced.peak_allocated_bytes
