"""What one search prices once: each configuration's evaluation (the full knob space on the fastest scouted pipeline
repeats the scout knobs' candidates), and a pipeline candidate's memory across the knobs memory does not read.

A pipeline candidate's memory replays every rank's schedule (cost_models/pipeline_memory.py, ~10 ms at pp 16 x
V 2 against ~1 ms for its step time), and Float8 linears and async TP change only the step: in cost_models
`config.float8` is read by the step time (step_parts) and the refusals (feasibility), `config.async_tp` by the TP
step time alone, neither by the memory ledger (tests/unit/test_search_memo.py checks the estimates equal), only by
the memory outside the allocator (async TP's symmetric-memory workspace; cost_models/outside_allocator.py), priced
again for each configuration on the shared ranks. The FP8 all-gather stays in the key: the pipeline estimate's notes
name it.

Every configuration, pipeline or not, also shares what reads only part of it (issue 27 item 6: FSDP1's backward
prefetch and rate limiter double the plain mesh's candidates, each costed whole before): the memory across backward
prefetch (read by the step time alone, step_time.py / step_timeline.py: BACKWARD_PRE moves no bytes), the step time
across the rate limiter (read by the memory ledger alone, memory.prefetch_below: it bounds the all-gathers in flight,
not their seconds), the host RAM (host_ram.host_ram: the precision, the replicas, offload and the offloaded bytes);
and the ledger without a pipeline shares Float8 and async TP as a pipeline's does where no DeepEP buffer is among its
outside terms (EP's all-to-all dispatch, as a pipeline's, holds none: expert_parallel.outside_allocator_bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter

from cost_models.evaluate import Evaluation, evaluate, memory_verdict
from cost_models.feasibility import as_run
from cost_models.host_ram import HostRam, Ways, host_ram
from cost_models.memory import MemoryEstimate, estimate_memory
from cost_models.outside_allocator import outside_key
from cost_models.pipeline_memory import pipeline_outside_terms, with_outside_terms
from cost_models.profile import Profile
from cost_models.quick_init import replaced
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, MoeDispatch, TrainingSpec
from cost_models.step_time import TimeBreakdown, estimate_step_time

MEMORY_FREE_FIELDS = frozenset({"float8", "async_tp"})  # FsdpConfig fields the ledger never reads (outside terms do)
LEDGER_FREE_FIELDS = frozenset({"backward_prefetch"})  # nor these, outside terms included
TIME_FREE_FIELDS = frozenset({"limit_all_gathers"})   # FsdpConfig fields the step time never reads
_KEY_FIELDS = attrgetter(*(f.name for f in fields(FsdpConfig) if f.name not in MEMORY_FREE_FIELDS | LEDGER_FREE_FIELDS))
_ESTIMATE_FIELDS = attrgetter(*(f.name for f in fields(FsdpConfig) if f.name not in LEDGER_FREE_FIELDS))
_TIME_FIELDS = attrgetter(*(f.name for f in fields(FsdpConfig) if f.name not in TIME_FREE_FIELDS))


def memory_key(config: FsdpConfig) -> tuple:
    """config's fields that a pipeline's rank replays read (all but MEMORY_FREE_FIELDS and LEDGER_FREE_FIELDS)."""
    return _KEY_FIELDS(config)


def estimate_key(config: FsdpConfig) -> tuple:
    """config's fields that estimate_memory reads, the memory outside the allocator included."""
    return _ESTIMATE_FIELDS(config)


def time_key(config: FsdpConfig) -> tuple:
    """config's fields that estimate_step_time reads."""
    return _TIME_FIELDS(config)


