"""Pipeline parallelism in --emit fsdp2: the stage split with torch.distributed.pipelining, as torchtitan's
pipeline_llm builds it (cut the model into this pipeline rank's stages, TP / checkpointing / compile / FSDP on each
stage, a PipelineStage each, then the schedule class), in transformers' llama-style names.

What the snippet writes mirrors calibration/pipeline.py, the code the trace tier and calibration runs execute: the
split of cost_models/pipeline.py (even blocks; the embedding on the first stage, the final norm, head and loss on
the last; torch's loop / v placement), a Stage module holding the kept blocks with the rotary embedding on every
stage, static stage shapes (microbatch x seq_len x hidden in the compute dtype, the logits last: no shape
inference between ranks), the schedule with scale_grads=False and the loss divided by the microbatches (so a
step's gradients are those of the local batch's mean loss), and FSDP2 with reshard_after_forward=False under PP
(cost_models/fsdp_options.py, torchtitan's default).

With TP and sequence parallel (torchtitan's pipeline_llm + apply_tp): the stages send their local sequence shard, a
plain tensor of the static shape [microbatch, seq_len / tp, hidden] (torchtitan's blocks keep use_local_output=True
between modules); each Stage wraps what it receives into the Shard(1) DTensor on the tp sub-mesh that the blocks
under the emitted plan take (they keep the residual stream a DTensor, so Hugging Face code that reads the
sequence length sees the global one), and unwraps what it sends. The first stage takes the token ids; the last
returns the vocab-sharded logits, and pipeline_step runs the schedule under loss_parallel().

Tied embeddings: the last stage's head is a copy of the embedding (as calibration/pipeline.py's StageModule, what the
trace and the estimate price), and pipeline_step sums the two copies' gradients after each step (_tied_lines), so
they take the same optimizer step and stay one weight. Pure strings: no torch import.
"""

from __future__ import annotations

from cost_models.pipeline import stages
from cost_models.specs import FsdpConfig, ModelSpec, TrainingSpec

from planner.emit import attention
from planner.errors import PlannerError

_DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}


def refuse_pipeline(config: FsdpConfig, model_spec: ModelSpec) -> None:
    """What the pipeline snippet does not write, in one line."""
    if config.pp == 1:
        return
    for name, what in (("cp", "context"), ("ep", "expert")):
        if getattr(config, name) > 1:
            raise PlannerError(name, f"{name}={getattr(config, name)} with pp={config.pp}: {what} parallelism inside "
                                     "pipeline stages is not written as FSDP2 code; use --emit torchtitan")


def sequence_shards(config: FsdpConfig) -> int:
    """How many pieces a stage's activations are cut into along the sequence: tp under sequence parallel."""
    return config.tp if config.pp > 1 and config.tp > 1 and config.sequence_parallel else 1


def pipeline_imports(config: FsdpConfig) -> list[str]:
    if config.pp == 1:
        return []
    return ["import functools", "from torch.distributed.pipelining import PipelineStage",
            f"from torch.distributed.pipelining.schedules import {config.pp_schedule.torch_class}",
            *(["from torch.distributed.tensor import DTensor"] if sequence_shards(config) > 1 else [])]


