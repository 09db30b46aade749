"""TRL 1.16's vllm_mode="server": `trl vllm-serve` (vLLM's own server: trl/scripts/vllm_serve.py build_command
execs `vllm serve --tensor-parallel-size --data-parallel-size ... --weight-transfer-config '{"backend": "nccl"}'`)
on GPUs of its own, the trainer's GPUs holding no engine. Read from TRL's installed code and vLLM 0.32's:

- generation (generation/vllm_generation.py generate, server branch): rank 0 sends every prompt of the generation
  batch in one /v1/completions request (n = num_generations); the server's data_parallel_size replicas of
  tensor_parallel_size GPUs each run their share (vllm serve's own max_num_seqs and max_num_batched_tokens, not
  TRL's); the trainer waits.
- the weight sync (sync_weights, server branch; vllm_client.py update_named_params): every rank walks the
  parameters (FSDP2: full_tensor() of each in its stored dtype; FSDP1: summon_full_params one unit at a time) and
  rank 0 streams them through vLLM's packed NCCL broadcast (vllm/distributed/weight_transfer/packed_tensor.py
  packed_nccl_broadcast_producer): pack_tensors keeps each gathered tensor in a list until the list passes
  DEFAULT_PACKED_BUFFER_SIZE_BYTES (1 GiB), concatenates it into one uint8 buffer (torch.cat beside the list) and
  broadcasts it on one of DEFAULT_PACKED_NUM_BUFFERS (2) streams, the previous chunk still in flight. The server's
  workers (rank offset 1 in a group of TP x DP + 1: init_communicator) receive into buffers of the same sizes
  (packed_nccl_broadcast_consumer: the new buffer allocated while its slot's old one is still referenced).
  Broken under FSDP1 when sharded: the walk's tensors are views of the unit's summoned flat parameter, which
  FSDP1 frees when the walk moves on (_unshard_param_utils.py _reshard: resize_(0)), while the packer still holds
  them to concatenate (benchmarks/trl_sync_check.py on 2 gloo ranks: their storage 0 bytes): a refusal.
- the link: the server on the trainer's first node (vllm_server_host loopback or 0.0.0.0, TRL's default) is
  reached over the node's NVLink; on another node over one GPU's share of the node's network (comm.Tier).
"""

from __future__ import annotations

import ipaddress

from . import comm
from .cluster_spec import ClusterSpec
from .feasibility import Refusal
from .model_spec import ModelSpec
from .profile import Profile
from .rollout_engine import EngineMemory
from .units import GiB

PACKED_BUFFER_BYTES = 1024 * 1024 * 1024   # vLLM packed_tensor.py DEFAULT_PACKED_BUFFER_SIZE_BYTES
PACKED_BUFFERS = 2                         # DEFAULT_PACKED_NUM_BUFFERS
LOCAL_HOSTS = ("0.0.0.0", "localhost", "")  # TRL's default vllm_server_host is 0.0.0.0: this machine


def is_local_host(host: str | None) -> bool:
    """Whether vllm_server_host (or vllm_server_base_url's host) names the trainer's own node."""
    if host is None or host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def sync_tensor_bytes(model: ModelSpec, linear_shapes, p: int) -> list[int]:
    """The tensors the sync sends, in TRL's order (FSDP2's module.named_parameters(): the embedding, each block's
    linears then the rest of it - norms, biases, a MoE block's stacked experts - as one tensor, the final norm and
    an untied head), in the stored dtype p. linear_shapes: a dense block's (in, out) linears (rl_actor's
    sent_tensors); a block they do not fit is one tensor."""
    out = [model.embedding_params * p]
    dense = model.dense_block_indices()
    for layer in range(model.n_layers):
        params = model.moe.dense_block_params if layer in dense else model.block_params
        linears = [i * o for i, o in linear_shapes]
        if sum(linears) > params:
            linears = []
        out += [n * p for n in linears] + [(params - sum(linears)) * p]
    return out + [model.root_other_params * p] + ([model.head_params * p] if model.head_params else [])


def chunks(tensors: list[int], buffer_bytes: int = PACKED_BUFFER_BYTES) -> list[int]:
    """pack_tensors' chunks: tensors appended until their sum passes the buffer (the one that passes it included)."""
    out, listed = [], 0
    for t in tensors:
        listed += t
        if listed > buffer_bytes:
            out.append(listed)
            listed = 0
    return out + ([listed] if listed else [])


