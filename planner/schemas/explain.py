"""`fsdp-plan explain --format json`: the estimate with its terms in words (formulas with their numbers)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from planner.schemas.common import _Out
from planner.schemas.candidate import EstimateOutput


class Term(_Out):
    term: str = Field(description='what is costed: "stored parameters", "matmul", ...')
    formula: str = Field(description="the formula with this configuration's numbers (text, units written out)")
    source: str = Field(description="where the formula comes from")


class Explanation(_Out):
    memory: list[Term] = Field(description="per-GPU memory at the peak moment, category by category")
    time: list[Term] = Field(description="the optimizer step: FLOPs per token, each operator class, the step")


class ExplainOutput(EstimateOutput):
    """`fsdp-plan explain --format json`: estimate's shape for the configuration explained, with the terms
    `fsdp-plan explain` prints (the same text) under "explanation"."""

    chosen_by: Literal["plan", "flags"] = Field(description="plan: the planner's pick; flags: the config given")
    explanation: Explanation