def pipeline_module_level(config: FsdpConfig, model_spec: ModelSpec, training: TrainingSpec | None) -> list[str]:
    """The split as constants, the mesh built once, the Stage module, the loss, build_pipeline and one step."""
    if config.pp == 1:
        return []
    split = stages(model_spec, config)
    of_rank = [[s.index for s in split if s.rank == r] for r in range(config.pp)]
    placement = "v" if config.pp_schedule.v_shaped else "loop"
    m, mb = config.pp_microbatches, config.micro_batch
    seq_len = (training or TrainingSpec()).seq_len
    if sequence_shards(config) > 1 and seq_len % config.tp:
        raise PlannerError("sequence_parallel", f"seq_len={seq_len} with tp={config.tp} and pp={config.pp}: the "
                                                "stages send static sequence shards of seq_len / tp tokens; choose "
                                                "a seq_len that tp divides, or --no-sequence-parallel")
    return [
        f"# The pipeline: {len(split)} stages on {config.pp} pipeline ranks, {config.pp_schedule.torch_class} over "
        f"{m} microbatches of {mb} sequence{'s' if mb > 1 else ''} (the local batch: {m * mb} per step)",
        *(f"#   stage {s.index} (pp rank {s.rank}): {s.describe()}" for s in split),
        "STAGE_BLOCKS = [" + ", ".join(f"({s.first_block}, {s.n_blocks})" for s in split) + "]  # (first, count)",
        f"STAGES_OF_RANK = {of_rank}  # pipeline rank -> its stages (torch's \"{placement}\" placement)",
        f"N_MICROBATCHES = {m}",
        f"MICROBATCH_SIZE = {mb}",
        f"SEQ_LEN = {seq_len}  # every step's sequence length: the stages' shapes are static",
        "",
        "",
        "@functools.cache",
        "def device_mesh(device_type):",
        "    \"\"\"The plan's mesh, built once: build_pipeline and every stage's apply_fsdp share it.\"\"\"",
        "    if dist.get_world_size() != math.prod(MESH_SHAPE):",
        "        raise ValueError(f\"the plan's mesh {MESH_SHAPE} needs {math.prod(MESH_SHAPE)} ranks\")",
        "    return init_device_mesh(device_type, MESH_SHAPE, mesh_dim_names=MESH_DIMS)",
        "",
        "",
        *_stage_class(sequence_shards(config) > 1, model_spec.tied_embeddings),
        "",
        "",
        "def next_token_loss(logits, input_ids):",
        "    \"\"\"One microbatch's shifted cross-entropy over the microbatches: the schedule runs with",
        "    scale_grads=False, so a step's gradients are those of the local batch's mean loss.\"\"\"",
        "    labels = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)",
        "    loss = torch.nn.functional.cross_entropy(",
        "        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)",
        "    return loss / N_MICROBATCHES",
        "",
        "",
        *_build_pipeline(config, model_spec.tied_embeddings),
        "",
        "",
        *(_tied_lines() if model_spec.tied_embeddings else []),
        "def pipeline_step(schedule, has_first, has_last, input_ids):",
        "    \"\"\"Forward and backward of the local batch (N_MICROBATCHES x MICROBATCH_SIZE sequences of",
        "    SEQ_LEN tokens) through the pipeline: the first stage's ranks feed the token ids, the last",
        "    stage's take them as targets. Returns the batch's mean loss on the last stage's ranks, else",
        "    None. Call optimizer.step() after it.\"\"\"",
        "    losses = []",
        "    targets = dict(target=input_ids, losses=losses) if has_last else {}",
        *([
            "    schedule.step(*([input_ids] if has_first else []), **targets)",
        ] if sequence_shards(config) == 1 else [
            "    with loss_parallel():  # the cross-entropy on the last stage's vocab-sharded logits",
            "        schedule.step(*([input_ids] if has_first else []), **targets)",
        ]),
        *(["    tie_gradients(schedule)  # the embedding's and the head's copies: one gradient"]
          if model_spec.tied_embeddings else []),
        "    return torch.stack(losses).sum() if has_last else None" if sequence_shards(config) == 1 else
        "    return torch.stack([loss.full_tensor() for loss in losses]).sum() if has_last else None",
    ]


def _tied_lines() -> list[str]:
    """Tied embeddings across stages: the last stage trains a copy of the embedding as its head (the Stage);
    after each step the two copies' gradients are summed - the tied weight's gradient - so both take the same
    optimizer step and stay equal (Megatron-LM's embedding group). The pair of ranks holding the first and the
    last stage for each data / tensor-parallel coordinate sums them in one all-reduce (their shards line up:
    both [vocab, hidden], sharded alike); a rank holding both (the V placement) adds them itself."""
    return [
        "def tied_group(mesh):",
        "    \"\"\"The process group of this rank and its partner holding the other end (first or last",
        "    stage) at the same data / tensor-parallel coordinates; None when one rank holds both ends.",
        "    Every rank creates every pair's group, in one order (new_group is collective).\"\"\"",
        "    last = next(r for r, mine in enumerate(STAGES_OF_RANK) if len(STAGE_BLOCKS) - 1 in mine)",
        "    if last == 0:",
        "        return None",
        "    ranks = mesh.mesh.reshape(len(STAGES_OF_RANK), -1)  # [pp rank, other coordinates]: global ranks",
        "    mine = None",
        "    for first_rank, last_rank in zip(ranks[0].tolist(), ranks[last].tolist()):",
        "        group = dist.new_group([first_rank, last_rank])",
        "        if dist.get_rank() in (first_rank, last_rank):",
        "            mine = group",
        "    return mine",
        "",
        "",
        "def tie_gradients(schedule):",
        "    \"\"\"The tied weight's gradient on both of its copies (the embedding on the first stage, the head",
        "    on the last): their sum, so both take the same optimizer step and stay equal.\"\"\"",
        "    from torch.distributed.tensor import DTensor",
        "",
        "    if schedule.tied is None:  # the model passed unties them",
        "        return",
        "    modules, group = schedule.tied",
        "    grads = [m.get_input_embeddings().weight.grad for m in modules",
        "             if m.get_input_embeddings() is not None]",
        "    grads += [m.get_output_embeddings().weight.grad for m in modules",
        "              if m.get_output_embeddings() is not None]",
        "    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]  # shards alike",
        "    if len(local) == 2:  # one rank holds both ends",
        "        local[0].add_(local[1])",
        "        local[1].copy_(local[0])",
        "    elif local:",
        "        dist.all_reduce(local[0], group=group)",
        "",
        "",
    ]


