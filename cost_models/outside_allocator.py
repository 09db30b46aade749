"""Memory on the GPU that PyTorch's caching allocator does not hold, term by term, each from its source.

    outside_allocator_terms(cluster, config, profile, deepep_bytes=0)   # -> (OutsideTerm, ...)

Which way each figure goes: torch.cuda.max_memory_reserved (what torchtitan and most papers publish as
"reserved") counts the caching allocator's segments only. So the estimate's peak_reserved_bytes is the
allocator's reserved figure + these terms (what the GPU must hold: `fits` compares it with the GPU's memory),
MemoryEstimate.allocator_reserved_bytes is the allocator's alone (what a published "reserved" figure is compared
with: benchmarks/frontier_accuracy.py, throughput_accuracy.py, tests/golden/test_published.py).

Not outside the allocator, so not counted here (torch 2.13, read in .venv/lib/python3.11/site-packages/torch):
- cuBLAS / cuBLASLt workspaces: one per (handle, stream) pair, held as an at::DataPtr of the CUDA allocator
  (include/ATen/cuda/CUDAContextLight.h: WorkspaceMapWithMutex maps (handle, stream) -> (DataPtr, size)); torch's
  own leak check clears them before reading torch.cuda.memory_allocated "to avoid counting cublasWorkspace
  allocations" (testing/_internal/common_utils.py), and Inductor's cudagraph trees say a workspace "will be
  allocated to the cudagraph private pool and accounted for in the allocator" (_inductor/cudagraph_trees.py).
  cuBLASLt shares it (TORCH_CUBLASLT_UNIFIED_WORKSPACE, torch/backends/cuda/__init__.py). Float8's torch._scaled_mm
  runs on cuBLASLt: the same workspace; its scales and amaxes are tensors.
- Inductor's buffers (torch.compile) are allocator tensors; the generated kernels' code is loaded into the CUDA
  context (module memory), within the context's estimate.
Outside it, and counted: the CUDA context, NCCL's communicators (connection buffers, NVLS), symmetric memory
(async TP: CUDASymmetricMemoryAllocator maps driver allocations, cuMemCreate handles, in
include/torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemory.hpp, not the caching allocator) and DeepEP's
NVLink buffer (expert_parallel.py).

A calibrated profile's measured cuda_context_bytes ((total - free) - torch.cuda.memory_reserved after the steps,
calibration/runner.py) already holds the context and the run's communicators: it replaces the context and the NCCL
terms. Every term can be overridden by name (Profile.outside_allocator, `--outside-allocator TERM=GiB`), and NCCL's
buffer sizes by the environment variables NCCL reads (`--outside-allocator NCCL_BUFFSIZE=8388608`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .mesh import mesh_of
from .quick_init import quick_init
from .specs import SpecError
from .units import GiB, KiB, MiB


@quick_init
@dataclass(frozen=True)
class OutsideTerm:
    name: str           # the key an override uses ("cuda_context", "nccl", ...)
    bytes: int          # per GPU
    detail: str         # what it holds, with the numbers
    source: str         # where the figure comes from


# CUDA context per architecture (the driver's per-process reservations: local memory for the resident threads'
# stacks, the device heap and printf FIFO, and the loaded modules, torch's kernels under lazy loading). No vendor
# table gives it: stated estimates inside hardware.md's 0.5-1 GB for context + workspaces, larger on parts with
# more SMs (the stack reservation scales with SMs x resident threads). Calibration measures it.
CUDA_CONTEXT_BYTES = {"volta": int(0.30 * GiB), "turing": int(0.30 * GiB), "ampere": int(0.45 * GiB),
                      "ada": int(0.40 * GiB), "hopper": int(0.50 * GiB), "blackwell": int(0.55 * GiB),
                      "cdna3": int(0.50 * GiB), "cdna4": int(0.50 * GiB)}
DEFAULT_CUDA_CONTEXT_BYTES = int(0.50 * GiB)  # an architecture the table lacks

# NCCL's per-connection buffers, one set per protocol, as NCCL defines its defaults (src/include/device.h,
# src/init.cc) and the environment variables that replace them.
NCCL_STEPS = 8
NCCL_DEFAULTS = {
    "NCCL_BUFFSIZE": 1 << 22,                    # Simple: DEFAULT_BUFFSIZE (1 << 22), 4 MiB
    "NCCL_LL_BUFFSIZE": 8 * 512 * NCCL_STEPS * 16,   # LL: LINES_PER_THREAD 8 x MAX_NTHREADS 512 x STEPS x 16 B line
    "NCCL_LL128_BUFFSIZE": 120 * 640 * NCCL_STEPS * 8,  # LL128: ELEMS_PER_THREAD 120 x MAX_NTHREADS 640 x STEPS x 8 B
    # channels: NCCL's topology search sets them (its INFO line "N coll channels"); stated per scale-up fabric below
    "NCCL_MIN_NCHANNELS": 0, "NCCL_MAX_NCHANNELS": 0,
    "NCCL_NCHANNELS_PER_PEER": 2,                # send/recv (all-to-all, pipeline sends): channels per peer (stated)
    "NCCL_NVLS_ENABLE": 1,                       # NVLink SHARP on NVSwitch Hopper / Blackwell (NCCL's default: on)
    "NCCL_NVLS_NCHANNELS": 16,                   # NVLS channels (stated: NCCL's default on sm90)
    "NCCL_NVLS_CHUNKSIZE": 128 * KiB,            # NVLS step size (NCCL >= 2.20)
    "NCCL_PROTO": "",                            # "" all protocols; "^LL128" etc. leaves those buffers out
}
NCCL_VARIABLES = tuple(NCCL_DEFAULTS)
TERMS = ("cuda_context", "nccl", "nvls", "pp_p2p", "symmetric_memory", "deepep", "float8", "compile")


def _ring_channels(gpu) -> int:
    """Ring channels NCCL builds on this part's fabric (stated from its INFO logs on such nodes; the search decides):
    NVSwitch nodes 24, NVLink cube-mesh 12, PCIe only 4."""
    link = gpu.scale_up_link.lower()
    if "nvswitch" in link or "nvlink switch" in link or gpu.architecture in ("cdna3", "cdna4"):
        return 24
    pcie_only = gpu.scale_up_domain_gpus == 1 or link.startswith("none") or "bridge" in link
    return 4 if pcie_only else 12


def _nvls_capable(gpu) -> bool:
    link = gpu.scale_up_link.lower()
    return gpu.architecture in ("hopper", "blackwell") and ("nvswitch" in link or "nvlink switch" in link)


@dataclass(frozen=True)
class _Group:
    name: str
    size: int
    p2p_peers: int = 0      # > 0: a send/recv (or all-to-all) group: buffers per peer, not rings
    in_domain: bool = True  # all its ranks inside one NVLink domain


def process_groups(cluster, config) -> tuple[_Group, ...]:
    """The NCCL communicators a configuration creates per rank: one per process group that runs collectives
    (torchtitan's mesh: one per dimension and flattened dimension it uses; a 1-D mesh over the world reuses the
    default group), the default group's (DCP's save plans, barriers), one per pipeline neighbour (torch's
    ProcessGroupNCCL builds a 2-rank communicator per send/recv pair)."""
    return _mesh_groups(cluster, mesh_of(config, cluster))


def _mesh_groups(cluster, m) -> tuple[_Group, ...]:
    """process_groups of the mesh `m` (cost_models/mesh.Mesh)."""
    domain = cluster.gpu.scale_up_domain_gpus or cluster.gpus_per_node
    groups, inner = [], 1
    # the dense mesh innermost first: a group of `size` ranks `inner` apart spans inner x size consecutive ranks
    for name, size in (("tp", m.tp), ("cp", m.cp), ("fsdp", m.fsdp), ("dp_replicate", m.dp_replicate)):
        if size > 1:
            span = (inner if name != "fsdp" else m.tp) * size
            groups.append(_Group(name, size, in_domain=span <= domain))
        inner *= {"tp": m.tp, "cp": m.cp, "fsdp": m.dp_shard, "dp_replicate": m.dp_replicate}[name]
    if m.ep > 1:
        groups.append(_Group("ep", m.ep, p2p_peers=m.ep - 1, in_domain=m.ep <= domain))
        if m.efsdp > 1 and m.efsdp != m.fsdp:
            groups.append(_Group("efsdp", m.efsdp, in_domain=m.efsdp * m.ep <= domain))
    if m.world > 1 and all(g.size != m.world for g in groups):
        groups.append(_Group("world", m.world, in_domain=m.world <= domain))
    return tuple(groups)


def _nccl_value(overrides: dict, name: str):
    return overrides.get(name, NCCL_DEFAULTS[name])


def _connection_bytes(overrides: dict) -> tuple[int, str]:
    """One connection's buffers: each protocol NCCL_PROTO leaves on."""
    proto = str(_nccl_value(overrides, "NCCL_PROTO"))
    off = {p.strip().upper() for p in proto[1:].split(",")} if proto.startswith("^") else set()
    on = {p.strip().upper() for p in proto.split(",")} if proto and not proto.startswith("^") else set()
    sizes = {"LL": _nccl_value(overrides, "NCCL_LL_BUFFSIZE"), "LL128": _nccl_value(overrides, "NCCL_LL128_BUFFSIZE"),
             "Simple": _nccl_value(overrides, "NCCL_BUFFSIZE")}
    kept = {p: int(b) for p, b in sizes.items() if p.upper() not in off and (not on or p.upper() in on)}
    return sum(kept.values()), " + ".join(f"{p} {b / MiB:g} MiB" for p, b in kept.items())


