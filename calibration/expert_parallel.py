"""Expert parallelism applied to a Hugging Face mixture-of-experts model: transformers' own path, torchtitan's layout.

transformers 5 (>= 5.21) ships the expert-parallel path torchtitan runs (transformers/distributed/expert_parallel.py):
the model's `ep_plan` (`base_model_ep_plan`: `layers.*.mlp.experts.gate_up_proj / down_proj: grouped_gemm`, the
experts module `ep_dispatch_experts`) shards the stacked expert tensors on dim 0 over the ep mesh (a DTensor
`Shard(0)`: each rank keeps E / ep whole experts, `num_experts` becomes E / ep) and `AllToAllEP` moves the tokens:
each (token, expert) row sorted by expert, gathered, sent to the expert's rank with `all_to_all_single` (dispatch),
run there through the family's own grouped_mm experts forward (top-1, unit weights), sent back with a second
all-to-all (combine), put back in (token, slot) order and weighted by the routing weights on the sender. Then
FSDP2 shards the experts over the efsdp sub-mesh (transformers' apply_fully_sharded_data_parallelism: the experts
module `fully_shard`ed on `efsdp`, its gradient divided by the data-parallel degree with a sum reduction), and the
rest of the model over dp_shard x cp as calibration.apply does for every model. We use that path, not a copy.

The mesh is transformers' / torchtitan's second view, `(dp_replicate, efsdp, ep)` with ep innermost (an EP group is
consecutive ranks) and efsdp = dp_shard x cp x tp / ep; it is built here with FakeTensorMode suspended (a mesh
cannot be made inside it: pitfalls.md), so callers need nothing new.

Routing is balanced, as the estimate prices it: token t's j-th choice goes to expert (t k + j) mod E, so every
expert gets T k / E rows and every rank T k / ep (cost_models/expert_parallel.py prices the busiest rank's excess
as a stated factor). The router runs as usual and its weights are kept, so its gradient flows; only which experts
the rows reach is fixed. On real tensors AllToAllEP's own dispatch runs (its split sizes read back from the
counts, as in training); on fake tensors - where `.tolist()` has no value to read - the same split sizes are
computed in Python, the only line that differs (`_FakeAwareAllToAll._dispatch_tokens`). With `routing_imbalance`
> 1 (trace only: the fake group checks no sizes) rank 0 receives that many times the mean rows from every peer.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

EP_IMPLEMENTATION = "planner_balanced_all_to_all"
_IMBALANCE = {"factor": 1.0}   # the trace's busiest-rank factor (rank 0), set by routing_imbalance()


@contextlib.contextmanager
def routing_imbalance(factor: float):
    """Within the block: rank 0's experts receive `factor` x the balanced rows (fake tensors only)."""
    old = _IMBALANCE["factor"]
    _IMBALANCE["factor"] = float(factor)
    try:
        yield
    finally:
        _IMBALANCE["factor"] = old


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def balanced_counts(rows: int, n_experts: int) -> list[int]:
    """Rows per expert when row r goes to expert r mod E: rows // E each, one more for the first rows % E."""
    return [rows // n_experts + (1 if e < rows % n_experts else 0) for e in range(n_experts)]


def _implementation_class():
    from transformers.distributed.expert_parallel import AllToAllEP, _AllToAllState, _WaitTensor
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    class _FakeAwareAllToAll(AllToAllEP):
        """transformers' AllToAllEP with balanced routing; on fake tensors the split sizes computed in Python."""

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            n_tokens, k = top_k_index.shape
            experts = self.num_local_experts * self.ep_mesh.size()
            balanced = (torch.arange(n_tokens * k, device=top_k_index.device) % experts).view(n_tokens, k)
            return super().__call__(hidden_states, balanced.to(top_k_index.dtype), top_k_weights)

        def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
            if not _is_fake(hidden_states):
                return super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
            if self.tp_mesh.size() > 1:
                raise NotImplementedError("the fake-tensor dispatch covers tp = 1 (experts whole, tokens unsliced)")
            # AllToAllEP._dispatch_tokens line by line, the split sizes from the balanced counts
            ep_group, ep_size = self.ep_mesh.get_group(), self.ep_mesh.size()
            n_local, me = self.num_local_experts, self.ep_mesh.get_local_rank()
            num_tokens, num_top_k = hidden_states.size(0), top_k_index.size(-1)
            expert_ids = top_k_index.reshape(-1)
            order = torch.argsort(expert_ids)
            send_tokens = hidden_states[order // num_top_k]
            counts = balanced_counts(expert_ids.numel(), n_local * ep_size)
            send_sizes = [sum(counts[r * n_local:(r + 1) * n_local]) for r in range(ep_size)]
            mine = counts[me * n_local:(me + 1) * n_local]   # every peer routes its rows by the same pattern
            factor = _IMBALANCE["factor"] if me == 0 else 1.0
            mine = [round(factor * c) for c in mine]
            recv_sizes = [sum(mine)] * ep_size
            recv_counts = torch.tensor(mine * ep_size, dtype=torch.long, device=hidden_states.device)
            recv_tokens = all_to_all_single_autograd(send_tokens, recv_sizes, send_sizes, ep_group)
            recv_tokens = _WaitTensor.apply(recv_tokens)
            recv_expert_ids = torch.arange(n_local, device=hidden_states.device).repeat(ep_size)
            recv_expert_ids = recv_expert_ids.repeat_interleave(recv_counts, output_size=sum(recv_sizes))
            recv_expert_ids = recv_expert_ids.unsqueeze(-1)
            recv_weights = torch.ones_like(recv_expert_ids, dtype=recv_tokens.dtype)
            state = _AllToAllState(top_k_weights, order, send_sizes, recv_sizes, num_tokens)
            return recv_tokens, recv_expert_ids, recv_weights, state

    return _FakeAwareAllToAll


def _register() -> None:
    from transformers.distributed.expert_parallel import EPImplementationInterface

    if EP_IMPLEMENTATION not in EPImplementationInterface():
        EPImplementationInterface.register(EP_IMPLEMENTATION, _implementation_class())


def expert_mesh(config, dense_mesh):
    """(dp_replicate, efsdp, ep, etp) DeviceMesh of torchtitan's expert view (etp = 1: experts whole) for the
    dense mesh calibration.apply.make_mesh built, and the cost_models Mesh of both views.

    Built with FakeTensorMode suspended, so it can be called from inside a trace."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    from cost_models.mesh import Mesh

    # the data-parallel mesh fully_shard takes: (dp_replicate,) dp_shard, or dp_shard x cp flattened ("dp_shard_cp")
    names = dense_mesh.mesh_dim_names or ()
    size = {n: dense_mesh[n].size() for n in ("dp_replicate", "dp_shard", "dp_shard_cp") if n in names}
    dp_shard = size["dp_shard_cp"] // config.cp if "dp_shard_cp" in size else size.get("dp_shard", 1)
    layout = Mesh(dp_replicate=size.get("dp_replicate", 1), dp_shard=dp_shard, cp=config.cp, tp=config.tp,
                  ep=config.ep)
    with unset_fake_temporarily():
        experts = init_device_mesh(dense_mesh.device_type, (layout.dp_replicate, layout.efsdp, layout.ep, 1),
                                   mesh_dim_names=("dp_replicate", "efsdp", "ep", "etp"))
    return experts, layout


def experts_plan(model: nn.Module) -> dict[str, str]:
    """The model's ep_plan with its `*` expanded to the module names it matches (transformers' own plan)."""
    plan = dict(getattr(model, "ep_plan", None) or {})
    if not plan:
        raise ValueError(f"{type(model).__name__} has no expert-parallel plan (transformers' base_model_ep_plan)")
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    out = {}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        # blocks already in a checkpoint wrapper: match the name without the wrapper's attribute
        out.update({n: style for n in names if regex.fullmatch(n.replace(_WRAPPED, ""))})
    return out


_WRAPPED = "_checkpoint_wrapped_module."


@contextlib.contextmanager
def _meshes_made_outside_fake_mode():
    """FSDP2 joins the efsdp mesh and the experts' ep mesh into one (DeviceMesh._concatenate) for the DTensor
    parameters; like any mesh it cannot be made inside FakeTensorMode (its rank tensor would be fake)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(device_mesh_list):
        with unset_fake_temporarily():
            return original(device_mesh_list)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)


