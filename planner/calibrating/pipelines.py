"""What the calibration runner's pipeline (calibration/runner_pipeline.py) can run: one line for a pipeline
candidate it cannot, before anything is launched."""

from __future__ import annotations

from cost_models.specs import FsdpConfig, Precision

from .request import CalibrationRequest, Target


def pipeline_refusal(request: CalibrationRequest, target: Target, config: FsdpConfig) -> tuple[str, str] | None:
    """(field, reason) when the runner cannot run `config`'s pipeline on this target, else None. The runner cuts
    a transformers model into stages (calibration/pipeline.py, the config's base_model_pp_plan) and runs FSDP2
    alone inside each stage, as the pipeline trace does; its step has no loss scaling; a pipeline's sends need
    every rank, which one emulating process does not have."""
    if config.pp == 1:
        return None
    if request.emulate_world_size:
        return ("emulate_world_size", f"pp={config.pp}: one process on a fake group cannot run a pipeline's stage "
                                      "sends; calibrate pipelines on all the ranks (drop --emulate-world-size)")
    if target.source != "hf":
        return ("pp", f"pp={config.pp}: the runner cuts transformers models into stages (base_model_pp_plan); "
                      f"{target.name} is built as {target.source} code: pass its --model CONFIG.json")
    if config.tp * config.cp * config.ep > 1:
        return ("pp", f"pp={config.pp}: the runner runs FSDP alone inside each stage (tp = cp = ep = 1), as the "
                      "pipeline trace does")
    if config.precision is Precision.FP16:
        return ("precision", f"pp={config.pp}: the runner's pipeline step has no fp16 loss scaling; use bf16")
    return None
