"""Expert parallelism: what one rank of an EP group holds, saves, computes and sends (torchtitan's layout, run by
transformers' AllToAllEP: calibration/expert_parallel.py; shared/reference/parallelism.md).

Holds. Each rank keeps E / ep whole experts: the stacked expert tensors' dim 0 is E / ep. FSDP2 shards them over
efsdp = dp_shard x cp x tp / ep ranks (not the dense parameters' d = dp_shard x cp), as a unit of their own inside
each sparse block (transformers' apply_fully_sharded_data_parallelism `fully_shard`s the experts module on the
efsdp mesh), padding dim 0 to a multiple of efsdp as it pads any dim 0 (cost_models/moe.py). The router (E rows)
and everything else stays on the dense mesh, sharded over d.

Saves, per routed row (T tokens x top-k rows a rank sends; the rank's experts receive as many under balanced
routing, `routing_imbalance` x as many on the busiest rank). Checked tensor by tensor with saved_tensors_hooks on a
Mixtral block and against the trace tier. Against transformers' grouped_mm path without EP (moe.mlp_bytes_per_token):
- the sender keeps the combined expert output (c*h: the weighted product's other operand), the routing weight (w),
  the sort order and the gather index (2 x int64);
- the expert side keeps the received row (c*h, the up projection's input), the activation's tensors (as without
  EP), the unit routing weights (c: the experts run top-1 with weights one), the sentinel mask of rows for
  other ranks' experts (1 byte: `_is_expert_parallel` masks them) and the gather index and inverse permutation
  (2 x int64; the sort permutation is not saved, the unit weights need no gradient);
so a balanced row saves 1 + c + 8 bytes more than without EP, and the busiest rank's expert-side bytes scale by the
imbalance. Backward: the same moments as without EP (moe.backward_moments: the un-permute, the activation's and the
up projection's backward), the weight gradients being those of the rank's E / ep experts.
Dispatch and combine buffers: the all-to-all inputs and outputs (k*h*c per token each way) live between the gather
and the permutation (forward) and between the two all-to-alls' backward calls; they are transient (not saved).

Computes. The grouped expert GEMMs on the rows the rank receives: T k under balanced routing (as many as without
EP: each token still visits k experts, now on other ranks), imbalance x that on the busiest rank, which every
other rank waits for at the combine.

Sends. Forward: dispatch (each rank's T k rows of h, c bytes) and combine (the same back) all-to-alls over the ep
group; backward the same two with the gradients. The all-to-all moves (ep - 1) / ep of its rows off the rank.

With tp > 1 (experts whole on every TP rank, etp = 1) the ranks of a TP group dispatch disjoint slices of the
tokens they share: the step time prices tokens / tp rows per rank (GEMMs and all-to-alls); the memory ledger
still counts every token's routed rows on each TP rank (an overestimate by up to tp of the experts' saved rows;
EP with tp > 1 is not traced yet, so that term is unchecked).
Ignored: the per-expert counts' all-to-all (E int64 per layer) and its host sync, capacity factors / token
dropping (none in transformers' path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import moe
from .specs import BackwardMoment, ClusterSpec, FsdpConfig, ModelSpec

INDEX_BYTES = moe.INDEX_BYTES


@dataclass(frozen=True)
class ExpertParallelView:
    """One rank's view of an EP group: the per-rank model (E / ep experts stacked), the experts' FSDP group."""

    model: ModelSpec       # stacked expert tensors of E / ep rows; block_params without the other ranks' experts
    ep: int
    efsdp: int             # ranks FSDP shards this rank's experts over
    d: int                 # ranks FSDP shards the rest over (dp_shard x cp)
    imbalance: float       # the busiest rank's routed rows over the mean (TrainingSpec.routing_imbalance)

    @property
    def local_experts(self) -> int:
        return self.model.moe.n_experts // self.ep

    # ------------------------------------------------------------ parameters

    def experts_gathered_elements(self) -> int:
        """One sparse block's experts as FSDP2 gathers them over efsdp: E / ep rows padded to efsdp x ceil."""
        return moe.experts_gathered_elements(self.model, self.efsdp)

    def experts_shard_elements(self) -> int:
        """This rank's shard of one sparse block's experts (rank 0: a full chunk, padding included)."""
        return self.experts_gathered_elements() // max(1, self.efsdp)

    def param_counts(self, training):
        """(gathered, shard) ParamCounts of the per-rank model: gathered counts the block's all-gather outputs
        (the rest padded at d, the experts at efsdp); shard counts are those whose / d is a rank's shard (the
        experts' efsdp shard scaled by d), which the ledger's model states divide by d."""
        from .memory_types import ParamCounts

        gathered = ParamCounts.of(self.model, training, self.d)
        g_experts = moe.experts_gathered_elements(self.model, self.d)
        experts_d = self.experts_gathered_elements()
        block = gathered.trainable_block - g_experts + experts_d
        shard_block = block - experts_d + self.experts_shard_elements() * self.d
        nd = self.model.n_dense_layers

        def counts(b: int) -> ParamCounts:
            delta = nd * (self.model.moe.dense_block_params - b) if nd else 0
            return replace(gathered, trainable_block=b, trainable_dense_delta=delta)

        return counts(block), counts(shard_block)

    # ------------------------------------------------------------ activations

    def expert_row_bytes(self, c: int) -> int:
        """Saved bytes per row the rank's experts receive: the row, the activation's tensors, the unit weight,
        the sentinel mask, the gather index and the inverse permutation (+ the sorted expert ids with biases)."""
        m = self.model
        return (c * m.hidden_size + moe._expert_activation_bytes(m, c, False) + c + 1
                + (3 if m.moe.expert_bias else 2) * INDEX_BYTES)

    def saved_delta_bytes_per_token(self, c: int) -> float:
        """Saved bytes per token of a sparse block above transformers' grouped_mm path without EP
        (moe.mlp_bytes_per_token): 1 + c + 8 per routed row, and the busiest rank's extra received rows."""
        k = self.model.moe.experts_per_token
        return k * (1 + c + INDEX_BYTES) + k * (self.imbalance - 1) * self.expert_row_bytes(c)

    def backward_moments(self, c: int, recomputed: bool) -> tuple[BackwardMoment, ...]:
        """moe.backward_moments with this rank's experts' weight gradients (E / ep of them), the expert-side
        working bytes scaled by the imbalance."""
        m = self.model
        local = replace(m, moe=replace(m.moe, n_experts=self.local_experts,
                                       experts_per_token=min(m.moe.experts_per_token, self.local_experts)))
        per_token = moe.backward_moments(m, c, recomputed=recomputed)
        grads = moe.backward_moments(local, c, recomputed=recomputed)
        return tuple(replace(t, grad_bytes=g.grad_bytes) for t, g in zip(per_token, grads))

    # ------------------------------------------------------------ compute and communication

    def expert_rows_per_token(self) -> float:
        """Rows the busiest rank's experts compute per token of its micro-batch: k x imbalance."""
        return self.model.moe.experts_per_token * self.imbalance

    def all_to_all_bytes_per_token(self, c: int) -> int:
        """Bytes one rank sends and receives in one dispatch (or combine) all-to-all, per token: k rows of h."""
        return self.model.moe.experts_per_token * self.model.hidden_size * c

    def notes(self) -> tuple[str, ...]:
        m = self.model
        rows = moe.rows_per_rank(self.local_experts, self.efsdp) if self.efsdp > 1 else self.local_experts
        out = [f"expert parallelism {self.ep}: {self.local_experts} of {m.moe.n_experts} experts per rank, sharded "
               f"by FSDP over efsdp = {self.efsdp} ranks ({rows} expert row(s) per rank); routing priced "
               + ("balanced (routing_imbalance 1.0)" if self.imbalance == 1 else
                  f"with the busiest rank receiving {self.imbalance:g}x the mean rows (routing_imbalance)")]
        if self.efsdp > 1 and self.local_experts % self.efsdp:
            out.append(f"{self.local_experts} experts per EP rank on an efsdp group of {self.efsdp}: FSDP2 pads "
                       f"their stacked tensors to {self.efsdp * rows} rows (counted; transformers' EP shards them on "
                       "dim 0, torchtitan on dim 1 when efsdp x ep exceeds the experts: expert_shard_dim is not "
                       "applied with EP here); a larger ep, or HYBRID_SHARD's smaller efsdp, removes it")
        return tuple(out)


