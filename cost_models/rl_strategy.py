"""What verl's actor strategy changes on the GPU: FSDP1 (`strategy: fsdp`) or FSDP2 (`fsdp2`), as verl 0.9.1 wraps
each (workers/engine/fsdp/transformer_impl.py _build_fsdp_module; utils/fsdp_utils.py):

- FSDP1: FullyShardedDataParallel with auto_wrap_policy on the decoder-layer class (get_fsdp_wrap_policy,
  use_orig_params False): one flat parameter per decoder layer and the root's flat parameter holding the
  embedding, final norm and head, which FSDP1 does not reshard after forward (torch fsdp/_runtime_utils.py
  _post_forward_reshard: "Do not free the root's parameters in the post-forward"), so it stays gathered from the
  root's pre-forward to its post-backward. The repo's ledger (memory.estimate_memory: one unit per block plus a
  root holding embedding and head) prices this layout.
- FSDP2: fully_shard on each decoder layer, and on embed_tokens and lm_head apart when the embeddings are not tied
  (apply_fsdp2 / _select_fsdp2_wrap_targets), then the root: the embedding resharded after its forward, the head
  after its forward and again after its backward, whose post-backward reduce-scatters the head's gradient then
  (not at the end of the backward, as the root's does).
- The weight sync (get_per_tensor_param): FSDP2's state_dict() holds DTensor references and each tensor is
  gathered in turn (full_tensor()); FSDP1's runs its SHARDED_STATE_DICT hooks (verl sets it for world size > 1):
  torch fsdp/_state_dict_utils.py unshards each unit in turn in full precision (_flat_param.py
  _force_full_precision under SUMMON_FULL_PARAMS), the root's until its children are done, and keeps a clone of
  each parameter's local chunk (_create_chunk_sharded_tensor / _create_chunk_dtensor): a copy of the rank's shard
  in the stored dtype, alive while the tensors are sent. LoRA (not merged, verl's default) sends the adapters
  (engine_workers.py update_weights: get_per_tensor_param(base_sync_done=True) at every sync; utils/fsdp_utils.py
  collect_lora_params): FSDP1 gathers them inside FSDP.summon_full_params(module) - every unit unsharded at once,
  in full precision, beside the shard - or, with rollout.layered_summon, one unit at a time
  (layered_summon_lora_params); FSDP2 gathers only the adapters (full_tensor()). The adapters go to the host.

TRL (1.16, framework trl): accelerate's FSDP2 (utils/fsdp_utils.py fsdp2_prepare_model) wraps the decoder layers
and the model only, FSDP1's root layout; its weight sync (generation/vllm_generation.py) gathers FSDP2's parameters
one at a time (full_tensor()) and FSDP1's units one at a time (summon_full_params(module, recurse=False), children
first, in full precision), with no copy. With PEFT the same walk, between merge_adapter() and unmerge_adapter()
(_iter_named_params: "with self._dist.gather_params(...)", a no-op under FSDP): the merge runs on the sharded
parameters - under FSDP2 each linear's delta (lora_B @ lora_A, DTensor Shard(0)) is a shard of the weight, freed
after its in-place add, below the whole tensors the walk gathers next - and the merged base is sent, the adapters
skipped. In server mode rank 0 packs what it gathers (rl_trl_server.py).

So FSDP2 holds at most what FSDP1 holds in every phase (equal with tied embeddings, bar the weight sync's copy),
except on one-rank shard groups (fsdp_size 1), where FSDP1 runs NO_SHARD and its update holds no root copy at the
loss (loss_root_bytes) while FSDP2 keeps the root's own (the final norm) gathered.
The update's step time is each API's (rl_time.micro_step: step_time's fsdp2, the copies around the collectives of
fsdp_copies.py): FSDP2 copies every all-gather in and out and packs the gradients, FSDP1 gathers into its flat
parameter but casts and divides its whole flat gradient. So FSDP2's update is the faster with an fp32 actor (bf16
compute, fp32 reduction), FSDP1's with a bf16 actor or LoRA (Qwen2.5-7B on 8 x H100: tests/unit/test_rl_strategy.py).
"""

from __future__ import annotations

import dataclasses

from . import moe_lora
from .feasibility import Refusal
from .memory_types import MemoryBreakdown
from .model_spec import ModelSpec
from .rl_trl_server import packed_send_peak_bytes

