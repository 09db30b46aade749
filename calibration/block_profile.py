"""Block memory profile: one block's activation memory traced from the real model, for families that have
no formula in cost_models/activations.py.

    terms, seconds = profile_block(hf_config, block_class=..., compute_dtype="bf16", attention="sdpa",
                                   seq_len=4096, hidden_size=h, vocab_size=V, n_dense_layers=0)

The Hugging Face model is built as the trace tier builds it (calibration.build: the attention and experts
kernels of a GPU run) at full width but a few layers - one period of its layer pattern (at least 2) plus
2, after an MoE model's leading dense layers - inside FakeTensorMode: no memory, no FLOPs. It runs
forward and backward, no FSDP, parameters in the compute dtype (what FSDP's mixed precision gathers),
under the trace tier's mask and kernel choices, with calibration.memtrack's per-module moments:

    saved    = activations at the next block's pre-forward - at the block's own (steady state: its output
               has replaced its input; the first block, whose input the model holds, is skipped)
    backward = (activation, gradient) bytes at every allocation of the block's backward, above its
               pre-backward, + the incoming gradient (c*h), which the memory model counts in the working set

which is what cost_models.memory calls a block's saved bytes and its backward moments. Three
(micro-batch, sequence) points - (1, s/2), (1, s), (2, s) - fit k + tokens x (a + q x s) for the saved
bytes (k dropped: it is no tensor of a token) and for each backward moment, matched across the points by
position; the moments that can be the peak for 1-128 sequences are kept. Saved bytes are the mean over
the profiled blocks (a layer pattern repeats). Leading dense blocks (DeepSeek) have no steady state: their
saved bytes are the sparse ones plus the difference of what each kind adds by its own post-forward.
The blocks' other inputs (masks, rotary tables, positions), which a checkpointed block keeps for its
recompute, are summed per storage from their forward pre-hooks at four points (the three runs above and
a no-grad forward at (2, s/2)) and fitted as s(a + a'b) + s^2(q + q'b): ActivationTerms.checkpoint_held.
One more forward and backward counts a steady-state block's operators for the step time, a dense one's in
the same run (calibration/block_ops.py): ActivationTerms.operators. Not in a tracked run: the counting's
full backward hooks move the tracker's backward moments (DeepSeek's, measured); the pre-hooks recording
the held inputs add no tensor, and read the tracked runs (the figures of a forward each, to the byte).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from cost_models.specs import ActivationTerms, BackwardMoment
from cost_models.units import DTYPE_BYTES

from .build import build_model
from .memtrack import MemoryTracker

MAX_PROFILED_LAYERS = 8   # a layer pattern longer than this is profiled on its first 8 layers
MIN_SEQ_LEN = 32


# layer-index lists a config may hold (which layers are sparse / dense), cut by index rather than position
_INDEX_LISTS = ("moe_layers", "mlp_only_layers")


def _per_layer_fields(hf_config: dict) -> dict:
    """The config's per-layer lists as transformers completes them (Llama 4 derives layer_types and
    no_rope_layers, Gemma 3 layer_types): every list as long as the model is deep, and the layer-index
    lists (as membership). A config transformers cannot complete contributes only its own lists."""
    from .build import hf_config_object, quiet_transformers

    try:
        fields = quiet_transformers(lambda: hf_config_object(hf_config)).to_dict()
    except Exception:  # noqa: BLE001 - the build itself reports what is wrong with the config
        fields = hf_config
    n = fields.get("num_hidden_layers", hf_config.get("num_hidden_layers"))
    per_layer = {key: value for key, value in fields.items() if isinstance(value, list) and len(value) == n}
    for key in _INDEX_LISTS:  # as per-layer membership, so that a pattern repeats by position like the rest
        if isinstance(fields.get(key), list) and fields[key]:
            per_layer[key] = [i in fields[key] for i in range(n)]
    return per_layer


def _layer_kinds(per_layer: dict, n_layers: int) -> list[tuple]:
    """Each layer's kind: its entry in every per-layer list."""
    return [tuple(repr(value[i]) for _, value in sorted(per_layer.items())) for i in range(n_layers)]