def expert_parallel_ops(ops, model: ModelSpec, ep: int, imbalance: float = 1.0, tp: int = 1):
    """A sparse block's operators as one EP rank runs them: its E / ep experts' grouped GEMMs, each on
    k x ep x imbalance / E rows per token of the micro-batch (the rows it receives: balanced, as many as
    without EP, now on fewer, larger GEMMs, which the shape factor prices), and the experts' activation on the
    busiest rank's imbalance x the rows. With tp > 1 the ranks of a TP group dispatch disjoint slices of the
    tokens they share (transformers' AllToAllEP, torchtitan with etp = 1): 1 / tp of those rows each."""
    m = model.moe
    local = m.n_experts // ep
    rows = m.experts_per_token * imbalance / (local * tp)

    def is_expert(x) -> bool:  # the formulas name them; a traced inventory has E products of k / E rows each
        return x.name.startswith("experts ") or (
            x.count == m.n_experts and abs(x.rows_per_token - m.experts_per_token / m.n_experts) < 1e-12)

    matmuls = tuple(replace(x, rows_per_token=rows, count=local) if is_expert(x) else x for x in ops.matmuls)
    memory = tuple(replace(o, forward_bytes=o.forward_bytes * imbalance, backward_bytes=o.backward_bytes * imbalance,
                           fused_forward_bytes=o.fused_forward_bytes * imbalance,
                           fused_backward_bytes=o.fused_backward_bytes * imbalance)
                   if o.name == "MLP activation" and imbalance != 1 else o for o in ops.memory_ops)
    return replace(ops, matmuls=matmuls, memory_ops=memory)


