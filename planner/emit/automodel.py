"""The plan as a NeMo Automodel 0.7.0 recipe YAML (`automodel recipe.yaml`, or torchrun -m nemo_automodel.cli.app):
its FSDP2 + EP "distributed" section, the model's backend (TE / DeepEP kernels, the benchmark gate) and the
batch. planner/doctor/readers/automodel.py reads it back (`fsdp-plan check recipe.yaml`) as the same plan.

Keys as nemo_automodel 0.7.0 names them (read from its source: recipes/_dist_utils.py parse_distributed_section,
components/distributed/config.py FSDP2Config / MoEParallelizerConfig, components/models/common/utils.py
BackendConfig, components/training/step_scheduler.py, _transformers/auto_model.py from_config):
- distributed: strategy fsdp2, dp_size (null: the rest) / dp_replicate_size / tp_size / cp_size / ep_size /
  pp_size, sequence_parallel, activation_checkpointing (a bool: every block), mp_policy (MixedPrecisionPolicy's
  param_dtype / reduce_dtype), offload_policy, enable_compile (each decoder layer compiled; the loss is not),
  reshard_after_forward; its `moe` sub-section (MoEParallelizerConfig) holds reshard_after_forward for the MoE
  parallelizer's blocks (default false: ZeRO-2-like), read only when ep_size > 1.
- model.backend: rms_norm torch_fp32 (Automodel's default, the HF-style fp32 upcast) | te, attn te (Transformer
  Engine's DotProductAttention: attention sdpa with attention_kernel cudnn) | sdpa (PyTorch SDPA: flash2) | flex |
  eager (cudnn reads back as te, fa4 as sdpa), dispatcher deepep (DeepEP) with experts torch_mm
  (torch._grouped_mm), fake_balanced_gate (round-robin routing), rope_fusion (0.7.0 forces it off:
  BackendConfig.__post_init__, issue #3027, whatever the file says; its own models - Trainer.own_models - then
  rotate in a compiled kernel, the rest in transformers' eager ops).
- model.torch_dtype: the dtype the parameters live in (bfloat16: bf16 Adam states, the bf16-pure precision).
What the dialect cannot say is refused in one PlannerError line naming the knob: no every-K-th or op-level
checkpointing (Automodel checkpoints every block or selects by its own policy), no compiled loss, no torchao Float8
recipe, Liger / TE SwiGLU / TE RoPE kernels, chunked or Liger losses, fp16, PP, and for MoE with EP only DeepEP
(Automodel's "torch" dispatcher all-gathers the tokens, which the cost model does not price).
"""

from __future__ import annotations

from cost_models.specs import (Attention, ClusterSpec, FsdpConfig, Kernel, LossKernel, ModelSpec, MoeDispatch,
                               Precision, Routing, Sharding, TrainingSpec)

from cost_models.mesh import mesh_of

from planner.emit.common import _comment, _summary, env_words, hub_id, launch_env, yaml_lines
from planner.errors import PlannerError

VERSION = "0.7.0"
RECIPE = "TrainFinetuneRecipeForNextTokenPrediction"
ATTENTION = {"sdpa": "sdpa", "flex": "flex", "eager": "eager"}
ATTENTION_KERNEL = {"flash2": "sdpa", "cudnn": "te"}  # attention sdpa's kernel -> model.backend.attn
DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
OPTIMIZER = {"adamw": "torch.optim.AdamW", "adam": "torch.optim.Adam", "sgd": "torch.optim.SGD"}


def _refuse(config: FsdpConfig, model: ModelSpec) -> None:
    """One PlannerError line for the first planned setting the recipe cannot hold."""
    refusals = [
        ("precision", config.precision is Precision.FP16, "fp16 (Automodel's FSDP2 recipes run bf16 or fp32, no "
                                                          "gradient scaler): choose bf16, bf16-pure or fp32"),
        ("activation_checkpointing", config.selective_op_ac or config.ac_every > 1,
         f"{config.activation_checkpointing}: Automodel checkpoints every block (true) or not at all; choose full "
         "or none"),
        ("compile_scope", config.compile and config.compile_loss, "Automodel compiles the decoder layers only "
                                                                  "(distributed.enable_compile): choose blocks"),
        ("float8", config.float8, "Automodel's FP8 is Transformer Engine's recipe (model.backend.te_fp8), not "
                                  "torchao's tensorwise Float8 the plan priced: drop float8"),
        ("reshard_after_forward", bool(config.reshard_after_forward), "Automodel takes a bool: leave it at 0"),
        ("pp", config.pp > 1, "the Automodel dialect writes no pipeline schedule yet: choose pp 1"),
        ("sharding", config.sharding is Sharding.NO_SHARD, "Automodel's FSDP2 mesh needs dp_replicate_size < "
                                                           "dp_size (no shard group of 1): choose FULL_SHARD, "
                                                           "SHARD_GRAD_OP or HYBRID_SHARD"),
        ("norm_kernel", config.norm_kernel is Kernel.LIGER, "Automodel has no Liger RMSNorm: choose eager "
                                                            "(torch_fp32) or te"),
        ("rope_kernel", config.rope_kernel is not Kernel.EAGER, f"Automodel {VERSION} forces rope_fusion off "
                                                                "(issue #3027): choose eager"),
        ("swiglu_kernel", config.swiglu_kernel is not Kernel.EAGER, "Automodel's dense MLP runs eager SwiGLU (its "
                                                                    "experts: see moe_dispatch): choose eager"),
        ("loss_kernel", config.loss_kernel is not LossKernel.EAGER, "the recipe's MaskedCrossEntropy is the "
                                                                    "model's plain cross-entropy: choose eager"),
        ("attention_kernel", config.attention_kernel.value not in ATTENTION_KERNEL,
         "Automodel's fused attention backends are te (cuDNN) and sdpa (flash2): choose cudnn or flash2"),
        ("moe_dispatch", model.moe is not None and config.ep > 1 and config.moe_dispatch is not MoeDispatch.DEEPEP,
         "Automodel's torch dispatcher all-gathers the tokens (not priced): choose deepep"),
    ]
    for knob, refused, why in refusals:
        if refused:
            raise PlannerError(knob, why)


