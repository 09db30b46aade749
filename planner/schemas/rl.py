"""`fsdp-plan rl estimate --format json` (planner/rl/report.py rl_dict): a verl (or TRL) GRPO configuration's memory
phase by phase, its engine, its batch and whether it runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cost_models.rl_phases import PHASES
from planner.schemas.common import Bytes, ModelSummary, _Out, absent_or


class RlPhase(_Out):
    """cost_models.rl_phases.Phase: one phase's peak on one GPU."""

    name: Literal[PHASES]
    reserved_bytes: Bytes = Field(description="what the GPU must hold: torch's terms with fragmentation and the "
                                              "CUDA context, plus the engine's")
    allocated_bytes: Bytes = Field(description="the sum of gpu_bytes")
    gpu_bytes: dict[str, Bytes] = Field(description="term -> bytes resident or transient at the phase's peak")
    offloaded: list[str] = Field(description="what is on the host or discarded (the engine asleep) meanwhile")
    note: str


class RlHost(_Out):
    """cost_models.rl_host.HostRam: peak = process_bytes + max(load_bytes, sum(terms) + checkpoint_staging_bytes,
    sync_bytes)."""

    terms: dict[str, int] = Field(description="term -> bytes per node held on the host between phases")
    process_bytes: int = Field(description="the workers' processes per node (a floor)")
    load_bytes: int = Field(description="rank 0's node loading the actor, before anything is offloaded")
    checkpoint_staging_bytes: int = Field(description="bytes per node a checkpoint save stages on top")
    sync_terms: dict[str, int] = Field(description="term -> bytes per node a LoRA actor's weight sync adds on the host "
                                                   "(verl: the merge's base backup, or the first sync's base)")
    sync_bytes: int = Field(description="the weight sync's moment per node: the terms it leaves on the host and "
                                        "sync_terms (0: none)")


class RlMemory(_Out):
    peak_reserved_bytes: Bytes = Field(description="the worst phase's reserved bytes")
    peak_phase: Literal[PHASES]
    cpu_bytes_per_node: int = Field(description="host RAM per node at its peak (host.* says which)")
    cpu_ram_capacity_bytes: int = Field(description="--cpu-ram-per-node (0: unknown, not checked)")
    capacity_bytes: Bytes = Field(description="the GPU's memory")
    phases: list[RlPhase] = Field(description="in the framework's order (verl's, or TRL's own: the phases it runs, "
                                              "cost_models/rl_schedule.py)")
    host: RlHost


class RlEngine(_Out):
    """cost_models.rollout_engine.EngineMemory with its settings."""

    engine: Literal["vllm", "sglang"]
    version: str
    gpu_memory_utilization: float
    tp: int
    weights_bytes: Bytes
    kv_bytes: Bytes
    kv_blocks: int = Field(description="vLLM blocks of block_size tokens (SGLang: tokens)")
    kv_tokens: int
    max_concurrent_seqs: int = Field(description="sequences of prompt + response the KV cache holds at once")
    cuda_graph_bytes: Bytes
    activation_peak_bytes: Bytes


class RlBatch(_Out):
    """cost_models.rl_batch.BatchPlan."""

    data_parallel: int
    sequences_per_step: int
    mini_batch_seqs_per_rank: int
    micro_batches_per_mini: int = Field(description="with dynamic batches: ceil(tokens / (budget x Ulysses)), "
                                                    "verl's rearrange_micro_batches count")
    update_tokens_per_gpu: int
    log_prob_tokens_per_gpu: int


class RlTime(_Out):
    """cost_models.rl_time.RlTime: one step's estimated seconds by part."""

    generation_s: float
    log_prob_s: float
    update_s: float
    weight_sync_s: float
    offload_s: float
    critic_s: float = Field(description="PPO's critic (values and update); 0 for GRPO")
    reward_s: float = Field(description="a reward model's scoring (its engine's prefill, wake and sleep); 0 without "
                                        "one. On its own pool: only what outlasts generation")
    reward_overlapped_s: float = Field(description="a reward model on its own pool: its scoring overlapped with "
                                                   "generation (verl streams it beside the rollout), not in step_s")
    step_s: float


class RlRewardPool(_Out):
    """A reward model on its own pool (reward_model.enable_resource_pool, cost_models/rl_reward.py): one of its GPUs,
    its engine awake."""

    gpus: int = Field(description="reward_model.n_gpus_per_node x nnodes, beside the trainer's")
    tp: int
    replicas: int
    gpu_memory_utilization: float
    reserved_bytes: Bytes = Field(description="its engine (weights, KV cache, profile-run peak, CUDA graphs) and its "
                                              "process's CUDA context")
    gpu_bytes: dict[str, Bytes]


class RlEstimateOutput(_Out):
    model: ModelSummary
    gpus: int
    gpu: str
    fits: bool
    reasons: list[str]
    notes: list[str] = Field(description="findings beyond the verdict, each with the knob that changes it")
    memory: RlMemory
    engine: RlEngine
    batch: RlBatch
    time: RlTime
    knobs: dict[str, bool | int | float | str] = Field(description="the knobs the search sets, by the request's "
                                                       "names (verl's: planner/emit/verl.py KEYS)")
    estimates: list[str] = Field(description="which figures are estimates rather than the engines' or verl's code")
    reward_pool: absent_or(RlRewardPool, "a reward model on GPUs of its own; absent otherwise")


class RlPlanOutput(_Out):
    """`fsdp-plan rl --format json`: the ranked configurations (the nearest misses when nothing fits)."""

    searched: int = Field(description="configurations in the space: the product of every searched knob's values")
    priced: int = Field(description="configurations priced to find each shared choice's best (planner/rl/search.py)")
    fits: bool
    not_searched: dict[str, str] = Field(description="knobs kept at the request's value, each with why")
    candidates: list[RlEstimateOutput] = Field(description="the best of each dtype and offload choice, fastest "
                                               "first; when nothing fits, smallest peak first")
