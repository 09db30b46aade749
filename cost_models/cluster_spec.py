"""Where it is trained: GpuSpec (one accelerator and its usual server), HostCpu (a node's CPUs, as the optimizer
step on the host uses them) and ClusterSpec (how many, how they connect). cost_models/specs.py re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .spec_values import SpecError, check_positive


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator and the usual server it comes in (planner/catalog/gpus.json, with sources).

    The fields after `source` describe what the cost model does not read yet (the architecture, the
    scale-up domain, the host link, the NICs; planner/hardware.py sizes nodes by default_gpus_per_node);
    their defaults keep every older construction valid. Bandwidths are per GPU and direction unless per node.
    """

    id: str
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    peak_flops: dict = field(default_factory=dict)  # dtype -> dense FLOP/s ("bf16", "fp16", "fp32", "fp8")
    intra_node_bus_bytes_per_s: float = 0.0          # NCCL bus bandwidth inside a node
    pcie_bytes_per_s: float = 25e9                   # host<->device, per direction, per GPU, as copies reach it
    default_internode_gbit_per_s: float = 1600.0     # per node, all NICs together
    default_cpu_ram_bytes_per_node: int = 0          # the usual server for this GPU; 0 = unknown
    source: str = ""
    architecture: str = ""                           # ampere, hopper, ada, blackwell, volta, cdna3, cdna4; "" = unknown
    default_gpus_per_node: int = 8                   # GPUs in the usual server (GB200: a compute tray of 4)
    scale_up_domain_gpus: int = 0                    # GPUs joined by NVLink / Infinity Fabric (HGX 8, NVL72 72);
    #                                                  1 = none (PCIe only); 0 = unknown: taken as the node
    scale_up_link: str = ""                          # e.g. "NVLink4 over NVSwitch"
    scale_up_peak_bytes_per_s: float = 0.0           # datasheet peak of that link; 0 = none or unknown
    host_link: str = ""                              # "PCIe Gen5 x16", "NVLink-C2C" (GH200, GB200)
    host_link_peak_bytes_per_s: float = 0.0          # datasheet peak (pcie_bytes_per_s is what copies reach)
    nics_per_node: int = 0                           # 0 = unknown
    nic: str = ""                                    # e.g. "8 x 400 Gb/s NDR InfiniBand (ConnectX-7)"
    matmul_efficiency: float = 0.0                   # best measured large bf16 GEMM / bf16 peak; 0 = unknown
    attention_efficiency: float = 0.0                # SDPA flash kernel fwd+bwd / bf16 peak (long s, head dim 128); 0 = unknown
    # (kernel, fwd+bwd speed over FlashAttention-2) of the other fused-attention kernels the part runs
    # (cost_models/attention_kernels.py; Hopper: cudnn, fa3); flash2 is always there
    attention_kernel_speeds: tuple[tuple[str, float], ...] = ()
    tdp_w: float = 0.0                               # board power (datasheet TDP), watts; 0 = unknown
    power_limit_w: float = 0.0                       # the cap it runs under (nvidia-smi -pl), watts; 0 = its TDP

    def __post_init__(self):
        check_positive("gpu.memory_bytes", self.memory_bytes)
        check_positive("gpu.hbm_bytes_per_s", self.hbm_bytes_per_s)
        check_positive("gpu.intra_node_bus_bytes_per_s", self.intra_node_bus_bytes_per_s)
        check_positive("gpu.pcie_bytes_per_s", self.pcie_bytes_per_s)
        check_positive("gpu.default_gpus_per_node", self.default_gpus_per_node)
        for name in ("scale_up_domain_gpus", "scale_up_peak_bytes_per_s", "host_link_peak_bytes_per_s",
                     "nics_per_node", "matmul_efficiency", "attention_efficiency"):
            check_positive(f"gpu.{name}", getattr(self, name), allow_zero=True)
        check_positive("gpu.tdp_w", self.tdp_w, allow_zero=True)
        check_positive("power_limit_w", self.power_limit_w, allow_zero=True)
        if self.power_limit_w and not self.power_limit_w <= self.tdp_w:
            raise SpecError("power_limit_w", f"{self.power_limit_w:g} W: {self.id}'s TDP is "
                                             f"{f'{self.tdp_w:g} W' if self.tdp_w else 'unknown'}")

    @property
    def clock_scale(self) -> float:
        """The compute rate under power_limit_w over the rate at TDP: (limit / TDP)^(1/3), the sustained clock
        if dynamic power ~ f V^2 with V ~ f (a stated estimate from physics, not a measurement; HBM and links
        keep their rates). 1 without a limit."""
        return (self.power_limit_w / self.tdp_w) ** (1 / 3) if self.power_limit_w else 1.0

    def matmul_fraction(self, default: float) -> float:
        """The large-GEMM rate over the bf16 peak priced here: the catalog's efficiency (`default`, the
        profile's, where unmeasured) x clock_scale."""
        return (self.matmul_efficiency or default) * self.clock_scale

    def attention_fraction(self, default: float) -> float:
        """The flash kernel's fwd+bwd rate over the bf16 peak priced here, as matmul_fraction."""
        return (self.attention_efficiency or default) * self.clock_scale

    def attention_kernels(self) -> tuple[str, ...]:
        """The fused-attention kernels priced on this part (FsdpConfig.attention_kernel values)."""
        return ("flash2", *(name for name, _ in self.attention_kernel_speeds))

    def attention_speed(self, kernel: str) -> float:
        """A fused-attention kernel's fwd+bwd speed over FlashAttention-2 here (1 for flash2, and for a kernel the
        part lacks, which cost_models/feasibility.py refuses)."""
        return dict(self.attention_kernel_speeds).get(kernel, 1.0)

    def supports(self, dtype: str) -> bool:
        return self.peak_flops.get(dtype, 0) > 0

    def priced_peak_flops(self, dtype: str) -> float:
        """The dense peak the step time prices `dtype` at: a dtype the GPU lacks runs emulated, at the fp32
        rate (evaluate rejects it anyway)."""
        return self.peak_flops.get(dtype) or self.peak_flops["fp32"]


