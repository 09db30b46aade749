"""verl's actor as the FSDP models price it: the model as trained (LoRA on its target_modules: rl_lora_targets.py),
its FSDP configuration and packed micro-batch (ActorRun), its per-GPU states and update peak from the repo's ledger
with verl's log-prob path in place of the cross-entropy (ActorStates), a no-grad log-prob forward, and the
reference's shard. rl_phases.py places them in verl's phases."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import activations, host_optimizer, moe_lora, rl_ulysses
from .cluster_spec import ClusterSpec
from .memory import estimate_memory
from .memory_types import MemoryBreakdown, ParamCounts
from .model_spec import ModelSpec
from .moe_lora_targets import shared_expert_shapes
from .profile import Profile
from .rl_batch import BatchPlan
from .rl_lora_targets import lora_model
from .rl_settings import ACTOR_DTYPES, RlSettings
from .rl_strategy import (forward_gathered_bytes, fsdp2_backward, head_backward_bytes, loss_root_bytes,
                          weight_sync_bytes)
from .rl_trl_head import trl_head_bytes
from .rl_trl_server import sync_tensor_bytes
from .spec_values import Attention, LossKernel, Sharding
from .specs import FsdpConfig, TrainingSpec
from .units import DTYPE_BYTES

ENTROPY_CHUNK_ROWS = 2048  # verl's entropy_from_logits_with_chunking default chunk

@dataclass(frozen=True)
class ActorStates:
    """The actor's per-GPU model states (the ledger's optimizer step) and its update's peak."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    step_temporary_bytes: int
    update_first: MemoryBreakdown    # the backward's peak at the first step (no Adam states yet)
    update_steady: MemoryBreakdown
    largest_tensor_bytes: int        # one gathered parameter (the embedding or head) in the actor's dtype
    unit_gather_bytes: int           # the units a forward-only phase holds gathered (rl_strategy.py)
    sync_bytes: tuple = ({}, {})     # the weight sync's transients: its state-dict walk's, its send's (rl_strategy.py)
    on_host: bool = False            # CPUOffloadPolicy: params, grads, Adam states (the sizes above) on the host


def all_linear_lora(model: ModelSpec) -> ModelSpec:
    """LoRA on every linear of a block (PEFT's target_modules="all-linear", verl's default): q, k, v, o and the
    MLP's (ModelSpec.lora_targets all-linear: their adapters and the inputs they save)."""
    return dataclasses.replace(model, lora_targets="all-linear")


# [tokens, vocab] tensors of the compute dtype alive at the entropy path's peak, traced with torch 2.13's eager
# autograd on fake tensors (tests/unit/test_rl_logits_trace.py): the logits and verl's entropy_from_logits
# (softmax, logsumexp, pd * logits) under no_grad; with grad, through its backward (a log-softmax beside it adds
# nothing to the peak).
ENTROPY_TENSORS_NO_GRAD = 3
ENTROPY_TENSORS_EAGER_GRAD = 7
# verl compiles entropy_from_logits by default (actor.use_torch_compile): AOTAutograd saves the logits and
# recomputes the rest; the backward holds them, their gradient and one working tensor. An estimate (inductor does
# not run on fake tensors).
ENTROPY_TENSORS_COMPILED_GRAD = 3


def verl_logits_bytes(model: ModelSpec, tokens: int, c: int, settings: RlSettings, grad: bool = True,
                      entropy: bool | None = None) -> int:
    """verl's dp_actor._forward_micro_batch on remove-padded tokens: the logits [tokens, vocab] in compute dtype
    (transformers' lm_head, no upcast); log-probs by flash-attn's cross_entropy_loss (its gradient in place);
    the entropy (verl torch_functional.entropy_from_logits) as traced or compiled (ENTROPY_TENSORS_*), or with
    chunking (entropy_from_logits_with_chunking) three fp32 chunks of ENTROPY_CHUNK_ROWS rows beside the logits.
    entropy: whether this pass computes it (None: the update's, settings.entropy; forward_only_bytes says which
    log-prob pass does)."""
    v = model.vocab_size
    logits = tokens * v * c
    if not (settings.entropy if entropy is None else entropy):
        return logits
    if settings.entropy_chunking:
        return logits + 3 * min(tokens, ENTROPY_CHUNK_ROWS) * v * 4
    if not grad:
        return ENTROPY_TENSORS_NO_GRAD * logits
    return (ENTROPY_TENSORS_COMPILED_GRAD if settings.entropy_compile else ENTROPY_TENSORS_EAGER_GRAD) * logits


