"""Efficiency coefficients of the cost model, as plain data.

Defaults come from public measurements (shared/reference/published.md, hardware.md); `fsdp-plan
calibrate` fits them to a user's cluster and saves them as a profile file that replaces these.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


def _default_compute_efficiency() -> dict:
    # The fraction of the GPU's best large-GEMM rate (catalog matmul_efficiency x peak) that a training
    # step's matmuls reach, per compute dtype (kernel_time.py). bf16/fp16: least-squares fit over the 16
    # published torchtitan rows jointly with memory_bound_efficiency (`python benchmarks/throughput_accuracy.py
    # --fit`: 0.890 +- 0.026). fp32 (no TF32): CUDA-core GEMMs reach ~85-90% of their much lower peak (1.0 x
    # the default 0.8 is a stated guess).
    return {"bf16": 0.89, "fp16": 0.89, "fp32": 1.0}


@dataclass(frozen=True)
class Profile:
    compute_efficiency: dict = field(default_factory=_default_compute_efficiency)
    # Achieved fraction of the catalog's bus bandwidth. The intra-node catalog figures are already
    # measured NCCL bus bandwidths (1.0); inter-node: 86 of ~100 GB/s measured (hardware.md).
    intra_node_comm_efficiency: float = 1.0
    inter_node_comm_efficiency: float = 0.85
    # The mesh's collectives, as the fraction of the alpha-beta rate of the tier their group spans that they
    # reach (bus bandwidth x eff, per-hop latency / eff; 1.0: priced as FSDP's collectives there). TP's
    # sequence-parallel all-gathers / reduce-scatters (all-reduces without SP) move activations many times per
    # block, smaller messages than FSDP's parameter gathers, on DTensor's code path (on a GPU bandwidth-bound;
    # on gloo, latency-bound); EP's dispatch / combine all-to-alls exchange with every peer at once. No
    # published figure sets either apart from the tier's rate: calibration fits each only where runs with
    # tp > 1 (ep > 1) identify it (calibration/fit.py), else it stays 1.0.
    tp_comm_efficiency: float = 1.0
    ep_comm_efficiency: float = 1.0
    # Per-hop latency of a ring step (NCCL LL/Simple protocols are a few microseconds per hop).
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 15e-6
    # Fixed host-side cost per micro-step: kernel launches and hooks, data loading.
    microstep_overhead_s: float = 0.01
    # Memory outside PyTorch's allocator: None prices it term by term for each configuration (the CUDA context per
    # architecture, NCCL's communicators, symmetric memory, ...: cost_models/outside_allocator.py); an int is a
    # measured figure (calibration: device memory used outside the allocator), which replaces the context and NCCL
    # terms. outside_allocator: (term or NCCL variable, value) overrides (outside_allocator.parse_overrides).
    cuda_context_bytes: int | None = None
    outside_allocator: tuple = ()
    # Caching-allocator reserved / allocated - 1 at the peak (fragmentation, FSDP paper section 7).
    fragmentation: float = 0.05
    # Fraction of HBM bandwidth the elementwise optimizer step achieves.
    optimizer_hbm_efficiency: float = 0.7
    # Fraction of the host's peak memory bandwidth (ClusterSpec.host_cpu) the ranks' optimizer steps on the CPU
    # reach together (CPU offload: cost_models/host_optimizer.py). 0.8 is a stated estimate (STREAM's triad on a
    # two-socket server reaches ~75-85% of the DIMMs' peak); only steps with many threads per rank reach it.
    host_memory_efficiency: float = 0.8
    # Achieved fraction of PCIe bandwidth for offload copies (pinned memory).
    pcie_efficiency: float = 0.8
    # --- the operator-level step time (kernel_time.py) ---
    # Large-GEMM efficiency (best measured product / peak) for a GPU whose catalog entry has none.
    default_gpu_matmul_efficiency: float = 0.8
    # Shape factor x / (x + x0) per matmul dimension: skinny and small products fall below the large rate.
    # x0 = 64 is a stated estimate (a 64-row product runs at about half the rate of a large one).
    matmul_half_dim: float = 64.0
    # Flash-attention fwd+bwd efficiency (fraction of peak) for a GPU whose entry has none, and a scale
    # calibration fits on top of the catalog's figure.
    default_attention_efficiency: float = 0.35
    attention_efficiency: float = 1.0
    # s / (s + s0): FlashAttention-2's rate at 1k tokens is ~70% of its rate at 16k (FA2 paper, fig. 4).
    attention_half_seq: float = 384.0
    # HBM bandwidth fraction at which the memory-bound kernels (norms, activations, rotary, casts, loss)
    # move the bytes operators.py counts. One streaming kernel reaches ~80-90% (hardware.md); a step's
    # eager chains reach about half of that on the counted bytes (each op's minimum traffic: launch gaps,
    # reductions, strided copies and the copies no formula lists are not counted). Least-squares fit over
    # the 16 published rows with the matmul efficiency (0.42 +- 0.03): identified by the rows' different
    # memory-bound shares (A100 against H100's twice the FLOP/s per byte, eager against compiled).
    memory_bound_efficiency: float = 0.42
    # Compute slows while NCCL kernels run beside it (they take SMs and HBM bandwidth): extra seconds per
    # second of hidden communication. 0.1 is a stated estimate (NCCL's ring kernels use ~8-16 of 108-132
    # SMs); calibration fits it from runs at more than one communication share.
    overlap_slowdown: float = 0.1
    source: str = "defaults (published measurements)"

    def reserved_bytes(self, allocated_bytes: int, outside_bytes: int) -> int:
        """What the GPU must hold for an allocated peak: the allocator's segments (allocated x (1 + fragmentation),
        what torch.cuda.max_memory_reserved shows) + the memory outside the allocator (outside_allocator.py)."""
        return int(allocated_bytes * (1 + self.fragmentation)) + outside_bytes

    def efficiency(self, dtype: str) -> float:
        return self.compute_efficiency.get(dtype, self.compute_efficiency["bf16"])

    def with_updates(self, **changes) -> "Profile":
        return replace(self, **changes)


DEFAULT_PROFILE = Profile()