@dataclass
class Costing:
    """evaluate() for one search's model, cluster, training and profile, each configuration priced once and a
    pipeline's memory once per memory_key."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    profile: Profile
    evaluations: dict[FsdpConfig, Evaluation] = field(default_factory=dict)
    memories: dict[tuple, MemoryEstimate] = field(default_factory=dict)
    ways: object = None  # cost_models/host_ram.Ways: how the trainer loads and saves, its FSDP API
    estimates: dict[tuple, MemoryEstimate] = field(default_factory=dict)
    times: dict[tuple, TimeBreakdown] = field(default_factory=dict)
    hosts: dict[tuple, HostRam] = field(default_factory=dict)
    step_parts: dict[tuple, tuple] = field(default_factory=dict)  # step_time._compute_parts, across FSDP's own knobs
    fsdp_parts: dict[tuple, tuple] = field(default_factory=dict)  # step_time._fsdp_collectives, across the compute's
    shapes: dict[tuple, object] = field(default_factory=dict)  # memory_shape.ledger_shape, likewise
    ledgers: dict[tuple, dict] = field(default_factory=dict)  # a ledger's moments without offload (offload_moments.py)
    outsides: dict[tuple, tuple] = field(default_factory=dict)  # outside_allocator_terms by outside_key
    verdicts: dict[tuple, tuple] = field(default_factory=dict)  # evaluate.memory_verdict by memory and host RAM

    def evaluate(self, config: FsdpConfig, runs: bool = False) -> Evaluation:
        """runs: the caller found nothing refusing config (cost_models.evaluate.unsupported_reasons), so where FSDP
        runs it as it is (feasibility.as_run) evaluate() need not look again."""
        e = self.evaluations.get(config)
        if e is None:
            run = as_run(config, self.cluster)  # what evaluate() prices
            memory = self._memory(run)
            key = time_key(run)
            time = self.times.get(key)
            if time is None:
                time = self.times[key] = estimate_step_time(self.model, self.cluster, self.training, run, self.profile,
                                                            parts=self.step_parts, fsdp_parts=self.fsdp_parts,
                                                            fsdp2=self.ways is None or self.ways.fsdp2)
            key = (run.precision, run.replicate_group_size(self.cluster), run.offload, memory.cpu_bytes_per_node)
            host = self.hosts.get(key)
            if host is None:
                host = self.hosts[key] = host_ram(self.model, self.cluster, self.training, run,
                                                  memory.cpu_bytes_per_node, self.ways or Ways())
            key = (id(memory), id(host), run.offload)  # both kept in this memo's dicts: their ids stay theirs
            judged = self.verdicts.get(key)
            if judged is None:
                judged = self.verdicts[key] = memory_verdict(
                    replaced(memory, host_ram=host), self.profile, self.cluster.gpu.memory_bytes,
                    self.cluster.cpu_ram_bytes_per_node, run.offload)
            e = self.evaluations[config] = evaluate(self.model, self.cluster, self.training, config, self.profile,
                                                    ways=self.ways, time=time,
                                                    refused=() if runs and run is config else None, judged=judged)
        return e

    def _memory(self, run: FsdpConfig) -> MemoryEstimate:
        """estimate_memory of this run (host RAM left out), priced once per estimate_key, the ledger (a pipeline's rank
        replays) once per memory_key."""
        key = estimate_key(run)
        memory = self.estimates.get(key)
        if memory is not None:
            return memory
        # without a pipeline, the outside terms are pipeline_outside_terms' too where no DeepEP buffer joins them
        shares = run.pp > 1 or run.ep == 1 or run.moe_dispatch is not MoeDispatch.DEEPEP
        outside = None
        if shares:  # priced once per what they read (outside_allocator.outside_key)
            outside_at = outside_key(run)
            outside = self.outsides.get(outside_at)
            if outside is None:
                outside = self.outsides[outside_at] = pipeline_outside_terms(self.model, self.cluster, self.training,
                                                                             run, self.profile)
            shared = self.memories.get(memory_key(run))
            if shared is not None:  # another run's (Float8, async TP): this one's outside terms in place of its
                memory = with_outside_terms(shared, outside)
        if memory is None:  # priced for this run: its outside terms are its own
            memory = estimate_memory(self.model, self.cluster, self.training, run, self.profile,
                                     fsdp1_adapter_units=self.ways is not None and self.ways.fsdp1_adapter_units,
                                     shapes=self.shapes, outside=outside, ledgers=self.ledgers)
            if shares:
                self.memories[memory_key(run)] = memory
        self.estimates[key] = memory
        return memory