def nccl_terms(cluster, config, overrides: dict | None = None) -> tuple[OutsideTerm, OutsideTerm, OutsideTerm]:
    """(nccl, nvls, pp_p2p): NCCL's communicators' buffers on one GPU. A ring channel holds one receive connection
    with a buffer per protocol (NCCL's Simple, LL and LL128 sizes); a send/recv group one Simple connection per peer
    and channel per peer; NVLS (NVSwitch Hopper / Blackwell, more than 2 GPUs in the group, NCCL_NVLS_ENABLE) maps
    NVLS_NCHANNELS x 2 (reduce and broadcast) x CHUNKSIZE x NCCL_STEPS per head, a head per rank of the group.
    Ignores: tree connections (all-reduce's tree algorithm, connected at its first use), the proxy's host memory,
    the device work FIFOs (a few MiB). Priced once per what it reads (a search asks for every candidate): the GPU's
    fabric, the node, the mesh, the overrides."""
    o, gpu, mesh = overrides or {}, cluster.gpu, mesh_of(config, cluster)
    key = (gpu.id, gpu.architecture, gpu.scale_up_link, gpu.scale_up_domain_gpus, cluster.gpus_per_node, mesh,
           tuple(sorted(o.items())))
    if key not in _NCCL_TERMS:
        _NCCL_TERMS[key] = _nccl_terms(cluster, mesh, o)
    return _NCCL_TERMS[key]


