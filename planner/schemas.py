"""The JSON Schemas of every `--format json` output: pydantic models that describe, field by field, what
planner/reports/table.py, planner/tracing.py, planner/doctor/, planner/reports/table_calibration.py and
planner/reports/explain.py write.

    fsdp-plan schema plan                  # print one (plan, estimate, trace, calibrate, check, explain)
    python -m planner.schemas docs/schemas # write docs/schemas/NAME.schema.json (tests/cli/test_schemas.py
                                           # fails when those files are stale)

The writers build plain dicts on their hot path; these models only describe them. Every model forbids extra
keys (`additionalProperties: false`), so tests/cli/test_schemas.py, which validates real CLI outputs against
the schemas, fails as soon as a writer adds, drops or renames a field without the schema following.

Shipped: the schemas are generated at runtime from these models (the package holds the models, not copies
of the JSON); docs/schemas/ holds the same text for readers without the package.

Versioning: SCHEMA_VERSION names the shape of all six outputs together and sits in each schema's `$id`
(urn:fsdp-planner:schema:NAME:vN) and `x-schema-version`. The schemas are closed, so any change to an
output's shape - a field added, removed, renamed or retyped - bumps it, and docs/schemas/ is regenerated in
the same commit. The outputs themselves carry no version field (scripts depend on their shape as it is).

Shapes worth knowing (kept as they are, since scripts read them):
- Keys of `config` that are off by default (compile, float8, reduce_dtype, expert_shard_dim, ...) are
  absent rather than false or null.
- A trace's memory `breakdown` (and its phases' and the difference's) has the estimate's categories plus
  "other": memory the tracker files under no category (calibration.memtrack.BREAKDOWN_KEYS).
- `plan`'s `candidates` holds the nearest misses (fits: false) when nothing fits.
- `explain`'s terms are text (formulas with their numbers written in): the figures a script computes
  with are the estimate-shaped keys beside them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from calibration.store import RunRecord
from cost_models.schedules import Schedule
from cost_models.specs import Attention, Precision, Sharding

SCHEMA_VERSION = 3  # 3: pipelines (issue 18): config.pp_schedule / pp_stages_per_rank, "pipeline", memory.pipeline_ranks, the time breakdown's pp terms, calibrate's measured.pipeline_ranks

Bytes = Annotated[int, Field(description="bytes per rank (GPU) unless said otherwise")]
Seconds = Annotated[float, Field(description="seconds")]
TorchDtype = Literal["float32", "bfloat16", "float16"]


def _no_default(schema: dict) -> None:
    schema.pop("default", None)


def absent_or(tp, description: str):
    """A key the writer leaves out rather than writing null: optional in the schema, never null."""
    return Annotated[Union[tp, SkipJsonSchema[None]], Field(default=None, description=description,
                                                            json_schema_extra=_no_default)]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------------------ shared pieces

class ModelSummary(_Out):
    """ModelSpec.summary_dict(): the model as the outputs name it."""

    name: str
    n_params: int = Field(description="parameters, all of them (routed experts included)")
    active_params: absent_or(int, "parameters one token's forward uses (mixture-of-experts models only)")
    priced_by: Literal["formula", "block memory profile"] = Field(
        description="which activation model prices it: the family's formulas or a traced block profile")
    activation_profile: absent_or(str, "where the traced block memory profile comes from (when there is one)")


class Config(_Out):
    """FsdpConfig.to_dict(): the configuration. Keys that are off by default are absent, not false."""

    sharding: Literal[tuple(s.value for s in Sharding)]
    precision: Literal[tuple(p.value for p in Precision)]
    offload: bool = Field(description="parameters, gradients and optimizer state offloaded to CPU")
    activation_checkpointing: str = Field(description='"none", "full", "every-K" or "selective-op"')
    micro_batch: int = Field(description="sequences per GPU per micro-step")
    grad_accum: int = Field(description="micro-steps per optimizer step")
    attention: Literal[tuple(a.value for a in Attention)]
    backward_prefetch: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    expert_shard_dim: absent_or(Literal[1], "stacked expert weights sharded on dim 1 (absent: dim 0)")
    expert_units: absent_or(Literal[True], "each block's experts are their own FSDP unit")
    reduce_dtype: absent_or(Literal["fp32", "bf16"], "gradient reduction dtype (absent: the precision's own)")
    compile: absent_or(Literal[True], "torch.compile each block")
    compile_loss: absent_or(Literal[False], "with compile: the loss is left eager (absent: compiled too)")
    float8: absent_or(Literal[True], "torchao Float8 linears")
    fp8_all_gather: absent_or(Literal[True], "Float8 weights all-gathered in FP8")
    reshard_after_forward: absent_or(int, "blocks reshard to a group of this many ranks after forward")
    tp: int = Field(ge=1, description="tensor-parallel degree (1: none)")
    cp: int = Field(ge=1, description="context-parallel degree (1: none)")
    ep: int = Field(ge=1, description="expert-parallel degree (1: none)")
    pp: int = Field(ge=1, description="pipeline-parallel degree (1: none)")
    async_tp: absent_or(Literal[True], "TP's collectives overlapped with the matmuls (torchtitan's async TP)")
    sequence_parallel: absent_or(Literal[False], "with tp > 1: no sequence parallel, logits gathered "
                                                 "(transformers' tp_plan); absent: sequence and loss parallel")
    pp_schedule: absent_or(Literal[tuple(s.value for s in Schedule)], "with pp > 1: the pipeline schedule")
    pp_stages_per_rank: absent_or(int, "with pp > 1: stages on each pipeline rank (V)")


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


class Memory(_Out):
    """The analytic per-rank memory estimate (with PP: the largest pipeline rank's, each rank in pipeline_ranks)."""

    peak_allocated_bytes: Bytes = Field(description="bytes per rank: what torch.cuda.max_memory_allocated would show")
    peak_reserved_bytes: Bytes = Field(description="bytes per rank: allocated peak + fragmentation + CUDA context, "
                                                   "compared with the GPU's memory")
    peak_phase: str = Field(description='phase of the peak: "backward" or "optimizer_step"')
    peak_moment: str = Field(description='what runs at the peak: "loss backward", "backward of block 31", ...')
    breakdown: MemoryBreakdown
    cpu_bytes_per_node: int = Field(description="bytes of CPU RAM per node the offloaded state needs")
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


class Candidate(_Out):
    """api.Candidate.to_dict(): one costed configuration."""

    config: Config
    pipeline: absent_or(Pipeline, "with pp > 1: the pipeline's schedule, microbatches and stage split")
    fits: bool
    reasons: list[str] = Field(description="why it does not fit (empty when it fits)")
    memory: Memory
    time: Time
    fsdp_kwargs: FsdpKwargs
    fully_shard_kwargs: FullyShardKwargs


# ------------------------------------------------------------------------------------------ the outputs

class EstimateOutput(Candidate):
    """`fsdp-plan estimate --format json`: one configuration, costed."""

    model: ModelSummary


class Verification(_Out):
    """tracing.Verification.to_dict(): the trace tier's check of a planned candidate (--verify-top)."""

    confirmed: bool = Field(description="the traced peak + context + fragmentation fits the GPU")
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


class TracedBreakdown(MemoryBreakdown):
    """calibration.memtrack.BREAKDOWN_KEYS: the estimate's categories and what the tracker files under none."""

    other: Bytes


class Snapshot(_Out):
    peak_allocated_bytes: Bytes
    peak_phase: str
    breakdown: TracedBreakdown


class TraceDetails(_Out):
    """calibration.trace.TraceResult.to_dict() less what `memory` holds."""

    phases: dict[str, Snapshot] = Field(description='"forward_backward" and "optimizer_step" windows')
    world_size: int
    shard_group_size: int
    builder: Literal["transformers", "reference"]
    attention: str = Field(description="the attention implementation traced")
    experts: str | None = Field(description='mixture-of-experts kernel ("grouped_mm"); null: no experts')
    seconds: Seconds = Field(description="s the trace took")


class TracedMemory(_Out):
    peak_allocated_bytes: Bytes
    peak_reserved_bytes: Bytes = Field(description="bytes per rank: traced peak + the estimate's fragmentation "
                                                   "and CUDA context")
    peak_phase: str = Field(description='"forward", "backward" or "optimizer_step"')
    breakdown: TracedBreakdown
    cpu_bytes_per_node: Literal[0] = Field(description="the trace tier runs no offload")
    notes: list[str]


class Analytic(_Out):
    source: Literal["analytic"]
    fits: bool
    reasons: list[str]
    memory: Memory


class PeakPhases(_Out):
    analytic: str
    trace: str


class Difference(_Out):
    """analytic - trace."""

    peak_allocated_bytes: int = Field(description="bytes per rank, analytic - trace")
    peak_allocated_relative: float = Field(description="(analytic - trace) / trace, rounded to 4 places")
    peak_phase: PeakPhases
    breakdown: TracedBreakdown = Field(description="bytes per rank by category, analytic - trace (the "
                                                   "estimate has no 'other': 0 - trace)")


class TraceOutput(_Out):
    """`fsdp-plan trace --format json`: estimate's shape with the traced memory, the analytic memory beside it
    and the difference. Step time is the analytic model's: the trace measures memory."""

    model: ModelSummary
    source: Literal["trace"]
    config: Config
    fits: bool = Field(description="the traced peak reserved fits the GPU")
    reasons: list[str]
    memory: TracedMemory
    time: Time
    fsdp_kwargs: FsdpKwargs
    fully_shard_kwargs: FullyShardKwargs
    trace: TraceDetails
    analytic: Analytic
    difference: Difference


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


class CalibrationRun(RunRecord):
    """A results.jsonl record (calibration.store.RunRecord) with the fitted prediction beside it."""

    fitted_step_s: float | None = Field(description="s, predicted with the fitted profile; null without a fit")
    extrapolated_step_s: float | None = Field(description="s, --layers: at the full depth")
    extrapolated_peak_bytes: int | None = Field(description="bytes per rank, --layers: at the full depth")


class FitSummary(_Out):
    fitted: list[str] = Field(description="the profile coefficients fitted")
    step_error_before: float = Field(description="RMS relative step-time error with the starting profile")
    step_error_after: float = Field(description="RMS relative step-time error with the fitted profile")
    notes: list[str]
    identified: dict[str, float] = Field(description="coefficient -> relative standard error")
    not_identified: list[str] = Field(description="fitted, but the runs barely moved them")


class CalibrateOutput(_Out):
    """`fsdp-plan calibrate --format json`: the runs, the fit and the re-ranking. Multi-node without --launch
    runs nothing: `runs` is empty and `commands` holds what to run on each node."""

    model: str
    runs: list[CalibrationRun] = Field(description="every run in results.jsonl of this model and cluster")
    new_runs: list[str] = Field(description="run_id of the runs made by this invocation")
    skipped_runs: list[str] = Field(description="run_id of the runs --resume found in results.jsonl")
    fit: FitSummary | None
    profile_path: str | None
    ranked: list[str] = Field(description="run_id of the measured runs, by measured tokens/s per GPU")
    best: Config | None = Field(description="the fastest measured configuration")
    notes: list[str]
    commands: list[str] = Field(description="multi-node without --launch: the commands to run")


OUTPUTS: dict[str, type[BaseModel]] = {"plan": PlanOutput, "estimate": EstimateOutput, "trace": TraceOutput,
                                       "calibrate": CalibrateOutput, "check": CheckOutput, "explain": ExplainOutput}


def json_schema(name: str) -> dict:
    """The JSON Schema (draft 2020-12) of `fsdp-plan NAME --format json`'s output."""
    from .errors import PlannerError

    if name not in OUTPUTS:
        raise PlannerError("schema", f"no schema for {name!r}; choose one of: {', '.join(OUTPUTS)}")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"urn:fsdp-planner:schema:{name}:v{SCHEMA_VERSION}", "x-schema-version": SCHEMA_VERSION,
            **OUTPUTS[name].model_json_schema()}


def schema_text(name: str) -> str:
    """The schema as written to docs/schemas/NAME.schema.json and printed by `fsdp-plan schema NAME`."""
    return json.dumps(json_schema(name), indent=2) + "\n"


def write_schemas(directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in OUTPUTS:
        path = out / f"{name}.schema.json"
        path.write_text(schema_text(name))
        paths.append(path)
    return paths


if __name__ == "__main__":  # python -m planner.schemas docs/schemas
    for p in write_schemas(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas"):
        print(p)
