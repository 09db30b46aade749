"""Pipeline stages of one candidate: which blocks each stage runs, which stages each pipeline rank holds, and the
rules a schedule puts on blocks and microbatches.

The split (printed with the candidate, emitted as torchtitan's module_fqns_per_model_part and as the fsdp2
snippet's stage modules): the n_layers blocks divided as evenly as whole blocks allow over pp x V stages, the
embedding on the first stage, the final norm, head and loss on the last. Where the blocks do not divide, the
stages with one block fewer are the end ones first (0, S - 1, 1, S - 2, ...): the first and last also hold the
embedding and the head (torchtitan's first/last_stage_less_layers does the same by default). With up to two
stages more than blocks the end stages hold the embedding alone and the head alone (how the Llama 3 405B
golden rows read the paper's one-layer chunks: tests/golden/test_pipeline_rows.py).

Stage-to-rank placement is torch's generate_stage_to_rank_mapping: "loop" (stage s on rank s mod pp) for
single-stage and interleaved schedules, "v" for DualPipeV (rank r holds stages r and 2 pp - 1 - r).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .feasibility import Refusal
from .schedules import Schedule
from .specs import FsdpConfig, ModelSpec


@dataclass(frozen=True)
class Stage:
    index: int            # 0 .. pp x V - 1, in the model's order
    rank: int             # pipeline rank (the pp mesh coordinate) that runs it
    first_block: int
    n_blocks: int
    embedding: bool       # the token embedding (and position embedding) is here
    head: bool            # the final norm, the LM head and the loss are here

    @property
    def blocks(self) -> range:
        return range(self.first_block, self.first_block + self.n_blocks)

    def describe(self) -> str:
        """'embedding + blocks 0-7', 'blocks 8-15 + norm + head + loss', 'embedding' (no blocks)."""
        last = self.first_block + self.n_blocks - 1
        blocks = ([] if not self.n_blocks else
                  [f"blocks {self.first_block}-{last}" if self.n_blocks > 1 else f"block {self.first_block}"])
        parts = (["embedding"] if self.embedding else []) + blocks
        return " + ".join(parts + (["norm + head + loss"] if self.head else []))


def blocks_per_stage(n_blocks: int, n_stages: int) -> tuple[int, ...]:
    """Whole blocks per stage, as even as they go; the end stages take one fewer first."""
    base, extra = divmod(n_blocks, n_stages)
    ends_first = sorted(range(n_stages), key=lambda s: (min(s, n_stages - 1 - s), s))
    fewer = set(ends_first[:n_stages - extra])
    return tuple(base if s in fewer else base + 1 for s in range(n_stages))


def stage_rank(stage: int, pp: int, schedule: Schedule) -> int:
    """torch.distributed.pipelining's generate_stage_to_rank_mapping, "loop" or "v" style."""
    if schedule.v_shaped:
        lap, position = divmod(stage, pp)
        return position if lap % 2 == 0 else pp - 1 - position
    return stage % pp


def stages(model: ModelSpec, config: FsdpConfig) -> tuple[Stage, ...]:
    """Every stage of the candidate's pipeline, in the model's order (one stage holding everything with pp 1)."""
    return _stages(model.n_layers, config.pp_stages, config.pp, config.pp_schedule)


@lru_cache(maxsize=1024)
def _stages(n_layers: int, n_stages: int, pp: int, schedule: Schedule) -> tuple[Stage, ...]:
    """stages() by what it reads, cached: a pipeline candidate's memory asks each rank's (the search, thousands)."""
    counts = blocks_per_stage(n_layers, n_stages)
    out, first = [], 0
    for s, n in enumerate(counts):
        out.append(Stage(s, stage_rank(s, pp, schedule), first, n, s == 0, s == n_stages - 1))
        first += n
    return tuple(out)


def rank_stages(model: ModelSpec, config: FsdpConfig, rank: int) -> tuple[Stage, ...]:
    """The stages pipeline rank `rank` holds, in the model's order."""
    return tuple(s for s in stages(model, config) if s.rank == rank)


def stage_refusals(model: ModelSpec, config: FsdpConfig) -> list[Refusal]:
    """What the model allows: a block in every stage but the end ones, which may hold the embedding or the head
    alone (at most two stages more than blocks)."""
    if config.pp == 1 or config.pp_stages <= model.n_layers + 2:
        return []
    v = config.pp_stages_per_rank
    most = (model.n_layers + 2) // v
    return [Refusal("pp", "pp-more-stages-than-blocks",
                    f"pp={config.pp} x {v} stage{'s' if v > 1 else ''} per rank = {config.pp_stages} stages for the "
                    f"{model.n_layers} blocks of {model.name}",
                    f"use pp <= {most}" + (" or fewer stages per rank" if v > 1 else ""), priced=False)]


def microbatch_refusal(config: FsdpConfig) -> Refusal | None:
    """What the schedule needs of the microbatches (local batch / micro_batch = grad_accum); torch raises on these."""
    if config.pp == 1:
        return None
    schedule, m, n_stages = config.pp_schedule, config.pp_microbatches, config.pp_stages
    if schedule in (Schedule.ONE_F_ONE_B, Schedule.DUALPIPEV) and m < n_stages:
        return Refusal("micro_batch", "pp-too-few-microbatches",
                       f"{schedule.value} needs at least as many microbatches as stages ({n_stages}); the local batch "
                       f"makes {m} of micro-batch {config.micro_batch}",
                       "use a larger global batch, a smaller micro-batch, or the gpipe schedule", priced=False)
    rounds = max(1, m // config.pp)
    if schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE) and m % rounds:
        return Refusal("micro_batch", "pp-microbatches-not-rounds",
                       f"{schedule.value} needs the microbatches ({m}) to be a multiple of microbatches // pp = "
                       f"{rounds}", f"use a multiple of pp={config.pp} microbatches", priced=False)
    return None


def pipeline_refusals(model: ModelSpec, config: FsdpConfig) -> list[Refusal]:
    refusal = microbatch_refusal(config)
    return stage_refusals(model, config) + ([refusal] if refusal else [])