_NCCL_TERMS: dict[tuple, tuple] = {}


def _nccl_terms(cluster, mesh, o: dict) -> tuple[OutsideTerm, OutsideTerm, OutsideTerm]:
    """nccl_terms on the mesh `mesh` (cost_models/mesh.Mesh), o: the NCCL overrides."""
    gpu = cluster.gpu
    channels = _ring_channels(gpu)
    lo, hi = int(_nccl_value(o, "NCCL_MIN_NCHANNELS")), int(_nccl_value(o, "NCCL_MAX_NCHANNELS"))
    channels = min(max(channels, lo), hi) if hi else max(channels, lo)
    per_conn, protos = _connection_bytes(o)
    simple = int(_nccl_value(o, "NCCL_BUFFSIZE"))
    per_peer = int(_nccl_value(o, "NCCL_NCHANNELS_PER_PEER"))
    nvls_on = int(_nccl_value(o, "NCCL_NVLS_ENABLE")) != 0 and _nvls_capable(gpu)
    nvls_head = (int(_nccl_value(o, "NCCL_NVLS_NCHANNELS")) * 2 * int(_nccl_value(o, "NCCL_NVLS_CHUNKSIZE"))
                 * NCCL_STEPS)
    rings, nvls, words, nvls_words = 0, 0, [], []
    for g in _mesh_groups(cluster, mesh):
        if g.p2p_peers:
            b = g.p2p_peers * per_peer * simple
            words.append(f"{g.name} ({g.size} ranks, all-to-all): {g.p2p_peers} peers x {per_peer} channels x Simple "
                         f"{simple / MiB:g} MiB = {b / MiB:.0f} MiB")
        else:
            b = channels * per_conn
            words.append(f"{g.name} ({g.size} ranks): {channels} ring channels x ({protos}) = {b / MiB:.0f} MiB")
            if nvls_on and g.in_domain and g.size > 2:
                nvls += g.size * nvls_head
                nvls_words.append(f"{g.name}: {g.size} heads x {nvls_head / MiB:g} MiB")
        rings += b
    peers = _pp_peers(mesh)
    p2p = peers * per_peer * simple
    cite = ("NCCL src/init.cc DEFAULT_BUFFSIZE / DEFAULT_LL_BUFFSIZE / DEFAULT_LL128_BUFFSIZE (NCCL_BUFFSIZE, "
            "NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE, NCCL_PROTO); ring channels a stated estimate "
            "(NCCL_MIN/MAX_NCHANNELS)")
    if nvls:
        nvls_channels = int(_nccl_value(o, "NCCL_NVLS_NCHANNELS"))
        nvls_detail = "; ".join(nvls_words) + f" ({nvls_channels} channels x 2 x chunk x 8 steps)"
    elif not nvls_on:
        nvls_detail = "none (NCCL_NVLS_ENABLE=0)" if _nvls_capable(gpu) else f"none ({gpu.id}: no NVSwitch NVLS)"
    else:
        nvls_detail = "none (no group of more than 2 GPUs inside the NVLink domain)"
    return (OutsideTerm("nccl", rings, "; ".join(words) or "no communicator (one GPU)", cite),
            OutsideTerm("nvls", nvls, nvls_detail, "NCCL >= 2.20 nvls.cc buffer layout as recalled (not checked "
                        "against a source here; NCCL_NVLS_ENABLE, NCCL_NVLS_NCHANNELS, NCCL_NVLS_CHUNKSIZE)"),
            OutsideTerm("pp_p2p", p2p, f"{peers} pipeline neighbour(s), a 2-rank communicator each: {per_peer} "
                        f"channels x Simple {simple / MiB:g} MiB = {p2p / MiB:.0f} MiB" if peers else "no pipeline",
                        "torch ProcessGroupNCCL: a communicator per send/recv pair; NCCL_NCHANNELS_PER_PEER "
                        "(stated 2)"))


