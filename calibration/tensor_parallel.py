"""Tensor parallelism applied to a torch model: the TP plan (module -> DTensor ParallelStyle) and its
application with torch.distributed.tensor.parallel.parallelize_module, before checkpointing, compile and
fully_shard (torchtitan's order; calibration.apply.apply_mesh_parallelisms calls this).

Where the plan comes from:
- transformers' own `config.base_model_tp_plan` when the family has one ("layers.*.self_attn.q_proj":
  "colwise", ...), read relative to each block; the model class's `_tp_plan` for the head
  ("lm_head": "colwise_gather_output");
- the family table (LLAMA_STYLE_PLAN) otherwise: the project's reference Llama, and any model whose blocks
  have the Llama names.

Two ways to run it (FsdpConfig.sequence_parallel):
- True, torchtitan's (`torchtitan/models/llama3/infra/parallelize.py`, apply_tp): the embedding row-wise over
  the vocabulary with its output sharded on the sequence (Shard(1)); each block's norms SequenceParallel
  (on s/tp tokens); the attention and the MLP all-gather their input (PrepareModuleInput Shard(1) ->
  Replicate); the row-wise linears reduce-scatter back to Shard(1); the final norm SequenceParallel and the
  head column-wise with vocab-sharded logits (Shard(-1)) for the loss parallel cross-entropy
  (loss_context). The residual stream stays a Shard(1) DTensor between modules (use_local_output=False), so
  Hugging Face code that reads the sequence length from it (positions, masks) sees the global shape.
- False, transformers' tp_plan as accelerate and HF Trainer run it: the plan's linears only (activations
  replicated between blocks, norms on every token, the embedding replicated) and the head column-wise with
  its logits all-gathered to the full vocabulary ("colwise_gather_output").

Qwen3's and Gemma 3's q/k norms ("replicated_with_grad_allreduce": a norm over head_dim on each rank's heads)
run as HeadShardedReplicate: Replicate weights, a Shard(-2) (heads) DTensor input, so that DTensor reduces their
gradients over tp.

Tied embeddings (sequence parallel only): the embedding's and the head's DTensor weights are both Shard(0)
over the vocabulary, and are tied again after parallelize_module.

Limits (ValueError, which the trace reports as unsupported): plan styles other than colwise / rowwise (the
mixture-of-experts styles belong to expert parallelism), KV heads that tp does not divide (transformers and
torchtitan both need kv_heads % tp == 0 for a column-wise k/v), tied embeddings without sequence
parallelism (a replicated embedding and a column-wise head cannot share one weight).
"""

from __future__ import annotations

import contextlib
import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# The family table: Llama's block linears (the names transformers' Llama, Mistral, Qwen2/3 and the
# reference Llama share), as transformers' LlamaConfig.base_model_tp_plan gives them.
LLAMA_STYLE_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}
SUPPORTED_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def block_plan(model: nn.Module) -> dict[str, str]:
    """{block-relative module name: "colwise" | "rowwise"}: transformers' base_model_tp_plan without its
    "<blocks>.*." prefix when the model's config has one, else the family table."""
    hf_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not hf_plan:
        return dict(LLAMA_STYLE_PLAN)
    plan = {}
    for pattern, style in hf_plan.items():
        if ".*." not in pattern:
            raise ValueError(f"tensor parallel: plan entry {pattern!r} is not inside the blocks; only block "
                             "linears are planned from base_model_tp_plan")
        rest = pattern.split(".*.", 1)[1]
        if style not in SUPPORTED_STYLES:
            raise ValueError(f"tensor parallel: plan style {style!r} for {pattern!r} is not supported (dense "
                             f"colwise / rowwise only: {', '.join(SUPPORTED_STYLES)})")
        plan[rest] = style
    return plan


def _head_sharded_replicate():
    """transformers' "replicated_with_grad_allreduce" as a DTensor style: the module's parameters Replicate over
    tp, its input - a rank's heads, (b, s, heads / tp, head_dim) - a Shard(-2) DTensor, its output local
    again. DTensor then reduces the weight's gradient over the heads of every rank (Partial -> Replicate), the
    all-reduce the transformers name asks for, and the activations are the plain module's."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class HeadShardedReplicateStyle(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            def partition(name, mod, mesh):
                for key, param in list(mod.named_parameters(recurse=False)):
                    mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                             requires_grad=param.requires_grad))

            def inputs(mod, args, mesh):
                first = args[0] if isinstance(args[0], DTensor) else DTensor.from_local(args[0], mesh, [Shard(-2)],
                                                                                         run_check=False)
                return (first, *args[1:])

            def outputs(mod, out, mesh):
                return out.to_local() if isinstance(out, DTensor) else out

            return distribute_module(module, device_mesh, partition, inputs, outputs)

    return HeadShardedReplicateStyle


def HeadShardedReplicate():  # noqa: N802 - reads like the ParallelStyle classes it sits among
    return _head_sharded_replicate()()


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _hf_style(module: nn.Module) -> bool:
    """Hugging Face blocks call their attention with keyword arguments (hidden_states=...)."""
    return type(module).__module__.startswith("transformers.")


def _prepare_input(module: nn.Module):
    """PrepareModuleInput that all-gathers a sub-module's sequence-sharded input (its first argument, or
    Hugging Face attention's hidden_states keyword)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    kind = type(module).__name__.lower()
    if _hf_style(module) and ("attn" in kind or "attention" in kind):  # decoder layers pass hidden_states=...
        return PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                  desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True)
    import inspect

    n_args = max(1, len([p for p in inspect.signature(module.forward).parameters.values()
                         if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]))
    return PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * (n_args - 1),
                              desired_input_layouts=(Replicate(),) + (None,) * (n_args - 1), use_local_output=True)