def profiled_layers(hf_config: dict, n_dense_layers: int = 0) -> int:
    """Layers to build: one period of the layer pattern after the leading dense layers (at least 2, at most
    MAX_PROFILED_LAYERS), plus those leading dense layers of an MoE, plus 2 (more than the model has, if
    need be: a block's figures do not depend on the depth)."""
    kinds = _layer_kinds(_per_layer_fields(hf_config), hf_config["num_hidden_layers"])[n_dense_layers:]
    period = next((p for p in range(1, len(kinds) + 1) if all(kinds[i] == kinds[i % p] for i in range(len(kinds)))),
                  MAX_PROFILED_LAYERS)
    # + 2: the first block (its input is held by the model's forward) and the one after the last measured
    return n_dense_layers + min(max(2, period), MAX_PROFILED_LAYERS) + 2


def _reduced_config(hf_config: dict, n_layers: int) -> dict:
    """The config dict at n_layers, its per-layer lists made explicit and cut (or repeated) to match."""
    fields = {**hf_config, "num_hidden_layers": n_layers, "use_cache": False}
    for key, value in _per_layer_fields(hf_config).items():
        cut = [value[i % len(value)] for i in range(n_layers)]
        fields[key] = [i for i, member in enumerate(cut) if member] if key in _INDEX_LISTS else cut
    return fields


def _blocks(model, block_class: str) -> list:
    return [m for m in model.modules() if type(m).__name__ == block_class]


def _measure(model, blocks: list, n_dense: int, vocab_size: int, micro_batch: int, seq_len: int,
             incoming_bytes: int, during=contextlib.nullcontext()):
    """For one (micro_batch, seq_len) forward + backward, (saved, backward) of the sparse (or only) blocks
    and of the leading dense ones (None without): saved = mean bytes a block saves, backward = its
    backward's moments as (activation, gradient) bytes above what was live at its pre-backward. `during`
    is entered around the forward and backward, inside the tracker: what else reads the same run (the
    blocks' other inputs) and saves a run of its own."""
    from .gpu_run_choices import cuda_kernel_choices

    ids = torch.randint(0, vocab_size, (micro_batch, seq_len))
    tracker = MemoryTracker(model, vocab_size=vocab_size)
    tracker.watch_backward(blocks)
    with tracker:
        with cuda_kernel_choices(), during:
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            del out
    for p in model.parameters():
        p.grad = None
    moments = [tracker.module_moments(block) for block in blocks]

    def backward_of(index: int) -> list[tuple[int, int]]:
        pre_acts, pre_grads = moments[index]["pre_backward"]
        # the incoming gradient is live at pre-backward; the memory model counts it in the working set
        return [(acts - pre_acts + incoming_bytes, grads - pre_grads)
                for acts, grads in tracker.backward_moments(blocks[index])]

    def own(index: int) -> int:
        """What the block added by its post-forward, its output aside (the caller still holds its input)."""
        m = moments[index]
        return m["post_forward"][0] - m["pre_forward"][0] - m["output"][0]

    sparse = list(range(n_dense, len(blocks)))
    # Steady state: what one block adds by the time the next starts (its output replaces its input). The
    # first block is skipped: the model's forward holds the embedding output (its input) to the end.
    first = max(sparse[0], 1)
    saved = [moments[j + 1]["pre_forward"][0] - moments[j]["pre_forward"][0] for j in range(first, len(blocks) - 1)]
    mean_saved = sum(saved) / len(saved)
    result = (mean_saved, [backward_of(j) for j in range(first, len(blocks) - 1)])
    if not n_dense:
        return result, None
    # Dense blocks lead, so none has a steady state: the sparse blocks' steady figure plus the difference of
    # what each kind adds by its own post-forward (whether a block saves its input cancels out).
    sparse_own = sum(own(j) for j in range(first, len(blocks) - 1)) / len(saved)
    dense_saved = mean_saved + sum(own(j) for j in range(n_dense)) / n_dense - sparse_own
    return result, (dense_saved, [backward_of(j) for j in range(n_dense)])


