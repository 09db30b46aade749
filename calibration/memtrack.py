"""Per-rank tensor memory of a training step, by category: our one door to PyTorch's memory tracker.

    tracker = MemoryTracker(model, optimizer, vocab_size=V)   # model: FSDP2-wrapped, or any nn.Module
    with tracker:
        step()                      # warm-up: creates optimizer state, first all-gathers
        tracker.reset()             # forget the warm-up's peak
        step()
    snap = tracker.snapshot()       # MemorySnapshot: peak_allocated_bytes, breakdown, peak_phase

It works the same on fake tensors (FakeTensorMode: the trace tier) and on real tensors (CPU runs under
torchrun/gloo, GPU runs). It counts tensor *storages* as they are created and freed (a view costs
nothing, a storage is counted once however many tensors share it), with no allocator rounding: the
figure is what `torch.cuda.max_memory_allocated` would show minus the caching allocator's 512-byte
rounding, and without the CUDA context or library workspaces.

Behind it sits `torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker` (FSDP2 modules), or its base
`MemTracker` for anything else (FSDP1, plain modules). Both are private torch APIs: nothing else in the
project may import them. Categories map onto cost_models.memory.MemoryBreakdown's field names:

    Sharded Param                 -> sharded_params     (the stored DTensor shards; all params without FSDP2)
    Unsharded Param               -> unsharded_params   (gathered compute-dtype params)
    Sharded Grad                  -> sharded_grads      (all grads without FSDP2)
    Unsharded Grad                -> unsharded_grads    (full-size grads from accumulation to reduce-scatter)
    OptState                      -> optimizer_state    (what the optimizer keeps between steps)
                                   + optimizer_temporaries (what it allocates during step() on top)
    Activation, Temp              -> activations        (saved for backward, recomputed, and the
                                                         activation gradients of the backward pass)
    tensors whose last dim is V   -> logits_and_loss    (logits, fp32 upcast, log-softmax, their grads;
                                                         only when vocab_size is given, else in activations)
    All Gather, Reduce Scatter    -> collective_buffers
    Buffer, Inputs                -> other

peak_phase is where the peak happened: "forward", "backward" or "optimizer_step".
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .memtrack_categories import TO_BREAKDOWN, category_enum, decomposed_ops

BREAKDOWN_KEYS = ("sharded_params", "unsharded_params", "sharded_grads", "unsharded_grads", "optimizer_state",
                  "activations", "logits_and_loss", "optimizer_temporaries", "collective_buffers", "other")


@dataclass(frozen=True)
class MemorySnapshot:
    """Bytes per rank at the peak of the tracked window, by category (keys: BREAKDOWN_KEYS)."""

    peak_allocated_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    peak_phase: str = "unknown"

    def to_dict(self) -> dict:
        return {"peak_allocated_bytes": self.peak_allocated_bytes, "peak_phase": self.peak_phase,
                "breakdown": dict(self.breakdown)}


def _tracker_class(fsdp2: bool):
    """A subclass of the private tracker that records the phase of the peak and files logits apart."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    if fsdp2:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

        base, refs = FSDPMemTracker, _FSDPRefType
    else:
        base, refs = MemTracker, _MemRefType
    categories = category_enum(refs)
    transient = {refs.ACT.value, refs.TEMP.value}

    class _Tracker(base):
        def __init__(self, *args, vocab_size: int | None = None):
            super().__init__(*args)
            self._ref_class = categories
            self.vocab_size = vocab_size
            self.peak_phase = "unknown"
            self.microbatched = False
            from torch.utils.weak import WeakIdKeyDictionary

            self._grad_hooked = WeakIdKeyDictionary()
            self.watched = WeakIdKeyDictionary()  # module -> [(activation, gradient) bytes] in its backward

        if fsdp2:
            def _fsdp_state_pre_forward(self, fsdp_mod, orig):
                inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

                def repeatable(*args, **kwargs):
                    # pipeline stages run forward once per microbatch: a new forward starts the unit's stats
                    # afresh (the private tracker refuses a root's second forward); peaks are kept
                    if self.microbatched and not self._mod_tracker.is_bw:
                        self.memory_tracking.pop(fsdp_mod, None)
                    return inner(*args, **kwargs)

                return repeatable

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in decomposed_ops():
                # A custom op's own allocations are invisible to a dispatch mode (it is popped while the op runs):
                # run its kernel with the mode pushed again, so that bitsandbytes' gemm_4bit shows the weight it
                # dequantizes for the matmul (cost_models/qlora.py) as a GPU's allocator would
                keys = torch._C._dispatch_keys(args[0]) & torch._C._dispatch_keyset_full_after(
                    torch._C.DispatchKey.Python)
                with self:
                    return func.redispatch(keys, *args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_snap(self, u_type, winfo, *args, **kwargs) -> None:
            super()._update_snap(u_type, winfo, *args, **kwargs)
            if self.watched and self._mod_tracker.is_bw and u_type.name == "ADD":
                parents = self._mod_tracker.parents
                for module, log in self.watched.items():
                    if self._mod_tracker.get_known_fqn(module) in parents:
                        log.append(_activations_and_grads(self._curr_mem_snap.get(winfo.device, {})))

        def _phase(self) -> str:
            if self._in_opt:
                return "optimizer_step"
            return "backward" if self._mod_tracker.is_bw else "forward"

        def _track(self, reftype, t: torch.Tensor) -> None:
            if (self.vocab_size and reftype in transient and t.dim() >= 1 and t.shape[-1] == self.vocab_size):
                reftype = categories.LOGITS
            super()._track(reftype, t)

        def _update_peak_stats(self, peak_state) -> None:
            # The global peak only. torch's also updates every active module's own peak, walking all tracked
            # modules (a WeakIdKeyDictionary: a hasattr on each module per allocation, 19 s of a 65 s DeepSeek
            # trace); nothing here reads per-module peaks (module_moments reads the pre/post snapshots).
            for device, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snap["Total"]:
                    self._peak_mem[device] = snap["Total"]
                    self._peak_mem_snap[device] = copy.deepcopy(snap)
                    self.peak_phase = self._phase()

        if fsdp2:
            def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
                inner = super()._fsdp_param_group_pre_backward(fsdp_mod, orig)

                def with_grad_hooks(*args, **kwargs):
                    out = inner(*args, **kwargs)
                    self._hook_unsharded_grads(fsdp_mod)
                    return out

                return with_grad_hooks

            def _hook_unsharded_grads(self, fsdp_mod) -> None:
                """File each unsharded gradient as such the moment autograd accumulates it (the private
                tracker only does so at the unit's post-backward, counting it as Temp until then)."""
                group = fsdp_mod._get_fsdp_state()._fsdp_param_group
                for fsdp_param in group.fsdp_params if group else ():
                    param = getattr(fsdp_param, "_unsharded_param", None)
                    if param is None or not param.requires_grad or param in self._grad_hooked:
                        continue
                    self._grad_hooked[param] = param.register_post_accumulate_grad_hook(self._file_grad)

            def _file_grad(self, param) -> None:
                if self._depth > 0 and param.grad is not None:
                    self._update_and_maybe_create_winfos(param.grad, refs.UNSHARDED_GRAD)

        if not fsdp2:
            def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
                # FSDP1 (use_orig_params=True) exposes parameters as views of its flat parameter, and frozen
                # parameters (LoRA) need no gradient: gradient hooks go on neither. Without them gradients
                # are counted where autograd makes them (activations) until the tracker meets them again;
                # the peak is unaffected.
                if install_grad_hooks and not all(p.is_leaf and p.requires_grad for p in module.parameters()):
                    install_grad_hooks = False
                with warnings.catch_warnings():  # it reads .grad of those views: torch warns each time
                    warnings.simplefilter("ignore", UserWarning)
                    return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def __exit__(self, *args):
            super().__exit__(*args)
            if self._depth == 0:
                for handle in self._grad_hooked.values():
                    handle.remove()
                self._grad_hooked.clear()

        def restart_peak(self) -> None:
            """Make the current usage the peak: what follows is measured on its own."""
            self.reset_mod_stats()
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap.get("Total", 0) for dev, snap in self._peak_mem_snap.items()}
            self.peak_phase = "unknown"

    return _Tracker