def logits_bytes(model: ModelSpec, tokens: int, c: int, settings: RlSettings, batch: BatchPlan,
                 grad: bool = True) -> int:
    """The log-prob path's bytes on `tokens` tokens per GPU: verl's logits and entropy, or TRL's fused head on the
    response tokens among them (rl_trl_head.py; the head trains unless LoRA leaves it frozen)."""
    if settings.framework == "trl":
        return trl_head_bytes(model, batch.scored_tokens(tokens), c, grad, head_trains=not settings.lora)
    return verl_logits_bytes(model, tokens, c, settings, grad)


@dataclass(frozen=True)
class ActorRun:
    """What the FSDP models price for verl's actor: the model as trained (LoRA adapters on its target_modules), the
    cluster its shard group sees (HYBRID over fsdp_size: a node of fsdp_size GPUs), the FsdpConfig and the packed
    micro-batch (micro_batch 1 of the micro-batch's tokens per GPU)."""

    model: ModelSpec
    cluster: ClusterSpec
    config: FsdpConfig
    training: TrainingSpec
    shard_ranks: int


def actor_run(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings, batch: BatchPlan,
              memo: dict | None = None) -> ActorRun:
    """FULL_SHARD over the GPUs (fsdp_size -1), NO_SHARD for fsdp_size 1, else HYBRID over fsdp_size; fp32 master
    weights with bf16 compute (or bf16 throughout); the loss priced apart (verl_logits_bytes). memo: a search's
    cache (one cluster: the actor's model and the critic's value model), keyed by what the run reads."""
    if memo is not None:
        key = ("actor_run", model.name, settings.finetune, settings.lora_rank, settings.lora_targets,
               settings.actor_dtype, settings.gradient_checkpointing, settings.fsdp_size, batch.update_tokens_per_gpu,
               settings.host_offload, settings.optimizer_impl)
        if key not in memo:
            memo[key] = actor_run(model, cluster, settings, batch)
        return memo[key]
    size = shard_group_ranks(cluster.n_gpus, settings.fsdp_size)
    sharding = Sharding.FULL_SHARD if size == cluster.n_gpus else Sharding.NO_SHARD if size == 1 \
        else Sharding.HYBRID_SHARD
    config = FsdpConfig(sharding=sharding, precision=ACTOR_DTYPES[settings.actor_dtype],
                        ac_every=int(settings.gradient_checkpointing), micro_batch=1, grad_accum=1,
                        attention=Attention.SDPA, loss_kernel=LossKernel.LIGER, offload=settings.host_offload)
    return ActorRun(model=lora_model(model, settings),
                    cluster=_shard_group_nodes(cluster, size) if 1 < size < cluster.n_gpus else cluster,
                    config=config, training=TrainingSpec(seq_len=batch.update_tokens_per_gpu,
                                                         finetune=settings.finetune, lora_rank=settings.lora_rank,
                                                         optimizer_impl=settings.optimizer_impl),
                    shard_ranks=size)


def shard_group_ranks(n_gpus: int, fsdp_size: int) -> int:
    """The actor's shard group (fsdp_config.fsdp_size, -1: all GPUs), at most the GPUs. A group of one rank shards
    nothing: FSDP1 runs NO_SHARD there (rl_strategy.loss_root_bytes), which the search's pruning reads
    (planner/rl/search.py _holds_no_more)."""
    return n_gpus if fsdp_size == -1 else min(fsdp_size, n_gpus)


def _shard_group_nodes(cluster: ClusterSpec, size: int) -> ClusterSpec:
    """HYBRID over fsdp_size: each shard group priced as a node of `size` GPUs (its collectives' tier), while every
    rank of the real node still steps on that node's CPUs at once (host_optimizer.py, CPUOffloadPolicy)."""
    return dataclasses.replace(cluster, gpus_per_node=size, host_cpu=dataclasses.replace(
        cluster.host_cpu, ranks_per_node=host_optimizer.ranks_per_node(cluster)))


