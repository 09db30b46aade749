"""What the trace tier refuses before it builds anything (TraceUnsupported / TraceError): the meshes, fine-tuning,
offload and optimizers it does not run, and Hugging Face models without transformers."""

from __future__ import annotations

from cost_models.specs import FsdpConfig, ModelSpec, Optimizer, TrainingSpec

from .trace_result import TraceError, TraceUnsupported


def _check_mesh(spec: ModelSpec, config: FsdpConfig, n_gpus: int) -> None:
    """The mesh the trace runs: tensor parallel (calibration/tensor_parallel.py) on dense models, expert
    parallelism (calibration/expert_parallel.py) on MoE models with tp = 1, context parallelism
    (calibration/context_parallel.py) with SDPA."""
    if config.cp > 1 and config.attention.value != "sdpa":
        raise TraceUnsupported("context parallelism runs ring attention in place of SDPA: trace it with sdpa")
    if config.ep > 1 and (config.tp > 1 or spec.moe is None):  # EP: calibration/expert_parallel.py (tp = 1)
        raise TraceUnsupported("the trace tier runs expert parallelism on mixture-of-experts models with tp = 1 "
                               "(transformers' AllToAllEP); use the analytic estimate")
    if config.pp > 1:
        raise TraceUnsupported("the trace tier does not run pipeline parallelism; use the analytic estimate")
    if config.tp > 1:
        from .tensor_parallel import check_tensor_parallel

        if n_gpus % config.tp:
            raise TraceError(f"tp={config.tp} does not divide the {n_gpus} GPUs")
        if spec.moe is not None:
            raise TraceUnsupported("the trace tier runs tensor parallelism on dense models only (the experts' TP "
                                   "plan belongs to expert parallelism); use the analytic estimate")
        try:
            check_tensor_parallel(spec.n_heads, spec.n_kv_heads, config.tp)
        except ValueError as exc:
            raise TraceUnsupported(str(exc)) from None


def _check_supported(config: FsdpConfig, training: TrainingSpec) -> None:
    if training.quantized:  # it would trace an unquantized LoRA base: 4x the bytes of the 4-bit one
        raise TraceUnsupported("the trace tier builds no bitsandbytes 4-bit base (Params4bit quantizes real weights "
                               "when loaded; fake tensors hold none): QLoRA's memory is the analytic estimate's, "
                               "checked against real CPU runs (tests/distributed/test_torchrun_qlora.py)")
    if training.finetune.adapters:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise TraceUnsupported("tracing LoRA fine-tuning needs peft: pip install 'fsdp-planner[lora]'") from None
    if config.offload:
        raise TraceUnsupported("the trace tier does not model CPU offload (on a CPU mesh, device and host "
                               "memory are one); use the analytic estimate")
    if training.optimizer is Optimizer.ADAMW_8BIT:
        raise TraceUnsupported("the trace tier does not model 8-bit AdamW (bitsandbytes kernels); trace with "
                               "adamw and subtract 6 bytes per sharded parameter, or use the analytic estimate")


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise TraceError("tracing a Hugging Face model needs transformers: pip install 'fsdp-planner[trace]'") from None