@contextlib.contextmanager
def _held_by_checkpointing(blocks: list, storages: dict[int, int]):
    """Records into `storages` (storage -> bytes) the blocks' inputs besides their hidden states (masks, rotary
    tables, positions), each storage once, in the forwards run inside: what checkpointed blocks keep alive
    for their recompute."""
    from torch.utils._pytree import tree_leaves

    def record(_module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        skip = hidden.untyped_storage()._cdata if isinstance(hidden, torch.Tensor) else None
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage()._cdata != skip:
                storages[leaf.untyped_storage()._cdata] = leaf.untyped_storage().nbytes()

    handles = [block.register_forward_pre_hook(record, with_kwargs=True) for block in blocks]
    try:
        yield storages
    finally:
        for handle in handles:
            handle.remove()


def _fit_held(points: list[tuple[int, int]], held: list[int]) -> tuple[float, float, float, float]:
    """(a, ab, q, qb) with bytes = s*(a + ab*b) + s^2*(q + qb*b) through four (b, s) points."""
    import numpy as np

    rows = np.array([[s, b * s, s * s, b * s * s] for b, s in points], dtype=float)
    return tuple(float(x) for x in np.linalg.solve(rows, np.array(held, dtype=float)))


def profile_block(hf_config: dict, *, block_class: str, compute_dtype: str, attention: str, seq_len: int,
                  hidden_size: int, vocab_size: int, n_dense_layers: int = 0, lora_spec=None,
                  lora_rank: int = 0) -> tuple[ActivationTerms, float]:
    """Fitted per-token terms of one block (see the module docstring) and the seconds the profile took.
    With n_dense_layers (an MoE's leading dense blocks) the sparse blocks after them are profiled. lora_rank > 0:
    the block under LoRA, peft's rank-r adapters on lora_spec's (a ModelSpec) lora_shapes and the base frozen
    (calibration/lora.py, as the trace tier adds them), adapters in the compute dtype (FSDP gathers them so);
    no operator inventory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .apply import TORCH_DTYPES
    from .block_ops import count_block_operators
    from .gpu_run_choices import _grouped_mm_shapes_any_dtype, _real_run_masking, cuda_kernel_choices

    started = time.perf_counter()
    n_layers = profiled_layers(hf_config, n_dense_layers)
    config = _reduced_config(hf_config, n_layers)
    c = DTYPE_BYTES[compute_dtype]
    long_s = max(MIN_SEQ_LEN, seq_len)
    points = ((1, max(MIN_SEQ_LEN, long_s // 2)), (1, long_s), (2, long_s))
    saved, backward = [], []
    lora_model = _lora_model(config, attention, compute_dtype, block_class, lora_spec, lora_rank) if lora_rank else None
    with _real_run_masking(True), _grouped_mm_shapes_any_dtype(), FakeTensorMode(allow_non_fake_inputs=False):
        if lora_model is not None:
            from .fake_world import _meta_to_fake

            model = lora_model
            _meta_to_fake(model)
        else:
            model = build_model(None, config, attention=attention, device="cpu", dtype=TORCH_DTYPES[compute_dtype])
        model.train()
        blocks = _blocks(model, block_class)
        if len(blocks) - n_dense_layers < 3:
            raise ValueError(f"need 3 sparse {block_class} blocks in the profiled model, found "
                             f"{len(blocks) - n_dense_layers}")
        # The three forward + backward runs also record the blocks' other inputs (the checkpoint-held fit's
        # first three points; a no-grad forward gives its fourth).
        sparse, dense, held = [], [], []
        for b, s in points:
            storages: dict[int, int] = {}
            of_sparse, of_dense = _measure(model, blocks, n_dense_layers, vocab_size, b, s, c * hidden_size * b * s,
                                           _held_by_checkpointing(blocks, storages))
            sparse.append(of_sparse)
            dense.append(of_dense)
            held.append(sum(storages.values()))
        held_points = [*points, (2, points[0][1])]
        storages = {}
        with _held_by_checkpointing(blocks, storages), torch.no_grad():
            model(input_ids=torch.randint(0, vocab_size, held_points[-1]))
        held = _fit_held(held_points, [*held, sum(storages.values())])
        operators = dense_operators = None
        if not lora_rank:  # the step-time inventory of a steady-state block (and of a dense one); under LoRA none
            with cuda_kernel_choices():
                counted = [blocks[max(n_dense_layers, 1)]] + ([blocks[0]] if n_dense_layers else [])
                operators, dense_operators = [*count_block_operators(model, counted, vocab_size, 1, long_s), None][:2]
    tokens = [b * s for b, s in points]
    seqs = [s for _, s in points]
    terms = dataclasses.replace(_terms(tokens, seqs, sparse, long_s), checkpoint_held=held, operators=operators)
    if n_dense_layers:
        terms = dataclasses.replace(terms, dense=dataclasses.replace(_terms(tokens, seqs, dense, long_s),
                                                                     operators=dense_operators))
    return terms, time.perf_counter() - started


def _lora_model(config: dict, attention: str, compute_dtype: str, block_class: str, spec, rank: int):
    """The reduced model on meta with peft's adapters (calibration.lora.add_lora: it cannot move fake tensors), every
    weight in the compute dtype (a pure-precision build: mixed precision gathers the adapters in it too)."""
    from .apply import TORCH_DTYPES
    from .lora import add_lora
    from .model_blocks import block_classes

    model = build_model(None, config, attention=attention, device="meta", dtype=TORCH_DTYPES[compute_dtype])
    return add_lora(model, spec, rank, block_classes(model, block_class),
                    "fp32" if compute_dtype == "fp32" else f"{compute_dtype}-pure")


def _terms(tokens: list[int], seqs: list[int], measured: list, seq_len: int) -> ActivationTerms:
    """ActivationTerms fitted from the three points' (saved, backward moments)."""
    _, a, q = _solve(tokens, seqs, [saved for saved, _ in measured])
    return ActivationTerms(saved_per_token=a, saved_per_token_per_seq=max(q, 0.0),
                           backward_moments=_envelope(_fit_moments(tokens, seqs, [bw for _, bw in measured]), seq_len))


def _solve(tokens: list[int], seqs: list[int], ys: list[float]) -> tuple[float, float, float]:
    """(k, a, q) with y = k + t*(a + q*s) through the three points."""
    import numpy as np

    rows = np.array([[1.0, t, t * s] for t, s in zip(tokens, seqs)])
    k, a, q = np.linalg.solve(rows, np.array(ys, dtype=float))
    return float(k), float(a), float(q)


def _fit_moments(tokens, seqs, backward) -> list[BackwardMoment]:
    """One BackwardMoment per allocation of each profiled block's backward, matched across the three
    points by position (the same ops run in the same order whatever the shape)."""
    fitted = []
    for block_index in range(len(backward[0])):
        logs = [point[block_index] for point in backward]
        if len({len(log) for log in logs}) != 1:
            # data-dependent op order: keep each point's peak moment only
            logs = [[max(log, key=sum)] for log in logs]
        for events in zip(*logs):
            k, a, q = _solve(tokens, seqs, [acts for acts, _ in events])
            fitted.append(BackwardMoment(grad_bytes=max(g for _, g in events), const_bytes=k, per_token=a,
                                         per_token_per_seq=q))
    return fitted


def _envelope(moments: list[BackwardMoment], seq_len: int) -> tuple[BackwardMoment, ...]:
    """The moments that are the peak for some micro-batch the planner may try (1 to 128 sequences)."""
    keep = []
    for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
        tokens = b * seq_len
        best = max(moments, key=lambda m: m.activation_bytes(tokens, seq_len) + m.grad_bytes)
        if best not in keep:
            keep.append(best)
    return tuple(keep)
