"""Memory outside the training step: loading, checkpoint save and resume, per rank and per node.

Each way returns an OutsideBytes: the host RAM of rank 0 (which loads or gathers a full state dict in some ways) and
of every other rank, and the GPU transient the way adds on top of the resident sharded states. Sources (torch 2.13,
read in its code):
- every rank loads (`from_pretrained` / `torch.load` on each rank before wrapping): the full model in host RAM on
  each rank. FSDP2 `set_model_state_dict(full_state_dict=True)` (`_distribute_state_dict`) moves each tensor to the
  device and keeps a new local shard of it (distribute_tensor) until load_state_dict copies them in: a shard of the
  model beside the params (measured on CPU: docs/accuracy.md). FSDP1 moves a unit to the device and flattens it
  (flat_param.py flatten_tensors: torch.cat beside the originals): two copies of the largest unit.
- rank 0 loads and broadcasts: FSDP1 `sync_module_states=True` (HF `cpu_ram_efficient_loading`: the other ranks
  build on meta) broadcasts unit by unit on the GPU; FSDP2 `set_model_state_dict(full_state_dict=True,
  broadcast_from_rank0=True)` (torch/distributed/_state_dict_utils.py `_broadcast_state_dict`: "Broadcast every
  tensor to avoid OOM") one tensor at a time, each rank keeping its slice.
- meta-device init + DCP load of a sharded checkpoint: FileSystemReader `torch.load`s one storage item (a rank's
  slice of one tensor) and copies it into place: one item in flight for the params; for the optimizer state two
  (measured at two sizes on CPU, not traced to a line of torch's code: both of a parameter's Adam states, likely).
- FSDP1's DCP save and resume through torch.distributed.checkpoint.state_dict (get_state_dict / set_state_dict, what
  --emit fsdp1 writes; Lightning's and accelerate's sharded FSDP1 saves run the same hooks): a copy of the rank's
  shard, not the live tensors as FSDP2's DTensors are (_fsdp1_dcp has the mechanism, line by line).
- DCP save: FileSystemWriter's `_OverlappingCpuLoader` copies GPU tensors to host up to per_thread_copy_ahead
  (10 MB, one thread) ahead of the writer, a whole item at a time; CPU tensors are written where they are.
- async DCP (`async_save`): DefaultStager copies the rank's whole state dict (its shard of params and optimizer
  state) to host first; torchtitan's async_with_pinned_mem keeps that copy pinned between saves.
- FULL_STATE_DICT with offload_to_cpu + rank0_only (FSDP1) / get_model_state_dict(full_state_dict, cpu_offload)
  (FSDP2): rank 0 ends with the whole state dict in host RAM; the device gathers one tensor (FSDP2) or one unit
  (FSDP1, whose root unit - embedding and head - stays gathered while its children are saved) at a time; the
  consolidated optimizer state (FSDP.optim_state_dict) adds its full size on rank 0. Gathered over gloo (CPU runs)
  each gather holds two copies (all_gather's output list and the tensor built from it; measured); NCCL's
  all_gather_into_tensor writes one (GPU-only, not measured here).
- HF `save_pretrained` of that full state dict: safetensors 0.8 `save_file` writes from the tensors' pointers
  (`_flatten_as_ptr`, no bytes copy): rank 0's gathered params only.
- sync DCP's plans and metadata (dcp_plan_bytes): Python objects per state-dict key and per chunk (a key's slice on
  one rank), on every rank's host even where the tensors are on the GPU. state_dict_saver._save_state_dict: each
  rank's local plan (a WriteItem per key: MetadataIndex, TensorWriteData, ChunkStorageMetadata, TensorProperties)
  is gathered, pickled, to the coordinator (_DistWrapper.reduce_scatter -> gather_object), which unpickles every
  rank's, builds the global plan (DefaultSavePlanner.create_global_plan: a new WriteItem per chunk) and Metadata (a
  TensorStorageMetadata per key, a ChunkStorageMetadata per chunk), gathers every rank's WriteResults (a
  MetadataIndex and _StorageInfo per chunk, FileSystemWriter.finish's storage_data) and broadcasts the Metadata:
  each rank unpickles the whole of it (broadcast_object: the received bytes copied twice, tobytes and a slice).
  The peak is that broadcast on every rank (traced phase by phase): rank 0 pickling it beside every rank's plans,
  the others unpickling it beside their own. Figures: tracemalloc peaks (CPython 3.11, torch 2.13) over one
  dcp.save of calibration.reference Llamas with FSDP2 and AdamW, 2 / 6 / 18 blocks (96 / 240 / 672 keys) on 2, 4
  and 8 gloo ranks (9 runs, docs/accuracy.md), split by least squares into bytes per chunk, per key and a fixed
  part: a measurement of these object kinds, not fitted to the tests' rows. The others' within 4 % of each run;
  rank 0's within 12 % but two runs (-20 %, +36 %: pickling's memo and buffer grow by doubling).
Ignored: the OS page cache of checkpoint files (reclaimable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from . import qlora
from .specs import Finetune, ModelSpec, TrainingSpec
from .units import DTYPE_BYTES

DCP_COPY_AHEAD_BYTES = 10_000_000  # FileSystemWriter(per_thread_copy_ahead=10_000_000), thread_count=1
# sync DCP's Python objects (module docstring): (per chunk, per key, fixed) bytes, rank 0 (the coordinator) and the
# others; tracemalloc on CPython 3.11 / torch 2.13 (docs/accuracy.md, "Memory outside the step")
DCP_OBJECT_BYTES_RANK0 = (2_996, 4_713, 303_402)
DCP_OBJECT_BYTES_OTHERS = (2_115, 3_350, 136_588)
PARAM_GROUP_KEYS = 12  # torch.optim.AdamW's param_groups entries, each a key DCP writes once (lr, betas, ...)


class LoadWay(str, Enum):
    EVERY_RANK = "every-rank"            # each rank reads the whole checkpoint
    RANK0_BROADCAST = "rank0-broadcast"  # sync_module_states / cpu_ram_efficient_loading / broadcast_from_rank0
    META_DCP = "meta-dcp"                # meta-device init, then dcp.load of a sharded checkpoint


class SaveWay(str, Enum):
    DCP = "dcp"                          # dcp.save: each rank writes its shard
    DCP_ASYNC = "dcp-async"              # dcp.async_save: the shard staged to host, written in the background
    FULL_RANK0 = "full-state-dict"       # FULL_STATE_DICT, offload_to_cpu + rank0_only: rank 0 holds all of it
    SAVE_PRETRAINED = "save-pretrained"  # HF save_pretrained of rank 0's full state dict (params only)


@dataclass(frozen=True)
class StateSizes:
    """What the ways move, in bytes: the whole model's params as stored, its optimizer state, the largest tensor
    and the largest FSDP unit (a block, or the root with embedding and head), over `ranks` ranks that share one
    copy of the state (FSDP's shard group x tp x pp)."""

    params_bytes: int
    optimizer_bytes: int
    largest_tensor_bytes: int
    largest_unit_bytes: int
    ranks: int
    pretrained_bytes: int = 0  # the pretrained weights as read (their file's dtype); 0: params_bytes
    root_unit_bytes: int = 0   # FSDP1's root unit (embedding, head, final norm); 0: largest_unit_bytes
    block_unit_bytes: int = 0  # one block's unit; 0: largest_unit_bytes
    sharded_keys: int = 0      # state-dict tensors sharded over the ranks (a chunk on each): params, their states
    replicated_keys: int = 0   # keys written once (Adam's step per trained tensor, param_groups' entries)

    def shard(self, n_bytes: int) -> int:
        return math.ceil(n_bytes / self.ranks)

    @property
    def state_bytes(self) -> int:
        return self.params_bytes + self.optimizer_bytes

    @property
    def largest_tensor_state_bytes(self) -> int:
        """The largest tensor's optimizer states (Adam's two, SGD's one: torch's states are zeros_like the param, in
        its dtype). Exact for a full fine-tune; under adapters, where the largest tensor is frozen, an overestimate."""
        return round(self.largest_tensor_bytes * self.optimizer_bytes / self.params_bytes)

    @classmethod
    def of(cls, model: ModelSpec, training: TrainingSpec, param_dtype: str, ranks: int,
           frozen_dtype: str | None = None) -> "StateSizes":
        """LoRA: the base stored in frozen_dtype (the compute dtype under mixed precision), adapters in
        param_dtype; only the adapters carry optimizer state. QLoRA: the base's block linears packed as
        cost_models/qlora.py stores them (loading quantizes shard by shard: one checkpoint file's bf16 weights in
        flight, not counted). Matrices: embedding, head, q / o, the MLP's, an MoE's stacked experts."""
        p = DTYPE_BYTES[param_dtype]
        f = DTYPE_BYTES[frozen_dtype or param_dtype]
        h = model.hidden_size
        largest = max(model.embedding_params, model.head_params, model.q_dim * h, model.ffn_hidden_size * h)
        if model.moe is not None and model.moe.stacked_expert_tensors:  # one tensor holds every routed expert's
            largest = max(largest, *(rows * per_row for rows, per_row in model.moe.stacked_expert_tensors))
        opt = training.optimizer.state_bytes_per_param(param_dtype)
        keys = _state_keys(model, training)
        if training.finetune.adapters:
            adapters_block = model.lora_params_per_block(training.lora_rank)
            adapters = model.lora_params(training.lora_rank)  # an MoE's dense blocks' own (all-linear)
            base, block = model.n_params * f, model.block_params * f
            if training.finetune is Finetune.QLORA:  # block linears packed 4-bit + their QuantStates (qlora.py)
                base = qlora.stored_base_bytes(model, f) + qlora.replicated_bytes(model, training.double_quant)
                block -= qlora.saving_bytes(qlora.quantized_per_block(model), f)
                largest = max(model.embedding_params, model.head_params)  # left unquantized, in the compute dtype
            block, root = block + adapters_block * p, model.root_params * f
            return cls(base + adapters * p, round(adapters * opt), largest * f, max(block, root), ranks,
                       root_unit_bytes=root, block_unit_bytes=block, sharded_keys=keys[0], replicated_keys=keys[1])
        block, root = model.block_params * p, model.root_params * p
        return cls(model.n_params * p, round(model.n_params * opt), largest * p, max(block, root), ranks,
                   root_unit_bytes=root, block_unit_bytes=block, sharded_keys=keys[0], replicated_keys=keys[1])


def _state_keys(model: ModelSpec, training: TrainingSpec) -> tuple[int, int]:
    """(sharded, replicated) keys of the model's and optimizer's state dict as DCP flattens them: each param tensor
    (pipeline_allocations.param_tensors' per block; embedding, head, final norm) and each trained tensor's states
    (Adam's two, SGD's momentum) sharded; Adam's `step` (a scalar tensor per trained tensor) and param_groups'
    entries written once. Trained: every tensor, or LoRA's A and B of each target."""
    from .pipeline_allocations import param_tensors  # lazy: a heavy module, needed for this count only

    root = 1 + (model.head_params > 0) + (model.root_other_params > 0)
    tensors = model.n_layers * len(param_tensors(model, model.block_params)) + root
    trained = model.n_layers * len(model.lora_tensor_elements(1)) + model.lora_dense_delta(1, tensors=True) \
        if training.finetune.adapters else tensors
    adam = training.optimizer.name.startswith("ADAM")  # AdamW 8-bit counted as AdamW
    return tensors + (2 if adam else 1) * trained, (trained if adam else 0) + PARAM_GROUP_KEYS


@dataclass(frozen=True)
class OutsideBytes:
    """Host RAM of rank 0 and of each other rank, and the transient on each GPU, of one way."""

    rank0_host_bytes: int
    rank_host_bytes: int
    gpu_bytes: int

    def node_bytes(self, ranks_per_node: int) -> int:
        """The busiest node's host RAM: rank 0's node."""
        return self.rank0_host_bytes + (ranks_per_node - 1) * self.rank_host_bytes


def dcp_plan_bytes(sizes: StateSizes) -> tuple[int, int]:
    """(rank 0, each other rank): sync DCP's plans and metadata (module docstring), from the chunks (a sharded
    key's slice on each rank, a replicated key's once) and keys of one save."""
    keys = sizes.sharded_keys + sizes.replicated_keys
    if not keys:
        return 0, 0
    chunks = sizes.sharded_keys * sizes.ranks + sizes.replicated_keys
    return tuple(round(per_chunk * chunks + per_key * keys + fixed)
                 for per_chunk, per_key, fixed in (DCP_OBJECT_BYTES_RANK0, DCP_OBJECT_BYTES_OTHERS))


def _gathered_bytes(sizes: StateSizes, fsdp2: bool) -> int:
    """What one step of a full gather or broadcast holds unsharded: a tensor (FSDP2) or a unit (FSDP1)."""
    return sizes.largest_tensor_bytes if fsdp2 else sizes.largest_unit_bytes


@dataclass(frozen=True)
class Fsdp1Dcp:
    """FSDP1's DCP save or resume through torch 2.13's get_state_dict / set_state_dict, term by term (bytes per rank):
    held: get_state_dict's copy of the rank's shard (params and optimizer state; params only for a params-only load);
    gather: one unit's state gathered whole beside it (get_state_dict's optimizer part); model: set_state_dict's model
    part (the root's params gathered and unsharded beside a block's); states: its optimizer part (the new shard of the
    states beside the largest tensor's states gathered whole); gloo_states: what gloo adds to `states` on rank 0."""

    held: int
    gather: int
    model: int
    states: int
    gloo_states: int = 0


def _fsdp1_dcp(sizes: StateSizes, saving: bool, optimizer: bool, on_gpu: bool) -> Fsdp1Dcp:
    """FSDP1's DCP save (saving) or load through torch 2.13's get_state_dict / set_state_dict. Read in
    torch/distributed:
    - get_state_dict runs FSDP1's SHARDED_STATE_DICT hooks: fsdp/_state_dict_utils.py _sharded_post_state_dict_hook
      chunks each unsharded param and _shard_utils.py _create_chunk_sharded_tensor keeps `chunks[rank].clone()`; the
      optimizer's (_optim_utils.py _allgather_orig_param_states) all-gathers each state of a unit into one
      `gathered_tensor` of the unit's padded size on the compute device and keeps each param's chunk, cloned
      (_ext_chunk_tensor). Held: a copy of the rank's shard of params and states (on the compute device unless
      StateDictOptions(cpu_offload=True): checkpoint/state_dict.py _verify_options passes it to
      ShardedStateDictConfig / ShardedOptimStateDictConfig(offload_to_cpu), and each chunk moves to host as it is
      made); transient: one state of the largest unit (the root, embedding and head, in a Llama) on the device, two
      on gloo (all_gather's extra copy, measured). dcp.save then writes these tensors as it writes FSDP2's.
    - set_state_dict's model part (_sharded_pre_load_state_dict_hook) moves each param's shard to the compute device
      (`local_tensor.to(fsdp_state.compute_device)`), all-gathers it whole there into the state dict and unshards the
      unit's flat param (_enter_unshard_params_ctx, writeback) to copy them in; the root's stay until its post-load
      hook, while each block does the same: 2 x root + 2 x block, each gather one copy more on gloo. Its optimizer
      part (_optim_utils.py _shard_orig_param_state) gathers every state of a param whole (_state_dict_utils.py
      _gather_state_dict on the compute device, then `output_tensor.to(local_shard_device)`: back to where the loaded
      shard is) and clones this rank's slice there: the new shard of the states beside the largest tensor's states;
      on gloo a rank that does not hold the last tensor's slice (rank 0 of 2: the head is rank 1's) also holds
      all_gather's copy of the last state. torch.optim.Optimizer.load_state_dict then casts each new state to its
      param's device (_process_value_according_to_param_policy: `value.to(device=param.device)`, no copy where it
      is there already) in a new dict, the old states freed only at its __setstate__. The caller's copy of the
      loaded shard stays until it returns.
    Ignored: the padding of flat params, the chunks' torch.cat of a unit's local states (not seen on gloo), the
    device copy of one param's shard in flight (.to(compute_device) before its all-gather)."""
    copies = 2 if on_gpu else 3
    root, block = sizes.root_unit_bytes or sizes.largest_unit_bytes, sizes.block_unit_bytes or sizes.largest_unit_bytes
    held = sizes.shard(sizes.state_bytes if optimizer or saving else sizes.params_bytes)
    gather = (copies - 1) * sizes.largest_unit_bytes if optimizer or saving else 0
    if saving:
        return Fsdp1Dcp(held, gather, 0, 0)
    model = max(copies * root, 2 * root + copies * block)
    if not optimizer:
        return Fsdp1Dcp(held, gather, model, 0)
    states = sizes.shard(sizes.optimizer_bytes) + sizes.largest_tensor_state_bytes
    return Fsdp1Dcp(held, gather, model, states, 0 if on_gpu else sizes.largest_tensor_bytes)


def _fsdp1_resume(sizes: StateSizes, optimizer: bool, on_gpu: bool, host_state_dict: bool,
                  items: int) -> OutsideBytes:
    """FSDP1's DCP resume (get_state_dict, dcp.load into it, set_state_dict; items: a reader's storage items in
    flight on host). On a CPU run (gloo) every term is host memory. On a GPU run with the state dict on the device
    (get_state_dict's default): its copy of the shard and every transient on the GPU. With
    StateDictOptions(cpu_offload=True) (what --emit fsdp1 and accelerate's FSDP1 SHARDED_STATE_DICT, whose
    ShardedStateDictConfig / ShardedOptimStateDictConfig default to offload_to_cpu=True, do): the copy of the shard
    is host memory, and so are the new shard of the states and the gathered states moved back to it
    (_gather_state_dict's `.to(local_shard_device)`); the GPU holds, one at a time, get_state_dict's gathered unit
    state, set_state_dict's gathered and unsharded root and block, and the new shard of the states as
    Optimizer.load_state_dict copies it in (beside the old, freed after). Ignored: one param's state gathered on the
    device during the flatten (below the new shard of all of them)."""
    t = _fsdp1_dcp(sizes, saving=False, optimizer=optimizer, on_gpu=on_gpu)
    if not on_gpu:
        return OutsideBytes(t.held + max(t.gather, t.model, t.states + t.gloo_states, items),
                            t.held + max(t.gather, t.model, t.states, items), 0)
    if not host_state_dict:  # FileSystemReader reads items to host and copies them into the device tensors
        return OutsideBytes(items, items, t.held + max(t.gather, t.model, t.states))
    host = t.held + max(items, t.states)
    new_states = sizes.shard(sizes.optimizer_bytes) if optimizer else 0
    return OutsideBytes(host, host, max(t.gather, t.model, new_states))


def load_bytes(way: LoadWay, sizes: StateSizes, fsdp2: bool = True, on_gpu: bool = True,
               optimizer: bool = False, host_state_dict: bool = True) -> OutsideBytes:
    """Loading the params (optimizer: with the optimizer state, a resume). on_gpu False: a CPU run (gloo), where
    the device's transients are host memory and moving a tensor to the device copies nothing. host_state_dict:
    FSDP1's DCP state dict made with StateDictOptions(cpu_offload=True) (_fsdp1_resume), else on the GPU."""
    full = sizes.state_bytes if optimizer else sizes.pretrained_bytes or sizes.params_bytes
    one = _gathered_bytes(sizes, fsdp2)
    if way is LoadWay.META_DCP:  # a storage item (a rank's slice of a tensor) in flight; the optimizer's state: two
        items = (2 if optimizer else 1) * sizes.shard(sizes.largest_tensor_bytes)  # (measured, docs/accuracy.md)
        if fsdp2:
            return OutsideBytes(items, items, 0)
        return _fsdp1_resume(sizes, optimizer, on_gpu, host_state_dict, items)
    if way is LoadWay.EVERY_RANK:
        # FSDP2: the new local shards (and one full tensor moved over); FSDP1: a unit and its flat copy
        device = sizes.shard(full) + one if fsdp2 else 2 * one
        if on_gpu:
            return OutsideBytes(full, full, device)
        return OutsideBytes(full + device - one, full + device - one, 0)
    # rank 0 reads; the others receive each tensor (FSDP1: each unit, flattened) and keep their slice
    device = one if fsdp2 else 2 * one
    return OutsideBytes(full, 0, device) if on_gpu else OutsideBytes(full, device, 0)


def save_bytes(way: SaveWay, sizes: StateSizes, fsdp2: bool = True, on_gpu: bool = True,
               offloaded: bool = False, host_state_dict: bool = True) -> OutsideBytes:
    """One checkpoint save of params and optimizer state (save_pretrained: params only). on_gpu False: a CPU run
    (gloo), where the state is host memory already and a gather's device copy is a host allocation. offloaded: the
    state sits in host RAM (CPU offload) on a GPU run: DCP writes it in place; a full gather still runs on the GPU.
    host_state_dict: FSDP1's DCP state dict made with StateDictOptions(cpu_offload=True), else on the GPU."""
    if way in (SaveWay.DCP, SaveWay.DCP_ASYNC):  # both plan and gather the same objects (dcp_plan_bytes)
        tensors = _dcp_tensor_bytes(way, sizes, fsdp2, on_gpu, offloaded, host_state_dict)
        rank0, others = dcp_plan_bytes(sizes)
        return OutsideBytes(tensors.rank0_host_bytes + rank0, tensors.rank_host_bytes + others, tensors.gpu_bytes)
    full = sizes.params_bytes if way is SaveWay.SAVE_PRETRAINED else sizes.state_bytes
    one = _gathered_bytes(sizes, fsdp2)
    if on_gpu:  # FSDP1's offload_to_cpu copies the gathered unit to host before cloning it into the state dict
        return OutsideBytes(full + (0 if fsdp2 else one), 0, one)
    return OutsideBytes(full + one, 2 * one, 0)  # gloo: two copies per gather; rank 0 keeps one of them


def _dcp_tensor_bytes(way: SaveWay, sizes: StateSizes, fsdp2: bool, on_gpu: bool, offloaded: bool,
                      host_state_dict: bool) -> OutsideBytes:
    """A DCP save's tensor copies (save_bytes' arguments)."""
    shard = sizes.shard(sizes.state_bytes)
    if way is SaveWay.DCP:
        in_place = offloaded or not on_gpu
        staged = 0 if in_place else min(shard, DCP_COPY_AHEAD_BYTES + sizes.shard(sizes.largest_tensor_bytes))
        if not fsdp2:
            t = _fsdp1_dcp(sizes, saving=True, optimizer=True, on_gpu=on_gpu)
            if not on_gpu:
                return OutsideBytes(t.held + t.gather, t.held + t.gather, 0)
            if not host_state_dict:  # the copy of the shard on the GPU, written through DCP's copy-ahead
                return OutsideBytes(staged, staged, t.held + t.gather)
            # get_state_dict(..., StateDictOptions(cpu_offload=True)), as the fsdp1 snippet saves: each cloned
            # chunk moves to host as it is made (ShardedStateDictConfig(offload_to_cpu=True)); the device keeps
            # the gather of one unit's state. dcp.save writes the host copies in place.
            return OutsideBytes(t.held, t.held, t.gather)
        return OutsideBytes(staged, staged, 0)
    return OutsideBytes(shard, shard, 0)  # async: the staged shard


def first_step_reserved_bytes(activation_bytes: list[int], state_bytes: list[int],
                              temporary_bytes: list[int]) -> tuple[int, int]:
    """(reserved after step 1, reserved after step 2) of a step whose forward allocates activation_bytes (freed by
    the end of its backward), whose first optimizer step creates state_bytes (Adam's exp_avg and exp_avg_sq per
    parameter shard, created lazily in _init_group before the foreach update) and then allocates and frees the
    foreach temporaries. Replayed through the caching allocator model (caching_allocator.py): a state tensor takes
    a cached block of the forward's segments only where one is large enough (best fit, no merging across
    segments); what it takes, the second forward must find in new segments. The allocated peak of both steps is the
    same; the reserved one can grow at step 1 (states in new segments) or at step 2 (activations displaced)."""
    from .caching_allocator import replay

    def step(tag: str) -> list:
        acts = [("alloc", f"{tag}a{i}", n) for i, n in enumerate(activation_bytes)]
        temps = [("alloc", f"{tag}t{i}", n) for i, n in enumerate(temporary_bytes)]
        return (acts + [("free", f"{tag}a{i}") for i in range(len(activation_bytes))] + temps
                + [("free", f"{tag}t{i}") for i in range(len(temporary_bytes))])

    first = step("1")
    n_acts = 2 * len(activation_bytes)
    first[n_acts:n_acts] = [("alloc", f"s{i}", n) for i, n in enumerate(state_bytes)]
    both = replay(first + step("2"), cuts=(len(first),))
    return both.reserved_at_cuts[0], both.peak_reserved_bytes