def actor_states(run: ActorRun, settings: RlSettings, batch: BatchPlan, profile: Profile) -> ActorStates:
    """The ledger's update at the packed micro-batch, with verl's log-prob loss in place of the cross-entropy."""
    model, config, training, size = run.model, run.config, run.training, run.shard_ranks
    # verl accumulates gradients over the mini-batch's micro-batches: from the second micro-batch on the whole
    # sharded gradient is resident (the ledger's grad_accum > 1: FSDP adds each new shard in place)
    accumulating = batch.micro_batches_per_mini > 1
    tokens = training.seq_len
    accum_config = dataclasses.replace(config, grad_accum=1 + accumulating)
    # verl builds the actor in its model_dtype (fp32 by default) and PEFT keeps the base in it (below), which FSDP2
    # casts at every all-gather; verl's LoRA engine calls PEFT's enable_input_require_grads (workers/engine/fsdp/
    # transformer_impl.py _build_lora_module)
    fp32_base = settings.lora and config.precision.mixed
    input_leaf = settings.lora and settings.framework == "verl"
    est = estimate_memory(model, run.cluster, training, accum_config, profile,
                          frozen_stored_bytes=4 if fp32_base else None, input_requires_grad=input_leaf)
    body = est.phases["backward"]
    # CPU offload (FSDP2's CPUOffloadPolicy): the ledger keeps the model states off the GPU; their sizes, for the
    # host and the copies, from the ledger without it
    on_gpu = not config.offload
    step = est.phases["optimizer_step"] if on_gpu else estimate_memory(
        model, run.cluster, training, dataclasses.replace(accum_config, offload=False), profile).phases["optimizer_step"]
    if fp32_base:
        # the frozen shard is stored in fp32, where the ledger keeps a frozen base in the compute dtype
        frozen = ParamCounts.of(model, training).frozen(model.n_layers)
        extra = -(-frozen * (4 - DTYPE_BYTES[config.precision.compute_dtype]) // size)
        step = dataclasses.replace(step, sharded_params=step.sharded_params + extra)
        body = dataclasses.replace(body, sharded_params=body.sharded_params + extra * on_gpu)
    c = DTYPE_BYTES[config.precision.compute_dtype]
    body = fsdp2_backward(body, est.peak_moment, model, settings, c, DTYPE_BYTES[config.gradient_reduce_dtype], size)
    # the loss moment: every block's saved tensors (checkpointed: its input), the root's, the root gathered (as
    # the strategy wraps it: rl_strategy.py), and the verl logits path or, once the logits' gradient is complete,
    # that gradient and the last block's all-gather (the root's pre-backward prefetches it): verl's entropy backward
    # peaks before it (FSDP1 traced with verl's own update: tests/distributed/test_torchrun_verl_actor.py)
    per_block = (activations.checkpointed_block_bytes_per_token(model, c) if settings.gradient_checkpointing else
                 activations.block_bytes_per_token(model, c, Attention.SDPA, tokens, 1, training.adapter_rank)
                 # all-linear on an MoE: peft's merged expert stacks, FSDP2 gathering base and adapters in c
                 + moe_lora.merged_bytes_per_token(model, c, c, training.adapter_rank, tokens))
    # Ulysses: flash attention saves the repeated k, v (rl_ulysses.py): every layer's, or the recomputed block's
    surplus = tokens * rl_ulysses.saved_surplus_bytes_per_token(model, c, batch.ulysses)
    ckpt = settings.gradient_checkpointing
    body = dataclasses.replace(body, activations=body.activations + surplus * (1 if ckpt else model.n_layers))
    saved = tokens * (model.n_layers * per_block + activations.root_bytes_per_token(model, c, lora=settings.lora))
    saved += 0 if ckpt else model.n_layers * surplus
    # enable_input_require_grads without checkpointing: the embedding's output, a leaf, kept by its AccumulateGrad
    saved += tokens * model.hidden_size * c if input_leaf and not ckpt else 0
    head, block = logits_bytes(model, tokens, c, settings, batch), model.block_params * c if size > 1 else 0
    head_gathered = 0
    if settings.framework == "verl":   # the entropy's backward, or the head's with the logits' gradient complete
        head_gathered, head, block = max((0, head, 0), (head_backward_bytes(model, settings, c),
                                                         tokens * model.vocab_size * c, block), key=sum)
    loss = MemoryBreakdown(sharded_params=step.sharded_params * on_gpu, optimizer_state=step.optimizer_state * on_gpu,
                           sharded_grads=step.sharded_grads * on_gpu if accumulating else 0,
                           unsharded_params=loss_root_bytes(model, settings, c, size) + head_gathered,
                           activations=saved, collective_buffers=block, logits_and_loss=head)
    steady = max(body, loss, key=lambda b: b.total_bytes)
    first = dataclasses.replace(steady, optimizer_state=0)
    p = DTYPE_BYTES[config.precision.param_dtype]
    largest = max(model.embedding_params, model.head_params) * p
    return ActorStates(params_bytes=step.sharded_params, grads_bytes=step.sharded_grads,
                       optimizer_bytes=step.optimizer_state, step_temporary_bytes=step.optimizer_temporaries,
                       update_first=first, update_steady=steady, largest_tensor_bytes=largest,
                       sync_bytes=weight_sync_bytes(model, settings, step.sharded_params, p, size,
                                                    sent_tensors(model, settings)),
                       unit_gather_bytes=forward_gathered_bytes(model, settings, c), on_host=not on_gpu)


def sent_tensors(model: ModelSpec, settings: RlSettings) -> tuple[int, ...]:
    """The tensors TRL's server-mode sync sends, in its order and the actor's stored dtype (rl_trl_server.py); none
    otherwise (the colocated syncs hold one tensor or unit at a time)."""
    if not (settings.framework == "trl" and settings.server):
        return ()
    p = DTYPE_BYTES[ACTOR_DTYPES[settings.actor_dtype].param_dtype]
    # the block's nn.Linear weights, whatever LoRA trains: all-linear's lora.Linear targets (ModelSpec.lora_shapes),
    # read without building that spec, which gpt-oss and Llama 4 refuse (an MoE's stacked experts: one tensor)
    mlp = shared_expert_shapes(model) if model.moe is not None else model.mlp_linear_shapes
    return tuple(sync_tensor_bytes(model, (*model.lora_target_shapes, *mlp), p))


def forward_only_bytes(model: ModelSpec, tokens: int, c: int, settings: RlSettings, sp: int = 1,
                       batch: BatchPlan | None = None) -> tuple[dict, dict]:
    """The log-prob forwards under no_grad on `tokens` tokens per GPU, (the old log-probs', the reference's), priced
    once for both: one block's working set (bounded by what it would save for backward), the residual stream in and
    out, Ulysses (sp > 1): what its attention's all-to-all moment adds over that bound (rl_ulysses.py); then each
    pass's head: verl's logits path, with the entropy in the old pass only (ray_trainer.py _compute_old_log_prob:
    calculate_entropy=True; _compute_ref_log_prob: False); TRL's fused head on the batch's response tokens, the same
    in both. All-linear LoRA on an MoE: the actor's pass runs its adapters, peft's merged expert stacks alive through
    the experts' forward (parametrize.cached() holds both: moe_lora.py; +3 E f h x c measured under no_grad on a
    Mixtral block); the reference's disables them (verl: disable_adapter). Attention-only LoRA: no merged stacks."""
    bound = activations.block_bytes_per_token(model, c, Attention.SDPA, tokens, 1) + 2 * c * model.hidden_size
    ulysses = rl_ulysses.forward_only_extra_bytes(model, tokens, c, sp, bound)
    body = {"forward activations": tokens * bound, **({"Ulysses all-to-all": ulysses} if ulysses else {})}
    lora_moe = lora_model(model, settings).lora_moe   # the actor's, on its target_modules
    merged = moe_lora.merged_weight_bytes(model, c, c, settings.lora_rank) if lora_moe else 0
    actor = {**body, **({"merged expert stacks (peft)": merged} if merged else {})}
    if settings.framework == "trl":
        head = {"log-prob head (fused)": logits_bytes(model, tokens, c, settings, batch, grad=False)}
        return {**actor, **head}, {**body, **head}
    return ({**actor, "logits and entropy": verl_logits_bytes(model, tokens, c, settings, grad=False, entropy=True)},
            {**body, "logits": verl_logits_bytes(model, tokens, c, settings, grad=False, entropy=False)})


def reference_bytes(model: ModelSpec, cluster: ClusterSpec, settings: RlSettings) -> int:
    """The reference's shard on one GPU: verl's in bf16; TRL's (only with beta != 0) in the actor's dtype, built
    with its model_init_kwargs (grpo_trainer.py). LoRA: none, the actor without its adapter is the reference."""
    if settings.lora or (settings.framework == "trl" and settings.beta == 0):
        return 0
    stored = DTYPE_BYTES[ACTOR_DTYPES[settings.actor_dtype].param_dtype] if settings.framework == "trl" else 2
    return -(-model.n_params * stored // cluster.n_gpus)
