"""What a calibration rank's training step runs (calibration/runner.py step 3): the rank's batch, the context of
a micro-step (loss parallel, context parallel), the optimizer and the loss."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from calibration.reference import causal_lm_loss
from cost_models.specs import FsdpConfig


def data_parallel_rank(rank: int, config: FsdpConfig, world: int | None = None) -> int:
    """The data-parallel rank of global `rank` in torchtitan's mesh [pp, dp_replicate, dp_shard, cp, tp] (tp
    innermost, then cp; pp outermost): the tp x cp ranks of one model copy share their sequences (TP ranks compute
    on the same tokens, CP ranks each take a slice of them), and so do its pipeline ranks (the first stage's take
    them as inputs, the last stage's as targets), so the batch is drawn from this rank, not the global one. Expert
    parallelism borrows data-parallel ranks and changes nothing here. world: needed with pp > 1."""
    if config.pp > 1:
        rank %= world // config.pp  # the coordinates inside this pipeline rank's [dp_replicate, ..., tp] block
    return rank // (config.tp * config.cp)


def check_same_sequences(model: nn.Module, config: FsdpConfig, batches: list[torch.Tensor], device: torch.device) -> None:
    """Raise unless every rank of each TP and CP group holds the same batches (a checksum's max and min over the
    group agree): ranks of one model copy that fed different sequences would train on neither."""
    mesh = getattr(model, "_calibration_mesh", None)
    if mesh is None:
        return
    checksum = sum(int((b.long().flatten() * (torch.arange(b.numel(), device=b.device) % 997 + 1)).sum())
                   for b in batches)
    for name in ("tp", "cp"):
        if getattr(config, name) > 1:
            t = torch.tensor([checksum, -checksum], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh[name].get_group())
            if int(t[0]) != -int(t[1]):
                raise RuntimeError(f"the ranks of a {name} group drew different batches (checksums {int(t[0])} vs "
                                   f"{-int(t[1])}): a {name} group must feed the same sequences")


CP_NEEDS_CUDA = ("cp: context parallelism's ring attention dispatches only CUDA SDPA kernels (torch's "
                 "context_parallel has no CPU path, shared/reference/pitfalls.md): run --cp on CUDA GPUs, or --cp 1 "
                 "on --device cpu")


def step_context(model: nn.Module, config: FsdpConfig, ids: torch.Tensor):
    """What a micro-step's forward and backward run inside: loss parallel with sequence-parallel TP (the
    cross-entropy on vocab-sharded logits, calibration.tensor_parallel.loss_context), and with cp > 1 torch's
    context_parallel on the mesh's "cp" dim, which shards the ids (the labels: labels = ids) on the sequence in
    its load-balanced chunks in place, as torchtitan does around its train step, and puts the whole sequence back
    on exit (the next step reuses the batch). Positions are each rank's local ones
    (the reference model and Hugging Face's derive them from the local length): the same kernels and shapes,
    so the same time and memory; the loss value is not the unsharded one."""
    from calibration.tensor_parallel import loss_context

    stack = contextlib.ExitStack()
    stack.enter_context(loss_context(config.tp, config.sequence_parallel))
    if config.cp > 1:
        if ids.device.type != "cuda":
            raise ValueError(CP_NEEDS_CUDA)
        from torch.distributed.tensor.experimental import context_parallel

        mesh = model._calibration_mesh
        stack.enter_context(context_parallel(mesh["cp"], buffers=[ids], buffer_seq_dims=[1]))
    return stack


def make_optimizer(name: str, params, precision_name: str, impl: str = "foreach"):
    """The job's optimizer, stepping with the implementation the plan priced (TrainingSpec.optimizer_impl: foreach,
    fused or for-loop, said explicitly: torch's own default is for-loop on CPU tensors); bitsandbytes' 8-bit AdamW
    has its own kernel."""
    lr = 1e-4
    how = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(params, lr=lr, **how)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **how)
    if name == "adamw-8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as exc:
            raise RuntimeError("optimizer adamw-8bit needs bitsandbytes installed") from exc
        return bnb.optim.AdamW8bit(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}")


def loss_fn_for(config: FsdpConfig):
    """The loss the plan prices: the model's own (Hugging Face computes it in the forward, from `labels`),
    or with compile (config.loss_compiled) the cross-entropy compiled apart, one fused kernel each way
    (torchtitan's compile.components "loss"); None: the model's own."""
    return torch.compile(causal_lm_loss) if config.loss_compiled else None


def loss_of(model, ids: torch.Tensor, loss_fn=None) -> torch.Tensor:
    """The loss of one forward: `.loss` (Hugging Face, our reference), else `loss_fn` (or the eager
    cross-entropy) of the logits. With a loss_fn the model is not given labels."""
    try:
        output = model(ids) if loss_fn is not None else model(ids, labels=ids)
    except TypeError:
        output = model(ids)  # a factory model without a labels argument
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    logits = getattr(output, "logits", None)  # the reference Llama's (loss, logits) named tuple too
    if logits is None:
        logits = output[0] if isinstance(output, (tuple, list)) else output
    return (loss_fn or causal_lm_loss)(logits, ids)