def emit_automodel(config: FsdpConfig, model: ModelSpec, cluster: ClusterSpec,
                   training: TrainingSpec | None = None) -> str:
    """The recipe YAML of the plan (module docstring); PlannerError for what the recipe cannot hold."""
    training = training or TrainingSpec()
    _refuse(config, model)
    mesh = mesh_of(config, cluster)
    dp, replicas = mesh.dp_replicate * mesh.dp_shard, mesh.dp_replicate
    reshard = config.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
    param_dtype = "bfloat16" if config.precision.compute_dtype == "bf16" else "float32"
    stored = "bfloat16" if config.precision is Precision.BF16_PURE else "float32"
    reduce = config.reduce_dtype or config.precision.reduce_dtype
    moe_ep = model.moe is not None and config.ep > 1
    mp = [("_target_", "torch.distributed.fsdp.MixedPrecisionPolicy"), ("param_dtype", param_dtype),
          ("reduce_dtype", DTYPE[reduce]), ("output_dtype", None)]
    distributed = [
        ("strategy", "fsdp2"),
        ("dp_size", dp, f"data-parallel ranks: dp_replicate x dp_shard ({replicas} x {dp // replicas})"),
        ("dp_replicate_size", replicas, "HSDP replicas" if replicas > 1 else ""),
        ("tp_size", config.tp), ("cp_size", config.cp), ("ep_size", config.ep), ("pp_size", config.pp),
        ("sequence_parallel", config.tp > 1 and config.sequence_parallel),
        ("activation_checkpointing", config.ac_every == 1, "every decoder layer" if config.ac_every else ""),
        ("reshard_after_forward", reshard, "ZeRO-3" if reshard else "ZeRO-2: gathered params kept for backward"),
        ("enable_compile", config.compile, "each decoder layer compiled; the loss stays eager" if config.compile
         else ""),
        ("mp_policy", mp),
    ]
    if config.offload:
        distributed.append(("offload_policy", [("_target_", "torch.distributed.fsdp.CPUOffloadPolicy")]))
    if moe_ep:
        distributed.append(("moe", [("reshard_after_forward", reshard, "the MoE parallelizer's blocks")]))
    te_norm = config.norm_kernel is Kernel.TE
    backend = [("_target_", "nemo_automodel.components.models.common.BackendConfig"),
               ("attn", ATTENTION_KERNEL[config.attention_kernel.value] if config.attention is Attention.SDPA
                else ATTENTION[config.attention.value]),
               ("linear", "te" if te_norm else "torch", "the same GEMMs either way"),
               ("rms_norm", "te" if te_norm else "torch_fp32"),
               ("rope_fusion", False, f"{VERSION} forces it off (issue #3027): its own models rotate compiled")]
    if model.moe is not None:
        deepep = config.moe_dispatch is MoeDispatch.DEEPEP
        backend += [("experts", "torch_mm", "torch._grouped_mm"),
                    ("dispatcher", "deepep" if deepep else "torch",
                     "DeepEP dispatch / combine" if deepep else ""),
                    ("fake_balanced_gate", training.routing is Routing.ROUND_ROBIN,
                     "benchmark routing: round-robin, no gate matmul" if training.routing is Routing.ROUND_ROBIN
                     else "")]
    optimizer = [("_target_", OPTIMIZER.get(training.optimizer.value, "torch.optim.AdamW")), ("lr", 1.0e-5),
                 ("weight_decay", 0.0 if training.optimizer.value == "adam" else 0.01)]
    if training.optimizer.value in ("adamw", "adam"):
        impl = training.optimizer_impl.value
        optimizer += [("fused", True)] if impl == "fused" else [("foreach", impl == "foreach")]
    body = [
        ("recipe", RECIPE),
        ("step_scheduler", [("global_batch_size", config.micro_batch * config.grad_accum * dp),
                            ("local_batch_size", config.micro_batch, f"{config.grad_accum} accumulation steps"),
                            ("max_steps", 100), ("ckpt_every_steps", 1000)]),
        ("dist_env", [("backend", "nccl"), ("timeout_minutes", 20)]),
        ("model", [("_target_", "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained"),
                   ("pretrained_model_name_or_path", hub_id(model)),
                   ("torch_dtype", stored, "bf16 params and Adam states" if stored == "bfloat16" else
                    "fp32 master weights and Adam states"),
                   ("backend", backend)]),
        ("distributed", distributed),
        ("loss_fn", [("_target_", "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy")]),
        ("dataset", [("_target_", "nemo_automodel.components.datasets.llm.mock_iterable_dataset."
                                  "MockIterableDataset"), ("seq_len", training.seq_len),
                     ("num_samples", 1000000)], "random tokens: replace with your dataset, same seq_len"),
        ("optimizer", optimizer),
    ]
    # its launcher runs torch.distributed.run's: torchrun's thread default
    launch = " ".join([*env_words(launch_env(config, cluster)), "automodel recipe.yaml --nproc-per-node",
                       str(cluster.gpus_per_node)])
    head = [f"NeMo Automodel {VERSION} recipe, run with: {launch}", *_summary(config, model, cluster)]
    return _comment(head) + "\n" + "\n".join(yaml_lines(body)) + "\n"


__all__ = ["emit_automodel", "hub_id", "VERSION"]
