"""torchrun worker: each rank's host-RAM peak of the ways to save, load and resume a sharded model, for real.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker_outside_step.py \
        --case '{"shape": {"n_layers": 2, "hidden_size": 256, "ffn_hidden_size": 1024, "vocab_size": 4096}}'

Each case builds calibration.reference's Llama at the shape (fp32), applies FSDP2 (calibration.apply.apply_fsdp2)
and AdamW with its states (one step on zero gradients), then runs each way and measures, per rank, the resident
set's high-water mark over the way minus the resident set before it (/proc/self/status VmHWM, reset by writing 5 to
/proc/self/clear_refs; freed memory trimmed before each way with malloc_trim, and a fixed mmap threshold, set with
mallopt, returns every large tensor's pages when it is freed). An FSDP1 copy of the model measures FULL_STATE_DICT with
offload_to_cpu + rank0_only. A case with "fsdp1": [shape, ...] also runs --emit fsdp1's checkpoint functions at
each shape (their peaks, restored or not), after its other ways; one with "trace_dcp": true traces the Python
objects of one more dcp.save last (tracemalloc's peak: its plans and metadata, which the formulas leave out). Rank 0
prints one JSON line per case: {"case": i, "ways": {way: [each rank's bytes]}, "fsdp1": [{"ways": ..., "restores":
bool}], "dcp_objects": [each rank's bytes] (traced cases), ...}.
"""

from __future__ import annotations

import ctypes
import gc
import re
import tempfile
import tracemalloc

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict)

from calibration.apply import apply_fsdp2, make_mesh
from calibration.reference import Block, build_reference, tiny_llama_spec
from cost_models.specs import FsdpConfig
from tests.distributed.cases import serve_cli

_LIBC = ctypes.CDLL("libc.so.6")
# M_MMAP_THRESHOLD (-3, malloc.h) fixed at its 128 KiB default: glibc otherwise raises it to the size of a freed
# mmapped block, and the next tensors of that size come from the heap, where freed pages stay resident.
_LIBC.mallopt(-3, 128 * 1024)


def spec(shape: dict):
    h = shape["hidden_size"]
    return tiny_llama_spec(n_heads=8, n_kv_heads=2, head_dim=h // 8, **shape)


def _status_bytes(field: str) -> int:
    kib = re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)
    return int(kib) * 1024


def measure(fn, marks: dict | None = None) -> tuple[int, object]:
    """(VmHWM over fn - VmRSS before it, fn's result); the result is dropped after the measurement by the caller.
    marks: gets "before", the VmRSS the peak is counted from."""
    gc.collect()  # the previous way's tensors (async save's staged copy sits in a reference cycle)
    _LIBC.malloc_trim(0)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0, proc(5))
    before = _status_bytes("VmRSS")
    if marks is not None:
        marks["before"] = before
    result = fn()
    peak = _status_bytes("VmHWM") - before
    dist.barrier()
    return peak, result


def _gather(value: int) -> list[int]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def build(shape: dict):
    torch.manual_seed(0)
    model = build_reference(spec(shape))
    return model


def run_case(case: dict, rank: int, world: int) -> dict:
    config = FsdpConfig(precision="fp32")
    gc.collect()
    gc.freeze()  # what exists now is never garbage: measure()'s collections scan only what the ways make (0.2 s -> 0)
    baseline = _status_bytes("VmRSS")  # torch imported, the process group up, no model yet
    model = build(case["shape"])
    apply_fsdp2(model, config, {Block}, make_mesh(config, world, world, "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # Adam's states exist from here on
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    ways: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = _shared_dir(tmp)

        def state():
            return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}

        ways["dcp save"] = measure(lambda: dcp.save(state(), checkpoint_id=f"{tmp}/dcp"))[0]
        ways["dcp async save"] = measure(lambda: dcp.async_save(state(), checkpoint_id=f"{tmp}/async").result())[0]

        def full():
            return (get_model_state_dict(model, options=full_options),
                    get_optimizer_state_dict(model, optimizer, options=full_options))

        ways["full state dict save (fsdp2)"], held = measure(full)
        if rank == 0:
            torch.save(held[0], f"{tmp}/full.pt")
        del held
        dist.barrier()
        ways["fsdp2 params only full state dict"] = measure(lambda: get_model_state_dict(model, options=full_options))[0]

        def every_rank():
            sd = torch.load(f"{tmp}/full.pt", weights_only=True)
            set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))
            return sd

        ways["load every rank"] = measure(every_rank)[0]

        def rank0_broadcast():
            sd = torch.load(f"{tmp}/full.pt", weights_only=True) if rank == 0 else {}
            set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            return sd

        ways["load rank0 broadcast"] = measure(rank0_broadcast)[0]

        def dcp_load():
            sd = {"model": get_model_state_dict(model)}
            dcp.load(sd, checkpoint_id=f"{tmp}/dcp")
            set_model_state_dict(model, sd["model"])

        ways["load dcp"] = measure(dcp_load)[0]
        ways["fsdp1 full state dict save"] = _fsdp1_full_save(case["shape"], rank, world)
        emitted, restored = _emitted_ways(case["shape"], f"{tmp}/full.pt", f"{tmp}/emitted", rank, world)
        ways.update(emitted)
        # after every measured way (what they leave in the heap would lower a later way's reading): each size in
        # case["fsdp1"], its save and resume measured, in one case
        fsdp1 = [_emitted_fsdp1_ways(shape, f"{tmp}/emitted_fsdp1_{i}", world) for i, shape in
                 enumerate(case.get("fsdp1", ()))]
        traced = {}
        if case.get("trace_dcp"):
            traced["dcp_objects"] = _gather(_dcp_objects_bytes(state, f"{tmp}/traced"))
    return {**traced, "ways": {name: _gather(value) for name, value in ways.items()}, "baseline": _gather(baseline),
            "emitted_restores": all(_gather(restored)),
            "fsdp1": [{"ways": {name: _gather(value) for name, value in measured.items()},
                       "restores": all(_gather(restored))} for measured, restored in fsdp1]}