def _pp_peers(mesh) -> int:
    """Pipeline neighbours of the busiest rank: the previous and the next stage (one at pp 2; looped schedules wrap
    the last rank to the first, so every rank has two)."""
    return 0 if mesh.pp == 1 else min(2, mesh.pp - 1)


def symmetric_memory_bytes(model, training, config) -> int:
    """Async TP's workspace on the TP group (torch/distributed/_symmetric_memory/__init__.py): fused all-gather +
    matmul asks for the local shard (b x s/tp x h), fused matmul + reduce-scatter for two output chunks
    (_pipelined_produce_and_all2all: out_chunks[0] x 2 = 2 x b x s/tp x h); get_symm_mem_workspace keeps the
    largest, in the compute dtype (bf16), plus its signal pad (32 blocks x 72 ranks x 4 B,
    CUDASymmetricMemoryTypes.hpp). 0 without async TP."""
    if not config.async_tp or model is None:
        return 0
    workspace = 2 * config.micro_batch * math.ceil(training.seq_len / config.tp) * model.hidden_size * 2
    return workspace + 32 * 72 * 4


def outside_key(config) -> tuple:
    """What outside_allocator_terms reads of config: the mesh (strategy, shard group, degrees), async TP's workspace
    (micro-batch), the Float8 and compile words; a search prices the terms once per key (planner/search/memo.py)."""
    return (config.sharding, config.shard_group_gpus, config.tp, config.cp, config.ep, config.pp, config.async_tp,
            config.micro_batch, config.float8, config.compile)