# `settings` below: rl_settings.RlSettings (its strategy, framework and lora)


def separate_head_units(model: ModelSpec, settings) -> bool:
    """verl's FSDP2 with untied embeddings: embed_tokens and lm_head are units of their own."""
    return (settings.strategy == "fsdp2" and settings.framework == "verl" and not model.tied_embeddings
            and model.head_params > 0)


def loss_root_bytes(model: ModelSpec, settings, c: int, shard_ranks: int) -> int:
    """The root's parameters gathered at the loss (verl's entropy backward): FSDP1 the whole root. FSDP2 with the
    embedding and head units of their own (verl): the root's own (the final norm) - each of those resharded after
    its forward (a non-root unit's reshard_after_forward), the head gathered again at its pre-backward, once the
    loss's backward reaches it (head_backward_bytes). FSDP1 on a one-rank shard group runs NO_SHARD
    (torch/distributed/fsdp/_init_utils.py: world size 1) and holds none: its compute-dtype copy is freed in every
    unit's post-forward, the root's too (_flat_param.py post_reshard: "For NO_SHARD, _mp_shard is not freed in the
    post-unshard ... we delay the free until the reshard"), and re-made at its pre-backward; without mixed precision
    there is no copy. Both measured with verl's own update on gloo (tests/distributed/test_torchrun_verl_actor.py)."""
    if settings.strategy == "fsdp" and shard_ranks == 1:
        return 0
    if separate_head_units(model, settings):
        return model.root_other_params * c
    return model.root_params * c


def head_backward_bytes(model: ModelSpec, settings, c: int) -> int:
    """The head gathered for its own backward where it is a unit of its own (FSDP2, verl), beside the logits'
    gradient; 0 where the root holds it from the forward on (loss_root_bytes)."""
    return model.head_params * c if separate_head_units(model, settings) else 0


def forward_gathered_bytes(model: ModelSpec, settings, c: int) -> int:
    """A forward-only pass's gathered units: FSDP1 the root and two blocks (the running one and the one prefetched;
    the rate limiter's two all-gathers); FSDP2 the root's own parameters and the largest of the embedding with the
    first block prefetched, two blocks, or the head."""
    blocks = 2 * model.block_params
    if separate_head_units(model, settings):
        return (model.root_other_params + max(model.embedding_params + model.block_params, blocks,
                                              model.head_params)) * c
    return (model.root_params + blocks) * c


def fsdp2_backward(body: MemoryBreakdown, moment: str, model: ModelSpec, settings, c: int, r: int,
                   d: int) -> MemoryBreakdown:
    """The ledger's backward peak (FSDP1's root layout) for FSDP2's separate units, by the moment it is at
    (MemoryEstimate.peak_moment): a block's backward holds neither the embedding nor the head gathered, nor the
    head's unsharded gradient; during the last block's (d > 1) the head's reduce-scatter input is in flight, as a
    block's is for the block below it (memory.py reduce_scatter_above). At the loss the embedding is resharded. A
    block's forward (a forward moment) holds the root's own parameters only: the embedding resharded after its
    forward, the head not gathered yet. Any other moment (or an unnamed one) is left as FSDP1's: an upper bound."""
    if not separate_head_units(model, settings):
        return body
    head_trainable = not settings.lora   # PEFT's all-linear leaves the output layer out
    head_grad = model.head_params * c if head_trainable else 0
    if moment.startswith("backward of block"):
        last = moment.split()[3] == str(model.n_layers - 1)
        rs = model.head_params * r if last and head_trainable and d > 1 else 0
        return dataclasses.replace(body, unsharded_params=body.unsharded_params - model.embedding_params * c
                                   - model.head_params * c, unsharded_grads=body.unsharded_grads - head_grad,
                                   collective_buffers=body.collective_buffers + rs)
    if moment == "loss backward":
        return dataclasses.replace(body, unsharded_params=body.unsharded_params - model.embedding_params * c)
    if moment.startswith("forward"):
        return dataclasses.replace(body, unsharded_params=body.unsharded_params - model.embedding_params * c
                                   - model.head_params * c)
    return body


