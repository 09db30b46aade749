"""α-β cost of ring collectives on a two-tier network (NCCL bus-bandwidth convention).

For a message of M bytes (the full, unsharded size) on n ranks, each rank moves (n-1)/n * M for
all-gather and reduce-scatter and 2(n-1)/n * M for all-reduce; time = steps * α + moved / busbw.
A ring that spans nodes crosses each node boundary once per channel, so the whole node's NIC
bandwidth carries (n-1)/n * M per node: the inter-node bus bandwidth is the node's network bandwidth,
not a per-GPU share (nccl-tests' busbw on multi-node rings). A ring within a node runs at the
intra-node (NVLink) bus bandwidth. Ignored: tree algorithms, NVLS, congestion from other jobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .quick_init import quick_init
from .profile import Profile
from .specs import ClusterSpec


@quick_init
@dataclass(frozen=True)
class Tier:
    """The network a collective runs on: its bus bandwidth and per-hop latency."""

    bus_bytes_per_s: float
    latency_s: float

    @classmethod
    def for_group(cls, cluster: ClusterSpec, profile: Profile, spans_nodes: bool,
                  groups_sharing_nics: int = 1) -> "Tier":
        """groups_sharing_nics: rings that cross nodes at the same time (HSDP: one replica group per
        GPU of a node), which share the node's network bandwidth."""
        if spans_nodes:
            bw = min(cluster.internode_bytes_per_s * profile.inter_node_comm_efficiency / groups_sharing_nics,
                     cluster.gpu.intra_node_bus_bytes_per_s * profile.intra_node_comm_efficiency)
            return cls(bw, profile.inter_node_latency_s)
        return cls(cluster.gpu.intra_node_bus_bytes_per_s * profile.intra_node_comm_efficiency,
                   profile.intra_node_latency_s)


def all_gather_s(message_bytes: float, n_ranks: int, tier: Tier) -> float:
    if n_ranks <= 1:
        return 0.0
    return (n_ranks - 1) * tier.latency_s + (n_ranks - 1) / n_ranks * message_bytes / tier.bus_bytes_per_s


def reduce_scatter_s(message_bytes: float, n_ranks: int, tier: Tier) -> float:
    return all_gather_s(message_bytes, n_ranks, tier)


def all_reduce_s(message_bytes: float, n_ranks: int, tier: Tier) -> float:
    if n_ranks <= 1:
        return 0.0
    return 2 * (n_ranks - 1) * tier.latency_s + 2 * (n_ranks - 1) / n_ranks * message_bytes / tier.bus_bytes_per_s


def all_to_all_s(message_bytes: float, n_ranks: int, tier: Tier) -> float:
    """Each rank sends message_bytes split evenly over the n ranks (itself included) and receives as much: it
    moves (n-1)/n * M off the rank, every peer's send and receive posted at once (NCCL's grouped send / recv,
    one latency). nccl-tests' alltoall busbw is the same (n-1)/n convention. A group inside one scale-up
    domain; across domains, spanning_all_to_all_s."""
    if n_ranks <= 1:
        return 0.0
    return tier.latency_s + (n_ranks - 1) / n_ranks * message_bytes / tier.bus_bytes_per_s


def spanning_all_to_all_s(message_bytes: float, n_ranks: int, ranks_per_domain: int, fast: Tier,
                          network: Tier) -> float:
    """all_to_all_s over n consecutive ranks, ranks_per_domain of them in each scale-up domain (the node): NCCL's
    grouped send / recv sends each peer's share on its own path at once, the (g-1)/n of the message bound for the
    domain's peers over NVLink (P2P transport) and the (n-g)/n for the others over the network, so the slower of
    the two sets the time (one network latency)."""
    g = min(ranks_per_domain, n_ranks)
    if g >= n_ranks:
        return all_to_all_s(message_bytes, n_ranks, fast)
    inside = (g - 1) / n_ranks * message_bytes / fast.bus_bytes_per_s
    across = (n_ranks - g) / n_ranks * message_bytes / network.bus_bytes_per_s
    return network.latency_s + max(inside, across)
