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

DeepEP (FsdpConfig.moe_dispatch "deepep": NeMo Automodel 0.7's GroupedExpertsDeepEP through Megatron's
MoEFlexTokenDispatcher, nemo_automodel/components/moe/experts.py and moe/megatron/token_dispatcher.py):
- sends a token once per destination rank, whatever number of that rank's experts it picked (DeepEP's dispatch
  layout: is_token_in_rank), and combine returns one row per (token, rank), the rank's experts' outputs already
  summed: ranks_per_token rows of h each way instead of k. Learned routing, uniform over the experts:
  ep (1 - C(E - E/ep, k) / C(E, k)) ranks (the hypergeometric chance a rank holds none of the k); Automodel's
  FakeBalancedGate (TrainingSpec.routing round-robin) gives token t the experts (t k + j) mod E, consecutive, so
  a token reaches one rank whenever k divides E / ep (Qwen3-30B-A3B and GPT-OSS 20B at ep 8).
- time: DeepEP's README ("Normal kernels with NVLink and RDMA forwarding", H800, 8 EP ranks in a node, DeepSeek-V3
  pretraining shapes: 4,096 tokens, hidden 7,168, top-8) measures 153 GB/s dispatch and 158 GB/s combine of NVLink
  bottleneck bandwidth, on NVLink whose datasheet peak is 200 GB/s per direction (README: ~160 GB/s reachable);
  priced as those fractions (0.765, 0.79) of the GPU's scale-up peak per direction (H100 SXM: 450 GB/s -> 344 and
  356 GB/s). Across nodes (ep beyond the scale-up domain): RDMA once per remote node a token reaches, then NVLink
  forwarding (deepep_spanning_seconds).
- memory-bound work: Megatron's fused permute (moe_permute_fusion=True: one kernel reads each received copy and
  writes the k rows sorted by expert) and unpermute (reads the k rows, writes one per copy), forward and again
  in backward with the gradients: 2c h (k + ranks_per_token) per token each way, in place of the eager gather /
  weighting / scatter-add; the experts' SwiGLU is Megatron's WeightedSwiGLUFunction (torch.compile'd, the
  routing weight folded in), gpt-oss' clamped one swiglu_oai_deepep (@torch.compile(fullgraph=True), experts.py
  get_expert_activation_for_deepep): both priced at the fused bytes.
- memory: DeepEP's NVLink buffer, cudaMalloc'd outside PyTorch's caching allocator (reserved, not allocated):
  channels (dispatcher_num_sms / 2 = 10) x NVLink ranks x 256 receive slots (Buffer.get_dispatch_config /
  get_combine_config for <= 8 ranks) x (the token's hidden bytes + its metadata: 128 top-k int64 indices, 128 fp32
  weights and 128 fp32 scales), DeepEP's Config.get_nvl_buffer_size_hint (csrc/config.hpp) as Automodel's
  fused_a2a.get_buffer sizes it. DeepEP does not install here (its build needs CUDA): the sizing is read from its
  source, not checked against an allocation. The saved tensors are priced as transformers' EP path saves them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import moe
from .identity_memo import IdentityMemo
from .specs import BackwardMoment, ClusterSpec, FsdpConfig, ModelSpec, MoeDispatch, Routing

INDEX_BYTES = moe.INDEX_BYTES
# DeepEP README, intranode normal kernels on H800 (8 EP ranks): 153 GB/s dispatch, 158 GB/s combine of NVLink
# bottleneck bandwidth, over the link's datasheet 200 GB/s per direction
DEEPEP_DISPATCH_OF_PEAK = 153 / 200
DEEPEP_COMBINE_OF_PEAK = 158 / 200
DEEPEP_CHANNELS = 10              # Automodel's dispatcher_num_sms 20 / 2 SMs per channel
DEEPEP_RECV_SLOTS = 256           # num_max_nvl_chunked_recv_tokens of DeepEP's configs for <= 8 ranks
DEEPEP_SLOT_METADATA_BYTES = 128 * 8 + 128 * 4 + 128 * 4  # top-k indices (int64), weights and scales (fp32)


