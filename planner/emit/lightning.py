"""The plan as a Lightning Trainer with FSDPStrategy (Lightning's FSDP1 integration). It says every planned setting
Lightning can hold and names in a comment what it cannot; planner/doctor/readers/python_lightning.py reads it back."""

from __future__ import annotations

from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec

from planner.emit import attention, optimizer
from planner.emit.code import mesh as meshed
from planner.emit.code import techniques as tech
from planner.emit.common import _KV_CACHE_WHY, _comment, _fsdp1_strategy, _mixed_dtypes, _summary, env_words, launch_env

# model_types whose modeling file lives under another module name (transformers' SPECIAL_MODEL_TYPE_TO_MODULE_NAME)
_HF_MODULES = {"gemma3_text": "gemma3"}


def _hf_module(model_type: str) -> str:
    return _HF_MODULES.get(model_type, model_type)


def emit_lightning(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec,
                   training: TrainingSpec | None = None) -> str:
    """Lightning Trainer with FSDPStrategy (Lightning's FSDP1 integration), same choices as emit_fsdp1."""
    meshed.refuse_mesh(config, "Lightning's FSDPStrategy (FSDP1)", "--emit fsdp2 (in Lightning: ModelParallelStrategy "
                       "with that code in configure_model) or torchtitan")
    strategy, strategy_note = _fsdp1_strategy(config, cluster)
    dtypes = _mixed_dtypes(config)
    precision = {Precision.FP32: "32-true", Precision.BF16: "bf16-mixed", Precision.FP16: "16-mixed",
                 Precision.BF16_PURE: "bf16-true"}[config.precision]
    lines = [
        _comment(_summary(config, model_spec, cluster)),
        "import torch",
        "from lightning.pytorch import Trainer",
        "from lightning.pytorch.strategies import FSDPStrategy",
        "from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy",
        f"from transformers.models.{_hf_module(model_spec.family)} import modeling_{_hf_module(model_spec.family)} "
        "as modeling" if model_spec.family not in ("generic",) else "# import your block class here",
        "",
        *attention.lightning_lines(config),
        f"Block = modeling.{model_spec.block_class}  # the repeated block: one FSDP unit each",
        "strategy = FSDPStrategy(",
        f"    sharding_strategy=ShardingStrategy.{strategy},{'  # ' + strategy_note if strategy_note else ''}",
        "    auto_wrap_policy={Block},",
        f"    activation_checkpointing_policy={'{Block}' if config.checkpoints else 'None'},"
        + (f"  # Lightning checkpoints every block (plan: {config.activation_checkpointing})" if config.ac_every > 1 else ""),
        f"    cpu_offload={'CPUOffload(offload_params=True)' if config.offload else 'False'},",
        f"    mixed_precision={'None' if dtypes is None else f'MixedPrecision(param_dtype={dtypes[0]}, reduce_dtype={dtypes[1]})'},",
        f"    backward_prefetch={'BackwardPrefetch.BACKWARD_PRE' if config.backward_prefetch else 'None'},",
        f"    forward_prefetch={config.forward_prefetch},",
        f"    limit_all_gathers={config.limit_all_gathers},  # rate limiter, not message merging",
        "    use_orig_params=True,",
        "    state_dict_type=\"sharded\",  # each rank saves its shard (DCP): no full state dict on rank 0",
        ")",
        f"trainer = Trainer(strategy=strategy, accelerator=\"gpu\", devices={cluster.gpus_per_node}, "
        f"num_nodes={cluster.n_nodes},",
        f"                  precision=\"{precision}\", accumulate_grad_batches={config.grad_accum})",
        f"# DataLoader batch_size={config.micro_batch} per GPU",
    ]
    if config.checkpoints:
        lines.append(f"# in the LightningModule: model.config.use_cache = False; {_KV_CACHE_WHY}")
    lines += [f"# {note}" for note in tech.lightning_unexpressed(config)]
    lines.append(f"# in configure_optimizers: {optimizer.script_note(training)}")
    env = launch_env(config, cluster, "lightning")
    if env:
        lines.append(f"# launch: {' '.join(env_words(env))} python train.py (Lightning's workers inherit them)")
    return "\n".join(lines) + "\n"
