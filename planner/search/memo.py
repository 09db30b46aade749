"""What one search prices once: each configuration's evaluation (the full knob space on the fastest scouted pipeline
repeats the scout knobs' candidates), and a pipeline candidate's memory across the knobs memory does not read.

A pipeline candidate's memory replays every rank's schedule (cost_models/pipeline_memory.py, ~10 ms at pp 16 x
V 2 against ~1 ms for its step time), and Float8 linears and async TP change only the step: in cost_models
`config.float8` is read by the step time (step_parts) and the refusals (feasibility), `config.async_tp` by the TP
step time alone, neither by the memory ledger (tests/unit/test_search_memo.py checks the estimates equal), only by
the memory outside the allocator (async TP's symmetric-memory workspace; cost_models/outside_allocator.py), priced
again for each configuration on the shared ranks. The FP8 all-gather stays in the key: the pipeline estimate's notes
name it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from cost_models.evaluate import Evaluation, evaluate
from cost_models.feasibility import as_run
from cost_models.memory import MemoryEstimate, estimate_memory
from cost_models.pipeline_memory import pipeline_outside_terms, with_outside_terms
from cost_models.profile import Profile
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec

MEMORY_FREE_FIELDS = frozenset({"float8", "async_tp"})  # FsdpConfig fields the ledger never reads (outside terms do)
_KEY_FIELDS = tuple(f.name for f in fields(FsdpConfig) if f.name not in MEMORY_FREE_FIELDS)


def memory_key(config: FsdpConfig) -> tuple:
    """config's fields that the memory estimate reads (all but MEMORY_FREE_FIELDS)."""
    return tuple(getattr(config, name) for name in _KEY_FIELDS)


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
    ways: object = None  # cost_models/host_ram.Ways: how the trainer loads and saves

    def evaluate(self, config: FsdpConfig) -> Evaluation:
        e = self.evaluations.get(config)
        if e is None:
            memory = None
            if config.pp > 1:
                run = as_run(config, self.cluster)
                key = memory_key(run)
                memory = self.memories.get(key)
                if memory is None:  # priced for this run: its outside terms are its own
                    memory = self.memories[key] = estimate_memory(self.model, self.cluster, self.training, run,
                                                                  self.profile)
                else:  # another run's (Float8, async TP): this one's outside terms in place of its
                    memory = with_outside_terms(memory, pipeline_outside_terms(self.model, self.cluster, self.training,
                                                                               run, self.profile))
            e = self.evaluations[config] = evaluate(self.model, self.cluster, self.training, config, self.profile,
                                                    memory=memory, ways=self.ways)
        return e
