"""The memory ledger's moments (memory.py) shared across CPU offload: offload moves the model states alone (memory.py's
gpu_states: the sharded parameters, gradients and optimizer state on the host, QLoRA's QuantState still on the GPU),
so a ledger with offload is the same configuration's ledger without it, those three terms taken off every moment. A
search prices both (planner/search/memo.py: ~1,100 of DeepSeek-V2-Lite's 4,250 ledgers on 64 GPUs); and, where no
backward prefetch runs, with and without the rate limiter (~130 more)."""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter

from .memory_peak import Moment
from .specs import FsdpConfig

# FsdpConfig's fields but offload, those no ledger reads (planner/search/memo.py's memory_key less offload) and the
# rate limiter (the caller's: whether it bounds a prefetch)
_KEY_FIELDS = attrgetter(*(f.name for f in fields(FsdpConfig) if f.name not in {
    "offload", "float8", "async_tp", "backward_prefetch", "limit_all_gathers"}))
_new = tuple.__new__  # offloaded's Moment._replace by position, ~5x cheaper (a search makes ~12,000)
assert Moment._fields[:5] == ("sharded_params", "unsharded_params", "sharded_grads", "unsharded_grads",
                              "optimizer_state")


def moments_key(config: FsdpConfig, *options) -> tuple:
    """What a ledger's moments read of config but offload and the rate limiter, with the caller's options (whether
    the limiter bounds a prefetch, estimate_memory's own; for one model, cluster, training and profile: its memo's).
    Without a backward prefetch (a shard group of one, or the blocks kept gathered) the limiter changes nothing."""
    return _KEY_FIELDS(config), *options


def offloaded(moments: dict, quant_state: int) -> dict:
    """moments of a ledger without offload, as the same ledger with offload makes them (gpu_states = 0)."""
    return {k: _new(Moment, (quant_state, m[1], 0, m[3], 0, *m[5:])) for k, m in moments.items()}
