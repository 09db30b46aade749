"""The optimizer step on the host's CPUs (CPU offload: FSDP1's CPUOffload, FSDP2's CPUOffloadPolicy, and so verl's
offload_policy): seconds of one rank's step from the bytes each parameter's update streams through memory, the
threads the rank steps with, the node's cores its ranks share and the node's memory bandwidth shared by the ranks
stepping at once (ClusterSpec.host_cpu):

    threads = min(threads_per_rank, cores_per_node / ranks_per_node)      # more threads than cores: time-shared
    rank bytes/s = min(threads x thread_bytes_per_s, memory_bytes_per_s x host_memory_efficiency / ranks_per_node)
    seconds = parameters x bytes per parameter / rank bytes/s

Every rank steps at once (FSDP's step follows the same reduce-scatters on every rank). A thread's rate is its
streaming rate (the step's ops are elementwise: a few flops a byte); SMT siblings are not counted as cores (the
published row: a second thread on the job's 2 CPUs gained 7%, as one core's two hardware threads would).

Bytes per parameter, from torch 2.13's torch/optim/adam.py at the planner's defaults (AdamW's decoupled weight
decay; no amsgrad, maximize or capturable), in passes over an element of the stored dtype:
- foreach (_multi_tensor_adam): mul_(p) 2, lerp_(m, g) 3, mul_(v) 2, addcmul_(v, g, g) 3, sqrt(v) -> t 2, div_(t)
  2, add_(t, eps) 2, addcdiv_(p, m, t) 4 = 20 (Adam: 18, no weight-decay mul_). Each op runs over every shard before
  the next (on CPU each _foreach op loops over the tensors): all 20 reach memory.
- for-loop (_single_tensor_adam; torch's default for CPU tensors: _default_to_fused_or_foreach takes foreach only on
  _get_foreach_kernels_supported_devices, which has no "cpu"): the same ops parameter by parameter, so an op finds
  in cache much of what the one before it wrote. FOR_LOOP_MEMORY_SHARE of the counted passes reach memory: AdamW's
  "about 12 passes over memory per element" of the published row, 12 of 20; never below the fused step's. Ignored:
  that share rises toward foreach's 20 where a parameter's tensors (about 6 copies of its shard) outgrow the rank's
  share of the cache (the row's 4 MiB tensors fit; FSDP1's flat parameters, a large model's FSDP2 shards may not).
- fused (torch._fused_adamw_, ATen's CPU FusedAdamKernel): reads p, g, m, v and writes p, m, v once: 2p + g + 2 x
  the states' bytes (AdamW fp32: 28 B = 7 passes; adamw-8bit, bitsandbytes' kernel: 8 + 4 + 2 x 2 = 16 B).
- SGD with momentum (torch/optim/sgd.py, weight_decay 0, no nesterov): buf.mul_(mu) 2, buf.add_(g) 3, p.add_(buf)
  3 = 8 passes (for-loop: the share, never below the fused 5).
On this shared 2-core machine (benchmarks/cpu_optimizer_rate.py, docs/step_time.md) one thread's for-loop / fused
time was 1.70 and 3.7 in two runs (counted: 12 / 7 = 1.71), foreach / for-loop 2.03 and 1.17 (counted 1.67): other
work's load swings the figures up to 3x, so they neither confirm nor refute the counts.
"""

from __future__ import annotations

from .cluster_spec import ClusterSpec
from .profile import Profile
from .spec_values import Optimizer, OptimizerImpl
from .specs import TrainingSpec
from .units import DTYPE_BYTES

FOR_LOOP_MEMORY_SHARE = 12 / 20   # the per-parameter AdamW's passes that reach memory (published.md: about 12 of 20)
# passes over an element of the stored dtype of the multi-tensor (and per-parameter) step's ops, counted above
KERNEL_PASSES = {Optimizer.ADAMW: 20, Optimizer.ADAM: 18, Optimizer.SGD: 8}


def bytes_per_param(training: TrainingSpec, param_dtype: str) -> float:
    """Bytes one parameter's step moves through host memory, for the optimizer and implementation priced."""
    p = DTYPE_BYTES[param_dtype]
    fused = 3 * p + 2 * training.optimizer.state_bytes_per_param(param_dtype)  # p read + written, g read, states
    impl = training.optimizer_impl
    if impl is OptimizerImpl.FUSED or training.optimizer not in KERNEL_PASSES:  # adamw-8bit: its own fused kernel
        return fused
    counted = KERNEL_PASSES[training.optimizer] * p
    return counted if impl is OptimizerImpl.FOREACH else max(fused, FOR_LOOP_MEMORY_SHARE * counted)


def ranks_per_node(cluster: ClusterSpec) -> int:
    """Ranks stepping on one node's CPUs at once: host_cpu.ranks_per_node, else a rank per GPU of the node."""
    return cluster.host_cpu.ranks_per_node or cluster.gpus_per_node


def rank_bytes_per_s(cluster: ClusterSpec, profile: Profile) -> float:
    """The bytes per second one rank's step streams while every rank of its node steps (the module's formula)."""
    host, ranks = cluster.host_cpu, ranks_per_node(cluster)
    threads = min(host.threads_per_rank, host.cores_per_node / ranks)
    return min(threads * host.thread_bytes_per_s, host.memory_bytes_per_s * profile.host_memory_efficiency / ranks)


def step_seconds(params: float, training: TrainingSpec, param_dtype: str, cluster: ClusterSpec,
                 profile: Profile) -> float:
    """Seconds of one rank's optimizer step over `params` parameters on the host."""
    return params * bytes_per_param(training, param_dtype) / rank_bytes_per_s(cluster, profile)
