"""What a candidate hands to PyTorch: FSDP1's FullyShardedDataParallel kwargs, FSDP2's fully_shard arguments,
the device mesh and the pipeline's schedule and stage split."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cost_models.schedules import Schedule
from planner.schemas.common import TorchDtype, _Out, absent_or


class Fsdp1MixedPrecision(_Out):
    param_dtype: absent_or(TorchDtype, "absent: parameters stay in their own dtype")
    reduce_dtype: TorchDtype
    cast_forward_inputs: absent_or(Literal[True], "LoRA: every unit casts its inputs")


class CpuOffload(_Out):
    offload_params: Literal[True]


class ModuleWrapPolicy(_Out):
    ModuleWrapPolicy: list[str] = Field(description="block class names, each its own FSDP unit")


class CustomPolicyArgs(_Out):
    blocks: list[str]
    trainable_leaves: bool


class CustomPolicy(_Out):
    CustomPolicy: CustomPolicyArgs = Field(description="LoRA: blocks and their trainable adapters as units")


class FsdpKwargs(_Out):
    """FullyShardedDataParallel (FSDP1) keyword arguments by name; enums as member names."""

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
    mixed_precision: Fsdp1MixedPrecision | None
    cpu_offload: CpuOffload | None
    auto_wrap_policy: ModuleWrapPolicy | CustomPolicy
    backward_prefetch: Literal["BACKWARD_PRE"] | None
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool
    sync_module_states: bool


class MpPolicy(_Out):
    param_dtype: TorchDtype | None
    reduce_dtype: TorchDtype


class Mesh(_Out):
    shape: list[int] = Field(description="ranks per mesh dimension")
    dim_names: list[Literal["pp", "dp_replicate", "dp_shard", "cp", "tp"]] = Field(
        description="torchtitan's order, outermost first; the dims of size > 1 with a mesh (dp_shard always)")


class FullyShardKwargs(_Out):
    """FSDP2 fully_shard keyword arguments of each block by name, with the DeviceMesh layout."""

    reshard_after_forward: bool | int = Field(description="bool, or the rank group blocks reshard to")
    mp_policy: MpPolicy | None
    offload_policy: Literal["CPUOffloadPolicy"] | None
    shard_placement_fn: absent_or(str, "a Python lambda (expert_shard_dim 1)")
    root_reshard_after_forward: absent_or(bool, "with an int reshard_after_forward: the root's own")
    mesh: Mesh


class PipelineStage(_Out):
    index: int = Field(ge=0, description="0 .. pp x V - 1, in the model's order")
    rank: int = Field(ge=0, description="the pipeline rank that runs it")
    first_block: int
    n_blocks: int = Field(ge=0, description="0: the embedding or the head alone (an end stage)")
    embedding: bool = Field(description="the token embedding is on this stage")
    head: bool = Field(description="the final norm, the head and the loss are on this stage")
    description: str


class Pipeline(_Out):
    """planner.reports.table_pipeline.pipeline_dict: the schedule, the microbatches and the stage split."""

    schedule: Literal[tuple(s.value for s in Schedule)]
    torchtitan_schedule: str = Field(description="parallelism.pipeline_parallel_schedule")
    stages_per_rank: int = Field(ge=1)
    microbatches: int = Field(ge=1, description="microbatches of one schedule step (config.grad_accum)")
    microbatch_size: int = Field(ge=1, description="sequences per microbatch (config.micro_batch)")
    local_batch: int = Field(ge=1, description="sequences per data-parallel rank per step")
    stages: list[PipelineStage]