# The one-thread rate of the published H100 host (shared/reference/published.md, "FSDP2 CPU offload, the optimizer
# step measured": 536.9M fp32 parameters stepped by a per-parameter AdamW on 1 thread in 1.93 s), as the bytes that
# step moves: 12 passes of 4 B per parameter (cost_models/host_optimizer.py) -> 13.35 GB/s.
PUBLISHED_H100_HOST_THREAD_BYTES_PER_S = 512 * 2 ** 20 * 12 * 4 / 1.93


@dataclass(frozen=True)
class HostCpu:
    """A node's CPUs as the optimizer step on the host (CPU offload) uses them (cost_models/host_optimizer.py).

    Defaults: a DGX H100 node. cores_per_node: 2 x 56-core Xeon Platinum 8480C (NVIDIA DGX H100 datasheet).
    memory_bytes_per_s: the peak of 2 sockets x 8 DDR5-4800 channels x 8 B = 614.4 GB/s (Intel's 8480+ figures;
    with two DIMMs a channel Sapphire Rapids runs 4400 MT/s, 563 GB/s: the datasheet's 2 TB in 32 DIMMs would be
    that, not checked); the step reaches Profile.host_memory_efficiency of it. thread_bytes_per_s: the bytes one
    thread's step streams per second (PUBLISHED_H100_HOST_THREAD_BYTES_PER_S, measured on an H100 node's host;
    this 2-core CI machine's: benchmarks/cpu_optimizer_rate.py, docs/step_time.md). threads_per_rank: the intra-op
    threads a rank steps with, OMP_NUM_THREADS (torchrun sets 1 unless the user does). ranks_per_node: the ranks
    that step on the node's CPUs at once; 0: the cluster's gpus_per_node (a rank per GPU)."""

    cores_per_node: int = 112
    memory_bytes_per_s: float = 2 * 8 * 4800e6 * 8
    thread_bytes_per_s: float = PUBLISHED_H100_HOST_THREAD_BYTES_PER_S
    threads_per_rank: int = 1
    ranks_per_node: int = 0

    def __post_init__(self):
        check_positive("host_cores_per_node", self.cores_per_node)
        check_positive("host_memory_gb_per_s", self.memory_bytes_per_s)
        check_positive("host_thread_gb_per_s", self.thread_bytes_per_s)
        check_positive("omp_num_threads", self.threads_per_rank)
        check_positive("host_cpu.ranks_per_node", self.ranks_per_node, allow_zero=True)


@dataclass(frozen=True)
class ClusterSpec:
    gpu: GpuSpec
    n_gpus: int
    gpus_per_node: int
    internode_bytes_per_s: float     # per node, shared by its GPUs
    cpu_ram_bytes_per_node: int = 0  # 0 = unknown: offload RAM is reported, not checked
    scale_up_domain_gpus: int = 0    # GPUs of this cluster in one NVLink / Infinity Fabric domain (a 72-GPU
    #                                  GB200 NVL72 cluster: 72); 0 = the node. A process group inside it
    #                                  runs on the fast tier (fast_tier_gpus)
    host_cpu: HostCpu = HostCpu()    # the node's CPUs (the optimizer step on the host)

    def __post_init__(self):
        check_positive("gpus", self.n_gpus)
        check_positive("gpus_per_node", self.gpus_per_node)
        check_positive("internode_gbps", self.internode_bytes_per_s)
        check_positive("cpu_ram_per_node", self.cpu_ram_bytes_per_node, allow_zero=True)
        check_positive("scale_up_domain_gpus", self.scale_up_domain_gpus, allow_zero=True)
        if self.gpus_per_node > self.n_gpus:
            raise SpecError("gpus_per_node", f"{self.gpus_per_node} is more than gpus={self.n_gpus}")
        if self.scale_up_domain_gpus > self.n_gpus:
            raise SpecError("scale_up_domain_gpus", f"{self.scale_up_domain_gpus} is more than gpus={self.n_gpus}")

    @property
    def n_nodes(self) -> int:
        return -(-self.n_gpus // self.gpus_per_node)

    @property
    def scale_up_gpus(self) -> int:
        """GPUs that share one scale-up domain here: the domain's size, else (0, unknown) the node's."""
        return self.scale_up_domain_gpus or self.gpus_per_node

    @property
    def fast_tier_gpus(self) -> int:
        """GPUs a process group can span on the intra-node tier (GpuSpec.intra_node_bus_bytes_per_s): the
        node (PCIe parts too: their bus figure is PCIe's), or the larger scale-up domain (GB200 NVL72: 72
        GPUs over NVLink across 18 trays of 4)."""
        return max(self.gpus_per_node, self.scale_up_domain_gpus)
