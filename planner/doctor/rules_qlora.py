"""The doctor's rules on QLoRA's silent failures (issue 29): each reads what a Python script loads
(planner/doctor/readers/python_qlora.py) and says the fix. Nothing fires without a BitsAndBytesConfig."""

from __future__ import annotations

from planner.doctor.findings import ERROR, WARNING, Context, Finding


def quant_storage(ctx: Context):
    q = ctx.setup.qlora
    if q is None:
        return
    compute = ctx.config.precision.compute_dtype
    if q.quant_storage == "uint8":
        yield Finding("qlora-integer-quant-storage", ERROR,
                      "bnb_4bit_quant_storage is uint8 (bitsandbytes' default): FSDP flattens and all-gathers the "
                      "packed weights with the unit's other parameters, and under FSDP2 training runs with loss 0 "
                      "and a NaN gradient norm (accelerate issue 3983).",
                      f"BitsAndBytesConfig(..., bnb_4bit_quant_storage=torch.{_torch(compute)}) (the compute dtype)")
    elif q.quant_storage != compute:
        yield Finding("qlora-storage-not-compute-dtype", ERROR,
                      f"bnb_4bit_quant_storage is {q.quant_storage} but the run computes in {compute}: FSDP needs one "
                      "dtype per unit, so the packed weights cannot be flattened / gathered with the rest (or are "
                      "cast, which corrupts the 4-bit codes).",
                      f"bnb_4bit_quant_storage=torch.{_torch(compute)} and from_pretrained(..., dtype=torch."
                      f"{_torch(compute)})")


def adapter_dtype(ctx: Context):
    q = ctx.setup.qlora
    if q is None or q.adapter_dtype is None or q.base_dtype is None or q.adapter_dtype == q.base_dtype:
        return
    if ctx.setup.fsdp_version != 1 or ctx.setup.wrap != "block":
        return  # FSDP2 casts every parameter to param_dtype per unit; adapters in units of their own flatten apart
    yield Finding("qlora-adapters-other-dtype", ERROR,
                  f"peft's adapters are {q.adapter_dtype} over a {q.base_dtype} base in one FSDP1 unit per block: "
                  "FSDP1 flattens them into one FlatParameter and refuses ('Must flatten tensors with uniform "
                  "dtype').",
                  "get_peft_model(model, lora_config, autocast_adapter_dtype=False) (adapters in the base's dtype), "
                  "or wrap each adapter in its own unit (peft.utils.other.fsdp_auto_wrap_policy)")


def fsdp1_orig_params(ctx: Context):
    if ctx.setup.qlora is not None and ctx.setup.fsdp_version == 1 and not ctx.setup.use_orig_params:
        yield Finding("qlora-without-use-orig-params", ERROR,
                      "QLoRA under FSDP1 without use_orig_params=True: the frozen 4-bit base and the trainable "
                      "adapters share FlatParameters, which must be uniformly trainable; wrapping fails.",
                      "FullyShardedDataParallel(..., use_orig_params=True) (accelerate: fsdp_use_orig_params: true)")


def every_rank_loads(ctx: Context):
    if ctx.setup.qlora is not None and ctx.setup.init == "all" and not ctx.setup.qlora.rank0_loading:
        yield Finding("qlora-every-rank-loads", WARNING,
                      "every rank loads and quantizes the whole checkpoint: each process holds the full model in host "
                      "RAM while it loads (N ranks x the model on a node).",
                      "load on rank 0 only: fsdp_cpu_ram_efficient_loading: true (HF Trainer / accelerate), or meta-"
                      "device init with sync_module_states=True and param_init_fn (FSDP1)")


def checkpointing_without_input_grads(ctx: Context):
    q = ctx.setup.qlora
    if q is not None and q.checkpointing and not q.input_grads_hook:
        yield Finding("qlora-checkpointing-without-input-grads", ERROR,
                      "reentrant gradient checkpointing over a frozen base: the embeddings' output needs no grad, so "
                      "the checkpointed blocks' inputs have none, torch.utils.checkpoint returns an output without a "
                      "grad_fn and no gradient reaches the adapters; the loss does not move.",
                      "call model.enable_input_require_grads() before wrapping (or peft's "
                      "prepare_model_for_kbit_training), or gradient_checkpointing_kwargs={\"use_reentrant\": False}")


def _torch(dtype: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]


RULES = (quant_storage, adapter_dtype, fsdp1_orig_params, every_rank_loads, checkpointing_without_input_grads)
