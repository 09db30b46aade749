"""The device mesh in the emitted configs: the N-D DeviceMesh, the tensor-parallel plan and context parallel for
--emit fsdp2 (torchtitan's order: TP, then activation checkpointing, compile, fully_shard on the data-parallel
sub-mesh), accelerate's ParallelismConfig, and the one-line refusal of a dialect that cannot hold a mesh.

The TP plan is the one calibration/tensor_parallel.py applies (torchtitan's parallelize_llama in transformers'
names: Llama's, which Mistral, Qwen2/3, Gemma and the reference model share, or Starcoder2's MLP c_fc /
c_proj; cost_models/mesh_rules.TP_MLP_PLANS; Qwen3's and Gemma 3's q / k norms over head_dim replicated with
their gradients summed over tp, transformers' replicated_with_grad_allreduce):
- sequence_parallel (torchtitan's): the embedding row-wise with its output on sequence shards (Shard(1)), each
  block's norms SequenceParallel, the attention's and the MLP's input all-gathered (PrepareModuleInput), q/k/v,
  gate, up column-wise, o, down row-wise reducing back onto the sequence shards, the final norm
  SequenceParallel and the head column-wise with vocab-sharded logits for loss_parallel's cross-entropy. The
  residual stream stays a Shard(1) DTensor, so Hugging Face code that reads the sequence length sees the
  global one.
- without it (transformers' tp_plan, as accelerate and HF Trainer run it): the block linears only, and the
  head column-wise with its logits gathered (colwise_gather_output).
Pure strings: no torch import.
"""

from __future__ import annotations

from cost_models.mesh import Mesh, mesh_of
from cost_models.mesh_rules import LLAMA_MLP_PLAN, TP_MLP_PLANS, TP_QK_NORM_HEADS_DIM, TP_SANDWICH_NORMS
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec

from planner.emit.code import pipeline as piped
from planner.errors import PlannerError

def uses_mesh(config: FsdpConfig) -> bool:
    return not (config.tp == config.cp == config.ep == config.pp == 1)


def mesh_words(config: FsdpConfig) -> str:
    """'tp=2, cp=4': the plan's non-data-parallel degrees, for refusals."""
    return ", ".join(f"{name}={getattr(config, name)}" for name in ("tp", "cp", "ep", "pp") if getattr(config, name) > 1)


def refuse_mesh(config: FsdpConfig, dialect: str, instead: str) -> None:
    """One PlannerError line for a dialect that has no device mesh (FSDP1, accelerate's FSDP1, Lightning's
    FSDPStrategy, the launchers): never a silently data-parallel config."""
    if uses_mesh(config):
        field = next(name for name in ("tp", "cp", "ep", "pp") if getattr(config, name) > 1)
        raise PlannerError(field, f"{dialect} cannot express the plan's mesh ({mesh_words(config)}); use {instead}")


# ---------------------------------------------------------------- --emit fsdp2

def refuse_fsdp2(config: FsdpConfig, model_spec: ModelSpec) -> None:
    """What the snippet's TP plan cannot apply, in one line (calibration/tensor_parallel.py refuses the same)."""
    piped.refuse_pipeline(config, model_spec)
    if config.ep > 1 and config.tp > 1:
        raise PlannerError("ep", f"ep={config.ep} with tp={config.tp}: expert parallelism beside tensor parallelism is "
                                 "priced but not written as FSDP2 code (transformers slices the tokens over TP first); "
                                 "use --emit torchtitan, or tp 1")
    if config.tp > 1 and not config.sequence_parallel and model_spec.tied_embeddings:
        raise PlannerError("sequence_parallel", f"{model_spec.name} ties its embedding to the head: transformers' "
                                                "plan (a replicated embedding, a column-wise head) cannot share one "
                                                "weight; plan with sequence parallel (the default)")


