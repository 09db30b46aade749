"""The JSON Schemas of every `--format json` output: pydantic models that describe, field by field, what
planner/reports/table.py, planner/tracing.py, planner/doctor/, planner/reports/table_calibration.py and
planner/reports/explain.py write.

    fsdp-plan schema plan                  # print one (plan, estimate, trace, calibrate, check, explain, rl,
                                           # rl-estimate)
    python -m planner.schemas docs/schemas # write docs/schemas/NAME.schema.json (tests/cli/test_schemas.py
                                           # fails when those files are stale)

The writers build plain dicts on their hot path; these models only describe them. Every model forbids extra
keys (`additionalProperties: false`), so tests/cli/test_schemas.py, which validates real CLI outputs against
the schemas, fails as soon as a writer adds, drops or renames a field without the schema following.

Shipped: the schemas are generated at runtime from these models (the package holds the models, not copies
of the JSON); docs/schemas/ holds the same text for readers without the package.

Versioning: SCHEMA_VERSION names the shape of all the outputs together and sits in each schema's `$id`
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
from pathlib import Path

from pydantic import BaseModel

from planner.schemas.common import SCHEMA_VERSION
from planner.schemas.candidate import CheckOutput, EstimateOutput, PlanOutput
from planner.schemas.trace import TraceOutput
from planner.schemas.explain import ExplainOutput
from planner.schemas.calibrate import CalibrateOutput
from planner.schemas.rl import RlEstimateOutput, RlPlanOutput

# "rl-estimate" is also what `fsdp-plan check` writes for a verl script or a TRL GRPOConfig
OUTPUTS: dict[str, type[BaseModel]] = {"plan": PlanOutput, "estimate": EstimateOutput, "trace": TraceOutput,
                                       "calibrate": CalibrateOutput, "check": CheckOutput, "explain": ExplainOutput,
                                       "rl": RlPlanOutput, "rl-estimate": RlEstimateOutput}


def json_schema(name: str) -> dict:
    """The JSON Schema (draft 2020-12) of `fsdp-plan NAME --format json`'s output."""
    from planner.errors import PlannerError

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
