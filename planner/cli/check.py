"""`fsdp-plan check`: price an existing FSDP setup and list what is wrong with it.

Exit code 0 with no errors, 1 with errors (usable in CI), 2 for unreadable input.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from planner.cli.options import CLUSTER, TRAINING, As, Format, FormatOpt, command, options, param
from planner.rl.request import RlRequest

CONFIG_HELP = ("The setup to check, told apart by content: an accelerate config (YAML); FSDP1 "
               "FullyShardedDataParallel kwargs or FSDP2 fully_shard arguments (JSON/YAML); Hugging Face "
               "TrainingArguments (JSON/YAML with fsdp, fsdp_config); a torchtitan 0.2 job file (.toml) or a "
               "flag list (a text file: 0.3's --module/--config, --section.option flags, activation-checkpoint:X); "
               "a NeMo Automodel recipe (YAML); the planner's own Python code (--emit fsdp2 / fsdp1 / lightning, "
               "read without running it); an RL job: a verl launch script (python3 -m verl.trainer.main_ppo "
               "key=value ...), overrides or YAML, or a TRL GRPOConfig (YAML / JSON), priced phase by phase as "
               "`fsdp-plan rl estimate`. Mesh degrees (tp, cp, ep, pp) are read too, and the file's trainer prices "
               "it. Without it: the --sharding/--precision/... flags")
# check's wording of the knobs it reads beside a setup file; None: the file's (seq_len: torchtitan's
# training.seq_len, else 2048)
_OWN = {
    "gpu": As(default=None, help="GPU type (see `fsdp-plan gpus`) [default: the file's (an RL file's fsdp-plan "
                                 "line), else a100-80gb]"),
    "seq_len": As(default=None, help="Tokens per sequence [default: the file's (torchtitan training.seq_len), else "
                                     "2048]"),
    "micro_batch": As(default=None, help="Sequences per GPU per micro-step"),
    "grad_accum": As(default=None, help="Micro-steps per optimizer step"),
    "sharding": As(default=None, help="Without a file: the strategy"),
    "precision": As(default=None, help="Without a file: fp32, bf16, bf16-pure, fp16"),
    "activation_checkpointing": As(default=None, help=None), "offload": As(help=None),
    "optimizer": As(default=None, help="adamw, adam, sgd, adamw-8bit [default: the file's (HF optim, torchtitan "
                                       "optimizer.name), else adamw]"),
    "optimizer_impl": As(default=None, help="foreach, fused or for-loop [default: the file's (HF optim, torchtitan "
                                            "optimizer.implementation), else the trainer's]"),
    # the file's fine-tuning (peft adapters, a BitsAndBytesConfig 4-bit base) unless a flag says otherwise
    "finetune": As(default=None, help="full, lora or qlora [default: the file's, else full]"),
    "lora_rank": As(default=None, help="LoRA rank [default: 16]"),
    "lora_dropout": As(default=None, help="peft's lora_dropout [default: the file's, else 0]"),
    "quant": As(default=None, help="qlora: nf4 or fp4 [default: the file's BitsAndBytesConfig]"),
    "double_quant": As(default=None, help="qlora: double quantization [default: the file's BitsAndBytesConfig]"),
    "quant_storage": As(default=None, help="qlora: bnb_4bit_quant_storage [default: the file's BitsAndBytesConfig]"),
}


def _params():
    return [
        param("config", Annotated[Optional[str], typer.Argument(help=CONFIG_HELP)], None),
        *options(*CLUSTER, *TRAINING, "micro_batch", "grad_accum", "sharding", "precision",
                 "activation_checkpointing", "offload", "alloc_conf", **_OWN),
        param("dynamic_control_flow", Annotated[bool, typer.Option(
            "--dynamic-control-flow", help="The model's forward has data-dependent control flow (MoE routing, "
                                           "...)")], False),
        *options("mean_prompt_len", "mean_response_len", "engine_version", request=RlRequest,
                 engine_version=As(default=None, help="RL files: vllm 0.8 or current [default: the file's, else "
                                                      "current]")),
        param("output_format", FormatOpt, Format.table),
    ]


def check_cmd(config: str | None, model: str | None, gpus: int | None, micro_batch: int | None,
              grad_accum: int | None, sharding: str | None, precision: str | None,
              activation_checkpointing: str | None, offload: bool, dynamic_control_flow: bool,
              output_format: Format, **knobs):
    """Check an existing FSDP config (file or flags): estimate, then findings with fixes."""
    from dataclasses import replace

    from cost_models.specs import FsdpConfig
    from planner.reports import table as report
    from planner.doctor import check
    from planner.errors import PlannerError
    from planner.doctor.readers import UserSetup, read_rl_setup, read_setup

    rl = read_rl_setup(config, gpus) if config is not None else None
    if rl is not None:  # a verl / TRL GRPO job: planner/rl
        from planner.cli.rl import check_rl

        return check_rl(rl, model, gpus, output_format, **knobs)
    for name in ("mean_prompt_len", "mean_response_len", "engine_version"):
        knobs.pop(name)
    setup = read_setup(config) if config is not None else None
    model = model or (setup.model if setup is not None else None)  # torchtitan 0.3's --module / --config
    if model is None:
        raise PlannerError("model", "missing: pass --model with a preset name or a config.json path")
    if setup is not None:
        if activation_checkpointing is not None:  # the flag's value decides
            setup = replace(setup, config=replace(setup.config, ac_every=activation_checkpointing,
                                                  selective_op_ac=False))
    else:
        setup = UserSetup(config=FsdpConfig(sharding=sharding or "FULL_SHARD", precision=precision or "bf16",
                                            ac_every=activation_checkpointing or "none", offload=offload),
                          source="flags")
    knobs = {k: v for k, v in knobs.items() if v is not None}  # unset: the file's (UserSetup.training), else default
    r = check(setup, model, gpus, micro_batch=micro_batch, grad_accum=grad_accum,
              dynamic_control_flow=dynamic_control_flow, **knobs)
    typer.echo(report.check_json(r) if output_format is Format.json else report.check_text(r))
    if r.has_errors:
        raise typer.Exit(1)


def register(app) -> None:
    app.command("check")(command(_params(), check_cmd, check_cmd.__doc__))