def fsdp2_imports(config: FsdpConfig) -> list[str]:
    if not uses_mesh(config):
        return []
    lines = ["import contextlib"] if _needs_step(config) else []
    if config.tp > 1:
        lines += ["from torch.distributed.tensor import Replicate, Shard",
                  "from torch.distributed.tensor.parallel import (",
                  "    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module)"]
        if config.sequence_parallel:
            lines.append("from torch.distributed.tensor.parallel import loss_parallel")
    if config.cp > 1:
        lines.append("from torch.distributed.tensor.experimental import context_parallel")
    if config.ep > 1:
        lines += ["import re", "from transformers.distributed.expert_parallel import apply_expert_parallelism"]
    if config.async_tp:
        lines += ["import torch._inductor.config",
                  "from torch.distributed._symmetric_memory import enable_symm_mem_for_group"]
    return lines + piped.pipeline_imports(config)


def _needs_step(config: FsdpConfig) -> bool:
    """The step itself changes: context parallel shards the inputs, loss parallel takes vocab-sharded logits (a
    pipeline steps through its own pipeline_step, which enters loss_parallel itself)."""
    return config.pp == 1 and (config.cp > 1 or (config.tp > 1 and config.sequence_parallel))


def fsdp2_module_level(config: FsdpConfig, cluster: ClusterSpec, model_spec: ModelSpec | None = None,
                       training: TrainingSpec | None = None) -> list[str]:
    """The mesh's shape, the TP plan of one block, the micro-step and the pipeline (model_spec: its stage split),
    before apply_fsdp."""
    if not uses_mesh(config):
        return []
    mesh = mesh_of(config, cluster)
    dims = mesh.used_dims()
    names = ", ".join(f'"{name}"' for name, _ in dims)
    shape = ", ".join(str(size) for _, size in dims)
    lines = [f"# The device mesh: {mesh.describe()} ({' x '.join(n for n, _ in dims)}; torchtitan's names, tp "
             "innermost)",
             f"MESH_SHAPE = ({shape},)" if len(dims) == 1 else f"MESH_SHAPE = ({shape})",
             f"MESH_DIMS = ({names},)" if len(dims) == 1 else f"MESH_DIMS = ({names})", ""]
    if config.tp > 1:
        lines += ["", *_block_tp_plan(config, model_spec), ""]
    if config.ep > 1:
        lines += ["", *_expert_parallel(mesh), ""]
    if _needs_step(config):
        lines += ["", *_micro_step(config), ""]
    if config.pp > 1:
        lines += ["", *piped.pipeline_module_level(config, model_spec, training), ""]
    return lines


def _expert_parallel(mesh: Mesh) -> list[str]:
    """Expert parallelism as calibration/expert_parallel.py applies it: transformers' own ep_plan on the experts'
    view of the ranks [dp_replicate, efsdp, ep, etp] (etp 1: experts whole), tokens moved by all-to-alls."""
    efsdp = 'ep_mesh["dp_replicate", "efsdp"]' if mesh.dp_replicate > 1 else 'ep_mesh["efsdp"]'
    return [
        f"# The experts' view of the ranks: (dp_replicate, efsdp, ep, etp), efsdp = dp_shard x cp x tp / ep",
        f"EP_MESH_SHAPE = ({mesh.dp_replicate}, {mesh.efsdp}, {mesh.ep}, 1)",
        "",
        "",
        "def apply_expert_parallel(model, device_type):",
        f'    """Expert parallel (ep {mesh.ep}): each rank keeps E / {mesh.ep} experts of every sparse block, the',
        "    tokens reach them by all-to-all (transformers' ep_plan and its all_to_all implementation).",
        '    Returns the experts modules and the mesh FSDP shards them over."""',
        "    ep_mesh = init_device_mesh(device_type, EP_MESH_SHAPE,",
        '                               mesh_dim_names=("dp_replicate", "efsdp", "ep", "etp"))',
        "    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]",
        "    plan = {}",
        "    for pattern, style in model.ep_plan.items():  # its * matches a block's index",
        '        regex = re.compile(re.escape(pattern).replace(r"\\*", r"\\d+"))',
        "        plan.update({n: style for n in names if regex.fullmatch(n)})",
        '    apply_expert_parallelism(model, ep_mesh["ep"], ep_mesh["etp"], plan,',
        '                             ep_implementation="all_to_all")',
        '    experts = [model.get_submodule(n) for n, s in plan.items() if s == "ep_dispatch_experts"]',
        f"    return experts, {efsdp}",
    ]


