"""Every memo keyed by part of an FsdpConfig reads no field outside its key: the fields each memoised function
reads are recorded (FsdpConfig.__getattribute__, properties and methods included) while real searches and
estimates run, and compared with the key's fields. A new read of a field a key leaves out (step_time._PARTS_FIELDS
drops the pipeline's and the precision's fields) fails here instead of silently reusing another configuration's
figures."""

import contextlib
import re
import sys
from dataclasses import fields

import pytest

from cost_models import memory, memory_shape, offload_moments, outside_allocator, pipeline_memory, step_time
from cost_models.specs import FsdpConfig
from planner import api
from planner.search import memo

ALL = frozenset(f.name for f in fields(FsdpConfig))


def _names(getter) -> frozenset:
    """The field names an operator.attrgetter reads (its repr lists them)."""
    return frozenset(re.findall(r"'(\w+)'", repr(getter)))


KEYS = {   # (module, function): the fields its memo key holds
    (step_time, "_compute_parts"): _names(step_time._PARTS_FIELDS),
    (step_time, "_fsdp_collectives"): _names(step_time._FSDP_FIELDS),
    (memory_shape, "ledger_shape"): _names(memory_shape._SHAPE_FIELDS),
    (step_time, "estimate_step_time"): ALL - memo.TIME_FREE_FIELDS,
    (pipeline_memory, "pipeline_outside_terms"): frozenset(
        ("sharding", "shard_group_gpus", "tp", "cp", "ep", "pp", "async_tp", "micro_batch", "float8", "compile")),
}
OUTSIDE_KEY_FIELDS = KEYS[(pipeline_memory, "pipeline_outside_terms")]
GIVEN_OUTSIDE = "estimate_memory given its outside terms"


@contextlib.contextmanager
def recording():
    """{(module, function): fields read while it ran}: every FsdpConfig attribute read during a call of a function
    in KEYS (nested calls count for each caller; calls are seen by their code object, whatever name a caller
    imported), and estimate_memory's when a search hands it the outside terms (what memo.memory_key must cover)."""
    reads = {k: set() for k in KEYS} | {GIVEN_OUTSIDE: set()}
    codes = {getattr(mod, name).__code__: (mod, name) for mod, name in KEYS}
    estimate_memory_code = memory.estimate_memory.__code__
    active: list[tuple] = []   # (code, the set it records into)
    original = FsdpConfig.__getattribute__

    def record(self, name):
        if active and name in ALL:
            for _, s in active:
                s.add(name)
        return original(self, name)

    def profile(frame, event, _):
        code = frame.f_code
        target = codes.get(code)
        if target is None and code is estimate_memory_code and frame.f_locals.get("outside") is not None:
            target = GIVEN_OUTSIDE
        if target is None:
            return
        if event == "call":
            active.append((code, reads[target]))
        elif event == "return" and active and active[-1][0] is code:
            active.pop()

    FsdpConfig.__getattribute__ = record
    sys.setprofile(profile)
    try:
        yield reads
    finally:
        sys.setprofile(None)
        FsdpConfig.__getattribute__ = original


@pytest.fixture(scope="module")
def reads():
    """Searches and estimates that reach every memo: a dense plan, the TP meshes and pipelines of a 405B search on
    1,024 GPUs, CP at 131k, EP with DeepEP, Float8 with its FP8 all-gather and async TP, FSDP1 with offload."""
    with recording() as r:
        api.plan("gpt-13b", 8)
        api.plan("llama3.1-405b", 1024, gpu="h100-80gb", pp=8)
        api.estimate("llama3.1-8b", 8, cp=4, seq_len=131_072, activation_checkpointing="full")
        api.estimate("mixtral-8x7b", 8, ep=8)
        api.estimate("llama3.1-70b", 64, gpu="h100-80gb", tp=8, compile=True, float8=True, fp8_all_gather=True, async_tp=True)
        api.estimate("llama2-7b", 8, sharding="HYBRID_SHARD", offload=True)
    return r


@pytest.mark.parametrize("target", list(KEYS), ids=lambda t: f"{t[0].__name__.split('.')[-1]}.{t[1]}")
def test_a_memoised_function_reads_only_its_key(reads, target):
    assert reads[target], "never called: the fixture no longer reaches it"
    assert reads[target] <= KEYS[target], sorted(reads[target] - KEYS[target])


def test_a_search_shares_a_ledger_only_across_fields_it_does_not_read(reads):
    """memo._memory shares one pipeline / plain ledger across memo.memory_key (all but Float8, async TP and backward
    prefetch) and prices the outside terms apart (outside_allocator.outside_key, equal to the set above)."""
    assert _names(memo._KEY_FIELDS) == ALL - memo.MEMORY_FREE_FIELDS - memo.LEDGER_FREE_FIELDS
    assert reads[GIVEN_OUTSIDE], "no search handed estimate_memory its outside terms"
    assert reads[GIVEN_OUTSIDE] <= _names(memo._KEY_FIELDS)
    assert _names(offload_moments._KEY_FIELDS) == _names(memo._KEY_FIELDS) - {"offload", "limit_all_gathers"}
    fake = type("C", (), {n: n for n in OUTSIDE_KEY_FIELDS})()
    assert set(outside_allocator.outside_key(fake)) == OUTSIDE_KEY_FIELDS