def ep_tier(view: ExpertParallelView, cluster: ClusterSpec, profile):
    """The network an EP group's all-to-all runs on: ep consecutive ranks (ep innermost in the expert view), the
    fast tier inside the scale-up domain; across nodes every GPU of a node exchanges at once, each with its share
    of the node's network bandwidth. The all-to-alls run at profile.ep_comm_efficiency of its alpha-beta rate,
    bandwidth and latency alike (1.0 unless calibration fitted it)."""
    from .comm import Tier

    spans = view.ep > cluster.fast_tier_gpus
    tier = Tier.for_group(cluster, profile, spans_nodes=spans,
                          groups_sharing_nics=min(cluster.gpus_per_node, view.ep) if spans else 1)
    return replace(tier, bus_bytes_per_s=tier.bus_bytes_per_s * profile.ep_comm_efficiency,
                   latency_s=tier.latency_s / profile.ep_comm_efficiency)


def all_to_all_seconds(view: ExpertParallelView, cluster: ClusterSpec, profile, tokens: int, c: int) -> float:
    """Seconds of one dispatch (or combine) all-to-all of a sparse block for a micro-batch of `tokens`: k rows of
    h per token, the busiest rank receiving (dispatch) and sending back (combine) imbalance x as many."""
    from .comm import all_to_all_s

    message = tokens * view.all_to_all_bytes_per_token(c) * view.imbalance
    return all_to_all_s(message, view.ep, ep_tier(view, cluster, profile))


def expert_fsdp_seconds(view: ExpertParallelView, cluster: ClusterSpec, profile, gather_bytes: float,
                        reduce_bytes: float, n_replicas: int, replicate_tier) -> tuple[float, float]:
    """(all-gather, gradient reduction) seconds of one sparse block's experts unit: over efsdp, whose ranks are
    ep apart (the group spans efsdp x ep consecutive ranks; the ep groups of a node cross the network at once),
    then HSDP's all-reduce of the shard across dp_replicate."""
    from . import comm

    efsdp = view.efsdp
    spans = efsdp > 1 and efsdp * view.ep > cluster.fast_tier_gpus
    tier = comm.Tier.for_group(cluster, profile, spans_nodes=spans,
                               groups_sharing_nics=min(view.ep, cluster.gpus_per_node) if spans else 1)
    return (comm.all_gather_s(gather_bytes, efsdp, tier),
            comm.reduce_scatter_s(reduce_bytes, efsdp, tier)
            + comm.all_reduce_s(reduce_bytes / max(1, efsdp), n_replicas, replicate_tier))


def view(model: ModelSpec, config: FsdpConfig, cluster: ClusterSpec, training) -> ExpertParallelView | None:
    """The EP view of a rank (None when ep = 1): `model` is the TP rank's model (tensor_parallel.local_model)."""
    if config.ep <= 1 or model.moe is None:
        return None
    from .mesh import mesh_of

    mesh = mesh_of(config, cluster)
    E, ep = model.moe.n_experts, config.ep
    mo = model.moe
    local_rows = tuple((rows // ep, per_row) for rows, per_row in mo.stacked_expert_tensors)
    others = (E - E // ep) * mo.expert_params
    local = replace(model, block_params=model.block_params - others,
                    moe=replace(mo, stacked_expert_tensors=local_rows))
    return ExpertParallelView(model=local, ep=ep, efsdp=mesh.efsdp, d=mesh.fsdp,
                              imbalance=float(getattr(training, "routing_imbalance", 1.0)))


__all__ = ["ExpertParallelView", "view", "expert_parallel_ops", "ep_tier", "all_to_all_seconds",
           "expert_fsdp_seconds"]
