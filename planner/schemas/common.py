"""What every output schema shares: the version, the units (bytes, seconds), the strict base model (no extra
keys) and the two blocks each command writes first, the model's summary and the configuration."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from cost_models.schedules import Schedule
from cost_models.spec_values import QUANT_STORAGE_DTYPES, Finetune, Optimizer, OptimizerImpl, QuantType
from cost_models.specs import Attention, AttentionKernel, Kernel, LossKernel, Precision, Sharding

SCHEMA_VERSION = 13  # 13: model.lora_targets (LoRA on every block linear, all-linear); 12: the rl outputs' reward_pool and time.reward_overlapped_s (a reward model on its own pool, issue 28); 11: the rl outputs' `reward` phase and time.reward_s (a reward model, issue 28); 10: cluster.power_limit_w / tdp_w (a power-capped GPU, issue 27); 9: memory.first_step (issue 29: the first step against the steady one); 8: config.shard_group_gpus (HSDP's shard group in GPUs, issue 26); 7: memory.outside_allocator_bytes (issue 27: the memory outside the caching allocator, term by term); 6: config.alloc_conf (PYTORCH_CUDA_ALLOC_CONF, issue 27); 5: host RAM per node (issue 29): memory.host_ram; QLoRA's training fields; the rl and rl-estimate outputs (issue 28); 4: trainers and kernels (issue 26): config.norm_kernel / rope_kernel / swiglu_kernel / loss_kernel / attention_kernel, candidate.trainer; the trace's reserved from the allocator replay (issue 27): peak_reserved_flat_bytes, reserved_from, trace.allocator; 3: pipelines (issue 18): config.pp_schedule / pp_stages_per_rank, "pipeline", memory.pipeline_ranks, the time breakdown's pp terms, calibrate's measured.pipeline_ranks

Bytes = Annotated[int, Field(description="bytes per rank (GPU) unless said otherwise")]
Seconds = Annotated[float, Field(description="seconds")]
TorchDtype = Literal["float32", "bfloat16", "float16"]


def _no_default(schema: dict) -> None:
    schema.pop("default", None)


def absent_or(tp, description: str):
    """A key the writer leaves out rather than writing null: optional in the schema, never null."""
    return Annotated[Union[tp, SkipJsonSchema[None]], Field(default=None, description=description,
                                                            json_schema_extra=_no_default)]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSummary(_Out):
    """ModelSpec.summary_dict(): the model as the outputs name it."""

    name: str
    n_params: int = Field(description="parameters, all of them (routed experts included)")
    active_params: absent_or(int, "parameters one token's forward uses (mixture-of-experts models only)")
    priced_by: Literal["formula", "block memory profile"] = Field(
        description="which activation model prices it: the family's formulas or a traced block profile")
    activation_profile: absent_or(str, "where the traced block memory profile comes from (when there is one)")
    lora_targets: absent_or(Literal["all-linear"], "LoRA / QLoRA: adapters on every block linear, the MLP's too "
                                                   "(absent: on the attention projections)")


_KERNELS = Literal[tuple(k.value for k in Kernel if k is not Kernel.EAGER)]  # FsdpConfig.to_dict leaves eager out


class Training(_Out):
    """TrainingSpec.to_dict(): what is trained on, with which optimizer and how its step runs."""

    seq_len: int = Field(description="tokens per sequence")
    global_batch: absent_or(int, "sequences per optimizer step (absent: micro-batch x data-parallel ranks x "
                                 "accumulation)")
    optimizer: Literal[tuple(o.value for o in Optimizer)]
    optimizer_impl: Literal[tuple(i.value for i in OptimizerImpl)] = Field(
        description="how torch runs the step (cost_models/optimizer_step.py): foreach (one more copy of the local "
                    "shard in the state dtype at the step), fused (none) or for-loop (two copies of one parameter); "
                    "adamw-8bit: fused (bitsandbytes' kernel)")
    finetune: Literal[tuple(f.value for f in Finetune)]
    lora_rank: absent_or(int, "LoRA adapters' rank (LoRA and QLoRA only)")
    lora_dropout: absent_or(float, "peft's lora_dropout, LoRA and QLoRA only (absent: 0, nn.Identity): each "
                                   "adapter's dropout mask and output priced (cost_models/lora_dropout.py)")
    quant: absent_or(Literal[tuple(q.value for q in QuantType)], "QLoRA only: bitsandbytes' 4-bit type")
    double_quant: absent_or(bool, "QLoRA only: the absmax quantized too (0.127 bits a weight, else 0.5)")
    quant_storage: absent_or(Literal[QUANT_STORAGE_DTYPES], "QLoRA only: bnb_4bit_quant_storage, the dtype the "
                                                            "packed weights are stored, sharded and gathered as")
    routing_imbalance: absent_or(float, "MoE with EP: the busiest rank's routed rows over the mean (absent: 1)")
    routing: absent_or(Literal["round-robin"], "MoE router: NeMo Automodel's FakeBalancedGate (absent: learned)")


class Config(_Out):
    """FsdpConfig.to_dict(): the configuration. Keys that are off by default are absent, not false."""

    sharding: Literal[tuple(s.value for s in Sharding)]
    precision: Literal[tuple(p.value for p in Precision)]
    offload: bool = Field(description="parameters, gradients and optimizer state offloaded to CPU")
    activation_checkpointing: str = Field(description='"none", "full", "every-K" or "selective-op"')
    micro_batch: int = Field(description="sequences per GPU per micro-step")
    grad_accum: int = Field(description="micro-steps per optimizer step")
    attention: Literal[tuple(a.value for a in Attention)]
    attention_kernel: absent_or(Literal[tuple(k.value for k in AttentionKernel if k is not AttentionKernel.FLASH2)],
                                "the fused (sdpa) attention's kernel: Transformer Engine's cuDNN fused attention or "
                                "flash-attention 3 (absent: PyTorch SDPA's FlashAttention-2)")
    backward_prefetch: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    expert_shard_dim: absent_or(Literal[1], "stacked expert weights sharded on dim 1 (absent: dim 0)")
    expert_units: absent_or(Literal[True], "each block's experts are their own FSDP unit")
    reduce_dtype: absent_or(Literal["fp32", "bf16"], "gradient reduction dtype (absent: the precision's own)")
    compile: absent_or(Literal[True], "torch.compile each block")
    compile_loss: absent_or(Literal[False], "with compile: the loss is left eager (absent: compiled too)")
    norm_kernel: absent_or(_KERNELS, "RMSNorm kernel: Liger's or Transformer Engine's (absent: eager)")
    rope_kernel: absent_or(_KERNELS, "RoPE kernel: Liger's or Transformer Engine's (absent: eager)")
    swiglu_kernel: absent_or(_KERNELS, "SwiGLU kernel: Liger's or Transformer Engine's (absent: eager)")
    loss_kernel: absent_or(Literal[tuple(k.value for k in LossKernel if k is not LossKernel.EAGER)],
                           "loss: torchtitan's chunked cross-entropy or Liger's fused linear cross-entropy (absent: "
                           "the model's own)")
    moe_dispatch: absent_or(Literal["deepep"], "MoE under EP: DeepEP's dispatch / combine (absent: NCCL all-to-all)")
    float8: absent_or(Literal[True], "torchao Float8 linears")
    fp8_all_gather: absent_or(Literal[True], "Float8 weights all-gathered in FP8")
    reshard_after_forward: absent_or(int, "blocks reshard to a group of this many ranks after forward")
    tp: int = Field(ge=1, description="tensor-parallel degree (1: none)")
    cp: int = Field(ge=1, description="context-parallel degree (1: none)")
    ep: int = Field(ge=1, description="expert-parallel degree (1: none)")
    pp: int = Field(ge=1, description="pipeline-parallel degree (1: none)")
    shard_group_gpus: absent_or(int, "HYBRID strategies: GPUs of one shard group, dp_shard x cp x tp (absent: a node)")
    async_tp: absent_or(Literal[True], "TP's collectives overlapped with the matmuls (torchtitan's async TP)")
    sequence_parallel: absent_or(Literal[False], "with tp > 1: no sequence parallel, logits gathered "
                                                 "(transformers' tp_plan); absent: sequence and loss parallel")
    pp_schedule: absent_or(Literal[tuple(s.value for s in Schedule)], "with pp > 1: the pipeline schedule")
    pp_stages_per_rank: absent_or(int, "with pp > 1: stages on each pipeline rank (V)")
    alloc_conf: absent_or(str, "PYTORCH_CUDA_ALLOC_CONF the run sets, e.g. expandable_segments:True (absent: "
                               "PyTorch's defaults); a pipeline's reserved memory is replayed under it")
