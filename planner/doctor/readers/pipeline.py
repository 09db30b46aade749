"""torchtitan's pipeline settings, read back for `fsdp-plan check` (planner/doctor/readers/torchtitan.py, from_torchtitan).

parallelism.pipeline_parallel_degree, _schedule (torchtitan's names: 1F1B, GPipe, Interleaved1F1B,
InterleavedZeroBubble, DualPipeV), _microbatch_size (the pipeline microbatch: training.local_batch_size / it =
the microbatches of one step), module_fqns_per_model_part (the stages' module names) or _layers_per_stage
(torchtitan derives the stages from it), _first / _last_stage_less_layers. How torchtitan splits the blocks
when the file names no modules is torchtitan's own _generate_llm_fqn_per_model_part
(torchtitan/distributed/pipeline_parallel.py), mirrored in planner/emit/torchtitan/split.py; the estimate prices the
even split (cost_models/pipeline.blocks_per_stage), and check says when the two differ.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from cost_models.schedules import Schedule

from planner.errors import PlannerError
from planner.doctor.readers.common import _int
from planner.emit.torchtitan.split import generated_blocks_per_stage

KEY = "parallelism.pipeline_parallel_{}"
FQNS = "parallelism.module_fqns_per_model_part"
_LAYER = re.compile(r"layers\.(\d+)$")


@dataclass(frozen=True)
class PipelineSettings:
    pp: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    microbatch_size: int = 1
    parts: tuple[tuple[str, ...], ...] = ()   # module_fqns_per_model_part, as written
    layers_per_stage: int | None = None
    first_less: int = 1                       # pipeline_parallel_first_stage_less_layers (torchtitan's default 1)
    last_less: int = 1

    def stages(self, n_layers: int) -> int:
        """Stages in all, as torchtitan derives them (parts; else layers_per_stage; else the schedule's V)."""
        if self.parts:
            return len(self.parts)
        if self.layers_per_stage:
            return math.ceil((n_layers + self.first_less + self.last_less) / self.layers_per_stage)
        return self.pp * self.schedule.default_stages_per_rank

    def stages_per_rank(self, n_layers: int) -> int:
        n = self.stages(n_layers)
        if n % self.pp:
            raise PlannerError(FQNS if self.parts else KEY.format("layers_per_stage"),
                               f"{n} stages do not divide over pipeline_parallel_degree={self.pp} ranks (torchtitan "
                               "raises); give a multiple of the degree")
        return n // self.pp

    def blocks_per_stage(self, n_layers: int) -> tuple[int, ...]:
        """The blocks of each stage as torchtitan runs them."""
        if self.parts:
            return tuple(sum(bool(_LAYER.match(name)) for name in part) for part in self.parts)
        n = self.stages(n_layers)
        blocks = generated_blocks_per_stage(n_layers, n, self.first_less, self.last_less)
        if blocks is None:
            raise PlannerError(KEY.format("layers_per_stage" if self.layers_per_stage else "degree"),
                               f"torchtitan cannot split {n_layers} blocks over {n} stages with the embedding counted "
                               f"as {self.first_less} and the head as {self.last_less} blocks (it raises); name the "
                               f"modules ({FQNS}) or change the stages")
        return blocks


def _schedule(settings: dict) -> Schedule:
    key = KEY.format("schedule")
    name = str(settings.get(key, "1F1B")).strip()
    for schedule in Schedule:
        if schedule.torchtitan_name.lower() == name.lower():
            return schedule
    raise PlannerError(key, f"{name!r} is not priced by fsdp-plan; choose one of: "
                            f"{', '.join(s.torchtitan_name for s in Schedule)}")


def _parts(value) -> tuple[tuple[str, ...], ...]:
    """module_fqns_per_model_part: a TOML list of lists, or the flags' words (one per part, names comma-joined)."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, (list, str)) for p in value):
        raise PlannerError(FQNS, f"expected lists of module names (--{FQNS} tok_embeddings,layers.0 layers.1,norm,"
                                 f"lm_head), got {value!r}")
    parts = tuple(tuple(str(n).strip() for n in (p if isinstance(p, list) else p.split(",")) if str(n).strip())
                  for p in value)
    if any(not p for p in parts):
        raise PlannerError(FQNS, "a model part without modules (torchtitan needs at least one per stage)")
    return parts


def torchtitan_pipeline(settings: dict, local_batch_size: int) -> PipelineSettings:
    """The file's pipeline settings (pp 1: none). PlannerError, naming the key, for what torchtitan refuses or
    fsdp-plan does not price: a schedule from a CSV file, a local batch the microbatch size does not divide."""
    pp = _int(settings, KEY.format("degree"), 1)
    if pp < 1:
        raise PlannerError(KEY.format("degree"), f"must be >= 1, got {pp}")
    if pp == 1:
        return PipelineSettings()
    if settings.get(KEY.format("schedule_csv")):
        raise PlannerError(KEY.format("schedule_csv"), "a schedule read from a CSV file is not priced by fsdp-plan; "
                                                       "leave it empty and name the schedule")
    size = _int(settings, KEY.format("microbatch_size"), 1)
    if size < 1 or local_batch_size % size:
        raise PlannerError(KEY.format("microbatch_size"), f"{size} must divide training.local_batch_size "
                                                          f"({local_batch_size}) into whole microbatches")
    layers = settings.get(KEY.format("layers_per_stage"))
    per_stage = _int(settings, KEY.format("layers_per_stage"), 0) if layers is not None else None
    if per_stage is not None and per_stage < 1:
        raise PlannerError(KEY.format("layers_per_stage"), f"must be >= 1, got {per_stage}")
    return PipelineSettings(pp=pp, schedule=_schedule(settings), microbatch_size=size,
                            parts=_parts(settings.get(FQNS)), layers_per_stage=per_stage,
                            first_less=_int(settings, KEY.format("first_stage_less_layers"), 1),
                            last_less=_int(settings, KEY.format("last_stage_less_layers"), 1))
