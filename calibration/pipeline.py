"""THE code that cuts a built model into one pipeline rank's stages and builds torch's schedule over them.

    modules = split_stages(model, spec, config, pp_rank)           # nn.Modules, this rank's stages in order
    for module in modules: apply_fsdp2(module, config, classes, mesh)   # TP, checkpointing, compile, FSDP
    schedule = build_schedule(modules, stage_indices(spec, config, pp_rank), config, pp_group, device,
                              causal_lm_loss, seq_len=s, dtype=compute_dtype)
    schedule.step(ids, target=ids, losses=[])    # first rank passes the ids, the last the targets

Used by the trace tier (calibration/trace_pipeline.py) and by real runs, so what is measured is one code path.
The split is cost_models/pipeline.py's (even blocks; the embedding on the first stage, the final norm, head and
loss on the last; torch's loop / v placement of stages on ranks), applied to Hugging Face decoders that name their
pieces in the config's base_model_pp_plan (embed_tokens, layers, norm) and the causal LM's _pp_plan (lm_head), as
transformers' llama-style families do. Each stage is a StageModule holding references to the built model's
modules (no copy: torchtitan's _split_module deep-copies a meta model; on fake or real tensors the unused pieces
are simply never tracked or trained): the kept blocks under their original index (`layers.5`, torchtitan's FQNs),
and on every stage the rotary embedding, whose cos / sin each stage computes for itself as the HF model does once.

With TP and sequence parallel (apply_stage_tensor_parallel, torchtitan's apply_tp inside pipeline_llm) the stages
send their local sequence shard, a plain (micro_batch, seq_len / tp, hidden) tensor, as torchtitan's do: each
StageModule wraps what it receives into the Shard(1) DTensor on the tp sub-mesh that its blocks take (they keep
the residual stream a DTensor, so Hugging Face code reading the sequence length sees the global one) and unwraps
what it sends; the last stage returns the vocab-sharded logits, for loss parallel's cross-entropy
(tensor_parallel.loss_context around the schedule). `--emit fsdp2` writes the same (planner/emit/code/pipeline.py).

With context parallelism (stage_context_parallel around the schedule) torch's context_parallel shards the token ids,
the labels and one position tensor every stage reads (its rotary angles) on the sequence, load-balanced, and the
ring reaches the CPU SDPA kernel (calibration/context_parallel.py): stages exchange (micro_batch, s / cp, hidden)
tensors, and the loss takes labels shifted before the sharding (next_token_loss), as torchtitan's datasets give them.
Run for real on 4 gloo ranks (pp 2 x cp 2) against the unsplit model: tests/distributed/test_pp_cp_torchrun.py.

The schedule is torch.distributed.pipelining's class for config.pp_schedule (cost_models/schedules.py), with
scale_grads=False as torchtitan builds it (its loss is already divided by the microbatches). Every PipelineStage
gets static input / output metadata (microbatch x seq_len x hidden in the compute dtype, the logits last), so
torch's warm-up vote is STATIC on every rank and no shapes travel between ranks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from cost_models.pipeline import rank_stages
from cost_models.schedules import Schedule
from cost_models.specs import FsdpConfig, ModelSpec


class PipelineSplitError(ValueError):
    """The model does not name its pieces for a pipeline split (no base_model_pp_plan)."""


class StageModule(nn.Module):
    """One pipeline stage of a transformers decoder: [embedding] + blocks + [norm + head]; forward takes token
    ids on the first stage, the previous stage's hidden states elsewhere, and returns hidden states (logits on the
    last stage)."""

    def __init__(self, causal_lm: nn.Module, first_block: int, n_blocks: int, embedding: bool, head: bool):
        super().__init__()
        base = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.model
        plan = getattr(causal_lm.config, "base_model_pp_plan", None) or {}
        if not {"embed_tokens", "layers", "norm"} <= set(plan) or not hasattr(base, "rotary_emb"):
            raise PipelineSplitError(f"{type(causal_lm).__name__} names no embed_tokens / layers / norm in its "
                                     "base_model_pp_plan (llama-style transformers decoders do)")
        self.config = causal_lm.config
        self.embed_tokens = base.embed_tokens if embedding else None
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in range(first_block, first_block + n_blocks)})
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if head else None
        self.lm_head = causal_lm.get_output_embeddings() if head else None
        self.sequence_mesh = None  # sequence parallel: the tp sub-mesh (apply_stage_tensor_parallel sets it)
        self.position_ids = None   # context parallel: the rank's (1, s / cp) positions (stage_context_parallel)
        if head and self.lm_head.weight is base.embed_tokens.weight:
            # tied embeddings: the last stage trains its own copy of the table (torchtitan's _split_module
            # deep-copies the model per stage), also where one rank holds both ends (DualPipeV's rank 0). A new
            # Linear with the table's values: copy.deepcopy of a fake parameter reads its data pointer and crashed
            # the interpreter ("corrupted double-linked list")
            tied = self.lm_head
            self.lm_head = nn.Linear(tied.in_features, tied.out_features, bias=tied.bias is not None,
                                     device=tied.weight.device, dtype=tied.weight.dtype)
            with torch.no_grad():
                self.lm_head.weight.copy_(tied.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        if self.sequence_mesh is not None and self.embed_tokens is None:  # a local (mb, s / tp, h) shard
            from torch.distributed.tensor import DTensor, Shard

            hidden = DTensor.from_local(hidden, self.sequence_mesh, [Shard(1)], run_check=False)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        if self.position_ids is not None:  # CP: the rotary angles of the rank's load-balanced tokens
            positions = self.position_ids
        rotary = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden))
        if self.sequence_mesh is None:
            return hidden
        # the local shard PipelineStage sends: a copy, not to_local()'s view (the split backward of zero-bubble and
        # DualPipeV detaches the stage output in place, which a view refuses); the DTensor's own storage is freed
        return hidden.to_local().clone()


def apply_stage_tensor_parallel(module: StageModule, tp_mesh, block_classes: set[type],
                                sequence_parallel: bool = False) -> None:
    """TP on one stage with calibration/tensor_parallel.py's styles. Without sequence parallel, transformers'
    tp_plan: each block's linears column- / row-wise, the head column-wise with its output gathered, the embedding
    replicated; stage inputs and outputs stay whole (b, s, h) tensors. With it, torchtitan's plan on the stage's
    pieces (sequence_parallel_root) and local (b, s / tp, h) shards between stages (the module docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.distributed.tensor import Replicate

    from .apply import _block_slots
    from .tensor_parallel import block_plan, block_styles, sequence_parallel_root

    plan = block_plan(module)
    for parent, name in _block_slots(module, block_classes):
        block = getattr(parent, name)
        parallelize_module(block, tp_mesh, block_styles(block, plan, sequence_parallel))
    if sequence_parallel:
        head = module.lm_head is not None
        parallelize_module(module, tp_mesh, sequence_parallel_root(
            "embed_tokens" if module.embed_tokens is not None else None, ["norm"] if head else [],
            "lm_head" if head else None))
        module.sequence_mesh = tp_mesh
    elif module.lm_head is not None:
        parallelize_module(module, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})