@dataclass(frozen=True)
class ExpertParallelView:
    """One rank's view of an EP group: the per-rank model (E / ep experts stacked), the experts' FSDP group."""

    model: ModelSpec       # stacked expert tensors of E / ep rows; block_params without the other ranks' experts
    ep: int
    efsdp: int             # ranks FSDP shards this rank's experts over
    d: int                 # ranks FSDP shards the rest over (dp_shard x cp)
    imbalance: float       # the busiest rank's routed rows over the mean (TrainingSpec.routing_imbalance)
    dispatch: MoeDispatch = MoeDispatch.ALL_TO_ALL
    routing: Routing = Routing.LEARNED

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
        """(gathered, shard) ParamCounts of the per-rank model (expert_parallel_counts.py)."""
        from .expert_parallel_counts import param_counts

        return param_counts(self, training)

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
        working bytes scaled by the imbalance; once per (model, ep, c, recomputed): every ledger shape reads them."""
        return _LOCAL.get(self.model, ("moments", self.ep, c, recomputed), lambda: _local_moments(self, c, recomputed))

    # ------------------------------------------------------------ compute and communication

    def expert_rows_per_token(self) -> float:
        """Rows the busiest rank's experts compute per token of its micro-batch: k x imbalance."""
        return self.model.moe.experts_per_token * self.imbalance

    def ranks_per_token(self) -> float:
        """EP ranks a token's k experts sit on, on average (module docstring): round-robin exactly, learned routing
        as uniform draws without replacement."""
        return ranks_per_token(self.model.moe.n_experts, self.model.moe.experts_per_token, self.ep, self.routing)

    def rows_sent_per_token(self) -> float:
        """Rows of h a token travels as in one dispatch (or combine): k, or DeepEP's one per destination rank."""
        if self.dispatch is MoeDispatch.DEEPEP:
            return self.ranks_per_token()
        return self.model.moe.experts_per_token

    def all_to_all_bytes_per_token(self, c: int) -> float:
        """Bytes one rank sends and receives in one dispatch (or combine), per token: its rows of h."""
        return self.rows_sent_per_token() * self.model.hidden_size * c

    def outside_allocator_bytes(self, c: int) -> int:
        """DeepEP's NVLink buffer (module docstring), allocated outside PyTorch's caching allocator; 0 without."""
        if self.dispatch is not MoeDispatch.DEEPEP:
            return 0
        hidden_bytes = self.model.hidden_size * max(c, 2)
        nvl_ranks = min(self.ep, 8)
        return DEEPEP_CHANNELS * nvl_ranks * DEEPEP_RECV_SLOTS * (hidden_bytes + DEEPEP_SLOT_METADATA_BYTES)

    def notes(self) -> tuple[str, ...]:
        m = self.model
        rows = moe.rows_per_rank(self.local_experts, self.efsdp) if self.efsdp > 1 else self.local_experts
        out = [f"expert parallelism {self.ep}: {self.local_experts} of {m.moe.n_experts} experts per rank, sharded "
               f"by FSDP over efsdp = {self.efsdp} ranks ({rows} expert row(s) per rank); routing priced "
               + ("round-robin (Automodel's FakeBalancedGate: balanced, no gate matmul)"
                  if self.routing is Routing.ROUND_ROBIN else "balanced (routing_imbalance 1.0)" if self.imbalance == 1
                  else f"with the busiest rank receiving {self.imbalance:g}x the mean rows (routing_imbalance)")]
        if self.dispatch is MoeDispatch.DEEPEP:
            out.append(f"DeepEP dispatch / combine: each token sent once per destination rank "
                       f"({self.ranks_per_token():.2f} of {self.ep} on average, not {m.moe.experts_per_token} "
                       "rows), at DeepEP's published NVLink bandwidth; its saved tensors priced as transformers' EP "
                       "path saves them")
        if self.efsdp > 1 and self.local_experts % self.efsdp:
            out.append(f"{self.local_experts} experts per EP rank on an efsdp group of {self.efsdp}: FSDP2 pads "
                       f"their stacked tensors to {self.efsdp * rows} rows (counted; transformers' EP shards them on "
                       "dim 0, torchtitan on dim 1 when efsdp x ep exceeds the experts: expert_shard_dim is not "
                       "applied with EP here); a larger ep, or HYBRID_SHARD's smaller efsdp, removes it")
        return tuple(out)


