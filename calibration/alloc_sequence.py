"""The ordered storage allocations and frees of a tracked step, for the caching allocator replay.

    events = record_allocations(tracker)      # before entering the MemoryTracker
    with tracker: step(); step()
    cost_models.caching_allocator.replay(events)

calibration.memtrack's tracker already sees every storage as it is created (ADD), freed (DEL: the storage's
weakref finalizer, the moment its last reference goes, as the CUDA block's free is), resized (SIZE: FSDP2
frees and re-allocates its unsharded parameters with storage.resize_) and re-filed (REF); this wraps its
snapshot update to write those in order as ("alloc", key, bytes, stream) / ("free", key). A resize is a free and
a new allocation (resize_ on CUDA makes a new block). Sizes are the storages' bytes unrounded (the replay
rounds, as round_size does).

Streams, as FSDP2 allocates on a GPU (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, torch 2.13):
foreach_all_gather allocates the all-gather output under the all-gather copy-in stream, and foreach_reduce
the reduce-scatter output (whose views become the new sharded gradients) under the reduce-scatter stream; the
reduce-scatter input is allocated on the current (default) stream. Those blocks come from their streams' own
pools. The tracker files the all-gather output as "All Gather" and the new sharded gradients as "Sharded Grad"
right after they are made, so their allocation is re-tagged then. Everything else is the default stream.
Not modelled: the copy-in's cast of the sharded parameters to the compute dtype (1/N of a unit, also on the
copy-in stream), HSDP's all-reduce stream, and the events that delay a block's reuse across streams.
"""

from __future__ import annotations

from .memtrack import MemoryTracker

STREAM_OF_CATEGORY = {"All Gather": "all_gather_copy_in", "Sharded Grad": "reduce_scatter"}
DEFAULT_STREAM = 0


def record_allocations(tracker: MemoryTracker, events: list | None = None) -> list[list]:
    """`events` (a new list by default), filled while `tracker` runs with the device's allocation events in
    order (module docstring). Call before the tracker first sees a tensor (track_inputs, entering)."""
    inner_tracker = tracker._tracker
    update = inner_tracker._update_snap
    device_type = tracker.device.type
    events = [] if events is None else events
    last_alloc: dict[int, int] = {}   # id of the tracker's storage record -> index of its live allocation

    def alloc(key: int, n_bytes: int, category) -> None:
        last_alloc[key] = len(events)
        events.append(["alloc", key, n_bytes, STREAM_OF_CATEGORY.get(_name(category), DEFAULT_STREAM)])

    def recording_update(u_type, winfo, *args, **kwargs):
        update(u_type, winfo, *args, **kwargs)
        if winfo.device.type != device_type:
            return
        key, kind = id(winfo), u_type.name
        if kind == "ADD":
            alloc(key, winfo.size * winfo.element_size, winfo.reftype)
        elif kind == "DEL":
            events.append(["free", key])
        elif kind == "SIZE":
            events.append(["free", key])
            alloc(key, winfo.size * winfo.element_size, winfo.reftype)
        elif kind == "REF" and _name(winfo.reftype) in STREAM_OF_CATEGORY and key in last_alloc:
            events[last_alloc[key]][3] = STREAM_OF_CATEGORY[_name(winfo.reftype)]

    inner_tracker._update_snap = recording_update
    return events


def _name(category) -> str:
    return str(getattr(category, "value", category))