def stage_indices(spec: ModelSpec, config: FsdpConfig, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank pp_rank runs, in the model's order (torch's loop / v placement)."""
    return [s.index for s in rank_stages(spec, config, pp_rank)]


def split_stages(model: nn.Module, spec: ModelSpec, config: FsdpConfig, pp_rank: int) -> list[nn.Module]:
    """This pipeline rank's stage modules, in the model's order (cost_models.pipeline.rank_stages)."""
    return [StageModule(model, s.first_block, s.n_blocks, s.embedding, s.head)
            for s in rank_stages(spec, config, pp_rank)]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss the HF model computes inside its forward (shifted cross-entropy on the fp32-upcast logits)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """causal_lm_loss on labels shifted before the sequence was sharded (transformers' shift_labels, as accelerate's
    context parallelism passes them; torchtitan's datasets shift too): under CP a rank holds load-balanced chunks of
    each sequence, so a shift inside its tokens would pair tokens of different chunks. The same tensors but the
    padded labels (one int64 per token)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, None, vocab_size=logits.shape[-1], shift_labels=labels)


def stage_loss(config: FsdpConfig):
    """The loss a pipeline's last stage computes: causal_lm_loss on the token ids, next_token_loss on labels shifted
    beforehand under context parallelism."""
    return next_token_loss if config.cp > 1 else causal_lm_loss