def weight_sync_bytes(model: ModelSpec, settings, params_bytes: int, p: int,
                      shard_ranks: int, sent: tuple[int, ...] = ()) -> tuple[dict, dict]:
    """The actor's transients in the weight sync beside its loaded shard, (the state-dict walk's, the send's), in the
    stored dtype p. FSDP2 (or LoRA, or unsharded): no walk; the send gathers one tensor at a time, the largest
    (embedding or head). verl's FSDP1 sharded: the walk holds the root unsharded beside its children's turns and a
    parameter's full clone before its chunk is kept (tensor/placement_types.py _replicate_to_shard: the chunk
    cloned, the whole freed) - the root with the largest tensor, or with a block and a clone no larger than it -
    while the copy of the shard grows; the send keeps that copy beside the tensor gathered. TRL's FSDP1: one unit
    at a time, the root or a block, LoRA's merged units alike (vllm_generation.py _iter_named_params: PEFT walks
    _iter_fsdp_params too); TRL's server mode (settings.server): rank 0 packs the `sent` tensors as it gathers them
    (rl_trl_server.packed_send_peak_bytes), beside FSDP1's unit. verl's FSDP1 LoRA: the whole model summoned
    (layered_summon: its largest unit), the adapters sent from the host; with model.lora.merge: merged_sync_bytes."""
    largest = max(model.embedding_params, model.head_params) * p
    unit = max(model.root_params, model.block_params) * p
    if settings.lora_merged:
        return merged_sync_bytes(model, settings.strategy, params_bytes, p, shard_ranks)
    trl_units = settings.framework == "trl" and settings.strategy != "fsdp2" and shard_ranks > 1
    if settings.framework == "trl" and settings.server:
        packed = {"packed broadcast buffers (rank 0)": packed_send_peak_bytes(list(sent), gathered=shard_ranks > 1)}
        return {}, {"gathered units": unit, **packed} if trl_units else packed
    if trl_units:
        return {}, {"gathered units": unit}
    if settings.lora and settings.strategy != "fsdp2" and settings.framework == "verl" and shard_ranks > 1:
        held = max(model.root_params, model.block_params) if settings.layered_summon else model.n_params
        return {"summoned params": held * p}, {}
    if settings.strategy == "fsdp2" or settings.lora or shard_ranks <= 1:
        return {}, {"gathered tensor": largest}
    copy = {"state-dict shard copy": params_bytes}
    return {**copy, "gathered units": fsdp1_walk_bytes(model, p)}, {**copy, "gathered tensor": largest}


def fsdp1_walk_bytes(model: ModelSpec, p: int) -> int:
    """FSDP1's SHARDED_STATE_DICT walk (weight_sync_bytes): the root unsharded beside its largest tensor's full
    clone, or beside a block and a clone no larger than it."""
    return model.root_params * p + max(max(model.embedding_params, model.head_params) * p, 2 * model.block_params * p)


def merged_sync_bytes(model: ModelSpec, strategy: str, params_bytes: int, p: int,
                      shard_ranks: int) -> tuple[dict, dict]:
    """verl 0.9.1's LoRA sync with model.lora.merge (workers/engine/fsdp/transformer_impl.py
    get_per_tensor_param -> _merged_lora_per_tensor_param, a generator the bucketed sender drains): inside
    utils/fsdp_utils.py merged_lora_context(backup_adapters=True) the base is backed up to the host
    (backup_base_model_weights: each shard cloned, then .cpu(); rl_host.py), PEFT merges every adapter
    (fsdp_merge_unmerge), state_dict() is walked and each tensor sent as .full_tensor().to(torch.bfloat16), then the
    base restored from the host. FSDP1 (sharded) merges inside FSDP.summon_full_params(module): the whole model
    unsharded in full precision at once beside PEFT's delta of the largest linear (peft lora/layer.py
    get_delta_weight: lora_B @ lora_A, then x scaling: two [out, in] tensors before the in-place add); its
    state-dict walk and send are then the full actor's (SHARDED_STATE_DICT). FSDP2: that summon is FSDP1's API, a
    no-op on FSDP2 modules, and the merge runs on the DTensor shards (each delta Shard(0): a shard of the weight);
    its send is the full actor's. Each sent tensor gathered in the stored dtype p and its bf16 copy (p = 4). Not
    counted: the backup's and the restore's one-shard GPU copies (one parameter's shard at a time). All-linear on an
    MoE: PEFT merges each expert stack's delta whole (moe_lora.merge_delta_elements)."""
    largest = max(model.embedding_params, model.head_params)
    send = {"gathered tensor": largest * p, **({"its bf16 copy": largest * 2} if p != 2 else {})}
    if strategy == "fsdp2" or shard_ranks <= 1:
        return {}, send
    # the largest adapted linear's delta (model: as trained; attention-only LoRA merges no MLP linear)
    adapted = (*model.lora_target_shapes, *(model.mlp_linear_shapes if model.lora_mlp else ()))
    linear = max((i * o for i, o in adapted), default=0)
    # all-linear on an MoE: a stacked expert's delta, one stack at a time (moe_lora.merge_delta_elements)
    delta = max(2 * linear, moe_lora.merge_delta_elements(model) if model.lora_moe else 0)
    merge = {"summoned params (merge)": model.n_params * p, "LoRA delta": delta * p}
    copy = {"state-dict shard copy": params_bytes}
    walk = {**copy, "gathered units": fsdp1_walk_bytes(model, p)}
    return max(merge, walk, key=lambda d: sum(d.values())), {**copy, **send}


