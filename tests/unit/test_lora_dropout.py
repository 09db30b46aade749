"""LoRA's dropout (peft's lora_dropout > 0; cost_models/lora_dropout.py): the rule against a real CPU step's saved
tensors and peak, the ledger and the trace tier on it, the knob's validation, and its readers and emitters.

The real runs are transformers' tiny Llama of the trace tests (h 128, f 352, 2 blocks, V 3,000; and their GPT-NeoX and
Phi-3), 256 tokens, rank 8
through calibration.lora.add_lora (the adapters the trace tier and calibration runs build), dropout as a GPU runs it
(calibration.gpu_run_choices: native_dropout's bool mask). Dropout 0 against 0.05: every saved-tensor storage once."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

import torch  # noqa: E402

from calibration.gpu_run_choices import cuda_kernel_choices  # noqa: E402
from calibration.lora import add_lora  # noqa: E402
from cost_models import lora_dropout  # noqa: E402
from cost_models.spec_values import SpecError  # noqa: E402
from cost_models.specs import Attention, TrainingSpec  # noqa: E402
from planner.doctor import check  # noqa: E402
from planner.doctor.readers import read_setup  # noqa: E402
from planner.models import from_hf_config  # noqa: E402
from tests.unit.test_trace import TINY  # noqa: E402

LLAMA = TINY["llama"]
TOKENS = 256


def _model(precision: str, targets: str, p: float, attention: str, arch: str = "llama"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY[arch]), attn_implementation=attention)
    spec = dataclasses.replace(from_hf_config(dict(TINY[arch])), lora_targets=targets)
    classes = {type(m) for m in model.modules() if type(m).__name__ == spec.block_class}
    return add_lora(model, spec, 8, classes, precision, dropout=p).train(), spec


def _saved_bytes(precision: str, targets: str, p: float, attention: str = "sdpa", autocast: bool = False,
                 arch: str = "llama") -> int:
    """Bytes of the storages one forward saves for backward (each once)."""
    model, _ = _model(precision, targets, p, attention, arch)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(0))
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with cuda_kernel_choices(), cast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False)
    return sum(storages.values())


def _priced(targets: str, c: int, copies: bool, attention: str, arch: str = "llama") -> int:
    """The rule's bytes for the model's 2 blocks: every adapter's, less block 0's masks on its normed input."""
    spec = dataclasses.replace(from_hf_config(dict(TINY[arch])), lora_targets=targets)
    per_block = lora_dropout.saved_bytes_per_token(spec, c, copies, lora_dropout.o_input_copied(spec, Attention(attention)))
    return TOKENS * (spec.n_layers * per_block - lora_dropout.first_block_masks_bytes_per_token(spec))


# measured 2026-12-07, the rule's figures to the byte: all-linear bf16 +999,424 B (3,904 a token: masks 2 x 1,120 less
# block 0's 384, outputs 2 x 2 x 512); attention only, fp32, eager (o's input, P @ V's copy, freed too) +688,128 (masks
# 2 x 512 - 384, outputs 2 x 4 x 256); fp32 adapters on a bf16 base, where peft casts x (each adapter saves its own
# copy already), with or without autocast: the masks alone, +475,136 all-linear, +163,840 attention
# GPT-NeoX (parallel block: block 0's fused qkv and fc1 adapters on the normed input; fused rotary: o reads a copy of
# the attention's output, which only its adapter kept) +393,216; Phi-3 (fused qkv and gate_up) +360,448
@pytest.mark.parametrize("arch, precision, targets, attention, autocast, c, copies", [
    ("llama", "bf16-pure", "all-linear", "sdpa", False, 2, False),
    ("llama", "fp32", "attention", "eager", False, 4, False),
    ("llama", "bf16", "all-linear", "sdpa", True, 2, True),
    ("llama", "bf16", "attention", "sdpa", False, 2, True),
    ("gpt_neox", "bf16-pure", "all-linear", "sdpa", False, 2, False),
    ("phi3", "bf16-pure", "all-linear", "sdpa", False, 2, False),
], ids=["bf16-all-linear", "fp32-attention-eager", "fp32-adapters-autocast", "fp32-adapters-attention",
        "neox-parallel-fused-rotary", "phi3-fused"])
def test_the_rule_is_what_a_real_forward_saves(arch, precision, targets, attention, autocast, c, copies):
    added = (_saved_bytes(precision, targets, 0.05, attention, autocast, arch)
             - _saved_bytes(precision, targets, 0.0, attention, autocast, arch))
    assert added == _priced(targets, c, copies, attention, arch) > 0


def test_the_real_peak_moves_by_the_rule_without_checkpointing():
    """A real CPU step (calibration.memtrack, the warm-up forgotten): the backward's peak holds every block's saved
    tensors, 999,424 B more at dropout 0.05 (bf16, all-linear), the rule to the byte."""
    from calibration.memtrack import MemoryTracker

    def peak(p: float) -> int:
        model, _ = _model("bf16-pure", "all-linear", p, "sdpa")
        ids = torch.randint(0, LLAMA["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(0))
        tracker = MemoryTracker(model, None, vocab_size=LLAMA["vocab_size"])
        with cuda_kernel_choices(), tracker:
            for step in range(2):
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                model.zero_grad(set_to_none=True)
                if step == 0:
                    tracker.reset()
        return tracker.snapshot().peak_allocated_bytes

    assert peak(0.05) - peak(0.0) == _priced("all-linear", 2, False, "sdpa") == 999_424


def test_the_trace_counts_the_dropout_and_the_estimate_prices_it():
    """The trace tier builds peft's LoraConfig with the requested dropout: FSDP2 on 2 ranks, bf16, all-linear, no
    checkpointing (h 256, f 512, 4 blocks, 2 x 128 tokens; at dropout 0 a row of test_trace's LORA_GOLDEN). The peak,
    the forward of the last block's down projection's adapter, rises by 4,390,912 B in the estimate (17,152 a token: 4
    blocks x 4,096, less block 0's three 256-byte masks, and the MLP's input and the down projection's input, which no
    adapter saves now, held by the forward: 2 x (256 + 512)); the trace rose by as much when written (15,744,224 ->
    20,135,136 B), and the two stay within 0.1% (a trace without the dropout would be 22% under)."""
    from planner import estimate
    from planner.tracing import trace

    kwargs = dict(sharding="FULL_SHARD", precision="bf16", micro_batch=2, seq_len=128, lora_targets="all-linear")
    r = trace(dict(TINY["llama-v320"]), 2, finetune="lora", lora_rank=8, lora_dropout=0.05, **kwargs)
    assert r.candidate.training.lora_dropout == 0.05
    without = estimate(model=dict(TINY["llama-v320"]), gpus=2, finetune="lora", lora_rank=8, **kwargs)
    priced = r.candidate.memory.peak_allocated_bytes - without.memory.peak_allocated_bytes
    assert priced == 256 * (4 * 4096 - 3 * 256 + 2 * (256 + 512)) == 4_390_912
    assert abs(r.candidate.memory.peak_allocated_bytes / r.traced.peak_allocated_bytes - 1) < 0.001


def test_the_ledger_prices_each_block_and_block_0_without_its_masks():
    """memory_shape: a block's saved bytes per token rise by the rule, with and without checkpointing (a recomputed
    block remakes them); without checkpointing block 0 saves its three attention-input masks less; the MLP inputs
    the adapters no longer save are counted as held by the forward; the o-projection's and the MLP's adapters' share
    is freed before the attention's backward (masks 128 + 2 x 128 + 352, outputs 2 x (736 - 128 - 352)), the down
    projection's mask before the activation's."""
    from cost_models.memory_shape import ledger_shape
    from cost_models.specs import FsdpConfig

    spec = dataclasses.replace(from_hf_config(dict(LLAMA)), lora_targets="all-linear")
    rule = lora_dropout.saved_bytes_per_token(spec, 2, copies=False, o_copied=False)
    assert rule == 1120 + 2 * (1120 - 128 - 128 - 352) == 2144  # masks: q k v o gate up (128) + down (352)
    for ac in (0, 1):
        config = FsdpConfig(precision="bf16", ac_every=ac)
        off, on = (ledger_shape(spec, TrainingSpec(seq_len=256, finetune="lora", lora_dropout=p), config, None, False)
                   for p in (0.0, 0.05))
        assert on.full - off.full == rule
        assert on.first_less - off.first_less == (0 if ac else 3 * 128)
        assert off.mlp_inputs_saved and not on.mlp_inputs_saved
        assert on.freed_attn - off.freed_attn == 736 + 2 * (736 - 128 - 352) == 1248
        assert on.w_mlp - off.w_mlp == -352


@pytest.mark.parametrize("value", [1.0, -0.1, "0.05", True])
def test_the_knob_is_a_probability(value):
    with pytest.raises(SpecError, match=r"^lora_dropout: must be a probability 0 <= p < 1"):
        TrainingSpec(finetune="lora", lora_dropout=value)


def test_the_cli_refuses_a_bad_dropout_in_one_line():
    from tests.doctor.cli_run import cli_process

    r = cli_process(["estimate", "--model", "llama3-8b", "--gpus", "8", "--finetune", "lora", "--lora-dropout", "1"])
    assert r.returncode == 2 and r.stderr.strip() == "error: lora_dropout: must be a probability 0 <= p < 1, got 1.0"


AXOLOTL = """
base_model: NousResearch/Meta-Llama-3.1-8B
adapter: lora
lora_r: 8
lora_target_linear: true
bf16: auto
fsdp_config:
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
"""


def test_an_axolotl_lora_dropout_moves_the_checked_figure_by_the_priced_bytes(tmp_path):
    """axolotl's lora_dropout: 0.05 read (absent: axolotl's 0), and `check`'s peak rises by 32 blocks of the rule less
    block 0's masks at 512 tokens (axolotl's sequence_len; no checkpointing: every block's saved tensors at the peak):
    Llama 3.1 8B, all-linear, bf16: 71,680 B a token a block (masks 38,912; outputs 2 x 16,384), 1,168,113,664 B."""
    figures = {}
    for p in (None, 0.05):
        path = tmp_path / "lora.yaml"
        path.write_text(AXOLOTL + ("" if p is None else f"lora_dropout: {p}\n"))
        r = check(read_setup(path), "llama3.1-8b", 8, gpu="h100-80gb")
        assert r.candidate.training.lora_dropout == (p or 0.0) and r.candidate.config.ac_every == 0
        figures[p] = r.candidate.memory.peak_allocated_bytes
        spec = r.candidate.model
    per_block = lora_dropout.saved_bytes_per_token(spec, 2, copies=False, o_copied=False)
    assert per_block == 38_912 + 2 * 16_384
    priced = 512 * (32 * per_block - lora_dropout.first_block_masks_bytes_per_token(spec))
    assert figures[0.05] - figures[None] == priced == 1_168_113_664


def test_a_bad_axolotl_lora_dropout_is_one_line_with_exit_2(tmp_path):
    from tests.doctor.cli_run import cli_process

    path = tmp_path / "bad.yaml"
    path.write_text(AXOLOTL + "lora_dropout: 1.5\n")
    r = cli_process(["check", str(path), "--model", "llama3.1-8b", "--gpus", "8"])
    assert r.returncode == 2 and r.stderr.strip() == "error: lora_dropout: must be a probability 0 <= p < 1, got 1.5"


def test_a_scripts_lora_config_dropout_is_read(tmp_path):
    """python_qlora.read_lora_config: LoraConfig(lora_dropout=0.1) in a script --emit fsdp2 wrote is priced."""
    from tests.doctor.test_qlora_check import FSDP2, LOADING

    path = tmp_path / "train.py"
    path.write_text(LOADING.replace("LoraConfig(r=16,", "LoraConfig(r=16, lora_dropout=0.1,") + "\n" + FSDP2)
    assert dict(read_setup(path).training)["lora_dropout"] == 0.1
    path.write_text(LOADING.replace("LoraConfig(r=16,", "LoraConfig(r=16, lora_dropout=P,") + "\n" + FSDP2)
    setup = read_setup(path)  # computed in the script: peft's 0, said in a note
    assert dict(setup.training)["lora_dropout"] == 0.0 and any("lora_dropout=P" in n for n in setup.notes)


def test_the_emitters_write_the_priced_dropout(tmp_path):
    """--emit axolotl writes the priced lora_dropout, read back as priced; the QLoRA Python's LoraConfig too."""
    from cost_models.specs import FsdpConfig
    from planner.emit.axolotl import emit_axolotl
    from planner.emit.qlora import python_lines
    from planner.hardware import make_cluster
    from planner.models import load_preset

    training = TrainingSpec(finetune="lora", lora_dropout=0.05)
    path = tmp_path / "config.yaml"
    path.write_text(emit_axolotl(FsdpConfig(), load_preset("llama3-8b"), make_cluster(8), training))
    assert "lora_dropout: 0.05" in path.read_text()
    assert dict(read_setup(path).training)["lora_dropout"] == 0.05
    lines = python_lines(dataclasses.replace(training, finetune="qlora"), FsdpConfig(), load_preset("llama3-8b"))
    assert any("lora_dropout=0.05," in line for line in lines)