def _activations_and_grads(dev_snap: dict) -> tuple[int, int]:
    """(activation bytes, gradient bytes) of one device's snapshot."""
    acts = grads = 0
    for key, n_bytes in dev_snap.items():
        category = TO_BREAKDOWN.get(str(getattr(key, "value", key)))
        if category == "activations":
            acts += n_bytes
        elif category in ("sharded_grads", "unsharded_grads"):
            grads += n_bytes
    return acts, grads


def _is_fsdp2(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors count their local shard)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


class MemoryTracker:
    """Context manager measuring per-rank tensor memory by category (see the module docstring).

    model: an FSDP2 module (fully_shard applied, categories as FSDP2 sees them) or any nn.Module (FSDP1,
    DDP, plain: parameters count as sharded_params, gradients as sharded_grads; FSDP1's gradients of its
    flat parameters may show under activations, the peak is the same). optimizer: tracked for
    optimizer_state / optimizer_temporaries (optional). vocab_size: files tensors whose last dimension is
    the vocabulary under logits_and_loss; None leaves them in activations. device: the device whose
    memory is reported (default: the parameters' device).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 vocab_size: int | None = None, device: torch.device | str | None = None):
        self.model = model
        self.optimizer = optimizer
        # A ModuleList of FSDP2 roots: one pipeline rank's stages, tracked as one model, each running its
        # forward once per microbatch (calibration/trace_pipeline.py)
        stages = isinstance(model, nn.ModuleList) and len(model) > 0 and all(map(_is_fsdp2, model))
        self.fsdp2 = stages or _is_fsdp2(model)
        cls = _tracker_class(self.fsdp2)
        if stages:
            self._tracker = cls(model[0], optimizer, vocab_size=vocab_size)
            self._tracker._root_mod = model  # the private tracker walks only its root's modules and buffers
            self._tracker.microbatched = True
        elif self.fsdp2:
            self._tracker = cls(model, optimizer, vocab_size=vocab_size)
        else:
            self._tracker = cls(vocab_size=vocab_size)
            self._tracker.track_external(*(x for x in (model, optimizer) if x is not None))
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)

    def __enter__(self) -> "MemoryTracker":
        # torch's module tracker warns "hierarchy tracking maybe messed up" when a module re-enters forward
        # before the backward pop of its last pass ran (inputs that need no grad); how often depends on
        # when autograd's callbacks fire, so a user's stderr would get it from some runs and not others.
        # The figures do not depend on it (each trace is checked against a real step in tests)
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up",
                                category=UserWarning)
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._tracker.__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)

    def track_inputs(self, *tensors) -> None:
        """Count input tensors made before entering (input ids, labels) under "other"."""
        if self.fsdp2:
            self._tracker.track_inputs(tensors)
        else:
            self._tracker.track_external(*tensors)

    def reset(self) -> None:
        """Start a new measuring window: call after the warm-up step, inside the context."""
        self._tracker.restart_peak()

    def next_microstep(self) -> None:
        """Between the micro-steps of one measured step (gradient accumulation): keep the peak, let the
        root module run forward again (PyTorch's tracker refuses a second root forward otherwise)."""
        self._tracker.reset_mod_stats()

    def current_bytes(self) -> int:
        snap = self._tracker.get_tracker_snapshot("current")
        return self._device_snap(snap).get("Total", 0)

    def _device_snap(self, snap: dict) -> dict:
        for dev, dev_snap in snap.items():
            if torch.device(dev).type == self.device.type:
                return dev_snap
        return {}

    def optimizer_state_bytes(self) -> int:
        """Bytes the optimizer keeps between steps (its state tensors, on any device)."""
        if self.optimizer is None:
            return 0
        return _storage_bytes(t for state in self.optimizer.state.values() for t in state.values())

    def snapshot(self) -> MemorySnapshot:
        """The peak since entering (or since reset()), by category. Categories sum to the peak."""
        raw = self._device_snap(self._tracker.get_tracker_snapshot("peak"))
        breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
        for key, n_bytes in raw.items():
            if key == "Total":
                continue
            breakdown[TO_BREAKDOWN.get(str(getattr(key, "value", key)), "other")] += n_bytes
        # The tracker files everything made during step() as optimizer state; the part above what the
        # optimizer keeps afterwards is the step's temporaries. (Optimizer state on another device, e.g.
        # Adam's CPU step counters, is not in this device's figure.)
        kept = min(breakdown["optimizer_state"], self._state_bytes_on_device())
        breakdown["optimizer_temporaries"] = breakdown["optimizer_state"] - kept
        breakdown["optimizer_state"] = kept
        peak = raw.get("Total", 0)
        return MemorySnapshot(peak_allocated_bytes=peak, breakdown=breakdown, peak_phase=self._tracker.peak_phase)

    def watch_backward(self, modules) -> None:
        """Record (activation, gradient) bytes at every allocation inside these modules' backward (call
        before entering); read them with backward_moments."""
        for module in modules:
            self._tracker.watched[module] = []

    def backward_moments(self, module: nn.Module) -> list[tuple[int, int]]:
        """(activation bytes, gradient bytes) at each allocation of `module`'s backward (watch_backward)."""
        return list(self._tracker.watched.get(module, []))

    def module_moments(self, module: nn.Module) -> dict[str, tuple[int, int]]:
        """(activation bytes, gradient bytes) live at `module`'s first pre-forward, post-forward and
        pre-backward since entering: keys pre_forward, post_forward, pre_backward (absent when not reached),
        and output: (bytes of its forward's output, 0).
        Activations are what forward saved and backward's temporaries (categories Activation and Temp)."""
        from torch.distributed._tools.mem_tracker import _ModState

        stats = self._tracker.memory_tracking.get(module)
        if stats is None:
            return {}
        names = {_ModState.PRE_FW: "pre_forward", _ModState.POST_FW: "post_forward",
                 _ModState.PRE_BW: "pre_backward"}
        out = {}
        for state, name in names.items():
            snaps = stats.snapshots.get(state)
            if snaps:
                out[name] = _activations_and_grads(self._device_snap(snaps[0]))
        out["output"] = (getattr(stats, "output_mem", 0), 0)  # bytes of what its forward returned
        return out

    def _state_bytes_on_device(self) -> int:
        if self.optimizer is None:
            return 0
        from torch.distributed.tensor import DTensor

        tensors = []
        for state in self.optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    local = t.to_local() if isinstance(t, DTensor) else t
                    if local.device.type == self.device.type:
                        tensors.append(local)
        return _storage_bytes(tensors)
