"""The outputs built around one priced configuration: `estimate`, `plan` (its candidates and nearest misses)
and `check` (the estimate plus the doctor's findings)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from planner.schemas.common import Config, ModelSummary, Training, _Out, absent_or
from planner.trainers import TRAINERS
from planner.schemas.budget import Memory, Time
from planner.schemas.fsdp_arguments import FsdpKwargs, FullyShardKwargs, Pipeline


class Candidate(_Out):
    """api.Candidate.to_dict(): one costed configuration."""

    trainer: Literal[tuple(TRAINERS)] = Field(description="the trainer that runs it (`--trainer`, planner/trainers): "
                                                          "the search proposed only what it runs, priced with its "
                                                          "defaults")
    training: Training
    config: Config
    pipeline: absent_or(Pipeline, "with pp > 1: the pipeline's schedule, microbatches and stage split")
    fits: bool
    reasons: list[str] = Field(description="why it does not fit (empty when it fits)")
    memory: Memory
    time: Time
    fsdp_kwargs: FsdpKwargs
    fully_shard_kwargs: FullyShardKwargs


class EstimateOutput(Candidate):
    """`fsdp-plan estimate --format json`: one configuration, costed."""

    model: ModelSummary


class Verification(_Out):
    """tracing.Verification.to_dict(): the trace tier's check of a planned candidate (--verify-top)."""

    confirmed: bool = Field(description="the traced peak reserved (allocator replay + the memory outside the allocator) fits "
                                        "the GPU")
    traced_peak_allocated_bytes: int | None = Field(description="bytes per rank; null: not traced")
    traced_peak_reserved_bytes: int | None = Field(description="bytes per rank; null: not traced")
    analytic_vs_trace: float | None = Field(description="(estimate - trace) / trace of the allocated peak")
    reason: str = Field(description="why not confirmed, or not traced (empty when confirmed)")


class PlanCandidate(Candidate):
    verification: absent_or(Verification, "--verify-top: the trace tier's check (top K only)")


class Cluster(_Out):
    gpu: str = Field(description="GPU id in the catalog (`fsdp-plan gpus`)")
    gpus: int
    gpus_per_node: int
    power_limit_w: absent_or(float, "the board power cap the GPUs are priced under, watts (--power-limit-w, or the "
                                    "catalog's: h100-96gb 500): matmul and attention at (cap / TDP)^(1/3) of their "
                                    "rates (absent: at TDP)")
    tdp_w: absent_or(float, "with power_limit_w: the GPU's board power (datasheet TDP), watts")


class PlanOutput(_Out):
    """`fsdp-plan --format json` (also with --verify-top K): the ranked candidates."""

    model: ModelSummary
    cluster: Cluster
    candidates: list[PlanCandidate] = Field(description="best first (--top of them); when nothing fits, the "
                                                        "nearest misses (fits: false)")
    suggestions: list[str] = Field(description="when nothing fits: what single change would make it fit")
    n_costed: int = Field(description="configurations costed")
    notes: absent_or(list[str], "about the space searched, one line each (e.g. data parallelism alone cannot "
                                "use the GPUs, and the way out)")
    verified_top: absent_or(int, "--verify-top: how many candidates the trace tier checked")


class Finding(_Out):
    code: str
    severity: Literal["error", "warning", "advice"]
    message: str
    fix: str


class CheckOutput(EstimateOutput):
    """`fsdp-plan check --format json`: the user's setup, costed, and what is wrong with it."""

    source: str = Field(description="what was read: the file's path and dialect, or 'flags'")
    fsdp_version: Literal[1, 2]
    findings: list[Finding] = Field(description="errors first, then warnings, then advice")