def _stage_class(sequence_parallel: bool, tied: bool) -> list[str]:
    """The Stage module; with sequence parallel it receives and sends local sequence shards (the module
    docstring) and holds the tp sub-mesh they are shards over (apply_fsdp sets sequence_mesh)."""
    wrap_in = [
        "        if self.sequence_mesh is not None and self.embed_tokens is None:  # [mb, s / tp, hidden]",
        "            h = DTensor.from_local(h, self.sequence_mesh, [Shard(1)], run_check=False)",
    ] if sequence_parallel else []
    head = [
        "        if self.lm_head is not None:",
        "            return self.lm_head(self.norm(h))  # vocab-sharded logits: loss parallel",
        "        if self.sequence_mesh is None:",
        "            return h",
        "        # the local shard PipelineStage sends: a copy, not to_local()'s view (zero-bubble's",
        "        # split backward detaches the stage output in place, which a view refuses)",
        "        return h.to_local().clone()",
    ] if sequence_parallel else [
        "        return self.lm_head(self.norm(h)) if self.lm_head is not None else h",
    ]
    return [
        "class Stage(torch.nn.Module):",
        "    \"\"\"One pipeline stage of a Hugging Face decoder (get_decoder()'s embed_tokens, layers, norm",
        "    and lm_head): token ids into the first stage, hidden states elsewhere; logits out of the last.",
        "    \"\"\"",
        "",
        "    def __init__(self, model, first, n_blocks, is_first, is_last"
        + (", copy_head=False):" if tied else "):"),
        "        super().__init__()",
        "        decoder = model.get_decoder()",
        "        self.config = model.config",
        "        self.embed_tokens = decoder.embed_tokens if is_first else None",
        "        self.layers = torch.nn.ModuleDict(  # the blocks keep their index: layers.5, ...",
        "            {str(i): decoder.layers[i] for i in range(first, first + n_blocks)})",
        "        self.rotary_emb = decoder.rotary_emb  # every stage computes its own cos / sin",
        "        self.norm = decoder.norm if is_last else None",
        "        self.lm_head = model.get_output_embeddings() if is_last else None",
        *([
            "        if is_last and copy_head:  # tied embeddings: the head trains a copy of its own, its",
            "            # gradient summed with the embedding's after each step (tie_gradients): one weight",
            "            tied = self.lm_head",
            "            self.lm_head = torch.nn.Linear(tied.in_features, tied.out_features, bias=False,",
            "                                           device=tied.weight.device, dtype=tied.weight.dtype)",
            "            with torch.no_grad():",
            "                self.lm_head.weight.copy_(tied.weight)",
        ] if tied else []),
        *(["        self.sequence_mesh = None  # sequence parallel: the tp sub-mesh (apply_fsdp sets it)"]
          if sequence_parallel else []),
        "",
        "    def get_input_embeddings(self):",
        "        return self.embed_tokens",
        "",
        "    def get_output_embeddings(self):",
        "        return self.lm_head",
        "",
        "    def forward(self, x):",
        "        from transformers.masking_utils import create_causal_mask",
        "",
        "        h = self.embed_tokens(x) if self.embed_tokens is not None else x",
        *wrap_in,
        "        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)",
        "        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,",
        "                                  cache=None, position_ids=positions)  # None with SDPA: causal",
        "        rotary = self.rotary_emb(h, position_ids=positions)",
        "        for layer in self.layers.values():",
        "            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)",
        *head,
    ]


