"""What the `fsdp-plan` commands share beyond the request's knobs (whose options planner/cli/flags.py
generates from planner/request): the output format, --profile, --emit's choices, and the command that takes
exactly estimate's flags."""

from __future__ import annotations

import inspect
from enum import Enum
from typing import Annotated, Callable, Optional

import typer

from planner.cli.flags import As, command, finite_float, options, param  # noqa: F401 (finite_float: the commands')
from planner.emit import ARTIFACTS
from planner.progress import quiet_for


class Format(str, Enum):
    table = "table"
    json = "json"


# --emit's choices are planner.emit's artifacts (one list): "accelerate-fsdp2" is the member accelerate_fsdp2.
Emit = Enum("Emit", {name.replace("-", "_"): name for name in ARTIFACTS}, type=str, module=__name__)

FormatOpt = Annotated[Format, typer.Option("--format", help="table or json", callback=quiet_for)]  # json: no progress
ProfileOpt = Annotated[Optional[str], typer.Option("--profile", help="Predict with a profile.json fitted by "
                                                   "`fsdp-plan calibrate`")]
ForceProfile = Annotated[bool, typer.Option("--force-profile", help="Use a profile fitted on another GPU type")]

# the knobs every command takes first, in --help's order
CLUSTER = ("model", "gpus", "gpus_per_node", "gpu", "internode_gbps", "gpu_memory", "intra_node_gb_per_s",
           "pcie_gb_per_s", "cpu_ram_per_node", "power_limit_w", "host_cores_per_node", "host_memory_gb_per_s",
           "host_thread_gb_per_s", "omp_num_threads")
TRAINING = ("seq_len", "global_batch", "optimizer", "optimizer_impl", "finetune", "lora_rank", "lora_dropout",
            "lora_targets", "quant", "double_quant", "quant_storage")
MESH = ("tp", "cp", "ep", "pp", "pp_schedule", "pp_stages_per_rank")
CONFIG = ("sharding", "precision", "activation_checkpointing", "micro_batch", "grad_accum", "offload",
          "backward_prefetch", "limit_all_gathers", "expert_shard_dim", "expert_units", "reduce_dtype", "moe_dispatch",
          "compile",
          "compile_scope", "attention_kernel", "liger", "norm_kernel", "rope_kernel", "swiglu_kernel", "loss_kernel",
          "float8", "fp8_all_gather", "reshard_after_forward")


def load_profile_flag(path: str | None, gpu: str, force: bool):
    """The cost-model Profile in --profile FILE (None without one), refused when fitted on another GPU type."""
    if path is None:
        return None
    from calibration.store import load_profile  # pydantic, no torch

    return load_profile(path, gpu_id=gpu, force=force)


def require_model_and_gpus(knobs: dict) -> None:
    from planner.errors import PlannerError

    if knobs.get("model") is None:
        raise PlannerError("model", "missing: pass --model with a preset name (see `fsdp-plan models`) or a "
                                    "config.json path")
    if knobs.get("gpus") is None:
        raise PlannerError("gpus", "missing: pass --gpus N (N >= 1)")


ConfigRunner = Callable[[dict, Format], None]


def config_command(app, name: str, help_text: str, run: ConfigRunner, takes_profile: bool = False,
                   own: tuple[inspect.Parameter, ...] = ()) -> None:
    """Register a command that takes exactly `fsdp-plan estimate`'s flags (model, cluster, training and one
    explicit configuration), plus `own` options of the command. `run(knobs, output_format)`: knobs are
    planner.api.estimate's keywords and the own options' values; with takes_profile they also hold `profile` (the
    --profile file's Profile, or None)."""
    params = [*options(*CLUSTER, *TRAINING, "attention", *CONFIG, *MESH, "shard_group_gpus", "async_tp",
                       "sequence_parallel", "routing_imbalance", "routing", async_tp=As(default=False)),
              param("output_format", FormatOpt, Format.table), param("profile", ProfileOpt, None),
              param("force_profile", ForceProfile, False),
              *options("trainer", "alloc_conf", "outside_allocator", "trust_remote_code"), *own]

    def body(output_format: Format, profile: str | None, force_profile: bool, **knobs):
        from planner.request import build_request

        if profile is not None and not takes_profile:
            from planner.errors import PlannerError

            raise PlannerError("profile", f"`fsdp-plan {name}` does not use a profile")
        values = {p.name: knobs.pop(p.name) for p in own}
        require_model_and_gpus(knobs)
        build_request(**knobs)  # bad degrees before the profile file is read
        if takes_profile:
            knobs["profile"] = load_profile_flag(profile, knobs["gpu"], force_profile)
        run({**knobs, **values}, output_format)

    app.command(name)(command(params, body, help_text))
