"""The GPU catalog (planner/catalog/gpus.json) and cluster construction from user flags."""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from cost_models.attention_kernels import architecture_speeds
from cost_models.specs import ClusterSpec, GpuSpec, HostCpu
from cost_models.units import GB, GiB, MiB, TB, TFLOP, gbit_per_s_to_bytes_per_s

from .errors import PlannerError

_CATALOG = Path(__file__).parent / "catalog" / "gpus.json"
DEFAULT_GPU = "a100-80gb"


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GpuSpec]:
    catalog = json.loads(_CATALOG.read_text())
    entries, kernels = catalog["gpus"], catalog["attention_kernels"]
    return {
        e["id"]: GpuSpec(
            id=e["id"],
            name=e["name"],
            memory_bytes=e["memory_mib"] * MiB,
            hbm_bytes_per_s=e["hbm_tb_per_s"] * TB,
            peak_flops={k: v * TFLOP for k, v in e["tflops"].items()},
            intra_node_bus_bytes_per_s=e["intra_node_bus_gb_per_s"] * GB,
            pcie_bytes_per_s=e["pcie_gb_per_s"] * GB,
            default_internode_gbit_per_s=e["internode_gbit_per_s"],
            default_cpu_ram_bytes_per_node=e["cpu_ram_gib_per_node"] * GiB,
            source=e["source"],
            architecture=e["architecture"],
            default_gpus_per_node=e["gpus_per_node"],
            scale_up_domain_gpus=e["scale_up_domain_gpus"],
            scale_up_link=e["scale_up_link"],
            scale_up_peak_bytes_per_s=e["scale_up_peak_gb_per_s"] * GB,
            host_link=e["host_link"],
            host_link_peak_bytes_per_s=e["host_link_peak_gb_per_s"] * GB,
            nics_per_node=e["nics_per_node"],
            nic=e["nic"],
            matmul_efficiency=e.get("matmul_efficiency", 0.0),
            attention_efficiency=e.get("attention_efficiency", 0.0),
            attention_kernel_speeds=architecture_speeds(kernels.get(e["architecture"], {})),
            tdp_w=float(e.get("tdp_w", 0)),
            power_limit_w=float(e.get("power_limit_w", 0)),
        )
        for e in entries
    }


def get_gpu(gpu_id: str) -> GpuSpec:
    catalog = gpu_catalog()
    key = str(gpu_id).strip().lower()
    if key not in catalog:
        close = difflib.get_close_matches(key, catalog, n=3, cutoff=0.4)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise PlannerError("gpu", f"unknown GPU {gpu_id!r}{hint}; choose one of: {', '.join(catalog)}")
    return catalog[key]


def make_cluster(gpus: int, gpu: str = DEFAULT_GPU, gpus_per_node: int | None = None,
                 internode_gbps: float | None = None, gpu_memory: int | None = None,
                 intra_node_gb_per_s: float | None = None, pcie_gb_per_s: float | None = None,
                 cpu_ram_per_node: int | None = None, scale_up_domain_gpus: int | None = None,
                 power_limit_w: float | None = None, host_cores_per_node: int | None = None,
                 host_memory_gb_per_s: float | None = None, host_thread_gb_per_s: float | None = None,
                 omp_num_threads: int | None = None) -> ClusterSpec:
    """A ClusterSpec from CLI-level values; every catalog figure can be overridden.

    Nodes default to the GPU's usual server (8, a GB200 compute tray 4, a GH200 superchip 1) and the
    scale-up domain to the GPU's (HGX 8, GB200 NVL72 72), both capped at `gpus`. power_limit_w: the board
    power cap the GPUs run under (None: the catalog's, h100-96gb 500 W, else the TDP); it scales the compute
    rates by (cap / TDP)^(1/3) (GpuSpec.clock_scale). host_*, omp_num_threads: the node's CPUs and the threads
    a rank steps the optimizer with on them under CPU offload (HostCpu; None: its defaults, a DGX H100 node's)."""
    if gpus is None or gpus < 1:
        raise PlannerError("gpus", f"must be >= 1, got {gpus}")
    for name, value in (("internode_gbps", internode_gbps), ("intra_node_gb_per_s", intra_node_gb_per_s),
                        ("pcie_gb_per_s", pcie_gb_per_s), ("host_memory_gb_per_s", host_memory_gb_per_s),
                        ("host_thread_gb_per_s", host_thread_gb_per_s)):
        if value is not None and not 0 < value < math.inf:  # NaN fails both comparisons
            raise PlannerError(name, f"must be a finite number > 0, got {value}")
    spec = get_gpu(gpu)
    overrides = {}
    if gpu_memory is not None:
        overrides["memory_bytes"] = gpu_memory
    if intra_node_gb_per_s is not None:
        overrides["intra_node_bus_bytes_per_s"] = intra_node_gb_per_s * GB
    if pcie_gb_per_s is not None:
        overrides["pcie_bytes_per_s"] = pcie_gb_per_s * GB
    if power_limit_w is not None:
        overrides["power_limit_w"] = checked_power_limit(spec, power_limit_w)
    if overrides:
        spec = replace(spec, **overrides)
    per_node = gpus_per_node if gpus_per_node is not None else min(gpus, spec.default_gpus_per_node)
    if per_node < 1:
        raise PlannerError("gpus_per_node", f"must be >= 1, got {per_node}")
    if per_node > gpus:
        raise PlannerError("gpus_per_node", f"{per_node} is more than gpus={gpus}")
    network = internode_gbps if internode_gbps is not None else spec.default_internode_gbit_per_s
    if scale_up_domain_gpus is not None and scale_up_domain_gpus < 1:
        raise PlannerError("scale_up_domain_gpus", f"must be >= 1, got {scale_up_domain_gpus}")
    return ClusterSpec(gpu=spec, n_gpus=gpus, gpus_per_node=per_node,
                       internode_bytes_per_s=gbit_per_s_to_bytes_per_s(network),
                       cpu_ram_bytes_per_node=cpu_ram_per_node or spec.default_cpu_ram_bytes_per_node,
                       scale_up_domain_gpus=min(scale_up_domain_gpus or spec.scale_up_domain_gpus, gpus),
                       host_cpu=host_cpu(host_cores_per_node, host_memory_gb_per_s, host_thread_gb_per_s,
                                         omp_num_threads))


def host_cpu(cores_per_node: int | None, memory_gb_per_s: float | None, thread_gb_per_s: float | None,
             omp_num_threads: int | None) -> HostCpu:
    """HostCpu from the flags (GB/s = 1e9 B/s), None keeping its default."""
    given = {"cores_per_node": cores_per_node, "threads_per_rank": omp_num_threads,
             "memory_bytes_per_s": None if memory_gb_per_s is None else memory_gb_per_s * GB,
             "thread_bytes_per_s": None if thread_gb_per_s is None else thread_gb_per_s * GB}
    return HostCpu(**{k: v for k, v in given.items() if v is not None})  # a bad value: SpecError naming the flag


def checked_power_limit(spec: GpuSpec, watts: float) -> float:
    """`watts` as a power limit of `spec`: above 0 and at most its TDP (a cap above it does not speed it up)."""
    if not spec.tdp_w:
        raise PlannerError("power_limit_w", f"{spec.id} has no board power (TDP) in the catalog, so a power limit "
                                            "cannot be priced; leave --power-limit-w out")
    if not 0 < watts <= spec.tdp_w:  # NaN fails too
        raise PlannerError("power_limit_w", f"must be watts > 0 and <= {spec.tdp_w:g} ({spec.id}'s TDP), got {watts}")
    return float(watts)