def _build_pipeline(config: FsdpConfig, tied: bool) -> list[str]:
    dtype = _DTYPES[config.precision.compute_dtype]
    looped = config.pp_schedule.looped
    between = "local" if sequence_shards(config) > 1 else "shape"  # the activations' shape between stages
    return [
        "def build_pipeline(model, device=None):",
        "    \"\"\"This rank's stages of `model` (the whole causal LM, the same weights on every rank), each",
        "    given apply_fsdp (TP, checkpointing, compile, FSDP), a PipelineStage with static shapes, and",
        "    the schedule over them. Returns (schedule, stage modules, has_first, has_last): optimize the",
        "    stage modules' parameters, run each step through pipeline_step.\"\"\"",
        "    if device is None:",
        "        device = torch.device(\"cuda\", torch.cuda.current_device())",
        "    device = torch.device(device)",
        *(f"    {line}" for line in attention.set_lines()),  # on the causal LM: its stages share its config
        "    mesh = device_mesh(device.type)",
        "    pp_rank = mesh[\"pp\"].get_local_rank()",
        "    hidden, vocab = model.config.hidden_size, model.get_output_embeddings().out_features",
        f"    dtype = {dtype}  # what the stages send each other: the compute dtype",
        "    shape = (MICROBATCH_SIZE, SEQ_LEN)",
        *(["    local = (MICROBATCH_SIZE, SEQ_LEN // mesh[\"tp\"].size())  # a stage sends its sequence shard"]
          if sequence_shards(config) > 1 else []),
        *(["    # one weight for the embedding and the head? (asked before FSDP gives each stage its own)",
           "    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight"]
          if tied else []),
        "    modules, pipeline_stages = [], []",
        "    for index in STAGES_OF_RANK[pp_rank]:",
        "        first, n_blocks = STAGE_BLOCKS[index]",
        "        is_first, is_last = index == 0, index == len(STAGE_BLOCKS) - 1",
        *([
            "        module = apply_fsdp(Stage(model, first, n_blocks, is_first, is_last), device)",
        ] if not tied else [
            "        stage = Stage(model, first, n_blocks, is_first, is_last, copy_head=tied)",
            "        module = apply_fsdp(stage, device)",
        ]),
        "        if is_first:",
        "            x = torch.zeros(shape, dtype=torch.long, device=device)",
        "        else:",
        f"            x = torch.empty(*{between}, hidden, dtype=dtype, device=device, requires_grad=True)",
        *([
            "        out = torch.empty(*shape, vocab if is_last else hidden, dtype=dtype, device=device,",
            "                          requires_grad=not is_last)",
        ] if between == "shape" else [
            "        out = torch.empty(*(shape if is_last else local), vocab if is_last else hidden,",
            "                          dtype=dtype, device=device, requires_grad=not is_last)",
        ]),
        "        pipeline_stages.append(PipelineStage(",
        "            module, index, len(STAGE_BLOCKS), device, input_args=(x,), output_args=(out,),",
        "            group=mesh[\"pp\"].get_group()))",
        "        modules.append(module)",
        f"    schedule = {config.pp_schedule.torch_class}(",
        f"        {'pipeline_stages' if looped else 'pipeline_stages[0]'}, n_microbatches=N_MICROBATCHES, "
        "loss_fn=next_token_loss,",
        "        scale_grads=False)",
        *(["    schedule.tied = (modules, tied_group(mesh)) if tied else None  # for tie_gradients"] if tied else []),
        "    mine = STAGES_OF_RANK[pp_rank]",
        "    return schedule, modules, 0 in mine, len(STAGE_BLOCKS) - 1 in mine",
    ]


def pipeline_notes(config: FsdpConfig) -> list[str]:
    if config.pp == 1:
        return []
    return [f"pipeline (pp {config.pp}, {config.pp_schedule.value}): schedule, stages, has_first, has_last = "
            "build_pipeline(model, device); optimizer over the stages' parameters; each step: loss = "
            "pipeline_step(schedule, has_first, has_last, input_ids) with the local batch (N_MICROBATCHES x "
            "MICROBATCH_SIZE sequences, the same on every pipeline rank of a data-parallel rank), then "
            "optimizer.step(). Every rank builds the whole model; the blocks of other stages are never used."]