def _shared_dir(tmp: str) -> str:
    """Rank 0's temporary directory, for every rank (DCP writes one checkpoint folder from all ranks)."""
    out = [tmp]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def _dcp_objects_bytes(state, path: str) -> int:
    """The Python objects' peak over one more dcp.save of `state()` (tracemalloc: its plans and global metadata,
    which grow with the keys and the ranks; tensor storage is not traced). Traced apart from the measured ways:
    tracing's own bookkeeping would add to their readings."""
    gc.collect()
    dist.barrier()
    tracemalloc.start()
    try:
        dcp.save(state(), checkpoint_id=path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        dist.barrier()


def _fsdp1_full_save(shape: dict, rank: int, world: int) -> int:
    """FSDP1 (a block per unit, the root with embedding and head) state_dict() under FULL_STATE_DICT with
    rank0_only. offload_to_cpu=False: the flat parameters are host memory already on CPU (offload_to_cpu=True on
    CPU tensors segfaults in torch 2.13's clone of the offloaded views, seen here)."""
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(build(shape), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 use_orig_params=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        peak = measure(model.state_dict)[0]
    del model
    return peak


def _emitted_ways(shape: dict, full_path: str, path: str, rank: int, world: int) -> tuple[dict, bool]:
    """The plan's `--emit fsdp2` snippet run as written: apply_fsdp, make_optimizer, then its load_pretrained (rank 0
    passes the full state dict), save_checkpoint and load_checkpoint; whether the resume restores the saved params."""
    from planner.emit import emit_fsdp2
    from planner.hardware import make_cluster

    namespace: dict = {}
    exec(compile(emit_fsdp2(FsdpConfig(precision="fp32"), spec(shape), make_cluster(world)), "<emitted>", "exec"),
         namespace)
    model = namespace["apply_fsdp"](build(shape), device="cpu")
    optimizer = namespace["make_optimizer"](model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    ways = {}
    ways["emitted load_pretrained"] = measure(lambda: namespace["load_pretrained"](
        model, torch.load(full_path, weights_only=True) if rank == 0 else None))[0]
    ways["emitted save_checkpoint"] = measure(lambda: namespace["save_checkpoint"](model, optimizer, path))[0]
    saved = [p.detach().to_local().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ways["emitted load_checkpoint"] = measure(lambda: namespace["load_checkpoint"](model, optimizer, path))[0]
    restored = all(torch.equal(a, p.detach().to_local()) for a, p in zip(saved, model.parameters()))
    return ways, restored


def _emitted_fsdp1_ways(shape: dict, path: str, world: int) -> tuple[dict, bool]:
    """The plan's `--emit fsdp1` snippet run as written (every rank built the model: no loading function): apply_fsdp,
    make_optimizer, save_checkpoint, then load_checkpoint over changed params: each one's host peak per rank, and
    whether the resume restores the saved params."""
    from planner.emit import emit_fsdp1
    from planner.hardware import make_cluster

    namespace: dict = {}
    exec(compile(emit_fsdp1(FsdpConfig(precision="fp32"), spec(shape), make_cluster(world)), "<emitted fsdp1>",
                 "exec"), namespace)
    model = namespace["apply_fsdp"](build(shape), device=torch.device("cpu"))
    optimizer = namespace["make_optimizer"](model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    ways = {"emitted fsdp1 save_checkpoint": measure(lambda: namespace["save_checkpoint"](model, optimizer, path))[0]}
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ways.update(_emitted_fsdp1_resume(namespace, model, optimizer, path))
    return ways, all(torch.equal(a, p.detach()) for a, p in zip(saved, model.parameters()))


def _emitted_fsdp1_resume(namespace: dict, model, optimizer, path: str) -> dict:
    """--emit fsdp1's load_checkpoint as written, its set_state_dict read apart (the snippet's name for it wrapped):
    the whole resume's peak; what is resident when set_state_dict starts (get_state_dict's host copy of the shard,
    filled by dcp.load: on a GPU, the host RAM it holds); set_state_dict's own peak above that (on a GPU, its
    gathers and the new states, the copy-in: cost_models/outside_step.py _fsdp1_resume)."""
    marks: dict = {}
    set_state_dict = namespace["set_state_dict"]

    def read_apart(*args, **kwargs):
        marks["at set"], marks["peak before set"] = _status_bytes("VmRSS"), _status_bytes("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # set_state_dict's high-water mark from here
        set_state_dict(*args, **kwargs)

    namespace["set_state_dict"] = read_apart
    try:
        peak = measure(lambda: namespace["load_checkpoint"](model, optimizer, path), marks)[0]
    finally:
        namespace["set_state_dict"] = set_state_dict
    before, at_set = marks["before"], marks["at set"]
    return {"emitted fsdp1 load_checkpoint": max(peak, marks["peak before set"] - before),
            "emitted fsdp1 resume host state dict": at_set - before,
            "emitted fsdp1 resume set_state_dict": peak + before - at_set}


if __name__ == "__main__":
    serve_cli(run_case)
