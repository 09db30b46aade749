"""The device mesh of one candidate: FSDP2 composed with tensor, context, expert (and pipeline) parallelism.

torchtitan's layout (torchtitan/distributed/parallel_dims.py; shared/reference/parallelism.md):
- world = pp x dp_replicate x dp_shard x cp x tp, the dense mesh ordered [pp, dp_replicate, dp_shard, cp, tp]
  (tp innermost: a TP group is consecutive ranks, inside a node);
- FSDP shards over dp_shard x cp (its "fsdp" axis), HSDP replicates over dp_replicate; the batch is split over
  dp_replicate x dp_shard (CP and TP ranks of one group see the same sequences);
- experts on a second view [pp, dp_replicate, efsdp, ep] with efsdp = dp_shard x cp x tp / ep: EP borrows ranks
  from data and tensor parallelism, each rank holds n_experts / ep experts, sharded by FSDP over efsdp.

Degrees are validated on construction; what a model or a cluster allows (heads, experts, the sequence, the
scale-up domain) is checked in cost_models/mesh_rules.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .specs import SpecError, check_degree

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")   # outermost first, as init_device_mesh takes them


@dataclass(frozen=True)
class Mesh:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "pp"):
            check_degree(name, getattr(self, name))
        if (self.dp_shard * self.cp * self.tp) % self.ep:
            raise SpecError("ep", f"{self.ep} must divide dp_shard x cp x tp = {self.dp_shard * self.cp * self.tp} "
                                  "(expert parallelism borrows ranks from data and tensor parallelism)")

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp(self) -> int:
        """Ranks FSDP shards the dense parameters over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def data_parallel(self) -> int:
        """Ranks that see different sequences: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks FSDP shards each rank's experts over: dp_shard x cp x tp / ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def dense_dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the dense mesh's dimensions, outermost first."""
        return tuple((name, getattr(self, name)) for name in DENSE_DIMS)

    def used_dims(self) -> tuple[tuple[str, int], ...]:
        """The dense dimensions of size > 1 (dp_shard always: FSDP's axis, even when it is 1 with cp)."""
        return tuple((n, s) for n, s in self.dense_dims() if s > 1 or n == "dp_shard")

    def describe(self) -> str:
        """'FSDP 8', 'FSDP 2 x CP 4', 'HSDP 4x8 x TP 8 x EP 16': the words people write the mesh in."""
        fsdp = f"HSDP {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 and self.dp_shard > 1 else (
            f"DDP {self.dp_replicate}" if self.dp_replicate > 1 else f"FSDP {self.dp_shard}")
        parts = [fsdp] + [f"{name.upper()} {size}" for name, size in (("cp", self.cp), ("tp", self.tp),
                                                                     ("ep", self.ep), ("pp", self.pp)) if size > 1]
        return " x ".join(parts)


def mesh_of(config, cluster) -> Mesh:
    """The mesh a configuration runs on this cluster: its tp / cp / ep / pp and the data-parallel degrees its
    strategy takes from the GPUs left (FsdpConfig.dp_degrees)."""
    return mesh_for(config, cluster.n_gpus, cluster.gpus_per_node)


def mesh_for(config, n_gpus: int, gpus_per_node: int, ep: int | None = None) -> Mesh:
    """mesh_of from the GPU counts; ep overrides the config's (1: the dense mesh alone, valid for any ep)."""
    dp_replicate, dp_shard = config.dp_degrees(n_gpus, gpus_per_node)
    return Mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=config.cp, tp=config.tp,
                ep=config.ep if ep is None else ep, pp=config.pp)
