"""Built by its own tool (issue 26 item 3): the --emit lightning artifact executed with Lightning 2.6 (the test
extra), its FSDPStrategy built for real, and what Lightning holds compared with the plan: the sharding strategy,
the mixed-precision dtypes, CPU offload, the wrap and checkpointing policies (the block class), the FSDP1 switches,
and the Trainer's ranks and accumulation.

One substitution on CPU: Lightning refuses FSDP without a GPU accelerator when the Trainer is built
(accelerator_connector._check_strategy_and_fallback: "The strategy `fsdp` requires a GPU accelerator"), so the
Trainer line is run with accelerator="cpu" and without strategy=; the strategy itself is the artifact's, untouched.
The Trainer's precision string is checked through Lightning's own FSDPPrecision plugin (what FSDPStrategy uses on
GPUs: its compute dtype is the plan's), since on CPU Lightning turns "16-mixed" into "bf16-mixed". With CUDA the
Trainer line runs as written but on the one GPU here (devices=1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cost_models import fsdp_options
from cost_models.specs import FsdpConfig, TrainingSpec
from planner import plan
from planner.doctor.readers import read_setup
from planner.emit import emit_artifact, emit_lightning
from planner.emit.format import fold
from planner.hardware import make_cluster
from planner.models import load_preset

LLAMA, CLUSTER, TRAINING = load_preset("llama3-8b"), make_cluster(16, gpus_per_node=8), TrainingSpec(seq_len=4096)
AS_WRITTEN = 'trainer = Trainer(strategy=strategy, accelerator="gpu", devices=8,'
ON_CPU = 'trainer = Trainer(accelerator="cpu", devices=8,'
TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIGS = {
    "hsdp-zero2-offload-fp16": FsdpConfig(sharding="HYBRID_SHARD_ZERO2", offload=True, precision="fp16"),
    "full-checkpointed-accumulating": FsdpConfig(ac_every=1, grad_accum=4, backward_prefetch=False,
                                                 limit_all_gathers=False, forward_prefetch=True),
    "no-shard-bf16-true": FsdpConfig(sharding="NO_SHARD", precision="bf16-pure"),
    "fp32-reduce-bf16": FsdpConfig(precision="fp32", reduce_dtype="bf16", sharding="SHARD_GRAD_OP"),
}


def artifact(name: str) -> tuple[str, FsdpConfig]:
    if name == "planned":  # the lightning trainer's own pick, as tests/doctor/test_trainer_round_trip.py plans it
        best = plan("llama3-8b", gpus=16, gpu="h100-80gb", seq_len=4096, trainer="lightning").best
        return fold(emit_artifact("lightning", best)), best.config
    return fold(emit_lightning(CONFIGS[name], LLAMA, CLUSTER, TRAINING)), CONFIGS[name]


def run(text: str) -> dict:
    namespace: dict = {}
    exec(compile(text, "lightning_plan.py", "exec"), namespace)  # the planner's own artifact (check never execs)
    return namespace


@pytest.mark.parametrize("name", ["planned", *CONFIGS])
def test_lightning_builds_the_strategy_the_plan_priced(tmp_path, name):
    from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
    from torch.distributed.fsdp import BackwardPrefetch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    text, config = artifact(name)
    assert AS_WRITTEN in text
    built = run(text.replace(AS_WRITTEN, ON_CPU))
    strategy, trainer = built["strategy"], built["trainer"]
    assert strategy.sharding_strategy.name == fsdp_options.fsdp1_strategy(config, CLUSTER.gpus_per_node)[0]
    mixed = fsdp_options.fsdp1_mixed_precision(config.precision, False, config.reduce_dtype)
    held = strategy.mixed_precision
    assert (None if held is None else (held.param_dtype, held.reduce_dtype)) == (None if mixed is None else (
        getattr(torch, mixed.get("param_dtype") or "", None), getattr(torch, mixed["reduce_dtype"])))
    assert strategy.cpu_offload.offload_params is config.offload
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {LlamaDecoderLayer}  # one unit per block
    checkpointed = strategy._activation_checkpointing_kwargs  # Lightning's own record of the policy
    assert ({LlamaDecoderLayer} if config.checkpoints else None) == (
        checkpointed["auto_wrap_policy"]._module_classes if checkpointed else None)
    assert strategy.kwargs["backward_prefetch"] == (BackwardPrefetch.BACKWARD_PRE if config.backward_prefetch else None)
    assert (strategy.kwargs["forward_prefetch"], strategy.kwargs["limit_all_gathers"]) == (
        config.forward_prefetch, config.limit_all_gathers)
    assert (trainer.num_nodes, trainer.num_devices, trainer.accumulate_grad_batches) == (2, 8, config.grad_accum)
    precision = FSDPPrecision(text.split('precision="')[1].split('"')[0])  # the Trainer's string, Lightning's plugin
    assert precision.mixed_precision_config.param_dtype == TORCH_DTYPE[config.precision.compute_dtype]
    path = tmp_path / "lightning_plan.py"
    path.write_text(text)
    back = read_setup(path).config  # and check reads the same plan back (the loader's batch: --micro-batch)
    assert back == dataclasses.replace(config, micro_batch=1), (back, config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning builds an FSDP Trainer on a GPU accelerator only")
def test_the_trainer_line_builds_as_written_on_a_gpu():
    from lightning.pytorch.strategies import FSDPStrategy

    text, config = artifact("full-checkpointed-accumulating")
    built = run(text.replace(AS_WRITTEN, AS_WRITTEN.replace("devices=8", "devices=1")))
    trainer = built["trainer"]
    assert isinstance(trainer.strategy, FSDPStrategy) and trainer.strategy is built["strategy"]
    assert (trainer.precision, trainer.accumulate_grad_batches) == ("bf16-mixed", config.grad_accum)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_without_mixed_precision_it_reads_what_lightning_derives_from_the_trainers_precision(tmp_path, precision):
    """No MixedPrecision on the strategy: Lightning's FSDPPrecision builds one from the Trainer's string
    (bf16-mixed: params, reduction and buffers in bf16); the reading prices that reduction dtype."""
    from lightning.fabric.plugins.precision.fsdp import FSDPPrecision

    text, _ = artifact("full-checkpointed-accumulating")
    line = next(line for line in text.splitlines() if line.strip().startswith("mixed_precision="))
    text = text.replace(line + "\n", "").replace('precision="bf16-mixed"', f'precision="{precision}"')
    path = tmp_path / "lightning_plan.py"
    path.write_text(text)
    back = read_setup(path).config
    derived = FSDPPrecision(precision).mixed_precision_config
    by_name = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    assert (back.precision.compute_dtype, back.gradient_reduce_dtype) == (by_name[derived.param_dtype],
                                                                           by_name[derived.reduce_dtype])