def packed_send_peak_bytes(tensors: list[int], buffer_bytes: int = PACKED_BUFFER_BYTES,
                           buffers: int = PACKED_BUFFERS, gathered: bool = True) -> int:
    """Rank 0's peak in packed_nccl_broadcast_producer: at each chunk's torch.cat its tensors' list and the
    concatenated buffer, beside the chunks still in flight on the other streams (a slot's chunk is freed when the
    slot comes round again). gathered False (one rank: full_tensor() of an unsharded parameter is itself): the list
    holds the resident parameters, the buffer alone is new."""
    sizes, peak = chunks(tensors, buffer_bytes), 0
    for i, size in enumerate(sizes):
        in_flight = sum(sizes[max(0, i - buffers + 1):i])
        peak = max(peak, in_flight + (1 + gathered) * size)
    return peak


def packed_receive_peak_bytes(tensors: list[int], buffer_bytes: int = PACKED_BUFFER_BYTES,
                              buffers: int = PACKED_BUFFERS) -> int:
    """A server worker's peak in packed_nccl_broadcast_consumer: a chunk's new buffer allocated while its slot's
    previous one is still referenced, beside the other slots' (every tensor received whole, whatever the TP)."""
    sizes = chunks(tensors, buffer_bytes)
    return max((sum(sizes[max(0, i - buffers):i + 1]) for i in range(len(sizes))), default=0)


def send_s(cluster: ClusterSpec, profile: Profile, message_bytes: float, local: bool) -> float:
    """The broadcast of the model from rank 0 to the server's workers: pipelined, each byte crosses rank 0's link
    once - the node's bus when the server is on its node, else one GPU's share of the node's network."""
    tier = comm.Tier.for_group(cluster, profile, spans_nodes=not local, groups_sharing_nics=cluster.gpus_per_node)
    return tier.latency_s + message_bytes / tier.bus_bytes_per_s


def server_gpu_bytes(e: EngineMemory, tensors: list[int], outside_bytes: int) -> dict:
    """One server GPU at the weight sync: the engine awake (vLLM's rule on a GPU of its own), its process's memory
    outside the allocator (an estimate: the trainer's), and the receive buffers, which vLLM's budget leaves out."""
    return {"engine weights": e.weights_bytes, "engine KV cache": e.kv_bytes,
            "engine activations": e.activation_peak_bytes, "engine CUDA graphs": e.cuda_graph_bytes,
            "CUDA context": outside_bytes, "receive buffers": packed_receive_peak_bytes(tensors)}


def server_refusals(model: ModelSpec, cluster: ClusterSpec, strategy: str, tp: int, dp: int, local: bool,
                    server_bytes: dict) -> list[Refusal]:
    """What stops TRL's server job: the server's GPUs not on the trainer's first node when the host says they are,
    data parallelism on a dense model (trl/scripts/vllm_serve.py: "Setting this above `1` for dense models is not
    supported/useful and will error out (see vLLM PR #30739)"), FSDP1 sharded (the module docstring), a server GPU
    over its memory at the sync."""
    out = []
    # the trainer's GPUs on its first node (cluster.gpus_per_node) and the server's in a node of the GPU's usual size
    node = max(cluster.gpus_per_node, cluster.gpu.default_gpus_per_node)
    if local and cluster.gpus_per_node + tp * dp > node:
        out.append(Refusal("vllm_server_host", "server-room", f"the server's {tp * dp} GPUs (TP {tp} x DP {dp}) and "
                           f"the trainer's {cluster.gpus_per_node} on its first node exceed the node's {node}",
                           "run the server on a node of its own (--vllm-server-host its address) or fewer trainer "
                           "GPUs a node (--gpus-per-node)"))
    if dp > 1 and model.moe is None:
        out.append(Refusal("vllm_server_data_parallel_size", "server-dp-dense", f"{dp} on a dense model: trl "
                           "vllm-serve says it errors (vLLM PR #30739)", "keep it at 1 and raise "
                           "--rollout-tp, or run several servers"))
    if strategy == "fsdp" and cluster.n_gpus > 1:
        out.append(Refusal("strategy", "server-fsdp1", "TRL 1.16 sends FSDP1's parameters as views of each unit's "
                           "summoned flat parameter, which FSDP1 frees when its walk moves on while vLLM's packed "
                           "broadcast still holds them to concatenate", "--strategy fsdp2 (fsdp_version 2)"))
    need = sum(server_bytes.values())
    if need > cluster.gpu.memory_bytes:
        out.append(Refusal("gpu_memory_utilization", "server-memory", f"a server GPU needs {need / GiB:.1f} GiB at "
                           f"the weight sync (receive buffers {server_bytes['receive buffers'] / GiB:.1f} GiB outside "
                           f"vLLM's budget) > {cluster.gpu.memory_bytes / GiB:.1f} GiB",
                           "lower vllm-serve's --gpu-memory-utilization"))
    return out