# verl 0.9.1's rollout.checkpoint_engine.update_weights_bucket_megabytes (trainer/config/rollout/rollout.yaml: 2048)
SYNC_BUCKET_BYTES = 2048 << 20


def sync_bucket(settings, engine_version: str) -> dict:
    """The weight sync's transfer bucket on the trainer's GPU (verl 0.9.1, the engine in its own server process):
    vLLM, workers/rollout/vllm_rollout/vllm_rollout.py update_weights -> bucketed_weight_transfer.py
    BucketedWeightSender._init_buffer, torch.empty(bucket_size, uint8) on the GPU, shared with vLLM's worker by CUDA
    IPC, each tensor copied into it (one larger than it sent by its own IPC handle), freed after the sync; SGLang,
    sglang_rollout.py update_weights -> get_named_tensor_buckets: the gathered tensors themselves held up to that
    size (a bound). Allocated before the sender draws the first tensor: beside the send, and beside the walk of a
    merged LoRA (drawn from the generator; the other walks run before update_weights). verl of 2025 (engine version
    0.8) loaded each tensor in-process: none. TRL: its own sync (rl_trl_server.py)."""
    if settings.framework != "verl" or engine_version == "0.8":
        return {}
    return {"weight-transfer bucket": SYNC_BUCKET_BYTES}


def sync_refusals(settings) -> tuple[Refusal, ...]:
    """verl 0.9.1 raises at a LoRA adapter's first sync with rollout.layered_summon when the engine starts without
    the base (load_format dummy: settings.base_preloaded): utils/fsdp_utils.py collect_lora_params(layered_summon=
    True, base_sync_done=False), FSDP1 and FSDP2 alike, "To use layered_summon, you must make sure base-model is
    preloaded in vllm, e.g. let rollout.load_format=safetensors". A merged LoRA never asks for the base (engine_
    workers.py do_lora_base_sync only without model.lora.merge)."""
    if settings.framework != "verl" or not settings.lora_adapter or not settings.layered_summon \
            or settings.base_preloaded:
        return ()
    return (Refusal("load_format", "layered-summon-base",
                    f"{settings.load_format} under layered_summon: verl 0.9.1 raises at the first weight sync "
                    "(collect_lora_params: the LoRA base must be preloaded in the engine)",
                    "set --load-format safetensors (rollout.load_format), or drop --layered-summon"),)


def sync_moment(walk: dict, send: dict, held: dict, walk_engine: dict, send_engine: dict, reserved) -> tuple:
    """The weight sync's larger moment, (torch terms, engine terms): the walk (where there is one) beside the engine
    as verl wakes it first (verl 0.9.1 engine_workers.py: the weights resumed before get_per_tensor_param; 2025's
    FSDPVLLMShardingManager.__enter__: state_dict() before wake_up()), or the send; reserved(torch, engine): a
    moment's GPU bytes."""
    moments = [({**held, **send}, send_engine)] + ([({**held, **walk}, walk_engine)] if walk else [])
    return max(moments, key=lambda m: reserved(*m))
