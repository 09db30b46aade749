"""A candidate's memory and time as the estimate writes them: the peak's breakdown by category, the pipeline's
ranks, the step time's terms."""

from __future__ import annotations


from typing import Literal

from pydantic import Field

from planner.schemas.common import Bytes, Seconds, _Out, absent_or


class MemoryBreakdown(_Out):
    """cost_models.memory.MemoryBreakdown: bytes per rank at the peak moment, by category."""

    sharded_params: Bytes
    unsharded_params: Bytes
    sharded_grads: Bytes
    unsharded_grads: Bytes
    optimizer_state: Bytes
    activations: Bytes
    logits_and_loss: Bytes
    optimizer_temporaries: Bytes
    collective_buffers: Bytes


class PipelineRank(_Out):
    """cost_models.memory.PipelineRankMemory: one pipeline rank's stages and peak."""

    rank: int = Field(ge=0, description="the pipeline rank (pp mesh coordinate)")
    stages: list[int] = Field(description="the stages it runs, in the model's order")
    description: str = Field(description="its stages in words ('embedding + blocks 0-7')")
    peak_allocated_bytes: Bytes
    peak_reserved_bytes: Bytes
    peak_moment: str
    breakdown: MemoryBreakdown


class HostRam(_Out):
    """cost_models.host_ram.HostRam: host RAM per node (rank 0's, the busiest), by what holds it."""

    peak_bytes: Bytes = Field(description="bytes per node: processes + the largest of load, offloaded state + "
                                          "checkpoint save, offloaded state + resume; compared with "
                                          "--cpu-ram-per-node")
    process_bytes: Bytes = Field(description="bytes per node: the ranks' processes (torch and the process group; "
                                             "a floor: CUDA's host pages and dataloader workers not counted)")
    offloaded_bytes: Bytes = Field(description="bytes per node: CPU offload's params, grads and optimizer state")
    load_bytes: Bytes = Field(description="bytes per node while the pretrained weights are read (load_way)")
    checkpoint_save_bytes: Bytes = Field(description="bytes per node during one checkpoint save (save_way)")
    resume_bytes: Bytes = Field(description="bytes per node while a checkpoint is read back (resume_way)")
    save_gpu_bytes: Bytes = Field(description="bytes per GPU the save adds on the device (a full gather's unit or "
                                              "tensor; FSDP1's DCP: a unit's state gathered; 0 with FSDP2's DCP)")
    load_gpu_bytes: Bytes = Field(description="bytes per GPU loading the pretrained weights adds on the device (a "
                                              "broadcast tensor or unit, new local shards), beside the sharded params")
    resume_gpu_bytes: Bytes = Field(description="bytes per GPU a resume adds on the device beside the sharded params "
                                                "and optimizer state (FSDP1's DCP: its gathers and the new states)")
    load_way: Literal["every-rank", "rank0-broadcast", "meta-dcp"]
    save_way: Literal["dcp", "dcp-async", "full-state-dict", "save-pretrained"]
    resume_way: Literal["every-rank", "rank0-broadcast", "meta-dcp"]
    why: str = Field(description="why these ways, with what the others would take")


class FirstStep(_Out):
    """The first training step against the steady one (MemoryEstimate.first_step_dict): torch's optimizers make their
    state lazily, in the first step's optimizer step."""

    peak_allocated_bytes: Bytes = Field(description="bytes per rank: the first step's allocated peak (its forward and "
                                                    "backward without the optimizer state; at most the steady "
                                                    "peak_allocated_bytes)")
    optimizer_state_bytes: Bytes = Field(description="bytes per rank of optimizer state on the GPU, made in the first "
                                                     "optimizer step beside the gradients and the step's temporaries")
    peak_reserved_bytes: absent_or(int, "bytes per rank reserved at the end of the first step, + "
                                        "outside_allocator_bytes (the step replay's first step alone; absent where "
                                        "the flat rule prices the reserved)")


