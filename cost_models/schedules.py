"""Pipeline schedules by the names torchtitan and torch.distributed.pipelining give them.

shared/reference/parallelism.md ("Pipeline parallel"): GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush,
Narayanan et al. 2021), interleaved 1F1B (Narayanan et al. SC21), zero bubble (Qi et al. 2023) and DualPipeV
(DeepSeek-V3 report). Looped schedules run several stages per rank: the interleaved ones place stage s on rank
s mod pp ("loop" style), DualPipeV folds the stages into a V (rank r holds stages r and 2 pp - 1 - r).
"""

from __future__ import annotations

from enum import Enum


class Schedule(str, Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZERO_BUBBLE = "zero-bubble"
    DUALPIPEV = "dualpipev"

    @property
    def torch_class(self) -> str:
        """The class in torch.distributed.pipelining.schedules."""
        return {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                "zero-bubble": "ScheduleInterleavedZeroBubble", "dualpipev": "ScheduleDualPipeV"}[self.value]

    @property
    def torchtitan_name(self) -> str:
        """parallelism.pipeline_parallel_schedule (torchtitan strips the class's "Schedule")."""
        return self.torch_class.removeprefix("Schedule")

    @property
    def looped(self) -> bool:
        """Several stages per rank (pp_stages_per_rank > 1 allowed; torch's PipelineScheduleMulti)."""
        return self in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE, Schedule.DUALPIPEV)

    @property
    def v_shaped(self) -> bool:
        """Stages folded into a V (torch's generate_stage_to_rank_mapping style "v"): the first and last
        stage on rank 0."""
        return self is Schedule.DUALPIPEV

    @property
    def split_backward(self) -> bool:
        """The backward split into an input pass (I) and a weight pass (W) run later (torch's
        stage_backward_input / stage_backward_weight)."""
        return self in (Schedule.ZERO_BUBBLE, Schedule.DUALPIPEV)

    @property
    def default_stages_per_rank(self) -> int:
        return 2 if self.looped else 1