def apply_expert_parallel(model: nn.Module, config, dense_mesh, fsdp_kwargs: dict) -> list[nn.Module]:
    """Expert parallelism for `model` (config.ep > 1), then fully_shard of each experts module over efsdp (with
    `fsdp_kwargs` minus the mesh). Returns the experts modules; the caller shards the rest over dp_shard x cp."""
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    if config.tp > 1:
        raise NotImplementedError("expert parallelism with tp > 1 is priced but not applied yet (the TP token slicing)")
    _register()
    mesh, layout = expert_mesh(config, dense_mesh)
    plan = experts_plan(model)
    apply_expert_parallelism(model, mesh["ep"], mesh["etp"], plan, ep_implementation=EP_IMPLEMENTATION)
    modules = dict(model.named_modules())
    experts = [modules[n] for n, style in plan.items() if style == "ep_dispatch_experts"]
    efsdp = mesh["dp_replicate", "efsdp"] if layout.dp_replicate > 1 else mesh["efsdp"]
    kwargs = {k: v for k, v in fsdp_kwargs.items() if k not in ("mesh", "shard_placement_fn")}
    with _meshes_made_outside_fake_mode():
        for module in experts:
            fully_shard(module, mesh=efsdp, **kwargs)
        # transformers: the experts' gradient covers every data-parallel batch (ep / tp x efsdp = dp_shard x cp,
        # x dp_replicate), so divide by that; a sum reduction and a local divide (gloo rejects PREMUL_SUM)
    for module in experts:
        module.set_gradient_divide_factor(float(layout.dp_replicate * layout.dp_shard * layout.cp))
        if layout.efsdp > 1:
            module.set_force_sum_reduction_for_comms(True)
    return experts


__all__ = ["apply_expert_parallel", "expert_mesh", "experts_plan", "balanced_counts", "routing_imbalance",
           "EP_IMPLEMENTATION"]