@contextmanager
def stage_context_parallel(modules: list[nn.Module], cp_mesh, buffers: list[torch.Tensor]):
    """Context parallelism inside the stages (cp_mesh of size > 1; else nothing): torch's context_parallel around the
    schedule with `buffers` (the token ids, the labels) and one (1, s) position tensor sharded in place on the
    sequence, load-balanced, the ring reaching the CPU SDPA kernel (calibration/context_parallel.sequence_sharded).
    Every StageModule of the rank reads those positions for its rotary angles (torchtitan shards its freqs_cis the
    same way); its causal mask is still decided on the local order (none: SDPA with is_causal, what the ring takes).
    Stages exchange plain (micro_batch, s / cp, hidden) tensors, as torchtitan's do."""
    if cp_mesh.size() == 1:
        yield
        return
    from .context_parallel import sequence_sharded

    positions = torch.arange(buffers[0].shape[1], device=buffers[0].device).unsqueeze(0)
    for module in modules:
        module.position_ids = positions
    with sequence_sharded(cp_mesh, [*buffers, positions]):
        yield


def _schedule_class(schedule: Schedule):
    from torch.distributed.pipelining import schedules

    return getattr(schedules, Schedule(schedule).torch_class)


def build_schedule(stage_modules: list[nn.Module], stage_indices: list[int], config: FsdpConfig, pp_group,
                   device: torch.device | str, loss_fn, *, seq_len: int, hidden_size: int, vocab_size: int,
                   dtype: torch.dtype, sequence_shards: int = 1):
    """torch's schedule for config.pp_schedule over this rank's stages (PipelineStage each, static metadata on a CP
    rank's s / cp tokens of the seq_len: (micro_batch, s / cp / sequence_shards, hidden) activations in `dtype` -
    sequence_shards = tp under sequence parallel, else 1 -, token ids into the first stage, (micro_batch, s / cp,
    vocab) logits out of the last). n_microbatches = config.pp_microbatches."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    n_stages = config.pp_stages
    mb = config.micro_batch
    seq_len //= config.cp  # context parallel: the rank's tokens of each sequence (stage_context_parallel)
    stages = []
    for module, index in zip(stage_modules, stage_indices):
        ids = torch.zeros(mb, seq_len, dtype=torch.long, device=device)
        hidden_in = torch.empty(mb, seq_len // sequence_shards, hidden_size, dtype=dtype, device=device,
                                requires_grad=True)
        last = index == n_stages - 1
        out = torch.empty(mb, seq_len if last else seq_len // sequence_shards, vocab_size if last else hidden_size,
                          dtype=dtype, device=device, requires_grad=not last)
        stages.append(PipelineStage(module, index, n_stages, torch.device(device),
                                    input_args=(ids if index == 0 else hidden_in,), output_args=(out,),
                                    group=pp_group))
    cls = _schedule_class(config.pp_schedule)
    if issubclass(cls, PipelineScheduleMulti):
        return cls(stages, n_microbatches=config.pp_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=config.pp_microbatches, loss_fn=loss_fn, scale_grads=False)


__all__ = ["StageModule", "PipelineSplitError", "split_stages", "stage_indices", "build_schedule", "causal_lm_loss",
           "next_token_loss", "stage_loss", "stage_context_parallel"]