def block_styles(block: nn.Module, plan: dict[str, str], sequence_parallel: bool) -> dict:
    """The ParallelStyle of each module of one block (names relative to the block)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    names = dict(block.named_modules())
    styles: dict = {}
    for pattern, style in plan.items():
        matched = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ValueError(f"tensor parallel: {pattern!r} names no module of {type(block).__name__}")
        for name in matched:
            if style == "replicated_with_grad_allreduce":  # q/k norms over head_dim (Qwen3, Gemma 3)
                styles[name] = HeadShardedReplicate()
            elif style == "colwise":
                styles[name] = ColwiseParallel()
            else:  # rowwise: with sequence parallel, reduce-scatter back onto the sequence shards
                styles[name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) \
                    if sequence_parallel else RowwiseParallel()
    if sequence_parallel:
        for name, child in block.named_children():
            if _is_norm(child):
                styles[name] = SequenceParallel()
        parents = {n.rsplit(".", 1)[0] for n, s in plan.items() if s == "colwise" and "." in n}
        for parent in sorted(parents):
            for name in (n for n in names if n and fnmatch.fnmatchcase(n, parent)):
                styles[name] = _prepare_input(names[name])
    return styles


def root_styles(model: nn.Module, blocks_parent: str, sequence_parallel: bool) -> dict:
    """The embedding, the final norm and the head (names relative to `model`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    names = {id(m): n for n, m in model.named_modules()}
    embedding, head = _embedding_and_head(model)
    tied = head.weight is embedding.weight
    styles: dict = {}
    if sequence_parallel:
        parent = model.get_submodule(blocks_parent) if blocks_parent else model
        prefix = f"{blocks_parent}." if blocks_parent else ""
        norms = [prefix + name for name, child in parent.named_children() if _is_norm(child)]  # beside the blocks
        styles = sequence_parallel_root(names[id(embedding)], norms, names[id(head)])
    else:
        if tied:
            raise ValueError("tensor parallel without sequence parallel: tied embeddings (transformers' plan keeps "
                             "the embedding replicated and splits the head column-wise) are not supported")
        styles[names[id(head)]] = ColwiseParallel(output_layouts=Replicate())   # colwise_gather_output
    return styles


def sequence_parallel_root(embedding: str | None, norms: list[str], head: str | None) -> dict:
    """torchtitan's root styles under sequence parallel, for the pieces a module holds (a pipeline stage: the
    embedding on the first, the final norm and the head on the last): the embedding row-wise over the vocabulary
    with its output on sequence shards, the norms SequenceParallel, the head column-wise with vocab-sharded
    logits (loss parallel), every output a DTensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles: dict = {}
    if embedding is not None:
        styles[embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    styles.update({name: SequenceParallel() for name in norms})
    if head is not None:
        styles[head] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return styles


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, block_slots: list[tuple[nn.Module, str]],
                          sequence_parallel: bool) -> int:
    """parallelize_module on each block (block_slots: calibration.apply._block_slots) and on the root's
    embedding, final norm and head; returns how many modules were parallelized."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not block_slots:
        raise ValueError("tensor parallel: the model has no blocks")
    plan = block_plan(model)
    count = 0
    for parent, name in block_slots:
        block = getattr(parent, name)
        styles = block_styles(block, plan, sequence_parallel)
        parallelize_module(block, tp_mesh, styles)
        count += len(styles)
    module_names = {id(m): n for n, m in model.named_modules()}
    container = module_names[id(block_slots[0][0])]           # "model.layers" (HF), "layers" (reference)
    blocks_parent = container.rsplit(".", 1)[0] if "." in container else ""
    embedding, head = _embedding_and_head(model)
    tied = head.weight is embedding.weight
    styles = root_styles(model, blocks_parent, sequence_parallel)
    parallelize_module(model, tp_mesh, styles)
    if tied:  # each style made its own DTensor of the one weight: tie them again (both Shard(0), the vocabulary)
        head.weight = embedding.weight
    return count + len(styles)


def _embedding_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") \
        else getattr(model, "embed_tokens", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    if head is None or embedding is None:
        raise ValueError(f"tensor parallel: cannot find the embedding and the head of {type(model).__name__}")
    return embedding, head


def check_tensor_parallel(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """ValueError unless tp splits the query and the KV heads evenly (column-wise q / k / v)."""
    if n_heads % tp or n_kv_heads % tp:
        raise ValueError(f"tensor parallel: tp={tp} must divide the attention heads ({n_heads}) and the KV heads "
                         f"({n_kv_heads}); replicated KV heads are not applied by this TP plan")


def local_vocab_size(vocab_size: int, tp: int, sequence_parallel: bool) -> int:
    """Last dimension of one rank's logits: vocab / tp with loss parallel, the full vocabulary when the head's
    output is gathered (colwise_gather_output)."""
    return vocab_size // tp if tp > 1 and sequence_parallel else vocab_size


def loss_context(tp: int, sequence_parallel: bool):
    """torch's loss_parallel() for the cross-entropy on vocab-sharded logits (torchtitan's loss parallel),
    around forward and backward; a null context otherwise."""
    if tp > 1 and sequence_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()