def outside_allocator_terms(cluster, config, profile, model=None, training=None,
                            deepep_bytes: int = 0) -> tuple[OutsideTerm, ...]:
    """Every term, in TERMS order, after the profile's measured context and its overrides (Profile.outside_allocator:
    term name -> bytes, or an NCCL variable -> its value)."""
    overrides = dict(profile.outside_allocator)
    nccl_env = {k: v for k, v in overrides.items() if k in NCCL_VARIABLES}
    gpu = cluster.gpu
    measured = profile.cuda_context_bytes is not None
    if measured:
        context = OutsideTerm("cuda_context", profile.cuda_context_bytes, "measured: the context and the calibration "
                              "run's communicators", f"the profile ({profile.source}): (total - free) - "
                              "torch.cuda.memory_reserved, calibration/runner.py")
        nccl = tuple(OutsideTerm(n, 0, "in the measured figure", "") for n in ("nccl", "nvls", "pp_p2p"))
    else:
        context = OutsideTerm("cuda_context", CUDA_CONTEXT_BYTES.get(gpu.architecture, DEFAULT_CUDA_CONTEXT_BYTES),
                              f"{gpu.architecture or 'unknown'} architecture",
                              "stated estimate per architecture (cost_models/outside_allocator.py); hardware.md: "
                              "context and library workspaces 0.5-1 GB")
        nccl = nccl_terms(cluster, config, nccl_env)
    symm = symmetric_memory_bytes(model, training, config)
    terms = (context, *nccl,
             OutsideTerm("symmetric_memory", symm, f"async TP workspace on the TP group ({config.tp} ranks)" if symm
                         else "no async TP", "torch/distributed/_symmetric_memory get_symm_mem_workspace; "
                         "CUDASymmetricMemoryAllocator (driver allocations, not the caching allocator)"),
             OutsideTerm("deepep", deepep_bytes, "DeepEP's NVLink buffer" if deepep_bytes else "no DeepEP",
                         "cost_models/expert_parallel.py (DeepEP's Buffer, allocated outside PyTorch)"),
             OutsideTerm("float8", 0, "inside the allocator: torch._scaled_mm's cuBLASLt workspace, scales as tensors"
                         if config.float8 else "no Float8", "torch/backends/cuda/__init__.py (unified cuBLASLt "
                         "workspace)"),
             OutsideTerm("compile", 0, "Inductor's buffers are allocator tensors; kernel code is in the context"
                         if config.compile else "no torch.compile", "torch/_inductor/cudagraph_trees.py"))
    return tuple(OutsideTerm(t.name, int(overrides[t.name]), f"overridden (was {t.bytes / GiB:.2f} GiB: {t.detail})",
                             "--outside-allocator / Profile.outside_allocator")
                 if t.name in overrides else t for t in terms)


def parse_overrides(items) -> tuple[tuple[str, int | str], ...]:
    """'TERM=GiB' (a term's bytes, in GiB or with a unit: 0.5, 512MiB) or 'NCCL_VAR=VALUE' (as NCCL reads it) ->
    (key, value) pairs for Profile.outside_allocator; a dict {key: bytes or value} passes through. Bad input raises
    SpecError naming the field and the valid keys."""
    from .units import parse_bytes

    pairs = list(items.items()) if isinstance(items, dict) else []
    for item in ([] if isinstance(items, dict) else items or []):
        key, sep, value = str(item).partition("=")
        if not sep:
            raise SpecError("outside_allocator", f"{item!r} is not TERM=GiB; terms: {', '.join(TERMS)}; NCCL "
                                                 f"variables: {', '.join(NCCL_VARIABLES)}")
        pairs.append((key.strip(), value.strip()))
    out = []
    for key, value in pairs:
        if key in TERMS:
            try:
                size = value if isinstance(value, int) else (
                    int(float(value) * GiB) if str(value).replace(".", "", 1).isdigit() else parse_bytes(str(value)))
            except ValueError:
                size = -1
            if size < 0:
                raise SpecError("outside_allocator", f"{key}={value!r}: a size in GiB (0.5) or with a unit (512MiB)")
            out.append((key, size))
        elif key in NCCL_VARIABLES:
            if key != "NCCL_PROTO" and not str(value).lstrip("-").isdigit():
                raise SpecError("outside_allocator", f"{key}={value!r}: an integer, as NCCL reads it")
            out.append((key, value if key == "NCCL_PROTO" else int(value)))
        else:
            raise SpecError("outside_allocator", f"unknown term {key!r}; choose one of: {', '.join(TERMS)}, or an "
                                                 f"NCCL variable: {', '.join(NCCL_VARIABLES)}")
    return tuple(out)