class Memory(_Out):
    """The analytic per-rank memory estimate (with PP: the largest pipeline rank's, each rank in pipeline_ranks)."""

    peak_allocated_bytes: Bytes = Field(description="bytes per rank: what torch.cuda.max_memory_allocated would show")
    peak_reserved_bytes: Bytes = Field(description="bytes per rank: the caching allocator's reserved (allocated peak + "
                                                   "fragmentation) + outside_allocator_bytes, compared with the GPU's "
                                                   "memory")
    outside_allocator_bytes: Bytes = Field(description="bytes per rank outside PyTorch's caching allocator (CUDA "
                                                       "context, NCCL communicators, symmetric memory, DeepEP); "
                                                       "peak_reserved_bytes minus this is what "
                                                       "torch.cuda.max_memory_reserved shows")
    peak_phase: str = Field(description='phase of the peak: "backward" or "optimizer_step"')
    peak_moment: str = Field(description='what runs at the peak: "loss backward", "backward of block 31", ...')
    breakdown: MemoryBreakdown
    cpu_bytes_per_node: int = Field(description="bytes of CPU RAM per node the offloaded state needs")
    host_ram: absent_or(HostRam, "host RAM per node, loading and checkpoints included (the estimate's; the trace "
                                 "tier leaves it out)")
    first_step: absent_or(FirstStep, "the first step against the steady one (the estimate's; the trace tier leaves "
                                     "it out)")
    notes: list[str]
    pipeline_ranks: absent_or(list[PipelineRank], "with pp > 1: every pipeline rank's memory (the headline "
                                                  "figures are the largest one's)")


class TimeBreakdown(_Out):
    """cost_models.step_time.TimeBreakdown without its headline figures: seconds per optimizer step."""

    compute_s: Seconds = Field(description="s: all micro-steps' compute, recompute included")
    recompute_s: Seconds = Field(description="s: the part of compute_s re-running checkpointed forwards")
    matmul_s: Seconds = Field(description="s: matmuls (block linears, experts, head), recompute excluded")
    attention_s: Seconds = Field(description="s: attention kernels, recompute excluded")
    memory_bound_s: Seconds = Field(description="s: norms, activations, rotary, residuals, loss, casts, copies")
    exposed_comm_s: Seconds = Field(description="s: communication not hidden behind compute")
    overlap_slowdown_s: Seconds = Field(description="s: compute slowed by NCCL kernels running beside it")
    total_comm_s: Seconds = Field(description="s: all collective time, hidden or not (for information)")
    offload_copy_s: Seconds = Field(description="s: CPU offload host<->device copies")
    optimizer_s: Seconds = Field(description="s: the optimizer step (GPU, or CPU with offload)")
    overhead_s: Seconds = Field(description="s: fixed per-micro-step cost")
    tp_comm_s: Seconds = Field(description="s: tensor parallel's collectives (of total_comm_s), hidden or not")
    tp_exposed_comm_s: Seconds = Field(description="s: tensor parallel's collectives not hidden (of exposed_comm_s)")
    cp_comm_s: Seconds = Field(description="s: context parallel's ring exchanges (of total_comm_s), hidden or not")
    cp_exposed_comm_s: Seconds = Field(description="s: context parallel's ring exchanges not hidden behind the "
                                                   "attention (of exposed_comm_s)")
    ep_comm_s: Seconds = Field(description="s: expert parallel's dispatch and combine all-to-alls (of total_comm_s "
                                           "and exposed_comm_s: priced exposed)")
    pp_bubble_s: absent_or(float, "s: the pipeline schedule's bubble (ranks idle while it fills and drains)")
    pp_imbalance_s: absent_or(float, "s: the slowest stage's extra (embedding, head and loss) over the others")
    pp_comm_s: absent_or(float, "s: stage-to-stage sends of activations and gradients not hidden (of "
                                "exposed_comm_s)")


class Time(_Out):
    """The analytic step time of one optimizer step."""

    step_s: Seconds = Field(description="s per optimizer step")
    tokens_per_s_per_gpu: float = Field(description="tokens per second per GPU")
    mfu: float = Field(description="model FLOPs utilisation, 0-1 (torchtitan's count, no recompute)")
    breakdown: TimeBreakdown
    hfu: float = Field(description="hardware FLOPs utilisation, 0-1 (recompute included)")