def fsdp2_ep_lines(config: FsdpConfig) -> list[str]:
    """Body lines applying EP before checkpointing (torchtitan's order), and the experts' FSDP kwargs."""
    if config.ep == 1:
        return []
    return [f"# Expert parallel (ep {config.ep}) before checkpointing, compile and FSDP",
            "ep_experts, efsdp_mesh = apply_expert_parallel(model, device_type)"]


def expert_unit_lines(config: FsdpConfig, cluster: ClusterSpec, unit_kwargs: str) -> list[str]:
    """Inside the block loop: each EP experts module its own unit over efsdp; its gradient covers every
    data-parallel rank's tokens, so it is averaged over all of them (transformers does the same)."""
    mesh = mesh_of(config, cluster)
    dp = mesh.dp_replicate * mesh.dp_shard * mesh.cp
    return ["    # EP: this block's experts, their own unit on efsdp; averaged over all data-parallel ranks",
            "    for experts in [m for m in block.modules() if any(m is e for e in ep_experts)]:",
            f'        fully_shard(experts, **{{**{unit_kwargs}, "mesh": efsdp_mesh}})',
            f"        experts.set_gradient_divide_factor({dp}.0)"]


def _block_tp_plan(config: FsdpConfig, model_spec: ModelSpec | None) -> list[str]:
    """One block's TP plan, its MLP's linears under the model's own names (TP_MLP_PLANS; Llama's by default)."""
    mlp = TP_MLP_PLANS.get(model_spec.family, LLAMA_MLP_PLAN) if model_spec is not None else LLAMA_MLP_PLAN
    names = "Llama names" if mlp == LLAMA_MLP_PLAN else f"{model_spec.family}'s names"
    row = "RowwiseParallel(output_layouts=Shard(1), use_local_output=False)" if config.sequence_parallel \
        else "RowwiseParallel()"
    mlp_lines = [f"        \"{name}\": {'ColwiseParallel()' if style == 'colwise' else row}," for name, style in mlp]
    qk_norm_lines = _qk_norm_lines(model_spec)
    if not config.sequence_parallel:
        return [
            "def block_tp_plan():",
            f"    \"\"\"One block's TP plan: transformers' base_model_tp_plan ({names}; no sequence parallel).\"\"\"",
            "    return {",
            *(f"        \"{name}\": ColwiseParallel()," for name in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            *qk_norm_lines,
            "        \"self_attn.o_proj\": RowwiseParallel(),",
            *mlp_lines,
            "    }",
        ]
    return [
        "def block_tp_plan():",
        f"    \"\"\"One block's TP plan: torchtitan's parallelize_llama in transformers' {names}. Norms",
        "    on s/tp tokens (sequence parallel), inputs all-gathered, row-wise outputs reduce-scattered.\"\"\"",
        "    gather_input = dict(desired_input_layouts=(Replicate(),), use_local_output=True)",
        "    return {",
        "        \"input_layernorm\": SequenceParallel(),",
        "        \"self_attn\": PrepareModuleInput(  # the decoder layer passes hidden_states=...",
        "            input_kwarg_layouts={\"hidden_states\": Shard(1)},",
        "            desired_input_kwarg_layouts={\"hidden_states\": Replicate()}, use_local_output=True),",
        *(f"        \"{name}\": ColwiseParallel()," for name in
          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        *qk_norm_lines,
        "        \"self_attn.o_proj\": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),",
        "        \"post_attention_layernorm\": SequenceParallel(),",
        *(f"        \"{name}\": SequenceParallel(),  # the sandwich's" for name in
          TP_SANDWICH_NORMS.get(model_spec.family if model_spec is not None else "", ())),
        "        \"mlp\": PrepareModuleInput(input_layouts=(Shard(1),), **gather_input),",
        *mlp_lines,
        "    }",
    ]


def _qk_norm_lines(model_spec: ModelSpec | None) -> list[str]:
    """Qwen3's and Gemma 3's q / k norms over head_dim (transformers' replicated_with_grad_allreduce), as
    torchtitan's Qwen3 plan writes them: SequenceParallel on the heads dimension makes the weights Replicate
    DTensors and the input (this rank's heads, local after the column-wise q / k) a DTensor sharded on the heads,
    so DTensor sums the weights' gradients over tp; the output is local again, as the attention expects.
    Without it each rank's norm weights would learn from its own heads alone and drift apart."""
    dim = TP_QK_NORM_HEADS_DIM.get(model_spec.family) if model_spec is not None else None
    if dim is None:
        return []
    return ["        # q/k norms over head_dim on this rank's heads: weights replicated, gradients summed over tp",
            *(f"        \"self_attn.{name}\": SequenceParallel(sequence_dim={dim}, use_local_output=True),  # heads"
              for name in ("q_norm", "k_norm"))]


def _micro_step(config: FsdpConfig) -> list[str]:
    """forward_backward(model, mesh, input_ids): the loss as the plan computes it on this mesh."""
    what = [w for w, on in (("context parallel shards every sequence over mesh[\"cp\"]", config.cp > 1),
                            ("loss parallel: the cross-entropy on vocab-sharded logits",
                             config.tp > 1 and config.sequence_parallel)) if on]
    lines = [
        "def forward_backward(model, mesh, input_ids):",
        "    \"\"\"One micro-step on the plan's mesh: " + ";\n    ".join(what) + ".",
        "    Call optimizer.step() after the last micro-step.\"\"\"",
        "    # next-token targets, shifted before context parallel splits the sequence",
        "    labels = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)",
    ]
    if config.cp > 1:
        lines += [
            "    positions = torch.arange(input_ids.shape[1], device=input_ids.device).repeat(len(input_ids), 1)",
            "    # load-balanced ring attention gives rank r chunks r and 2 cp - 1 - r: Hugging Face reads a jump",
            "    # in position_ids as packed sequences (an explicit mask, which ring attention cannot take), so",
            "    # the rotary embedding gets the real positions through a hook and the mask stays causal",
            "    rotary = next(m for n, m in model.named_modules() if n.endswith(\"rotary_emb\"))",
            "    hook = rotary.register_forward_pre_hook(",
            "        lambda m, args, kwargs: (args, {**kwargs, \"position_ids\": positions}), with_kwargs=True)",
        ]
    lines += ["    with contextlib.ExitStack() as stack:"]
    if config.cp > 1:
        lines += [
            "        stack.callback(hook.remove)",
            "        stack.enter_context(context_parallel(  # each rank keeps s / cp tokens of each sequence",
            "            mesh[\"cp\"], buffers=[input_ids, labels, positions], buffer_seq_dims=[1, 1, 1]))",
        ]
    if config.tp > 1 and config.sequence_parallel:
        lines.append("        stack.enter_context(loss_parallel())")
    lines += [
        "        logits = model(input_ids=input_ids).logits",
        "        loss = torch.nn.functional.cross_entropy(",
        "            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)",
        "        loss.backward()",
        "    return loss",
    ]
    return lines


def fsdp2_mesh_lines(config: FsdpConfig, cluster: ClusterSpec) -> tuple[list[str], str]:
    """(body lines building `mesh` and the data-parallel sub-mesh `dp_mesh`, the name fully_shard takes)."""
    mesh = mesh_of(config, cluster)
    names = [name for name, _ in mesh.used_dims()]
    lines = [
        "if dist.get_world_size() != math.prod(MESH_SHAPE):",
        "    raise ValueError(f\"the plan's mesh {MESH_SHAPE} needs {math.prod(MESH_SHAPE)} ranks\")",
        "mesh = init_device_mesh(device_type, MESH_SHAPE, mesh_dim_names=MESH_DIMS)",
    ] if config.pp == 1 else ["mesh = device_mesh(device_type)  # one mesh for all stages (build_pipeline's)"]
    if config.cp > 1:
        lines.append("mesh[\"dp_shard\", \"cp\"]._flatten(\"dp_shard_cp\")  # FSDP shards over dp_shard x cp")
        shard = "dp_shard_cp"
    else:
        shard = "dp_shard"
    replicate = "dp_replicate" in names
    what = "HSDP: replicas of the shard group" if replicate else "FSDP's axis"
    sub = f"mesh[\"dp_replicate\", \"{shard}\"]" if replicate else f"mesh[\"{shard}\"]"
    lines.append(f"dp_mesh = {sub}  # {what}")
    return lines, "dp_mesh"


def fsdp2_tp_lines(config: FsdpConfig, tied: bool = False) -> list[str]:
    """Body lines applying TP to every block and the root, before checkpointing (torchtitan's order)."""
    if config.tp == 1:
        return []
    lines = [
        f"# Tensor parallel (tp {config.tp}) first, then checkpointing, compile and FSDP (torchtitan's order)",
        "tp_mesh = mesh[\"tp\"]",
        "for name in block_names:",
        "    parallelize_module(model.get_submodule(name), tp_mesh, block_tp_plan())",
        "module_names = {m: n for n, m in model.named_modules()}",
        "embedding = module_names[model.get_input_embeddings()]",
        "head = module_names[model.get_output_embeddings()]",
    ]
    if config.sequence_parallel and config.pp > 1:  # a stage module: its own pieces of the root
        lines = [line for line in lines if not line.startswith(("module_names", "embedding", "head ="))]
        lines += [
            "root_plan = {}  # the embedding on the first stage; the final norm and the head on the last",
            "if model.get_input_embeddings() is not None:",
            "    root_plan[\"embed_tokens\"] = RowwiseParallel(",
            "        input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)",
            "if model.get_output_embeddings() is not None:",
            "    root_plan[\"norm\"] = SequenceParallel()",
            "    root_plan[\"lm_head\"] = ColwiseParallel(  # vocab-sharded logits: loss parallel",
            "        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)",
            "parallelize_module(model, tp_mesh, root_plan)",
            "model.sequence_mesh = tp_mesh  # the stage sends / receives local shards [mb, s / tp, hidden]",
        ]
    elif config.sequence_parallel:
        lines += [
            "blocks_parent = block_names[0].rpartition(\".\")[0].rpartition(\".\")[0]  # \"model\" in HF models",
            "final_norm = f\"{blocks_parent}.norm\" if blocks_parent else \"norm\"",
            "parallelize_module(model, tp_mesh, {",
            "    embedding: RowwiseParallel(",
            "        input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),",
            "    final_norm: SequenceParallel(),",
            "    head: ColwiseParallel(  # vocab-sharded logits: loss parallel (forward_backward)",
            "        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),",
            "})",
        ]
        if tied:
            lines.append("model.get_output_embeddings().weight = model.get_input_embeddings().weight  # re-tie")
    elif config.pp > 1:  # a stage module: the head on the last stage only
        lines = [line for line in lines if not line.startswith(("module_names", "embedding", "head ="))]
        lines += ["if model.get_output_embeddings() is not None:  # the last stage: its logits gathered",
                  "    parallelize_module(model.get_output_embeddings(), tp_mesh, ColwiseParallel(",
                  "        output_layouts=Replicate()))"]
    else:
        lines.append("parallelize_module(model, tp_mesh, {head: ColwiseParallel(output_layouts=Replicate())})"
                     "  # gathered")
    if config.async_tp:
        lines += ["# async TP: inductor overlaps the TP collectives with the matmuls (compiled blocks)",
                  "torch._inductor.config._micro_pipeline_tp = True",
                  "enable_symm_mem_for_group(tp_mesh.get_group().group_name)"]
    return lines


def fsdp2_notes(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec) -> list[str]:
    notes = piped.pipeline_notes(config)
    mesh: Mesh = mesh_of(config, cluster)
    if config.tp > 1:
        notes.append(f"TP plan: transformers' Llama names for {model_spec.block_class} (q/k/v, gate, up colwise; "
                     "o, down rowwise); rename them for a model whose blocks name them otherwise.")
    if config.cp > 1:
        notes.append("context parallel: run each micro-step through forward_backward (SDPA, no attention mask, "
                     "fixed-length sequences); its ring attention runs on CUDA only.")
    if config.ep > 1:
        notes.append(f"expert parallel (ep {mesh.ep}): transformers (>= 5.21) applies the model's own ep_plan; "
                     f"each rank keeps E / {mesh.ep} experts, FSDP-sharded over efsdp = {mesh.efsdp}; routing is "
                     "priced balanced (--routing-imbalance to price a skew).")
    return notes


# ---------------------------------------------------------------- accelerate / HF Trainer (ParallelismConfig)

def accelerate_mesh(config: FsdpConfig, cluster: ClusterSpec, dialect: str) -> Mesh | None:
    """The mesh accelerate's ParallelismConfig(dp_replicate_size, dp_shard_size, tp_size, cp_size) holds for the
    plan (None: data parallelism only, as before), or one PlannerError line for what it cannot: expert or
    pipeline parallelism, torchtitan's sequence parallel (accelerate runs TP as transformers' tp_plan), and the
    meshes accelerate 1.15 refuses (FSDP2 with nothing to shard over; TP / CP beside pure replication)."""
    if not uses_mesh(config):
        return None
    if config.ep > 1 or config.pp > 1:
        field = "ep" if config.ep > 1 else "pp"
        what = "expert" if field == "ep" else "pipeline"
        raise PlannerError(field, f"{dialect} has no {what} parallelism (accelerate's ParallelismConfig: "
                                  "dp_replicate, dp_shard, tp, cp); use --emit torchtitan or fsdp2")
    if config.tp > 1 and config.sequence_parallel:
        raise PlannerError("sequence_parallel", f"{dialect} runs TP as transformers' tp_plan, which has no "
                                                "sequence parallel (the plan has it); plan with "
                                                "--no-sequence-parallel, or use --emit torchtitan or fsdp2")
    mesh = mesh_of(config, cluster)
    if mesh.dp_shard == 1 and mesh.cp == 1:
        raise PlannerError("tp", f"{dialect} cannot hold the plan's mesh {mesh.describe()}: accelerate's FSDP2 "
                                 "needs dp_shard or cp > 1 to shard over; use --emit fsdp2 or torchtitan")
    if mesh.dp_replicate > 1 and mesh.dp_shard == 1:
        raise PlannerError("sharding", f"{dialect} cannot hold the plan's mesh {mesh.describe()}: accelerate "
                                       "refuses TP / CP beside pure replication (dp_shard 1); use --emit fsdp2 or "
                                       "torchtitan")
    return mesh


def accelerate_notes(config: FsdpConfig) -> list[str]:
    """How the training script uses accelerate's mesh: TP at load time, CP around each step."""
    notes = []
    if config.tp > 1:
        notes.append(f"TP through transformers' tp_plan: load the model with from_pretrained(..., tp_plan=\"auto\", "
                     f"tp_size={config.tp}) (transformers' base_model_tp_plan; the head's logits gathered)")
    if config.cp > 1:
        notes.append("context parallel: run each step inside accelerator.maybe_context_parallel(buffers=[input_ids, "
                     "labels, position_ids], buffer_seq_dims=[1, 1, 1], no_restore_buffers={input_ids, labels, "
                     "position_ids}) with SDPA and no attention mask, labels shifted beforehand")
    return notes


def launcher_mesh_note(config: FsdpConfig) -> list[str]:
    """torchrun / slurm / pytorchjob launch the ranks; the mesh is the training script's."""
    if not uses_mesh(config):
        return []
    return [f"the plan's mesh ({mesh_words(config)}) is built by the training script (--emit fsdp2 writes it; "
            "--emit torchtitan sets its degrees); this only launches the ranks"]
