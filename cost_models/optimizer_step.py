"""What the optimizer step allocates on top of the parameters, gradients and state it updates: its temporaries,
per rank, for each optimizer and implementation (TrainingSpec.optimizer, .optimizer_impl). From torch 2.13's own
code (torch/optim/adam.py, sgd.py; AdamW is Adam with decoupled_weight_decay=True, adamw.py) at the defaults the
planner's runs and emitted artifacts use (no amsgrad, maximize, capturable or differentiable; AdamW's decoupled
weight decay, Adam's and SGD's weight_decay 0, SGD's momentum without nesterov):

- foreach, Adam / AdamW (_multi_tensor_adam): every op is one multi-tensor call over a (device, dtype) group; all
  update the state and parameters in place but `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`, a
  new tensor per parameter, alive until the group's addcdiv_: one more copy of the local trainable shards in the
  state dtype. (maximize's `_foreach_neg(device_grads)` and Adam's non-decoupled weight decay `_foreach_add(grads,
  params)` make a grads-sized list too, but `del device_grads` drops it before the sqrt: the peak stays one
  copy; capturable adds one scalar per parameter.) With CPU offload foreach=True runs the same list through the
  CPU fallback, on the host.
- fused (_fused_adam): torch._fused_adamw_ (Adam: _fused_adam_) updates params, exp_avg and exp_avg_sq in place
  in one kernel (CUDA: multi_tensor_apply; CPU: FusedAdamKernel, one tensor at a time); the grad-scaler's grad_scale /
  found_inf are read inside it (no separate unscale). Nothing tensor-sized is allocated. Its step counters live
  on the device, 4 B per parameter tensor (ignored).
- for-loop (_single_tensor_adam, foreach=False): parameter by parameter, `denom = (exp_avg_sq.sqrt() /
  bias_correction2_sqrt).add_(eps)` holds the sqrt and the quotient of one parameter at once, and `denom` stays
  bound until the next parameter's quotient replaces it: at parameter i, size(i-1) + 2 size(i).
- SGD with momentum, every implementation: `momentum_buffer.mul_(momentum).add_(grad)` and `param.add_(buf)`
  in place (foreach: _foreach_mul_ / _foreach_add_; fused: torch._fused_sgd_); nothing allocated after the first
  step (which clones the gradient into the buffer: state).
- adamw-8bit (bitsandbytes 0.50.2, bitsandbytes/optim/optimizer.py Optimizer2State.update_step): parameter by
  parameter, F.optimizer_update_8bit_blockwise updates the 8-bit states and the parameter in place (its
  `p.data.contiguous()` is a no-op on FSDP2's contiguous shards): none, spelled fused (TrainingSpec).
- fp16 (ShardedGradScaler): found-inf flags and the scale per device, 4 KiB in all.

Local tensor sizes are the FSDP2 shards (dim 0 over the shard group d, ceil(elements / d): row padding ignored).
Parameter order (for-loop): the embedding, then each block's attention (q, k, v, o), MLP matrices (a gated MLP's
gate, up, down) or routed experts' stacked tensors and its two norms, then the final norm and the head: Llama's
registration order (transformers and calibration/reference.py); fused projections (qkv, gate_up) of other families
count as their parts. Measured on a real 2-rank gloo FSDP2 run of calibration.reference's Llama
(tests/distributed/test_torchrun_optimizer.py): foreach one copy of the shard, fused none, for-loop the final norm's
quotient plus two copies of the head's shard, each to the byte.
"""

from __future__ import annotations

import math

from .spec_values import Optimizer, OptimizerImpl, Precision
from .specs import ModelSpec, TrainingSpec
from .units import DTYPE_BYTES

GRAD_SCALER_BYTES = 4 * 1024  # ShardedGradScaler's found-inf flags and scale, per device


def trainable_tensor_elements(model: ModelSpec, training: TrainingSpec, embedding: bool = True,
                              head: bool = True) -> list[int]:
    """Elements of the trainable parameter tensors that can set the for-loop step's peak, in registration order:
    the embedding, one block's matrices (the other blocks repeat them), the head; LoRA: one block's adapters
    (lora_A r x in, lora_B out x r per target). A block's two norms follow its MLP and the final norm precedes the
    head (Llama's order); biases are left out. embedding / head False: a pipeline stage without them."""
    if training.finetune.adapters:
        return model.lora_tensor_elements(training.lora_rank)
    h = model.hidden_size
    attention = [model.q_dim * h, model.kv_dim * h, model.kv_dim * h, h * model.q_dim]
    if model.moe is not None and model.moe.stacked_expert_tensors:
        mlp = [rows * per_row for rows, per_row in model.moe.stacked_expert_tensors]
    else:
        mlp = [model.ffn_hidden_size * h] * (3 if model.gated_mlp else 2)
    block = attention + mlp + [h, h]
    # two blocks: one block's last norm precedes the next one's q
    return [model.embedding_params] * embedding + block + block + [h, model.head_params] * head


def for_loop_peak_elements(sizes: list[int], d: int) -> int:
    """max over parameters i of size(i-1) + 2 size(i), each the local shard ceil(size / d) (see the module
    docstring: the previous denom, this one's sqrt and quotient)."""
    local = [math.ceil(n / d) for n in sizes if n]
    return max((prev + 2 * cur for prev, cur in zip([0] + local, local)), default=0)


# the members step_temporary_bytes compares with, looked up once (a search asks ~3,000 times)
_FP16, _ADAMS = Precision.FP16, frozenset({Optimizer.ADAM, Optimizer.ADAMW})
_FUSED, _FOR_LOOP = OptimizerImpl.FUSED, OptimizerImpl.FOR_LOOP


def step_temporary_bytes(model: ModelSpec, training: TrainingSpec, precision: Precision, d: int,
                         trainable_elements: int, embedding: bool = True, head: bool = True) -> int:
    """Bytes the optimizer step allocates beyond params, grads and state on one rank holding the 1/d shard of
    `trainable_elements` parameters (on the host with CPU offload; see the module docstring for each case);
    embedding / head False: a pipeline rank without them."""
    scaler = GRAD_SCALER_BYTES if precision is _FP16 else 0
    if training.optimizer not in _ADAMS or training.optimizer_impl is _FUSED:
        return scaler  # SGD, bitsandbytes' 8-bit, the fused kernels: in place
    width = DTYPE_BYTES[precision.param_dtype]  # the state's dtype: the stored params'
    if training.optimizer_impl is _FOR_LOOP:
        sizes = trainable_tensor_elements(model, training, embedding, head)
        return width * for_loop_peak_elements(sizes, d) + scaler
    return math.ceil(trainable_elements * width / d) + scaler  # foreach: the sqrt list, one state's worth