def ranks_per_token(n_experts: int, k: int, ep: int, routing: Routing = Routing.LEARNED) -> float:
    """Mean number of EP ranks (E / ep consecutive experts each) holding at least one of a token's k experts.
    Round-robin (Automodel's FakeBalancedGate): token t takes experts (t k + j) mod E, averaged exactly over the
    E / gcd(k, E) distinct starts. Learned: k experts drawn uniformly without replacement, ep (1 - C(E - E/ep, k) /
    C(E, k)) (a stated simplification: real routers are neither uniform nor independent across tokens)."""
    per_rank = n_experts // ep
    if routing is Routing.ROUND_ROBIN:
        starts = [(t * k) % n_experts for t in range(n_experts // math.gcd(k, n_experts))]
        return sum(len({((s + j) % n_experts) // per_rank for j in range(k)}) for s in starts) / len(starts)
    return ep * (1 - math.comb(n_experts - per_rank, k) / math.comb(n_experts, k))


def _formula_op(model: ModelSpec, c: int, seq_len: int, name: str):
    """The structural formula's memory op `name` for a block whose priced inventory is traced (operators.py)."""
    from . import operators

    formula = operators.block_ops(replace(model, activation_profile=None), c, seq_len)
    return next(o for o in formula.memory_ops if o.name == name)


def _traced_swap(ops, out, into=None):
    """A traced inventory's one pointwise op less the formula's op `out`, plus the op `into` (None: nothing): the
    trace has no names to swap by, so the formula's bytes for that chain stand in for the traced ones."""
    keys = ("forward_bytes", "backward_bytes", "fused_forward_bytes", "fused_backward_bytes")
    traced = ops.memory_ops[0]
    changed = replace(traced, **{k: max(0.0, getattr(traced, k) - getattr(out, k) + (getattr(into, k) if into else 0))
                                 for k in keys})
    return replace(ops, memory_ops=(changed,) + ops.memory_ops[1:])


def routing_ops(ops, model: ModelSpec, routing: Routing, c: int = 2):
    """A sparse block's operators under its router: Automodel's FakeBalancedGate (round-robin) runs no gate matmul
    (E x h) and no softmax / top-k (it writes constant weights 1 / k and arithmetic indices). A traced inventory
    loses its E x h product and the formula's softmax / top-k bytes."""
    if routing is not Routing.ROUND_ROBIN:
        return ops
    E, h = model.moe.n_experts, model.hidden_size
    if ops.traced:
        kept = tuple(m for m in ops.matmuls if not (m.n == E and m.k == h and m.count == 1))
        return replace(_traced_swap(ops, _formula_op(model, c, ops.seq_len, "router softmax/top-k")), matmuls=kept)
    return replace(ops, matmuls=tuple(m for m in ops.matmuls if m.name != "router"),
                   memory_ops=tuple(o for o in ops.memory_ops if o.name != "router softmax/top-k"))


def deepep_ops(ops, model: ModelSpec, c: int, rows_per_token: float):
    """DeepEP's path through Megatron's flex dispatcher (module docstring): the fused permute / unpermute in place
    of the eager routing chain, 2c h (k + rows_per_token) per token each way; a gated SwiGLU expert activation at
    its fused bytes (WeightedSwiGLUFunction, or gpt-oss' compiled swiglu_oai_deepep). A traced inventory swaps the
    formula's routing chain for the permute and keeps its traced expert activation (no op to swap by name)."""
    h, k = model.hidden_size, model.moe.experts_per_token
    permute = 2 * c * h * (k + rows_per_token)
    if ops.traced:
        from .operators import MemoryOp

        deepep = MemoryOp("DeepEP permute / unpermute", permute, permute, permute, permute)
        return _traced_swap(ops, _formula_op(model, c, ops.seq_len, "expert routing"), deepep)

    def one(o):
        if o.name == "expert routing":
            return replace(o, name="DeepEP permute / unpermute", forward_bytes=permute, backward_bytes=permute,
                           fused_forward_bytes=permute, fused_backward_bytes=permute)
        if o.name == "MLP activation" and model.gated_mlp:  # fused SwiGLU
            return replace(o, forward_bytes=o.fused_forward_bytes, backward_bytes=o.fused_backward_bytes)
        return o

    return replace(ops, memory_ops=tuple(one(o) for o in ops.memory_ops))


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


def ep_tier(view: ExpertParallelView, cluster: ClusterSpec, profile, spans: bool | None = None):
    """The network an EP group's all-to-all runs on: ep consecutive ranks (ep innermost in the expert view), the
    fast tier inside the scale-up domain; across nodes every GPU of a node exchanges at once, each with its share
    of the node's network bandwidth (`spans` False: the fast tier whatever the group). The all-to-alls run at
    profile.ep_comm_efficiency of its alpha-beta rate, bandwidth and latency alike (1.0 unless calibration fitted
    it)."""
    from .comm import Tier

    spans = view.ep > cluster.fast_tier_gpus if spans is None else spans
    tier = Tier.for_group(cluster, profile, spans_nodes=spans,
                          groups_sharing_nics=min(cluster.gpus_per_node, view.ep) if spans else 1)
    return replace(tier, bus_bytes_per_s=tier.bus_bytes_per_s * profile.ep_comm_efficiency,
                   latency_s=tier.latency_s / profile.ep_comm_efficiency)


def all_to_all_seconds(view: ExpertParallelView, cluster: ClusterSpec, profile, tokens: int, c: int) -> float:
    """Seconds of one dispatch (or combine) all-to-all of a sparse block for a micro-batch of `tokens`: k rows of
    h per token, the busiest rank receiving (dispatch) and sending back (combine) imbalance x as many. A group
    spanning scale-up domains sends its peers' shares over NVLink and the network at once
    (comm.spanning_all_to_all_s); DeepEP's internode kernels send a token over RDMA once per remote domain its
    experts reach and forward it there over NVLink (deepep_spanning_seconds)."""
    from .comm import all_to_all_s, spanning_all_to_all_s

    message = tokens * view.all_to_all_bytes_per_token(c) * view.imbalance
    domain = cluster.fast_tier_gpus
    fast = ep_tier(view, cluster, profile, spans=False)
    peak = cluster.gpu.scale_up_peak_bytes_per_s
    if view.dispatch is MoeDispatch.DEEPEP and peak:
        # DeepEP's NVLink kernels: the mean of dispatch and combine (the step prices them in pairs)
        rate = peak * (DEEPEP_DISPATCH_OF_PEAK + DEEPEP_COMBINE_OF_PEAK) / 2 * profile.ep_comm_efficiency
        nvlink = replace(fast, bus_bytes_per_s=rate)
        if view.ep <= domain:
            return all_to_all_s(message, view.ep, nvlink)
        return deepep_spanning_seconds(view, ep_tier(view, cluster, profile), nvlink, domain, tokens, c, message)
    if view.ep <= domain:
        return all_to_all_s(message, view.ep, fast)
    return spanning_all_to_all_s(message, view.ep, domain, fast, ep_tier(view, cluster, profile))


def deepep_spanning_seconds(view: ExpertParallelView, network, nvlink, domain: int, tokens: int, c: int,
                            message: float) -> float:
    """DeepEP's internode normal kernels (its README: "NVLink and RDMA forwarding"; csrc/kernels/internode.cu): a
    token goes over RDMA once to each remote domain holding one of its experts (to the GPU of the same local
    index), which forwards it over NVLink to the ranks there, the two stages pipelined by channel: the slower sets
    the time. Remote domains per token: ranks_per_token over the ep / domain domains (E / (ep / domain) experts
    each), less the own domain's share. Priced at the NCCL network tier's rate: DeepEP's internode bandwidths are
    not cited here."""
    domains = view.ep // domain
    m = view.model.moe
    remote = ranks_per_token(m.n_experts, m.experts_per_token, domains, view.routing) * (domains - 1) / domains
    rdma_s = tokens * view.imbalance * remote * view.model.hidden_size * c / network.bus_bytes_per_s
    nvlink_s = (view.ep - 1) / view.ep * message / nvlink.bus_bytes_per_s
    return network.latency_s + max(rdma_s, nvlink_s)


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
    return rank_view(model, config, mesh.fsdp, training)


_LOCAL = IdentityMemo(limit=256)   # (model, ep) -> its E / ep experts (ParamCounts.of pads each block's tensors)


def _local_experts(model: ModelSpec, ep: int) -> ModelSpec:
    """The model with a rank's E / ep experts."""
    E, mo = model.moe.n_experts, model.moe
    local_rows = tuple((rows // ep, per_row) for rows, per_row in mo.stacked_expert_tensors)
    others = (E - E // ep) * mo.expert_params
    return replace(model, block_params=model.block_params - others, moe=replace(mo, stacked_expert_tensors=local_rows))


def _local_moments(view: ExpertParallelView, c: int, recomputed: bool) -> tuple[BackwardMoment, ...]:
    m, e = view.model, view.local_experts
    local = replace(m, moe=replace(m.moe, n_experts=e, experts_per_token=min(m.moe.experts_per_token, e)))
    per_token, grads = (moe.backward_moments(x, c, recomputed=recomputed) for x in (m, local))
    return tuple(replace(t, grad_bytes=g.grad_bytes) for t, g in zip(per_token, grads))


def rank_view(model: ModelSpec, config: FsdpConfig, d: int, training) -> ExpertParallelView:
    """view() from the dense shard group d = dp_shard x cp (efsdp = d x tp / ep: mesh.Mesh.efsdp); one object per
    what it reads (a search's ledgers and step times ask ~10,000 times)."""
    ep, tp, dispatch, routing = config.ep, config.tp, config.moe_dispatch, getattr(training, "routing", Routing.LEARNED)
    imbalance = float(getattr(training, "routing_imbalance", 1.0))
    return _LOCAL.get(model, ("view", ep, tp, d, dispatch, imbalance, routing), lambda: ExpertParallelView(
        model=_LOCAL.get(model, (ep,), lambda: _local_experts(model, ep)), ep=ep, efsdp=d * tp // ep, d=d,
        imbalance=imbalance, dispatch=dispatch, routing=routing))


__all__ = ["ExpertParallelView", "view", "rank_view", "expert_parallel_ops", "ep_tier", "all_to_all_seconds",
           "deepep_spanning_seconds", "expert_fsdp_seconds", "ranks_per_token", "routing_ops", "deepep_ops"]
